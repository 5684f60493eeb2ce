"""AdamW with decoupled weight decay, warmup + cosine learning rate, and gradient clipping by the global norm."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.config import TrainConfig
from large_model_training.mesh import ParallelMesh


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices are decayed, vectors (norm weights and biases) are not, as in GPT-2 and Llama."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the per-parameter loop gives bitwise the same update whatever parameters a rank
    # holds, which keeps layouts (and resumed runs) on the same curve. The cost is small at CPU scale.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def norm_parameters(model: nn.Module, mesh: ParallelMesh) -> list[torch.nn.Parameter]:
    """The parameters whose gradients this rank counts in the global norm: each value once over tp.

    A parameter replicated over tp (norm weights, replicated key/value weights) is counted on tp rank 0 only.
    """
    from large_model_training.parallel.tensor import tp_layouts

    replicated = {name for name, layout in tp_layouts(model).items() if layout.replicated}
    duplicates = getattr(model, "duplicate_parameters", set())  # a last stage's copy of a tied embedding
    return [p for name, p in model.named_parameters()
            if not (name in replicated and mesh.tp_rank != 0) and name not in duplicates]


def global_grad_norm(params: list[torch.nn.Parameter], mesh: ParallelMesh) -> torch.Tensor:
    """L2 norm of the whole model's gradient, across every rank that holds a different part of it.

    `params` come from `norm_parameters`. Gradients are identical over dp after the reduction, so only the
    model-parallel axes (tp, pp) are summed.
    """
    total = torch.zeros((), dtype=torch.float32, device=mesh.device)
    for p in params:
        if p.grad is None:
            continue
        total += p.grad.detach().float().pow(2).sum()
    for axis in ("tp", "pp"):
        if getattr(mesh, f"{axis}_size") > 1:
            dist.all_reduce(total, group=mesh.group(axis))
    return total.sqrt()


@torch.no_grad()
def clip_gradients(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale all gradients by max_norm / norm when the norm exceeds max_norm (same factor on every rank)."""
    if max_norm <= 0:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
