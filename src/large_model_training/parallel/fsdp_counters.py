"""Byte counters for FSDP2's collectives (ZeRO-3): what its all-gathers and reduce-scatters actually move.

FSDP2 does not report its traffic, and a byte count derived from the parameter count misses what changes it:
float8 all-gathers (1 byte per block-weight value, `parallel/fsdp_float8.py`), fp32 or bf16 reduction, the
padding of uneven shards, a gather skipped or repeated. FSDP2's own extension point for custom collectives
(`set_custom_all_gather` / `set_custom_reduce_scatter`, whose interface lives in its `_fsdp_api` module) lets us
wrap the collectives it would run anyway and count their buffers, so `comm_bytes_dp` is measured, as it is for
the ZeRO 0-2 engine. Bytes are per rank and follow the tp counters' convention: a gather or a scatter moves
(n-1)/n of the full buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class CommBytes:
    """Bytes the counted collectives moved since the last `take()`, by kind."""

    def __init__(self):
        self.all_gather = self.reduce_scatter = 0.0

    def take(self) -> tuple[float, float]:
        out = (self.all_gather, self.reduce_scatter)
        self.all_gather = self.reduce_scatter = 0.0
        return out


def _moved(full: torch.Tensor, group: dist.ProcessGroup) -> float:
    n = group.size()
    return (n - 1) / n * full.numel() * full.element_size()


class _Allocating:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_Allocating, AllGather):
    def __init__(self, counts: CommBytes):
        self.counts = counts

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        self.counts.all_gather += _moved(output_tensor, group)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_Allocating, ReduceScatter):
    def __init__(self, counts: CommBytes):
        self.counts = counts

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.counts.reduce_scatter += _moved(input_tensor, group)
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def count_collectives(module, counts: CommBytes) -> None:
    """Route a `fully_shard`-ed module's all-gathers and reduce-scatters through counting wrappers."""
    module.set_custom_all_gather(CountingAllGather(counts))
    module.set_custom_reduce_scatter(CountingReduceScatter(counts))
