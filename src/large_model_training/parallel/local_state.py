"""Pieces of the in-memory copies' engine state (`Engine.local_state_dict`).

DataParallelEngine and FSDPEngine hand their tensors as they lie, nothing gathered. ExpertParallelEngine still
goes through the checkpoint's by-name state (`full_local_state`: full tensors, gathered over dp; its two
DataParallelEngines share one model, whose parameters outside either flat buffer would be copied twice):
correct on every layout, at the cost of a gather per copy.
"""

from __future__ import annotations

from typing import Any

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


def full_local_state(engine: Any) -> dict:
    return {"model": engine.model_state_dict(), "optim": engine.state_dict()}


def load_full_local_state(engine: Any, state: dict) -> None:
    engine.load_model_state_dict(state["model"])
    engine.reload_parameters()
    engine.load_state_dict(state["optim"])
