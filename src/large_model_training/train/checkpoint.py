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
import shutil
import threading
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception: caught by name

from large_model_training.config import Config, ConfigError, ModelConfig
from large_model_training.mesh import ParallelMesh
from large_model_training.train.checkpoint_fused import request_separate, written_before_fusion
from large_model_training.train.checkpoint_layout import (
    as_dtensors as _as_dtensors,
    as_local as _as_local,
    map_named as _map_named,
)
from large_model_training.train.checkpoint_meta import (  # re-exported (`x as x`): callers read them from here
    FORMAT,
    LATEST,
    STEP_DIR,
    VERSION,
    check_compatible as check_compatible,
    manifest as _manifest,
    newest_checkpoint as newest_checkpoint,
    read_meta,
    resolve_checkpoint as resolve_checkpoint,
    verify_checkpoint as verify_checkpoint,
)


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


def _optimizer_state(engine, model: nn.Module) -> dict[str, Any]:
    """The engine's optimizer state by parameter name; a tied embedding is listed under both of its names, as
    in the model's state dict, so that pipeline layouts (where the last stage holds `output.weight`) and
    single-stage layouts (one tensor for both) read each other's checkpoints."""
    state = engine.state_dict()
    # Only where this rank holds both ends of the tie (one stage); a first stage of several has no head.
    if getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings and hasattr(model, "output"):
        for per_param in state.values():
            if isinstance(per_param, dict) and "tok_embeddings.weight" in per_param:
                per_param.setdefault("output.weight", per_param["tok_embeddings.weight"])
    return state


