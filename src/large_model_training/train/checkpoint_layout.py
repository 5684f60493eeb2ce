"""How a rank's state is described to DCP: tensors split over tp or ep become DTensors of their logical shape.

Plain tensors with the same name on several ranks are taken by DCP as replicas of one value; a shard is not, so
it must say which slice of the whole it is. Model and optimizer states use the same names, so one rule covers
both: tp shards (`TPLayout.shard_dim`) are `Shard(dim)` over the tp axis; the routed experts' stacked weights
under expert parallelism, (E / ep, ...) per rank, are `Shard(0)` over the expert mesh's ep axis, so the
checkpoint holds every (E, ...) tensor whatever ep was and resumes at any other ep.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from large_model_training.mesh import ParallelMesh


def sharded_names(model: nn.Module) -> dict:
    """Parameter name -> its TPLayout, for parameters split over tp (replicated ones are absent)."""
    from large_model_training.parallel.tensor import tp_layouts

    return {name: layout for name, layout in tp_layouts(model).items() if layout.shard_dim is not None}


def map_named(state: Any, fn, name: str = "") -> Any:
    """Apply fn(param_name, tensor) to every tensor in a nested state, naming it by its nearest parameter key."""
    if isinstance(state, dict):
        return {k: map_named(v, fn, k if "." in str(k) else name) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return fn(name, state)
    return state


def from_local(value: torch.Tensor, device_mesh, dim: int, shape: list[int]) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(value, device_mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride)


def as_dtensors(state: dict[str, Any], model: nn.Module, mesh: ParallelMesh | None) -> dict[str, Any]:
    """Wrap tp- and ep-sharded tensors as DTensors, so DCP stores them by their logical (full) shape.

    Padding (the vocabulary rounded up to a multiple of tp) is cut off: ceil(V/t) rows per rank with the
    remainder on the last rank is exactly DTensor's uneven Shard layout, so the checkpoint holds V rows whatever
    tp was, and loading fills the real rows of a view in place.
    """
    tp = mesh is not None and mesh.tp_size > 1
    ep = mesh is not None and getattr(mesh, "expert_mesh", None) is not None
    if not tp and not ep:
        return state
    sharded = sharded_names(model) if tp else {}
    experts = _expert_names(model) if ep else set()

    def wrap(name: str, value: torch.Tensor) -> torch.Tensor:
        if value.ndim == 0:
            return value
        if name in experts:
            return from_local(value, mesh.expert_mesh["ep"], 0, [value.shape[0] * mesh.ep_size, *value.shape[1:]])
        if name not in sharded:
            return value
        layout = sharded[name]
        dim, shape = layout.shard_dim, list(value.shape)
        shape[dim] = layout.full_size or shape[dim] * mesh.tp_size
        if layout.full_size:
            rows = max(0, min(value.shape[dim], layout.full_size - mesh.tp_rank * value.shape[dim]))
            value = value.narrow(dim, 0, rows)
        return from_local(value, mesh.device_mesh["tp"], dim, shape)

    return map_named(state, wrap)


def _expert_names(model: nn.Module) -> set[str]:
    from large_model_training.parallel.expert_engine import expert_parameter_names

    return expert_parameter_names(model)


def as_local(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return map_named(state, lambda name, v: v.to_local() if isinstance(v, DTensor) else v)
