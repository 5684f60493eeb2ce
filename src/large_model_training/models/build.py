"""Build this rank's model: construct without memory (meta device), apply parallelism, then materialise.

Constructing on the meta device first means a rank never allocates weights it will not keep; the layout-free
initialisation (`models/init.py`) then fills exactly the shards this rank holds.
"""

from __future__ import annotations

import torch
from torch import nn

from large_model_training.config import ModelConfig
from large_model_training.mesh import ParallelMesh
from large_model_training.models.init import init_parameters
from large_model_training.models.transformer import Transformer


def build_model(cfg: ModelConfig, mesh: ParallelMesh | None, seed: int, device: torch.device | None = None) -> nn.Module:
    """The model this rank trains, initialised identically to the single-device model for the same seed."""
    device = device or (mesh.device if mesh is not None else torch.device("cpu"))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    init_parameters(model, cfg, seed)
    return model
