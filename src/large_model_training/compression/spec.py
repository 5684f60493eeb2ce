"""Compression specs: the one string a user writes (`--compression topk:0.01`), parsed once into a typed value.

Parsing belongs to configuration, not to the hook: the launching process parses the spec with the rest of the
config, so a typo is a one-line `ConfigError` (exit 2) before any rank starts, never a traceback from inside a
backward pass.

Grammar (case-insensitive):
    none                 dense all-reduce (the reference)
    topk:R               the largest-|g| fraction R of each bucket, R in (0, 1]
    randomk:R            a seeded random fraction R, the same coordinates on every dp rank
    threshold:T          every coordinate with |g| >= T, T > 0 (the seed's 'sparsification')
    int8 | int4          symmetric per-chunk absmax quantisation; add ':stochastic' for stochastic rounding
    powersgd:R           rank-R PowerSGD (Vogels et al. 2019) on each matrix of a bucket, R an integer >= 1

Random choices (random-k coordinates, stochastic rounding, PowerSGD's first Q) come from generators seeded by
`seeded_generator(device, seed, ...)`, which mixes integers with splitmix64 instead of Python's `hash` (salted
per process for strings), so every process derives the same stream from the same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from large_model_training.config import ConfigError

GRAMMAR = "none, topk:R, randomk:R, threshold:T, int8[:stochastic], int4[:stochastic], powersgd:R"
KINDS = ("none", "topk", "randomk", "threshold", "int8", "int4", "powersgd")

QUANT_CHUNK = 256
"""Elements per quantisation scale. 256 keeps an outlier's damage local (it coarsens 255 neighbours, not a whole
bucket) while the fp32 scale costs 4/256 = 1.6% of an int8 payload (3.1% of int4); 1024 would quarter that
overhead at four times the reach of each outlier."""


@dataclass(frozen=True)
class CompressionSpec:
    """One parsed compression spec; `str(spec)` gives back a spec string that parses to an equal value."""

    kind: str = "none"
    """One of KINDS."""
    ratio: float = 1.0
    """topk / randomk: fraction of each bucket's coordinates sent, in (0, 1]."""
    threshold: float = 0.0
    """threshold: send coordinates with |g| >= threshold."""
    rank: int = 0
    """powersgd: rank of the approximation of each matrix."""
    stochastic: bool = False
    """int8 / int4: stochastic rounding (unbiased) instead of round-to-nearest."""
    chunk: int = QUANT_CHUNK
    """int8 / int4: elements sharing one fp32 scale."""

    @property
    def bits(self) -> int:
        """Bits per quantised value (0 for non-quantising kinds)."""
        return {"int8": 8, "int4": 4}.get(self.kind, 0)

    def __str__(self) -> str:
        if self.kind in ("topk", "randomk"):
            return f"{self.kind}:{self.ratio!r}"
        if self.kind == "threshold":
            return f"threshold:{self.threshold!r}"
        if self.kind == "powersgd":
            return f"powersgd:{self.rank}"
        return self.kind + (":stochastic" if self.stochastic else "")


def _number(kind: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"compression '{kind}:{text}': '{text}' is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"compression '{kind}:{text}': the value must be finite")
    return value


def parse_compression(spec: str) -> CompressionSpec:
    """Parse a spec string (see the module docstring); bad input raises ConfigError with a one-line message."""
    text = str(spec).strip().lower()
    kind, sep, arg = text.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"unknown compressor '{spec}'; choose one of: {GRAMMAR}")
    if kind == "none":
        if sep:
            raise ConfigError(f"compression 'none' takes no argument, got '{spec}'")
        return CompressionSpec()
    if kind in ("int8", "int4"):
        if sep and arg != "stochastic":
            raise ConfigError(f"compression '{spec}': the only option of {kind} is ':stochastic'")
        return CompressionSpec(kind, stochastic=bool(sep))
    if not arg:
        example = {"topk": "topk:0.01", "randomk": "randomk:0.01", "threshold": "threshold:1e-3",
                   "powersgd": "powersgd:4"}[kind]
        raise ConfigError(f"compression '{kind}' needs a value, e.g. {example}")
    if kind in ("topk", "randomk"):
        ratio = _number(kind, arg)
        if not 0.0 < ratio <= 1.0:
            raise ConfigError(f"compression '{spec}': the ratio must be in (0, 1], got {ratio}")
        return CompressionSpec(kind, ratio=ratio)
    if kind == "threshold":
        threshold = _number(kind, arg)
        if threshold <= 0.0:
            raise ConfigError(f"compression '{spec}': the threshold must be > 0, got {threshold}")
        return CompressionSpec(kind, threshold=threshold)
    try:
        rank = int(arg)
    except ValueError:
        raise ConfigError(f"compression '{spec}': the rank must be an integer, got '{arg}'") from None
    if rank <= 0:
        raise ConfigError(f"compression '{spec}': the rank must be >= 1, got {rank}")
    return CompressionSpec(kind, rank=rank)


def sparse_count(numel: int, ratio: float) -> int:
    """k = max(1, ceil(ratio * numel)), with the ratio read as the decimal the user wrote.

    Fraction(repr(ratio)) makes 0.07 exactly 7/100: in floats 0.07 * 100 is 7.000000000000001, whose ceiling
    would send one coordinate more than asked.
    """
    return min(numel, max(1, math.ceil(Fraction(repr(ratio)) * numel)))


_MASK64 = (1 << 64) - 1


def mix_seed(*keys: int) -> int:
    """A 63-bit seed from integers (splitmix64 finaliser per key): equal keys give equal seeds in any process."""
    h = 0x9E3779B97F4A7C15
    for key in keys:
        h = (h ^ (key & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h >> 1


def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on `device` seeded from keys, e.g. (seed, step, bucket index[, rank])."""
    gen = torch.Generator(device=device)
    gen.manual_seed(mix_seed(*keys))
    return gen
