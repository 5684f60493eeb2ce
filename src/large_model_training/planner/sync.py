"""The planner's terms for `--sync local:H` / `streaming:H` (DiLoCo, parallel/diloco.py): the dp volume and
the exposed time of the outer exchange, which replace the per-step gradient reduction.

Per rank, an outer exchange of n parameters passes n x b bytes to its collective (b = 4 fp32, 2 bf16,
1 + 4/256 int8 and 1/2 + 4/256 int4 with one fp32 scale per 256-element chunk, 1/8 + 4/256 sign: what
`comm_bytes_dp` counts on a sync step), once every H steps per parameter; streaming sends 1/fragments of the
model at a time, just as often per parameter. So the mean dp bytes per step is n b / H. Time, under the ring
model of planner/comm.py:
  local:H       one blocking all-reduce (int8/int4/sign: all-gather of every rank's message) of the model every
                H steps;
  streaming:H   fragments x per H steps, an exchange of n / fragments, overlapped with `overlap` inner steps of
                compute: only what runs past them is exposed.
"""

from __future__ import annotations

from large_model_training.choices import QUANT_CHUNK, SYNC_GATHERED
from large_model_training.compression.sign import OUTER_SIGN_CHUNK
from large_model_training.config import SyncConfig
from large_model_training.planner.comm import ring_all_gather, ring_all_reduce

WIRE_BYTES = {"none": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / QUANT_CHUNK, "int4": 0.5 + 4.0 / QUANT_CHUNK,
              "sign": 1 / 8 + 4.0 / OUTER_SIGN_CHUNK}
"""Bytes per parameter each rank passes to one outer exchange, by sync.compression."""


def outer_bytes_per_step(params: int, dp: int, sync: SyncConfig) -> float | None:
    """Mean dp bytes per step this rank passes to the outer exchanges of its `params` parameters; None for
    every-step (the gradient reduction's terms apply)."""
    if not sync.mode.infrequent:
        return None
    return 0.0 if dp == 1 else params * WIRE_BYTES[sync.compression] / sync.mode.every


def _exchange_time(n_bytes: float, dp: int, bandwidth: float, latency: float, compression: str) -> float:
    if compression in SYNC_GATHERED:  # every rank's message gathered: a ring all-gather of dp messages
        return (dp - 1) * latency + ring_all_gather(n_bytes * dp, dp) / bandwidth
    return 2 * (dp - 1) * latency + ring_all_reduce(n_bytes, dp) / bandwidth


def outer_exposed_time(params: int, dp: int, sync: SyncConfig, bandwidth: float, latency: float,
                       inner_step_s: float) -> float:
    """Seconds per step (averaged over H) the outer exchange adds to an inner step of `inner_step_s`."""
    if dp == 1:
        return 0.0
    h, n_bytes = sync.mode.every, params * WIRE_BYTES[sync.compression]
    if sync.mode.kind == "local":
        return _exchange_time(n_bytes, dp, bandwidth, latency, sync.compression) / h
    f = sync.fragments
    one = _exchange_time(n_bytes / f, dp, bandwidth, latency, sync.compression)
    return f * max(0.0, one - sync.overlap * inner_step_s) / h


def outer_state_bytes(params: int, sync: SyncConfig, dp: int) -> float:
    """Bytes of the outer state per rank: the fp32 anchor and Nesterov momentum (8 per parameter), plus the
    fp32 error-feedback residual of a lossy exchange (4) when there is anyone to exchange with."""
    if not sync.mode.infrequent:
        return 0.0
    return params * (8 + (4 if sync.compression != "none" and dp > 1 else 0))
