"""Per-rank shapes the planner's formulas need: key/value heads on a tp rank and blocks per virtual stage.

They follow the runtime's own rules (parallel/tensor.py for heads, parallel/pipeline/partition.py for the
split), so a planned layout has the shapes the runtime will build.
"""

from __future__ import annotations

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.layout import Job, Layout
from large_model_training.parallel.pipeline.partition import stage_layers


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Key/value heads computed on one tp rank: tp divides n_kv_heads (the fused wqkv keeps a rank's groups whole,
    models/fused.py; `layout.py` refuses the rest)."""
    return max(1, cfg.kv_heads // tp)


def kv_weight_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Key/value heads whose weights a tp rank holds: the ones it computes."""
    return kv_heads_per_rank(cfg, tp)


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per (virtual) stage, as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def virtual_stage_layers(job: Job, layout: Layout) -> list[int]:
    """Blocks per virtual stage, from the pipeline partitioner the runtime uses (balanced by compute, the
    embedding and head counted; with v >= 2 over the schedule's placement, per rank and then per chunk, and the
    embedding's and head's chunks may hold no block); the even split when the partitioner refuses the layout."""
    try:
        return stage_layers(job.model, layout.pp, layout.virtual_stages, layout.schedule, job.seq_len, layout.pp_layers)
    except ConfigError:
        return split_layers(job.model.n_layers, layout.pp * layout.virtual_stages)
