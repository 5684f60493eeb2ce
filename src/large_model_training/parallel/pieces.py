"""The shard pieces of the flat parameter buffer that an update rule works on (public: every rule shares them)."""

from __future__ import annotations

import torch


class ShardPiece:
    """The part [lo, hi) of one bucket this rank updates (ZeRO 0: the whole bucket), with its optimizer state.
    Update rules (AdamW, 1-bit Adam, Muon, DiLoCo's outer step) read and write these: `master` is the fp32 value
    (the parameters themselves under fp32), `param_view` the compute-dtype parameters it is published to."""

    def __init__(
        self,
        bucket_index: int,
        lo: int,
        hi: int,
        param_view: torch.Tensor,
        master: torch.Tensor,
        state_dtype: torch.dtype = torch.float32,
    ):
        self.bucket_index, self.lo, self.hi = bucket_index, lo, hi
        self.param_view = param_view
        self.master = master
        self.own_master = master is not param_view  # an fp32 copy of bf16 parameters, else the parameters
        self.exp_avg = torch.zeros_like(master, dtype=state_dtype)
        self.exp_avg_sq = torch.zeros_like(master, dtype=state_dtype)
        self.decay: list[tuple[int, int]] = []  # [a, b) slices (piece-relative) of decayed parameters
        self.counted: list[tuple[int, int]] = []  # slices counted in this rank's gradient norm
        self.params: list[tuple[str, int, int, int]] = []  # (name, piece a, piece b, offset within the param)
