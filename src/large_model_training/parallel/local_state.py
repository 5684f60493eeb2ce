"""The in-memory copies' engine state (`Engine.local_state_dict`) for engines that do not yet give it as it lies.

DataParallelEngine hands its flat buffers' views and its rule's per-piece tensors, nothing gathered. FSDPEngine and
ExpertParallelEngine still go through the checkpoint's by-name state: full tensors, gathered over dp (FSDP's
DTensors and the expert engine's two optimizers need their own as-it-lies form first). Correct on every layout,
at the cost of a gather per copy.
"""

from __future__ import annotations

from typing import Any


def full_local_state(engine: Any) -> dict:
    return {"model": engine.model_state_dict(), "optim": engine.state_dict()}


def load_full_local_state(engine: Any, state: dict) -> None:
    engine.load_model_state_dict(state["model"])
    engine.reload_parameters()
    engine.load_state_dict(state["optim"])
