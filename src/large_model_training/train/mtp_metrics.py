"""The multi-token prediction losses of a step (`model.mtp_depth`, models/transformer.py's TokenPredictor), for
the metrics: each depth's loss, averaged over the step's micro-batches and the data-parallel replicas, as the
logged next-token loss is."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.mesh import ParallelMesh


def take_mtp_losses(model: nn.Module, micro_batches: int, mesh: ParallelMesh) -> dict:
    """{"mtp_loss_per_depth": [loss of depth 1, ...]} (collective over the gradient group, and over pp: the
    prediction modules are on the last stage); resets the sums."""
    chunks = list(getattr(model, "chunks", {0: model}).values())
    summed = [chunk.mtp_losses for chunk in chunks if getattr(chunk, "mtp_losses", None) is not None]
    total = torch.stack(summed).sum(0) if summed else torch.zeros(model.cfg.mtp_depth, device=mesh.device)
    for chunk in chunks:
        chunk.mtp_losses = None
    if mesh.grad_size > 1:
        dist.all_reduce(total, group=mesh.grad_group)
    if mesh.pp_size > 1:
        dist.all_reduce(total, group=mesh.pp_group)
    return {"mtp_loss_per_depth": [float(x) for x in total / (micro_batches * mesh.grad_size)]}
