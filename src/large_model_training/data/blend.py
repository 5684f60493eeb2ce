"""Weighted blends of data sources (`--data "0.7:dirA,0.3:dirB"`): which source each global sample comes from.

Megatron's BlendedDataset gives each next sample to the source furthest below its share, which needs the
assignment of every earlier sample: it builds (and caches) an index over the whole run. Here the j-th sample of
source k has the ideal time (j + 1/2) / w_k and samples are taken in time order, ties to the lower source: the
Sainte-Laguë divisor method. Among the first n samples every source has within one sample of n * w_k, and the
global position of (k, j) has a closed form, so any step's assignment is computed alone, from nothing but the
step: the loader's state stays the step number, with no index to build at start-up.
"""

from __future__ import annotations

import math

import numpy as np

from large_model_training.errors import ConfigError

SCALE = 1 << 20  # weights become integers out of SCALE: exact comparisons, no float ties


def parse_blend(spec: str) -> list[tuple[float, str]]:
    """'0.7:dirA,0.3:dirB' -> [(0.7, 'dirA'), (0.3, 'dirB')]; a plain path (or "") is one source of weight 1."""
    items = spec.split(",") if spec else [""]
    if len(items) == 1:
        weight, sep, path = items[0].partition(":")
        if not sep or not _is_number(weight):
            return [(1.0, items[0])]
    blend = []
    for item in items:
        weight, sep, path = item.strip().partition(":")
        if not sep or not _is_number(weight) or not path:
            raise ConfigError(f'--data blend item {item!r} is not WEIGHT:PATH (as in --data "0.7:dirA,0.3:dirB")')
        w = float(weight)
        if not (math.isfinite(w) and w > 0):
            raise ConfigError(f"--data blend weights must be positive numbers, got {weight} for {path}")
        blend.append((w, path))
    return blend


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class Blend:
    """Global sample number -> (source, that source's own sample number), for fixed weights."""

    def __init__(self, weights: list[float]):
        total = sum(weights)
        if any(w / total < 1.0 / SCALE for w in weights):
            raise ConfigError(f"--data blend weights {weights} differ by more than {SCALE}x: drop the smallest")
        self.units = [round(w / total * SCALE) for w in weights]

    def _position(self, k: int, j: np.ndarray) -> np.ndarray:
        """Global sample number of source k's samples j (int64 array): how many samples of every source come
        before them, counting ties with lower sources."""
        pos = np.array(j, dtype=np.int64, copy=True)
        for m, u_m in enumerate(self.units):
            if m == k:
                continue
            scaled = (2 * j + 1) * u_m  # compare (2i+1)/u_m < (2j+1)/u_k in integers
            before = -(-scaled // self.units[k]) // 2
            if m < k:
                before = before + ((scaled % self.units[k] == 0) & ((scaled // self.units[k]) % 2 == 1))
            pos += before
        return pos

    def count(self, k: int, n: int) -> int:
        """How many of the first n global samples come from source k (the smallest j whose position is >= n)."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if int(self._position(k, np.array([mid]))[0]) >= n:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def assign(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Sources and per-source sample numbers of global samples first .. first + count - 1, in order."""
        if len(self.units) == 1:
            return np.zeros(count, dtype=np.int64), np.arange(first, first + count, dtype=np.int64)
        sources, numbers, positions = [], [], []
        for k in range(len(self.units)):
            j = np.arange(self.count(k, first), self.count(k, first + count), dtype=np.int64)
            sources.append(np.full(len(j), k, dtype=np.int64))
            numbers.append(j)
            positions.append(self._position(k, j))
        order = np.argsort(np.concatenate(positions), kind="stable")
        return np.concatenate(sources)[order], np.concatenate(numbers)[order]
