"""What the in-memory copies' engine state (`Engine.local_state_dict`) takes from the model besides parameters.

Every engine hands its tensors as they lie (nothing gathered: the copies are restored onto the same layout), and
the model's persistent buffers beside them: not parameters, so in no flat buffer or FSDP shard, yet state that
training changes (MoE's router expert bias).
"""

from __future__ import annotations

import torch
from torch import nn


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers its state dict holds (not the non-persistent ones, e.g. a rotary table)."""
    return {
        f"{prefix}.{name}" if prefix else name: buffer
        for prefix, module in model.named_modules()
        for name, buffer in module.named_buffers(recurse=False)
        if buffer is not None and name not in module._non_persistent_buffers_set
    }
