"""Next-token cross-entropy. Kept apart from the model so tensor parallelism can swap in a vocab-parallel one."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over all tokens, computed in fp32 (bf16 log-softmax over a large vocabulary loses precision)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
