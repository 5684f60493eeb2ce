"""From a Config (lmt train's flags and TOML) to the planner's job and layout, and the two calls a bench needs:
`estimate_memory(cfg)` (bytes per rank, broken down) and `predict_step_time(cfg, hardware)` (seconds).

Settings the planner knows that `Config` may not have yet (they arrive with other issues) are split off the
dotted overrides and TOML here, so `--zero 1` or a TOML written by `lmt plan --write-config` work today.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from large_model_training.config import SECTION_TYPES, Config, ConfigError, build_config, load_toml, validate
from large_model_training.planner.hardware import Hardware, get_hardware, per_rank
from large_model_training.planner.layout import Job, Layout, layout_from_config, layout_problems
from large_model_training.planner.memory import MemoryBreakdown
from large_model_training.planner.search import Planner

PLANNER_SETTINGS = ("parallel.schedule", "parallel.virtual_stages", "parallel.zero", "parallel.sequence_parallel",
                    "train.recompute", "train.precision", "train.compression", "train.grad_reduce_fp32",
                    "train.compression_target")
"""Dotted settings the planner reads; those Config does not define yet are kept aside (see layout.py)."""


def _has_field(key: str) -> bool:
    section, _, name = key.partition(".")
    cls = SECTION_TYPES.get(section)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


def split_settings(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(settings Config has, planner settings it does not have yet)."""
    known = {k: v for k, v in flat.items() if k not in PLANNER_SETTINGS or _has_field(k)}
    extra = {k: v for k, v in flat.items() if k in PLANNER_SETTINGS and not _has_field(k)}
    return known, extra


def load_config(toml_path: str | None, overrides: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """build_config's preset -> TOML -> overrides, with the planner's extra settings split off."""
    flat = load_toml(toml_path) if toml_path else {}
    flat.update({k: v for k, v in overrides.items() if v is not None})
    known, extra = split_settings(flat)
    return build_config(None, known), extra


def check_model(cfg: Config) -> None:
    """Validate the model and training settings as `lmt train` does, independent of the layout."""
    probe = copy.deepcopy(cfg)
    probe.parallel.tp, probe.parallel.pp, probe.parallel.dp = 1, 1, 1
    probe.train.micro_batch_size, probe.train.global_batch_size = 1, 0
    probe.data.path = ""
    defaults = {"sequence_parallel": False, "schedule": "1f1b", "virtual_stages": 1, "zero": 0, "pp_layers": ""}
    for name, value in defaults.items():  # the layout is checked by the planner, per candidate
        if hasattr(probe.parallel, name):
            setattr(probe.parallel, name, value)
    validate(probe)


def job_and_layout(cfg: Config, extra: dict[str, Any] | None = None) -> tuple[Job, Layout]:
    """The job and the layout `cfg` describes, checked; ConfigError names every problem."""
    check_model(cfg)
    for key in ("tp", "pp"):
        if getattr(cfg.parallel, key) < 1:
            raise ConfigError(f"parallel.{key} must be positive, got {getattr(cfg.parallel, key)}")
    if cfg.parallel.dp < 0:
        raise ConfigError(f"parallel.dp must be positive, got {cfg.parallel.dp}")
    job, layout = layout_from_config(cfg, extra)
    problems = layout_problems(job, layout)
    if problems:
        raise ConfigError(f"layout {layout.describe()} cannot run {cfg.model.preset}: " + "; ".join(problems))
    return job, layout


def local_hardware() -> Hardware:
    """The measured `cpu` entry if `lmt calibrate` ran, else a stand-in with CPU kernels (memory only)."""
    try:
        return get_hardware("cpu")
    except ConfigError:
        return Hardware("cpu (not calibrated)", 1e11, 1e11, float(_physical_memory()), 1e10, 1e9, 1e-4, 1e9, 1e-4,
                        os.cpu_count() or 1, 1, 1.0, reserved_fraction=0.2, fused_kernels=False,
                        source="uncalibrated round figures (memory estimates only); run `lmt calibrate`")


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def _planner(job: Job, layout: Layout, hardware: Hardware | None) -> Planner:
    hw = per_rank(hardware or local_hardware(), layout.devices)
    return Planner(job, hw, layout.devices, hw.devices_per_node)


def memory_by_stage(cfg: Config, hardware: Hardware | None = None,
                    extra: dict[str, Any] | None = None) -> list[MemoryBreakdown]:
    """Memory of one device of every pipeline stage (in order)."""
    from large_model_training.planner.memory import stage_layer_counts, stage_memory

    job, layout = job_and_layout(cfg, extra)
    planner = _planner(job, layout, hardware)
    chunks = planner.chunks(layout)
    m, p, v = job.micro_batches(layout), layout.pp, layout.virtual_stages
    counts = stage_layer_counts(chunks, p)
    out = []
    for rank in range(p):
        held = planner.pipelines.in_flight(layout.schedule, p, m, v, rank)
        head = planner.pipelines.in_flight(layout.schedule, p, m, v, rank, last_stage_only=True) if rank == p - 1 else 0
        per_chunk = max(chunks[rank::p])
        out.append(stage_memory(job, layout, rank, per_chunk, counts[rank], held, head,
                                planner.hardware.fused_kernels))
    return out


def estimate_memory(cfg: Config, hardware: Hardware | None = None,
                    extra: dict[str, Any] | None = None) -> MemoryBreakdown:
    """Bytes on the most loaded rank of the layout `cfg` describes, by kind (parameters, gradients,
    optimizer states, activations, buffers). Without `hardware`, this machine's kernels (CPU unless an
    accelerator is present) decide what the activations store."""
    return max(memory_by_stage(cfg, hardware, extra), key=lambda mem: mem.total)


def predict_step_time(cfg: Config, hardware: Hardware | str | None = None,
                      extra: dict[str, Any] | None = None) -> float:
    """Predicted seconds of one optimizer step of `cfg` on `hardware` (default: the calibrated `cpu`)."""
    if isinstance(hardware, str):
        hardware = get_hardware(hardware)
    job, layout = job_and_layout(cfg, extra)
    planner = _planner(job, layout, hardware)
    return planner.evaluate(layout, simulate=True).time.step_time_s
