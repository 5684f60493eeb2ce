"""From a Config (lmt train's flags and TOML) to the planner's job and layout, and the two calls a bench needs:
`estimate_memory(cfg)` (bytes per rank, broken down) and `predict_step_time(cfg, hardware)` (seconds).
"""

from __future__ import annotations

import copy
import os

from large_model_training.config import Config
from large_model_training.errors import ConfigError
from large_model_training.layout import Job, Layout, job_and_layout, validate
from large_model_training.planner.hardware import Hardware, get_hardware, per_rank
from large_model_training.planner.memory import MemoryBreakdown
from large_model_training.planner.search import Planner


def without_data_files(cfg: Config) -> Config:
    """A copy of cfg to check on the machine that plans, where the run's data files need not exist."""
    probe = copy.deepcopy(cfg)
    probe.data.path, probe.data.tokenizer = "", ""
    return probe


def checked_job_and_layout(cfg: Config) -> tuple[Job, Layout]:
    """The job and layout `cfg` describes, checked by the same `validate` as `lmt train`."""
    return job_and_layout(validate(without_data_files(cfg)))


def local_hardware() -> Hardware:
    """The measured `cpu` entry if `lmt calibrate` ran, else a stand-in with CPU kernels (memory only)."""
    try:
        return get_hardware("cpu")
    except ConfigError:
        return Hardware(
            "cpu (not calibrated)",
            1e11,
            1e11,
            float(_physical_memory()),
            1e10,
            1e9,
            1e-4,
            1e9,
            1e-4,
            os.cpu_count() or 1,
            1,
            1.0,
            reserved_fraction=0.2,
            fused_kernels=False,
            source="uncalibrated round figures (memory estimates only); run `lmt calibrate`",
        )


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def _planner(job: Job, layout: Layout, hardware: Hardware | None) -> Planner:
    hw = per_rank(hardware or local_hardware(), layout.devices)
    return Planner(job, hw, layout.devices, hw.devices_per_node)


def memory_by_stage(cfg: Config, hardware: Hardware | None = None) -> list[MemoryBreakdown]:
    """Memory of one device of every pipeline stage (in order)."""
    job, layout = checked_job_and_layout(cfg)
    planner = _planner(job, layout, hardware)
    return [planner.rank_memory(layout, rank) for rank in range(layout.pp)]


def estimate_memory(cfg: Config, hardware: Hardware | None = None) -> MemoryBreakdown:
    """Bytes on the most loaded rank of the layout `cfg` describes, by kind (parameters, gradients,
    optimizer states, activations, buffers). Without `hardware`, this machine's kernels (CPU unless an
    accelerator is present) decide what the activations store."""
    return max(memory_by_stage(cfg, hardware), key=lambda mem: mem.total)


def predict_step_time(cfg: Config, hardware: Hardware | str | None = None) -> float:
    """Predicted seconds of one optimizer step of `cfg` on `hardware` (default: the calibrated `cpu`)."""
    if isinstance(hardware, str):
        hardware = get_hardware(hardware)
    job, layout = checked_job_and_layout(cfg)
    planner = _planner(job, layout, hardware)
    return planner.evaluate(layout, simulate=True).time.step_time_s
