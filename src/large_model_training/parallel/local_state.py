"""What the in-memory copies' engine state (`Engine.local_state_dict`) takes from the model besides parameters.

Every engine hands its tensors as they lie (nothing gathered: the copies are restored onto the same layout), and
the model's persistent buffers beside them: not parameters, so in no flat buffer or FSDP shard, yet state that
training changes (MoE's router expert bias).
"""

from __future__ import annotations

import torch
from torch import nn


class PersistentBuffers:
    """The model's buffers its state dict holds (not the non-persistent ones, e.g. a rotary table), found once:
    walking every module at every copy would cost milliseconds on a large model."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = [
            f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            for name, buffer in module.named_buffers(recurse=False)
            if buffer is not None and name not in module._non_persistent_buffers_set
        ]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.model.get_buffer(name) for name in self.names}

    @torch.no_grad()
    def load(self, saved: dict[str, torch.Tensor]) -> None:
        for name in self.names:
            self.model.get_buffer(name).copy_(saved[name])
