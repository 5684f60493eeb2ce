"""large-model-training: tensor, pipeline and data parallel training of large transformers.

import large_model_training as lmt
cfg = lmt.validate(lmt.build_config(overrides={"parallel.dp": 2, "train.steps": 100}))
losses = lmt.run_on_ranks(lmt.train_rank, cfg.parallel.world_size, (cfg, "runs/api"))[0].losses
"""

from large_model_training.api import GradientCheckpointing, GradientCompression, PipelineParallelism, TensorParallelism
from large_model_training.assembly import assemble, build_model
from large_model_training.config import (
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    build_config,
)
from large_model_training.errors import ConfigError
from large_model_training.launch import RankFailure, run_in_process, run_on_ranks
from large_model_training.layout import validate
from large_model_training.memory.recompute import apply_recompute
from large_model_training.mesh import ParallelMesh, RankGrid
from large_model_training.models.transformer import StageSpec, Transformer
from large_model_training.train.trainer import Trainer, TrainingError, TrainResult, train_rank

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "build_config",
    "validate",
    "RankFailure",
    "run_in_process",
    "run_on_ranks",
    "ParallelMesh",
    "RankGrid",
    "assemble",
    "build_model",
    "StageSpec",
    "Transformer",
    "GradientCompression",
    "GradientCheckpointing",
    "apply_recompute",
    "PipelineParallelism",
    "TensorParallelism",
    "Trainer",
    "TrainingError",
    "TrainResult",
    "train_rank",
]