class CheckpointWriter:
    """Saves checkpoints atomically, optionally in the background, and keeps the newest `keep`.

    A save is written into `checkpoints/.tmp_step_<N>`; when every rank has finished, rank 0 records the files'
    sizes and checksums in meta.json, renames the folder to `step_<N>` and then points `checkpoints/latest` at
    it. A save killed midway leaves only the hidden folder: the previous checkpoint stays the latest.

    With async_save, the state is snapshotted (cloned) and written by DCP from a background thread over a
    process group of its own (so its collectives never interleave with training's); training goes on, and the
    next save (or the end of the run) first waits for the previous one and finalises it. (DCP's own
    async_save stager could not copy our flat-buffer views on this torch version; a clone is what it does.)
    """

    def __init__(self, cfg: Config, run_dir: str, mesh: ParallelMesh | None, async_save: bool = False, keep: int = 0):
        self.cfg, self.run_dir, self.mesh = cfg, run_dir, mesh
        self.async_save, self.keep = async_save, keep
        self.root = os.path.join(run_dir, "checkpoints")
        self._pending: tuple[Any, int, str, str] | None = None  # (future, step, tmp folder, final folder)
        self._group = dist.new_group(backend="gloo") if async_save else None
        self.last_complete = ""

    def save(self, step: int, model: nn.Module, engine, loop_state: dict[str, Any]) -> str:
        """Collective. Returns the folder the checkpoint will have once complete. A failed write (a full disk)
        raises CheckpointSaveError; the previous checkpoint stays complete and `latest`."""
        self.wait()
        final, tmp = checkpoint_dir(self.run_dir, step), os.path.join(self.root, f".tmp_step_{step}")
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        state = _as_dtensors(
            {"model": engine.model_state_dict(), "optim": _optimizer_state(engine, model)}, model, self.mesh
        )
        try:
            torch.save({"rng": rng_state(model_device(model)), **loop_state}, os.path.join(tmp, f"rank_{rank}.pt"))
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            raise CheckpointSaveError(step, e) from e
        if self.async_save:
            # Snapshot first (training will change the tensors), then write from a thread over our own group.
            snapshot = _map_named(state, lambda name, t: _clone(t))
            future: Future = Future()

            def write() -> None:
                try:
                    dcp.save(snapshot, checkpoint_id=tmp, process_group=self._group)
                    future.set_result(None)
                except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
                    future.set_exception(e)

            threading.Thread(target=write, name=f"lmt-save-{step}", daemon=True).start()
            self._pending = (future, step, tmp, final)
        else:
            try:
                dcp.save(state, checkpoint_id=tmp)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps every rank's failure
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)  # give the space back (a full disk is the usual cause)
                raise CheckpointSaveError(step, e) from e
            self._finalize(step, tmp, final)
        return final

    def wait(self) -> None:
        """Finish the save in flight, if any (collective)."""
        if self._pending is not None:
            future, step, tmp, final = self._pending
            self._pending = None
            try:
                future.result()
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - see save()
                raise CheckpointSaveError(step, e) from e
            self._finalize(step, tmp, final)

    def _finalize(self, step: int, tmp: str, final: str) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            cfg = self.cfg
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "step": step,
                "model": asdict(cfg.model),
                "layout": {
                    "tp": cfg.parallel.tp,
                    "pp": cfg.parallel.pp,
                    "dp": cfg.parallel.dp,
                    "zero": cfg.parallel.zero,
                    "cp": cfg.parallel.cp,
                    "ep": cfg.parallel.ep,
                },
                "world_size": dist.get_world_size(),
                "config": cfg.to_dict(),
                "files": _manifest(tmp),
            }
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            _write_atomically(os.path.join(self.root, LATEST), os.path.basename(final))
            self._prune()
        self.last_complete = final
        dist.barrier()

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        steps = sorted(int(m.group(1)) for name in os.listdir(self.root) if (m := STEP_DIR.match(name)))
        for old in steps[: -self.keep]:
            shutil.rmtree(checkpoint_dir(self.run_dir, old), ignore_errors=True)


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed; the message names the step and the first cause (e.g. no space left)."""

    def __init__(self, step: int, error: BaseException):
        super().__init__(
            f"saving the checkpoint of step {step} failed: {_root_cause(error)} (the previous checkpoint is untouched)"
        )


def _root_cause(error: BaseException) -> str:
    """The first OSError inside DCP's CheckpointException (`failures`: rank -> (exception, traceback))."""
    failures = getattr(error, "failures", None) or {}
    for cause in [error, *(f[0] if isinstance(f, tuple) else f for f in failures.values())]:
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return cause.strerror or str(cause)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _clone(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return DTensor.from_local(
            t.to_local().clone(), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t.detach().clone()


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def save_checkpoint(
    cfg: Config,
    run_dir: str,
    step: int,
    model: nn.Module,
    engine,
    loop_state: dict[str, Any],
    mesh: ParallelMesh | None = None,
) -> str:
    """One synchronous, atomic save (collective)."""
    return CheckpointWriter(cfg, run_dir, mesh).save(step, model, engine, loop_state)


def load_checkpoint(ckpt: str, model: nn.Module, engine=None, mesh: ParallelMesh | None = None) -> dict[str, Any]:
    """Load model (and, with an engine, optimizer) state into this rank's modules; return its loop state."""
    if engine is None:  # weights only, one process (lmt generate)
        model_state = model.state_dict()
        _load_converting({"model": model_state}, ckpt, zero=0)
        model.load_state_dict(model_state)
        return {}
    state = _as_dtensors({"model": engine.model_state_dict(), "optim": _optimizer_state(engine, model)}, model, mesh)
    _load_converting(state, ckpt, zero=getattr(engine, "zero", 0))
    state = _as_local(state)
    engine.load_model_state_dict(state["model"])
    engine.reload_parameters()
    engine.load_state_dict(state["optim"])
    here = (
        {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size, "cp": mesh.cp_size}
        if mesh
        else {"tp": 1, "pp": 1, "dp": 1, "cp": 1}
    )
    return rank_loop_state(ckpt, here, dist.get_rank() if dist.is_initialized() else 0)


def _load_converting(state: dict[str, Any], ckpt: str, zero: int) -> None:
    """dcp.load into `state`; a checkpoint from before the fused projections is converted on the way."""
    fuse_back = []
    if written_before_fusion(ckpt):
        cfg = ModelConfig(**{**asdict(ModelConfig()), **read_meta(ckpt)["model"]})
        fuse_back = request_separate(state, cfg, ckpt, zero)
    dcp.load(state, checkpoint_id=ckpt)
    for fuse in fuse_back:
        fuse()


ENGINE_RANK_STATE = "engine"
"""The loop-state key of the engine's per-rank state (compression residuals, 1-bit Adam's errors, DiLoCo's
replica); checkpoints before it used "compression" for all of them, still read."""


def engine_rank_state(loop_state: dict[str, Any]) -> dict | None:
    """The engine's per-rank state of a rank's loop state, under its key or the old one."""
    return loop_state.get(ENGINE_RANK_STATE, loop_state.get("compression"))


def rank_loop_state(ckpt: str, layout: dict[str, int], rank: int) -> dict[str, Any]:
    """The loop state `rank` of a run in `layout` ({'tp': .., 'pp': .., 'dp': ..}) resumes with.

    In the layout it was saved with, each rank gets its own RNG states back; in another layout the streams
    cannot map one to one, so ranks take the loader position (the same on every rank) from rank 0's file and
    keep the generators seeded for this layout. "Same layout" is the same tp x pp x dp grid, not merely the
    same world size: a tp2 x dp2 checkpoint resumed as dp4 has 4 ranks too, but rank 1 is another rank there.
    """
    saved = read_meta(ckpt)["layout"]
    same_layout = all(saved.get(axis, 1 if axis == "cp" else None) == size for axis, size in layout.items())
    path = os.path.join(ckpt, f"rank_{rank if same_layout else 0}.pt")
    try:
        loop_state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint file missing: {path}") from None
    except Exception as e:  # a damaged file: say which one
        raise ConfigError(f"unreadable checkpoint file {path}: {str(e).splitlines()[0]}") from None
    if not same_layout:
        loop_state.pop("rng", None)
    return loop_state
