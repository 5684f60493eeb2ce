"""Layout-free weight initialisation: every parameter is drawn from its own generator, seeded by its name.

Why: a model split over tensor-parallel ranks or pipeline stages must start from exactly the same full weights
as the unsplit model for the same seed, so that every layout trains the same loss curve and checkpoints are
portable. Drawing parameters in construction order from one global generator would tie the values to which
modules a rank happens to build. Instead parameter `layers.5.attn.wq.weight` is always drawn, full size, from
a generator seeded by (seed, name); a module that holds a shard of it (see `parallel/tensor.py`) cuts its
slice out with `local_shard(name, full)`.

Scheme (GPT-2 / Megatron): normal(0, init_std) for projections and embeddings; the two projections that
write into the residual stream (`wo`, `w_down`) scaled by 1/sqrt(2 n_layers); norms start at weight 1, bias 0.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from large_model_training.config import ModelConfig

RESIDUAL_OUTPUT_PROJECTIONS = ("attn.wo.weight", "mlp.w_down.weight")


def parameter_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one named parameter (crc32 is stable across processes, unlike hash())."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def full_shape(module: nn.Module, param_name: str, param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of a parameter: parallel layers override it, plain ones have param.shape."""
    if hasattr(module, "full_shape"):
        return tuple(module.full_shape(param_name))
    return tuple(param.shape)


def local_shard(module: nn.Module, param_name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full tensor: parallel layers cut their slice, plain ones keep it whole."""
    if hasattr(module, "local_shard"):
        return module.local_shard(param_name, full)
    return full


def draw_full(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value of parameter `name` (fp32, CPU), identical in every layout."""
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name
    if is_norm:
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(RESIDUAL_OUTPUT_PROJECTIONS):
        std /= math.sqrt(2 * cfg.n_layers)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of (a possibly sharded, possibly partial) model with its layout-free value."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight is initialised once, under its first name
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            if cfg.tie_embeddings and name == "output.weight":  # a last stage's copy of the tied embedding
                name = "tok_embeddings.weight"
            full = draw_full(cfg, name, full_shape(module, param_name, param), seed)
            param.copy_(local_shard(module, param_name, full))
