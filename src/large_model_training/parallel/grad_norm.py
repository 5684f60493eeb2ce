"""The gradient norm's reduction across ranks, written once for every engine.

Each engine sums the squares of the gradient elements this rank owns; the axes that split those elements
(tp, pp, and dp where the optimizer state is sharded over it) then sum that partial square. Where gradients
stay local (compressed updates, 1-bit Adam after its warm-up) the ranks hold different gradients of the same
elements: the dp "sum" is then the ranks' mean square (the root-mean-square norm after the square root).
The axes are summed in the order given, so each engine keeps its floating-point result bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from large_model_training.mesh import ParallelMesh


def reduce_norm_sq(
    total: torch.Tensor, mesh: ParallelMesh, axes: tuple[str, ...], *, local_dp: bool = False
) -> torch.Tensor:
    """`total` (this rank's squared norm, fp32) summed in place over each axis of `axes` of size > 1 ('grad' is
    the gradient group); `local_dp`: then averaged over dp, as the ranks' gradients were never averaged."""
    for axis in axes:
        if getattr(mesh, f"{axis}_size") > 1:
            dist.all_reduce(total, group=mesh.group(axis))
    if local_dp and mesh.grad_size > 1:
        total /= mesh.grad_size
    return total
