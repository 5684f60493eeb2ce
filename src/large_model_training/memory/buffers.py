"""The memory pool: parameters and gradients in flat, contiguous buffers, with exact accounting.

The seed's memory pool (one arena, bump allocation, reset) made into what a trainer needs: every parameter of
a dtype lives in one buffer allocated once, modules see views into it, and gradients accumulate in place into
views of a twin buffer, so a step allocates nothing for parameters or gradients. The layout also defines the
gradient buckets of the data-parallel engine:

  - parameters are placed in REVERSE registration order, which is roughly the order backward produces their
    gradients (the last block's first), so a bucket's gradients are complete early and its reduction can start
    while backward goes on;
  - a bucket is a contiguous range of whole parameters of about `bucket_bytes`; each bucket is padded to a
    multiple of the dp size so that a reduce-scatter gives every rank an equal, contiguous shard of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    """Elements [start, end) of the flat buffers: whole parameters, padding at the end."""

    index: int
    start: int
    end: int
    params: list[tuple[str, nn.Parameter, int]] = field(default_factory=list)
    """(name, parameter, offset in the flat buffer), in buffer order."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """The [start, end) of the flat buffer that dp rank `rank` owns in this bucket."""
        size = self.numel // world
        return self.start + rank * size, self.start + (rank + 1) * size


@dataclass
class FlatLayout:
    """Where every parameter lives in the flat buffers, and how the buffers split into buckets."""

    buckets: list[Bucket]
    numel: int
    offsets: dict[str, tuple[int, int]]
    """Parameter name -> (offset, numel) in the flat buffers."""

    @staticmethod
    def build(
        named_params: list[tuple[str, nn.Parameter]], bucket_bytes: float, element_size: int, pad_to: int
    ) -> FlatLayout:
        """Buckets of about bucket_bytes over the parameters in reverse order, each padded to pad_to elements."""
        buckets: list[Bucket] = []
        offsets: dict[str, tuple[int, int]] = {}
        cursor = 0
        current = Bucket(0, 0, 0)
        for name, param in reversed(named_params):
            current.params.append((name, param, cursor))
            offsets[name] = (cursor, param.numel())
            cursor += param.numel()
            if (cursor - current.start) * element_size >= bucket_bytes:
                cursor = _close(current, cursor, pad_to, buckets)
                current = Bucket(len(buckets), cursor, cursor)
        if current.params:
            cursor = _close(current, cursor, pad_to, buckets)
        return FlatLayout(buckets, cursor, offsets)


def _close(bucket: Bucket, cursor: int, pad_to: int, buckets: list[Bucket]) -> int:
    end = bucket.start + -(-(cursor - bucket.start) // pad_to) * pad_to
    bucket.end = end
    buckets.append(bucket)
    return end


def adopt_parameters(layout: FlatLayout, buffer: torch.Tensor) -> None:
    """Copy every parameter's value into its place in `buffer` and make the parameter a view of it."""
    with torch.no_grad():
        for bucket in layout.buckets:
            for _, param, offset in bucket.params:
                view = buffer[offset : offset + param.numel()].view_as(param)
                view.copy_(param.data)
                param.data = view


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the storage the given tensors hold (each counted once; None and views of others skipped)."""
    seen, total = {}, 0  # by the storage object itself, not its address: fake tensors (lmt rehearse) have none
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if id(storage) in seen:
            continue
        seen[id(storage)] = storage  # held, so that no id is reused while counting
        total += storage.nbytes()
    return total
