"""Helpers the compressors share: the size of a sparse selection and seeded random streams.

The spec a user writes (`--compression topk:0.01`) is parsed once, with the rest of the config, into a
`CompressionSpec` (`large_model_training.choices`); the compressors read that typed value.

Random choices (random-k coordinates, stochastic rounding, PowerSGD's first Q) come from generators seeded by
`seeded_generator(device, seed, ...)`, which mixes integers with splitmix64 instead of Python's `hash` (salted
per process for strings), so every process derives the same stream from the same keys.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from large_model_training.choices import CompressionSpec, parse_compression

__all__ = ["CompressionSpec", "parse_compression", "sparse_count", "mix_seed", "seeded_generator"]


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
