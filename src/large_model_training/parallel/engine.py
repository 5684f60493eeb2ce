"""The data-parallel engine's one interface, and the one place that chooses and configures an engine.

The trainer and the checkpoints talk to an `Engine` only: ours (`DataParallelEngine`, ZeRO 0-2, compression)
or FSDP2's (`FSDPEngine`, ZeRO-3). `build_engine` decides which from the config, with everything that
depends on the model's tensor-parallel layout (the gradient sync, the norm's exclusions, the compression
buckets of tp-replicated parameters), so a new engine or option changes this file, not the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from large_model_training.compression import CompressionState, compression_hook
from large_model_training.config import Config
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.diloco import outer_rule
from large_model_training.parallel.dp_engine import DataParallelEngine
from large_model_training.parallel.expert_engine import ExpertParallelEngine
from large_model_training.parallel.fsdp import FSDPEngine
from large_model_training.parallel.grad_sync import GradSync
from large_model_training.parallel.tensor import tp_layouts
from large_model_training.parallel.update_rule import rule_factory


class Engine(Protocol):
    """Gradient reduction and optimizer of one rank; one step is prepare_step, backward, finish_grad_sync,
    grad_norm, step (if finite), end_step."""

    model: nn.Module

    def prepare_step(self, micro_batches: int) -> None: ...

    def grad_of(self, name: str) -> torch.Tensor:
        """A parameter's gradient as the gradient sync sums it."""

    def finish_grad_sync(self) -> int:
        """Wait for every reduction; dp bytes sent so far this step."""

    def grad_norm(self) -> torch.Tensor: ...

    def step(self, lr: float, grad_scale: torch.Tensor | float = 1.0) -> None: ...

    def end_step(self, stepped: bool) -> None:
        """After every step on every rank, whether or not `step` ran."""

    def comm_bytes(self) -> int: ...

    def model_state_bytes(self) -> int: ...

    def memory_by_kind(self) -> dict[str, int]:
        """model_state_bytes as {'parameters', 'gradients', 'optimizer_states'}."""

    @property
    def compressed_from(self) -> int | None:
        """The first step (0-based) whose dp exchange is compressed: the run log's note is written then."""

    def step_record(self) -> dict:
        """This step's metrics particular to the engine (DiLoCo: sync_outer); read after `end_step`."""

    def compression_note(self, sent: int) -> str:
        """The run log's line on what compression saves ('' without compression)."""

    def model_state_dict(self) -> dict: ...

    def load_model_state_dict(self, state: dict) -> None: ...

    def reload_parameters(self) -> None: ...

    def state_dict(self) -> dict:
        """Optimizer state by parameter name (full tensors): the same format from every engine and layout."""

    def load_state_dict(self, state: dict) -> None: ...

    def rank_state_dict(self) -> dict:
        """State only this rank holds, saved in its own file ({} if none)."""

    def load_rank_state_dict(self, saved: dict | None) -> None: ...

    def local_state_dict(self) -> dict:
        """Model and optimizer state as this rank holds it, for the in-memory copies (`--save-local-every`),
        which are restored onto the same layout: this rank's tensors as they lie, nothing gathered (local_state.py:
        the model's persistent buffers beside them)."""

    def load_local_state_dict(self, state: dict) -> None: ...


