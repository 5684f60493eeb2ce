"""Learning-rate schedule (warmup + cosine), the gradient-clipping factor, and memory reporting.

The AdamW update itself lives in the data-parallel engines (`parallel/adamw.py`, `parallel/fsdp.py`), which own
the optimizer state because under ZeRO it is sharded like the gradients."""

from __future__ import annotations

import math

import torch

from large_model_training.config import TrainConfig
from large_model_training.mesh import peak_memory_bytes


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor | float:
    """Factor that brings the global gradient norm down to max_norm (1 if below; same on every rank)."""
    if max_norm <= 0:
        return 1.0
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank: the device allocator's peak on accelerators; on the CPU, where no allocator
    tracks tensors, the process's peak resident set size (includes the Python runtime and libraries)."""
    peak = peak_memory_bytes(device)
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
