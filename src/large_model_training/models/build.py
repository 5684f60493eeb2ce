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
from large_model_training.models.transformer import StageSpec, Transformer
from large_model_training.parallel.collectives import TPGroup
from large_model_training.parallel.tensor import apply_tensor_parallel


def build_model(cfg: ModelConfig, mesh: ParallelMesh | None, seed: int, device: torch.device | None = None,
                sequence_parallel: bool = False, tp: TPGroup | None = None, stage: StageSpec | None = None) -> nn.Module:
    """The model this rank trains, initialised identically to the single-device model for the same seed.

    With a mesh whose tp axis is > 1, its layers are tensor-parallel over `tp` (a TPGroup whose byte counter
    the caller reads; made from the mesh if not given). `stage` builds only that slice of the model.
    """
    device = device or (mesh.device if mesh is not None else torch.device("cpu"))
    with torch.device("meta"):
        model = Transformer(cfg, stage)
    if mesh is not None and mesh.tp_size > 1:
        tp = tp or TPGroup(mesh.tp_group, mesh.tp_size, mesh.tp_rank)
        apply_tensor_parallel(model, tp, sequence_parallel)
    model.to_empty(device=device)
    model.tie_weights()
    init_parameters(model, cfg, seed)
    return model


def build_pipeline_model(cfg: ModelConfig, mesh: ParallelMesh, seed: int, stages: dict[int, StageSpec],
                         sequence_parallel: bool = False, tp: TPGroup | None = None) -> nn.Module:
    """This pipeline rank's chunks (virtual stage index -> slice), each initialised as in the whole model."""
    from large_model_training.parallel.pipeline.runtime import PipelineModel

    chunks = {j: build_model(cfg, mesh, seed, sequence_parallel=sequence_parallel, tp=tp, stage=spec)
              for j, spec in stages.items()}
    return PipelineModel(chunks)