def backward_step(
    engine: Engine,
    executor,
    micro_batches: list,
    count: int,
    *,
    context=None,
    backward_done: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of one optimizer step, the same for training, rehearsal and benchmarks: gradients zeroed
    for `count` micro-batches, forward and backward of `micro_batches` through the executor (inside `context`),
    every reduction finished, the global norm. Returns (this rank's loss sum, the gradient norm)."""
    engine.prepare_step(count)
    with context if context is not None else contextlib.nullcontext():
        loss_sum = executor.forward_backward(micro_batches, 1.0 / count)
    if backward_done is not None:
        backward_done()
    engine.finish_grad_sync()
    return loss_sum, engine.grad_norm()


def apply_step(engine: Engine, lr: float, grad_scale: float, apply: bool) -> dict:
    """The second half: the update (unless the step is skipped), `end_step` on every rank alike; returns the
    engine's step record."""
    if apply:
        engine.step(lr, grad_scale)
    engine.end_step(apply)
    return engine.step_record()


def compression_layout(cfg: Config) -> list:
    """What must match for a rank's residuals and warm-start factors to fit its buckets after a resume (plain
    values: the rank files are loaded weights_only)."""
    p, t = cfg.parallel, cfg.train
    return [
        p.tp,
        p.pp,
        p.dp,
        p.virtual_stages,
        p.bucket_mb,
        str(t.compression),
        t.error_feedback,
        str(t.precision),
        t.grad_reduce_fp32,
        str(t.compression_target),
    ]


def build_engine(
    model: nn.Module, mesh: ParallelMesh, cfg: Config, materialise: Callable[[], None] | None = None
) -> Engine:
    """The data-parallel engine of `model` that also owns the optimizer: FSDP2 for ZeRO-3; for ZeRO 0-2 ours, a
    gradient reducer per parameter group and the update rule `--optimizer` names (choices.Optimizer), inside
    DiLoCo's outer step under --sync local / streaming. tp-partial gradients are summed over `mesh.tp` (whose
    byte counter is the run's comm_bytes_tp). `materialise` (ZeRO-3, a model still on meta): allocates and
    initialises it once FSDP2 has sharded it."""
    t, p = cfg.train, cfg.parallel
    layouts = tp_layouts(model)
    sync = GradSync.for_model(model, mesh, cfg.model.tie_embeddings)
    excluded = set(getattr(model, "duplicate_parameters", set()))  # counted once in the gradient norm
    if mesh.tp_rank != 0:
        excluded |= {n for n, lay in layouts.items() if lay.replicated}
    common: dict[str, Any] = dict(
        precision=t.precision,
        grad_reduce_fp32=t.grad_reduce_fp32,
        weight_decay=t.weight_decay,
        betas=(t.beta1, t.beta2),
        norm_excluded=excluded,
        sync=sync,
    )
    if p.zero == 3:
        return FSDPEngine(model, mesh, sync_per_step=p.fsdp_sync_per_step, materialise=materialise, **common)
    assert materialise is None, "only ZeRO-3 shards before materialising"
    common.update(
        state_dtype=torch.float32 if t.optimizer_states == "fp32" else torch.bfloat16,  # Adam's moments
        sr_master=t.optimizer_states == "bf16_sr",
        train=t,
        update_rule=rule_factory(t.optimizer),
        zero=p.zero,
        bucket_mb=p.bucket_mb,
        rank_layout=compression_layout(cfg),
    )
    if cfg.sync.mode.infrequent:  # DiLoCo: inner steps reduce over no dp group, the outer step over dp
        common["update_rule"] = outer_rule(common["update_rule"], mesh, cfg.sync)
        common["rank_layout"] += [str(cfg.sync.mode), cfg.sync.fragments, str(cfg.sync.compression)]
        return DataParallelEngine(model, mesh.reducing_over(None, 1, 0), **common)
    if getattr(mesh, "ep_size", 1) > 1:  # experts reduce over their edp group (layout.py refuses compression)
        return ExpertParallelEngine(model, mesh, **common)
    compressed = t.compression.enabled or t.compression_target == "update"  # (layout.py: not with 1-bit Adam)
    own_buckets: set[str] = set()
    if (compressed or t.optimizer == "onebit-adam") and mesh.tp_size > 1:
        own_buckets = {n for n, lay in layouts.items() if lay.replicated}  # compressed identically on tp peers
    if compressed:
        common.update(
            comm_hook=compression_hook,
            hook_state=CompressionState(
                mesh.grad_group,
                mesh.grad_size,
                t.compression,
                error_feedback=t.error_feedback,
                seed=t.seed,
                dense_steps=t.compression_warmup,
            ),
            compress_update=t.compression_target == "update",
            compression_label=str(t.compression),
        )
    return DataParallelEngine(model, mesh, own_buckets=own_buckets, **common)
