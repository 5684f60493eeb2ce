"""Checkpoints: model and optimizer through torch.distributed.checkpoint (DCP), plus per-rank loop state.

Layout of one checkpoint folder `RUN/checkpoints/step_<N>/`:
  .metadata, __*_*.distcp   DCP: model and optimizer state under the model's parameter names (each rank writes
                             what it holds; replicated tensors are written once)
  rank_<r>.pt               rank r's RNG states and loader position (tensors and ints: loaded weights_only)
  meta.json                 format marker, step, model shape and layout: checked before anything is loaded

A save is written into a hidden temporary folder and made visible by one rename after every rank finished, so a
folder named step_<N> is always complete; `meta.json` is the last file written before the rename.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from large_model_training.config import Config, ConfigError, ModelConfig
from large_model_training.mesh import ParallelMesh

FORMAT = "lmt-checkpoint"
VERSION = 1
STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step}")


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators our code draws from: torch's CPU one and the device's (dropout). Data order is seeded."""
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device).get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state:
        torch.get_device_module(device).set_rng_state(state["device"])


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sharded_names(model: nn.Module) -> dict[str, int]:
    """Parameter name -> tensor dim it is split along over tp (replicated parameters are absent)."""
    from large_model_training.parallel.tensor import tp_layouts

    return {name: layout.shard_dim for name, layout in tp_layouts(model).items() if layout.shard_dim is not None}


def _map_named(state: Any, fn, name: str = "") -> Any:
    """Apply fn(param_name, tensor) to every tensor in a nested state, naming it by its nearest parameter key."""
    if isinstance(state, dict):
        return {k: _map_named(v, fn, k if "." in str(k) else name) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return fn(name, state)
    return state


def _as_dtensors(state: dict[str, Any], model: nn.Module, mesh: ParallelMesh | None) -> dict[str, Any]:
    """Wrap tp-sharded tensors as DTensors over the tp axis, so DCP stores them by their logical (full) shape.

    Plain tensors with the same name on several ranks are taken by DCP as replicas of one value; a tp shard is
    not, so it must say which slice of the whole it is. Model and optimizer states use the same names.
    """
    if mesh is None or mesh.tp_size == 1:
        return state
    from torch.distributed.tensor import DTensor, Shard

    sharded = _sharded_names(model)
    tp_mesh = mesh.device_mesh["tp"]

    def wrap(name: str, value: torch.Tensor) -> torch.Tensor:
        if name in sharded and value.ndim > 0:
            return DTensor.from_local(value, tp_mesh, [Shard(sharded[name])], run_check=False)
        return value

    return _map_named(state, wrap)


def _as_local(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return _map_named(state, lambda name, v: v.to_local() if isinstance(v, DTensor) else v)


def save_checkpoint(cfg: Config, run_dir: str, step: int, model: nn.Module, engine,
                    loop_state: dict[str, Any], mesh: ParallelMesh | None = None) -> str:
    """Collective: every rank calls it. Returns the final folder."""
    final = checkpoint_dir(run_dir, step)
    tmp = os.path.join(os.path.dirname(final), f".tmp_step_{step}")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = {"model": engine.model_state_dict(), "optim": engine.state_dict()}
    dcp.save(_as_dtensors(state, model, mesh), checkpoint_id=tmp)
    torch.save({"rng": rng_state(model_device(model)), **loop_state}, os.path.join(tmp, f"rank_{rank}.pt"))
    dist.barrier()
    if rank == 0:
        meta = {"format": FORMAT, "version": VERSION, "step": step, "model": asdict(cfg.model),
                "layout": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": cfg.parallel.dp},
                "world_size": dist.get_world_size(), "config": cfg.to_dict()}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    dist.barrier()
    return final


def read_meta(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"not an lmt checkpoint (no meta.json): {ckpt}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"unreadable checkpoint metadata {path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"not an lmt checkpoint (foreign meta.json): {path}")
    if meta.get("version") != VERSION:
        raise ConfigError(f"checkpoint {ckpt} has format version {meta.get('version')}, this lmt reads {VERSION}")
    if not os.path.isfile(os.path.join(ckpt, ".metadata")):
        raise ConfigError(f"checkpoint {ckpt} is incomplete: its .metadata file is missing")
    return meta


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder, or a run folder (-> its newest complete checkpoint). ConfigError otherwise."""
    if not os.path.isdir(path):
        raise ConfigError(f"resume path not found or not a folder: {path}")
    if os.path.exists(os.path.join(path, "meta.json")):
        read_meta(path)
        return path
    root = os.path.join(path, "checkpoints")
    steps = []
    if os.path.isdir(root):
        steps = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := STEP_DIR.match(name))
                       and os.path.exists(os.path.join(root, name, "meta.json")))
    if not steps:
        raise ConfigError(f"no checkpoint found in {path} (expected a run folder with checkpoints/step_<N>/ "
                          "or a checkpoint folder with meta.json)")
    ckpt = os.path.join(root, steps[-1][1])
    read_meta(ckpt)
    return ckpt


def check_compatible(ckpt: str, model_cfg: ModelConfig) -> dict[str, Any]:
    """The checkpoint's metadata, after checking it holds the same model shape as model_cfg."""
    meta = read_meta(ckpt)
    saved = {k: v for k, v in meta["model"].items() if k != "preset"}
    wanted = {k: v for k, v in asdict(model_cfg).items() if k != "preset"}
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}" for k, v in wanted.items() if saved.get(k) != v]
    if diff:
        raise ConfigError(f"checkpoint {ckpt} holds a different model ({'; '.join(diff[:3])})")
    return meta


def load_checkpoint(ckpt: str, model: nn.Module, engine=None, mesh: ParallelMesh | None = None) -> dict[str, Any]:
    """Load model (and, with an engine, optimizer) state into this rank's modules; return its loop state."""
    if engine is None:  # weights only, one process (lmt generate)
        model_state = model.state_dict()
        dcp.load({"model": model_state}, checkpoint_id=ckpt)
        model.load_state_dict(model_state)
        return {}
    state = _as_dtensors({"model": engine.model_state_dict(), "optim": engine.state_dict()}, model, mesh)
    dcp.load(state, checkpoint_id=ckpt)
    state = _as_local(state)
    engine.load_model_state_dict(state["model"])
    engine.reload_parameters()
    engine.load_state_dict(state["optim"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(ckpt, f"rank_{rank}.pt")
    if not os.path.exists(path):
        return {}
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # a damaged file: say which one
        raise ConfigError(f"unreadable checkpoint file {path}: {str(e).splitlines()[0]}") from None
