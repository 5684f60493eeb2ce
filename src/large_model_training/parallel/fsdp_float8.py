"""ZeRO-3 with `--precision fp8`: FSDP2 all-gathers the block linears' weights in float8 (tensorwise recipe).

Under ZeRO-3 every step all-gathers every weight twice (forward, and again in backward). A tensorwise fp8 GEMM
casts the gathered weight to float8 anyway, so casting each rank's shard *before* the gather with the whole
weight's scale gives the same float8 weight and moves 1 byte per value instead of bf16's 2: half the weight
all-gather bytes (torchao's `enable_fsdp_float8_all_gather`, which torchtitan runs). This uses torchao's FSDP2
extension as it is: the weight parameter becomes torchao's `WeightWithDynamicFloat8CastTensor`, whose
`fsdp_pre_all_gather` casts the fp32 shard with a precomputed scale and whose `fsdp_post_all_gather` gives the
gathered `Float8TrainingTensor` that our linear function multiplies directly (`models/float8.py`,
`float8_weight`). The fp32 master shard and AdamW are unchanged; the weight gradient is bf16, reduce-scattered as
before.

The scale must be the whole weight's: one amax per weight, MAX-reduced over the dp x cp group that FSDP shards
over and over the tp group (a tp shard is part of the weight too: tp=2 computes tp=1's scales, as without
FSDP), all weights in one all-reduce per group. It is recomputed whenever the weights change (after each
optimizer step and after a checkpoint or a rollback loads them), as torchao's
`precompute_float8_dynamic_scale_for_fsdp` is, which reduces over the FSDP mesh only.

Where this cannot apply the gather stays bf16 and the run log says why: the rowwise recipe (a weight's scales
differ per GEMM: no single float8 copy serves both), or torchao not installed.
"""

from __future__ import annotations

import importlib.util
import logging
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.mesh import ParallelMesh
from large_model_training.models.float8 import EPS
from large_model_training.parallel.collectives import all_reduce_


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def float8_gather_problem(model: nn.Module) -> str | None:
    """Why this model's ZeRO-3 gathers stay bf16, or None when its fp8 block weights can be gathered in float8."""
    recipes = {m.fp8.recipe.name for m in model.modules() if getattr(m, "fp8", None) is not None}
    if not recipes:
        return "no float8 layers"
    if recipes != {"tensorwise"}:
        named = ", ".join(sorted(recipes))
        return f"the {named} recipe scales each GEMM's rows differently, so no one float8 copy serves them"
    if importlib.util.find_spec("torchao") is None:
        return "torchao (which provides FSDP2's float8 all-gather) is not installed"
    return None


def float8_gather_note(model: nn.Module) -> str:
    """The run log's line under ZeRO-3 with fp8: in which format the block weights are all-gathered, and why."""
    problem = float8_gather_problem(model)
    if problem is None:
        return "ZeRO-3 all-gathers the float8 layers' weights in float8 (1 byte per value, half of bf16's)"
    return f"ZeRO-3 all-gathers the weights in bf16: {problem}"


def _float8_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "fp8", None) is not None]


@contextmanager
def _quiet(*loggers: str):
    """These loggers at ERROR for the duration (restored after)."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def wrap_for_float8_gather(model: nn.Module) -> int:
    """Before `fully_shard`: each float8 layer's weight becomes torchao's float8-gathering weight (same values,
    same fp32 storage); returns how many."""
    with _quiet("torchao", "torch.utils._pytree"):  # its CPU-less kernel libraries' load warnings, on a CPU build
        from torchao.float8.float8_training_tensor import LinearMMConfig
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    layers = _float8_layers(model)
    for layer in layers:
        weight = layer.weight
        wrapped = WeightWithDynamicFloat8CastTensor(weight.data, LinearMMConfig(), torch.float8_e4m3fn)
        layer.weight = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
    return len(layers)


class Float8GatherScales:
    """The tensorwise scales the float8 gathers cast with, kept equal to the whole weights' (see the module)."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh):
        self.layers, self.mesh = _float8_layers(model), mesh
        self.bytes = 0.0  # the amax all-reduces over dp so far (the engine adds them to its dp bytes)

    @torch.no_grad()
    def refresh(self) -> None:
        if not self.layers:
            return
        shards = [_local(layer.weight)._tensor for layer in self.layers]
        amax = torch.stack([s.abs().max().float() if s.numel() else torch.zeros((), device=s.device) for s in shards])
        if self.mesh.grad_size > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.mesh.grad_group)
            self.bytes += 2 * (self.mesh.grad_size - 1) / self.mesh.grad_size * amax.numel() * amax.element_size()
        all_reduce_(amax, self.mesh.tp, op=dist.ReduceOp.MAX)  # counted in the tp bytes
        scales = (torch.finfo(torch.float8_e4m3fn).max / amax.double().clamp(min=EPS)).float()
        for layer, scale in zip(self.layers, scales):
            _local(layer.weight)._precomputed_scale = scale
