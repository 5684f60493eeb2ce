"""Checkpoints written before the fused projections (models/fused.py) still resume: converted on load.

Such a checkpoint holds `attn.wq`, `attn.wk`, `attn.wv` and `mlp.w_gate`, `mlp.w_up` (model and optimizer state
under the same names). A rank's shard of a fused weight is a plain block of rows of each separate one: its kv
groups' rows of wq, wk and wv, and rows [a, b) of w_gate and w_up (the fused row orders were chosen so). So DCP is
asked for the separate tensors, each into a buffer of its own (a `Shard(0)` DTensor of the separate weight's full
shape where the fused one is a tp shard), and after the load they are fused into the rank's tensors in place.
Under ZeRO-3, FSDP2 shards rows over dp without regard for heads: refused with one line (resume once at zero <= 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from large_model_training.config import ConfigError, ModelConfig
from large_model_training.models.fused import (
    GATE_UP,
    QKV,
    SEPARATE_GATE_UP,
    SEPARATE_QKV,
    fuse_gate_up,
    fuse_qkv,
    split_gate_up,
    split_qkv,
)


def written_before_fusion(ckpt: str) -> bool:
    """Whether the checkpoint holds separate q/k/v projections (the format before models/fused.py)."""
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return any(key.endswith(".attn.wq.weight") for key in keys)


def request_separate(state: dict[str, Any], cfg: ModelConfig, ckpt: str, zero: int) -> list[Callable[[], None]]:
    """Replace, in place, every fused tensor of a nested state by its separate parts (fresh buffers); returns the
    calls that fuse the loaded parts back into the rank's tensors."""
    if zero == 3:
        raise ConfigError(
            f"checkpoint {ckpt} was written before q/k/v and gate/up were fused: resume it once "
            f"with --zero 0, 1 or 2 (any tp, pp, dp), then save; ZeRO-3 cannot convert it"
        )
    fuse_back: list[Callable[[], None]] = []
    for value in list(state.values()):
        if isinstance(value, dict):
            fuse_back += request_separate(value, cfg, ckpt, zero)
    for name in [n for n, v in state.items() if isinstance(v, torch.Tensor) and n.endswith((QKV, GATE_UP))]:
        fuse_back.append(_split_entry(state, name, cfg))
    return fuse_back


def _split_entry(state: dict[str, Any], name: str, cfg: ModelConfig) -> Callable[[], None]:
    from torch.distributed.tensor import DTensor

    from large_model_training.train.checkpoint_layout import from_local

    value = state.pop(name)
    local = value.to_local() if isinstance(value, DTensor) else value
    is_qkv = name.endswith(QKV)
    prefix = name[: -len(QKV if is_qkv else GATE_UP)]
    group = cfg.n_heads // cfg.kv_heads
    kv_here = local.shape[0] // ((group + 2) * cfg.head_dim)  # this rank's kv groups
    parts = [p.clone() for p in (split_qkv(local, group * kv_here, kv_here) if is_qkv else split_gate_up(local))]
    names = [prefix + p for p in (SEPARATE_QKV if is_qkv else SEPARATE_GATE_UP)]
    if isinstance(value, DTensor):  # a tp shard: each part is the same rows of its separate full weight
        full_rows = (
            [cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
            if is_qkv
            else [value.shape[0] // 2] * 2
        )
        state.update(
            (n, from_local(p, value.device_mesh, 0, [rows, *p.shape[1:]]))
            for n, p, rows in zip(names, parts, full_rows)
        )
    else:
        state.update(zip(names, parts))

    def fuse() -> None:
        with torch.no_grad():
            local.copy_(fuse_qkv(parts[0], parts[1], parts[2], kv_here) if is_qkv else fuse_gate_up(*parts))
        for n in names:
            state.pop(n)
        state[name] = value

    return fuse
