"""The optimizer step as the runtime runs it: every pass over the parameters between the last backward and the next
forward, in bytes per element (issue 35, fourth round).

The planner had priced the step as one fused pass (read parameter or master, gradient, m and v; write them back:
28 bytes, 30 with the bf16 copy): what a multi-tensor fused AdamW does (Apex's FusedAdam in Megatron-LM and
DeepSpeed, `torch.optim.AdamW(fused=True)` in torchtitan). lmt's own step is eager PyTorch, one kernel per
operation, each streaming whole tensors (parallel/adamw.py, `_update_region` and `_moments`, per element of this
rank's shard, fp32 masters and moments, gradients of G bytes):

  weight decay   master.mul_                                  8 (read and write fp32)
  gradient       grad.float()                                 G + 4 (none when G = 4)
  first moment   exp_avg.lerp_(grad)                          12
  second moment  exp_avg_sq.mul_, then .addcmul_(grad, grad)  8 + 16 (self and both operands read)
  denominator    sqrt(), / sqrt(bias2), add_(eps)             8 + 8 + 8
  update         master.addcdiv_(exp_avg, denom)              16
  bf16 moments   .float() before and copy_ back after, both   2 (S + 4) + 2 (4 + S)
                 each kept by stochastic rounding: add, mask    2 x 20
  bf16_sr        no fp32 master: the cast up, the rounding      6 + 20 + 6
                 and the copy back

then `FlatShards.publish` copies the masters into the compute-dtype parameters (4 + B), the clip norm
(grad_reducer.norm_sq: grad.float(), pow, sum: G + 4 + 8 + 4, 12 when G = 4) reads every gradient of the shard,
`prepare_step` zeroes the local gradient buffers (G) and every micro-batch's backward adds its new gradient into
them (autograd's AccumulateGrad, in place: 2 G + B; the clip scale's multiply runs only when the norm exceeds
the clip and is not counted). ZeRO-3 runs `torch.optim.AdamW(foreach=False)` on fp32 shards (parallel/fsdp.py):
the same passes without the casts, the norm without the cast, no publish (the gathers cast) and no zeroing
(gradients set to None). The passes are memory-bound kernels at the entry's streaming bandwidth; each 16M-element
slice (at least one per 25 MiB bucket) launches about 11 kernels (the AdamW passes, the publish, the zeroing).
A CPU entry keeps the one-pass count its calibration was made with (as eager_ops does).
"""

from __future__ import annotations

import math

from large_model_training.planner.hardware import Hardware
from large_model_training.planner.memory import DEFAULT_BUCKET_BYTES

FUSED_BYTES = 28
"""One fused AdamW pass per element: read parameter (or master), gradient, m, v (16); write parameter, m, v (12)."""
ROUNDING_BYTES = 20
"""Stochastic rounding of one fp32 tensor to bf16 beyond the plain cast: the random bits added (12), the mask (8);
the bits are drawn once per step, a slice long (parallel/adamw.RoundingNoise), not counted per element."""
SLICE = 1 << 24  # parallel/adamw.step_slice_elements on an accelerator
KERNELS_PER_SLICE = 11


def adamw_bytes(grad_bytes: int, optimizer_states: str = "fp32", fsdp: bool = False) -> int:
    """Bytes per shard element our AdamW moves (the module docstring's table)."""
    moved = 8 + 12 + 8 + 16 + 8 + 8 + 8 + 16
    if not fsdp and grad_bytes != 4:
        moved += grad_bytes + 4
    if optimizer_states in ("bf16", "bf16_sr"):
        moved += 4 * (2 + 4) + 2 * ROUNDING_BYTES
    if optimizer_states == "bf16_sr":
        moved += (2 + 4) + ROUNDING_BYTES + (4 + 2)
    return moved


def step_passes(
    shard: float,
    local: float,
    micro_batches: int,
    dtypes: tuple[int, int],
    optimizer_states: str = "fp32",
    fsdp: bool = False,
) -> tuple[float, int]:
    """(bytes, kernels) of one step's passes: `shard` elements this rank updates, `local` elements of gradient it
    holds in backward (its pipeline stage's), dtypes = (B compute, G gradient) bytes."""
    B, G = dtypes
    if fsdp:  # fp32 shards and gradients; the gathers cast, gradients are set to None
        moved = shard * (adamw_bytes(4, optimizer_states, fsdp=True) + 12)
    else:
        publish = 4 + B if B != 4 and optimizer_states != "bf16_sr" else 0
        norm = (G + 4 if G != 4 else 0) + 12
        moved = shard * (adamw_bytes(G, optimizer_states) + publish + norm) + local * (G + micro_batches * (2 * G + B))
    slices = max(math.ceil(shard / SLICE), math.ceil(local * G / DEFAULT_BUCKET_BYTES))
    return moved, slices * KERNELS_PER_SLICE


def optimizer_time(
    hw: Hardware,
    shard: float,
    local: float,
    micro_batches: int,
    dtypes: tuple[int, int],
    optimizer_states: str = "fp32",
    fsdp: bool = False,
    fused: bool = False,
) -> float:
    """Seconds of the optimizer step on one rank: lmt's passes on an accelerator, one fused pass when the
    framework runs a fused AdamW (`fused`) or on a CPU entry (its calibration's count)."""
    B = dtypes[0]
    if fused or not hw.fused_kernels:
        return shard * (FUSED_BYTES + (2 if B == 2 else 0)) / hw.stream_bandwidth
    moved, kernels = step_passes(shard, local, micro_batches, dtypes, optimizer_states, fsdp)
    return moved / hw.stream_bandwidth + kernels * hw.kernel_launch_s
