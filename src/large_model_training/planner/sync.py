"""The planner's terms for `--sync local:H` / `streaming:H` (DiLoCo, parallel/diloco.py): the dp volume and
the exposed time of the outer exchange, which replace the per-step gradient reduction.

Per rank, an outer exchange of n parameters is one message of n x b bytes (b = 4 fp32, 2 bf16, 1 + 4/256 int8
and 1/2 + 4/256 int4 with one fp32 scale per 256-element chunk, 1/8 + 4/256 sign), once every H steps per
parameter; streaming sends 1/fragments of the model at a time, just as often per parameter. What `comm_bytes_dp`
counts (each collective's input): n b for an all-reduce ('none', 'bf16'), n b (1 + 1/dp) for the two-stage
compressed average (int8/int4/sign: the all-to-all of the whole message, the all-gather of one shard's). What a
ring puts on each rank's link is 2 (dp-1)/dp n b either way (compression/two_stage.py), so time, under the ring
model of planner/comm.py:
  local:H       one blocking exchange of the model every H steps;
  streaming:H   fragments x per H steps, an exchange of n / fragments, overlapped with `overlap` inner steps of
                compute: only what runs past them is exposed.
"""

from __future__ import annotations

from large_model_training.choices import QUANT_CHUNK, SYNC_CODED
from large_model_training.compression.sign import OUTER_SIGN_CHUNK
from large_model_training.config import SyncConfig
from large_model_training.planner.comm import ring_all_reduce

WIRE_BYTES = {
    "none": 4.0,
    "bf16": 2.0,
    "int8": 1.0 + 4.0 / QUANT_CHUNK,
    "int4": 0.5 + 4.0 / QUANT_CHUNK,
    "sign": 1 / 8 + 4.0 / OUTER_SIGN_CHUNK,
}
"""Bytes per parameter of one outer exchange's message, by sync.compression."""


def outer_bytes_per_step(params: int, dp: int, sync: SyncConfig) -> float | None:
    """Mean dp bytes per step this rank passes to the outer exchanges of its `params` parameters (what
    comm_bytes_dp counts); None for every-step (the gradient reduction's terms apply)."""
    if not sync.mode.infrequent:
        return None
    if dp == 1:
        return 0.0
    stages = 1 + 1 / dp if sync.compression in SYNC_CODED else 1.0
    return params * WIRE_BYTES[sync.compression] * stages / sync.mode.every


def outer_wire_bytes_per_step(params: int, dp: int, sync: SyncConfig) -> float:
    """Mean bytes per step one rank sends on its link for the outer exchanges (ring algorithms): the figure to set
    against a dense fp32 all-reduce's ring_all_reduce(4 params, dp)."""
    if dp == 1 or not sync.mode.infrequent:
        return 0.0
    return ring_all_reduce(params * WIRE_BYTES[sync.compression], dp) / sync.mode.every


def _exchange_time(n_bytes: float, dp: int, bandwidth: float, latency: float) -> float:
    """An all-reduce of n_bytes, or the two stages (all-to-all, all-gather) of an n_bytes compressed message."""
    return 2 * (dp - 1) * latency + ring_all_reduce(n_bytes, dp) / bandwidth


def outer_exposed_time(
    params: int, dp: int, sync: SyncConfig, bandwidth: float, latency: float, inner_step_s: float
) -> float:
    """Seconds per step (averaged over H) the outer exchange adds to an inner step of `inner_step_s`."""
    if dp == 1:
        return 0.0
    h, n_bytes = sync.mode.every, params * WIRE_BYTES[sync.compression]
    if sync.mode.kind == "local":
        return _exchange_time(n_bytes, dp, bandwidth, latency) / h
    f = sync.fragments
    one = _exchange_time(n_bytes / f, dp, bandwidth, latency)
    return f * max(0.0, one - sync.overlap * inner_step_s) / h


def outer_state_bytes(params: int, sync: SyncConfig, dp: int) -> float:
    """Bytes of the outer state per rank: the fp32 anchor and Nesterov momentum (8 per parameter), plus the
    fp32 error-feedback residual of a lossy exchange (4) when there is anyone to exchange with, and the server
    residual of the two-stage formats (4 for the 1/dp of the parameters this rank serves)."""
    if not sync.mode.infrequent:
        return 0.0
    lossy = sync.compression != "none" and dp > 1
    return params * (8 + (4 if lossy else 0) + (4 / dp if lossy and sync.compression in SYNC_CODED else 0))
