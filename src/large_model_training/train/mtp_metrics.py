"""The multi-token prediction losses of a step (`model.mtp_depth`, models/transformer.py's TokenPredictor), for
the metrics: each depth's loss, averaged over the step's micro-batches and the data-parallel replicas, as the
logged next-token loss is."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.mesh import ParallelMesh


def take_mtp_losses(model: nn.Module, micro_batches: int, mesh: ParallelMesh) -> dict:
    """{"mtp_loss_per_depth": [loss of depth 1, ...]} (collective over the gradient group); resets the sums."""
    summed = getattr(model, "mtp_losses", None)
    depth = model.cfg.mtp_depth
    total = summed.clone() if summed is not None else torch.zeros(depth, device=mesh.device)
    model.mtp_losses = None
    if mesh.dp_size > 1:
        dist.all_reduce(total, group=mesh.dp_group)
    return {"mtp_loss_per_depth": [float(x) for x in total / (micro_batches * mesh.dp_size)]}
