"""Data-parallel gradient reduction (plain version): one coalesced all-reduce of every gradient after backward.

Averaging over dp makes a dp run equal to one process on the same global batch, because each rank's loss is the
mean over its own equal share of the samples. This is the foundation's simple engine; the overlapped, bucketed
engine with flat buffers and ZeRO replaces it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@torch.no_grad()
def allreduce_gradients(model: nn.Module, group: dist.ProcessGroup, group_size: int) -> int:
    """Average gradients over `group` in place; returns the bytes this rank passed to the collective."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if group_size == 1 or not grads:
        return 0
    flat = _flatten_dense_tensors(grads)
    flat.div_(group_size)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)
    return flat.numel() * flat.element_size()
