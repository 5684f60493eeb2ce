"""Model FLOPs utilisation of every step: `tflops_per_device` and `mfu` in metrics.jsonl and the step line.

FLOP convention (models/flops.py, `training_flops_per_token`): model FLOPs, as Megatron's and PaLM's MFU count
them: 6 per parameter a token multiplies with (2 forward, 4 backward; the head included, the embedding lookup
and norms not; of an MoE block only the k experts a token is routed to), plus attention's QK^T and AV over the
full s x s square (12 x layers x seq_len x heads x head_dim per token, causal masking not halved), recomputation
not counted. So the figure depends on the model, the tokens and the time, never on the layout, the recompute
policy or the kernels, and compares with published MFU.

A step's model FLOPs are those of its global batch (global_batch_size x seq_len tokens), shared by every device
of the job: tflops_per_device = flops / devices / step_time_s, and mfu = that over one device's peak at the run's
precision (bf16 or fp32 dense matmul):
  - an accelerator the planner's hardware catalogue names (planner/hardware.entry_for_device): its datasheet peak;
  - otherwise (the CPU; accelerators without an entry): a square matmul timed once as the trainer starts
    (planner/calibrate.matmul_rate: 1024 wide on the CPU, 8192 on an accelerator). Every rank measures at once,
    so a CPU rank measures the share of the cores it then trains with. Once per process, device, precision and
    thread count: a rank that rejoins in its own process (`--spares`, reliability/in_place.py) keeps its figure
    instead of spending a few hundred milliseconds of the recovery measuring it again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from large_model_training.choices import bf16_compute
from large_model_training.config import Config
from large_model_training.mesh import device_name
from large_model_training.models.flops import training_flops_per_token
from large_model_training.planner.calibrate import matmul_rate
from large_model_training.planner.hardware import entry_for_device


@dataclass(frozen=True)
class Utilization:
    flops_per_step: float
    """Model FLOPs of one optimizer step, all devices together."""
    devices: int
    peak: float
    """FLOP/s of one device at the run's precision."""
    peak_source: str
    """Where `peak` comes from, for the run log."""

    def record(self, step_time_s: float) -> dict[str, float]:
        per_device = self.flops_per_step / self.devices / step_time_s
        return {"tflops_per_device": per_device / 1e12, "mfu": per_device / self.peak}

    def note(self) -> str:
        return (
            f"MFU: {self.flops_per_step / 1e12:.4g} model TFLOP per step over {self.devices} device(s), peak "
            f"{self.peak / 1e12:.4g} TFLOP/s per device ({self.peak_source})"
        )


def device_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(FLOP/s, where it comes from) of one device: the catalogue's datasheet figure, or a measured matmul."""
    return _device_peak(device, precision, torch.get_num_threads())


@functools.cache
def _device_peak(device: torch.device, precision: str, threads: int) -> tuple[float, str]:
    name = device_name(device)
    entry = entry_for_device(name)
    if entry is not None:
        return entry.peak(precision), f"{entry.name} datasheet, {precision}"
    n = 1024 if device.type == "cpu" else 8192
    dtype = torch.bfloat16 if bf16_compute(precision) else torch.float32  # fp8: quoted as BF16-equivalent
    return matmul_rate(dtype, n, repeats=5, device=device), f"{name} {precision} {n}-wide matmul measured now"


def utilization(cfg: Config, device: torch.device, devices: int) -> Utilization:
    """The run's model FLOPs per step and this device's peak (`devices`: the job's world size)."""
    t = cfg.train
    tokens = t.global_batch_size * t.seq_len
    peak, source = device_peak(device, str(t.precision))
    return Utilization(training_flops_per_token(cfg.model, t.seq_len) * tokens, devices, peak, source)
