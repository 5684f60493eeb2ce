"""The flat parameter buffer of the ZeRO 0-2 engine and the shard pieces of it that an update rule works on.

`FlatShards` owns what every update rule shares and none should write again: the parameters as views of one
flat buffer (the compute dtype), this rank's piece [lo, hi) of each bucket (the whole bucket under ZeRO-0) with
its fp32 master, the publication of the masters into the parameters, the ZeRO-1/2 re-gather and the by-name
gathering that makes checkpoints layout-free. What a rule keeps per element (Adam's moments, Muon's momentum)
is the rule's own (parallel/update_rule.py).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch

from large_model_training.memory.buffers import FlatLayout, adopt_parameters
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.collectives import all_gather_single


class ShardPiece:
    """The part [lo, hi) of one bucket this rank updates (ZeRO 0: the whole bucket). `master` is the fp32 value
    (the parameters themselves under fp32, or bf16 ones under bf16_sr), `param_view` the compute-dtype
    parameters it is published to."""

    def __init__(self, bucket_index: int, lo: int, hi: int, param_view: torch.Tensor, master: torch.Tensor):
        self.bucket_index, self.lo, self.hi = bucket_index, lo, hi
        self.param_view = param_view
        self.master = master
        self.own_master = master is not param_view  # an fp32 copy of bf16 parameters, else the parameters
        self.decay: list[tuple[int, int]] = []  # [a, b) slices (piece-relative) of decayed parameters
        self.counted: list[tuple[int, int]] = []  # slices counted in this rank's gradient norm
        self.params: list[tuple[str, int, int, int]] = []  # (name, piece a, piece b, offset within the param)


class FlatShards:
    """The flat parameter buffer, this rank's pieces of it and their masters; the parameters become views."""

    def __init__(
        self,
        layout: FlatLayout,
        mesh: ParallelMesh,
        *,
        zero: int,
        compute_dtype: torch.dtype,
        norm_excluded: AbstractSet[str] = frozenset(),
        sr_master: bool = False,
    ):
        self.buckets, self.zero, self.compute_dtype = layout.buckets, zero, compute_dtype
        self.dp, self.dp_rank, self.group = mesh.grad_size, mesh.grad_rank, mesh.grad_group
        self.sr_master = sr_master and compute_dtype == torch.bfloat16  # bf16 masters, stochastically rounded
        # fp32 master values come from the fp32 model before the parameters are cast to the compute dtype.
        self.param_buffer = torch.zeros(layout.numel, dtype=torch.float32, device=mesh.device)
        adopt_parameters(layout, self.param_buffer)
        self.pieces = [self._make_piece(b, norm_excluded) for b in self.buckets]
        if compute_dtype != torch.float32:
            self.param_buffer = self.param_buffer.to(compute_dtype)
            adopt_parameters(layout, self.param_buffer)
            for piece in self.pieces:
                piece.param_view = self.param_buffer[piece.lo : piece.hi]
                if self.sr_master:  # no fp32 copy: the bf16 parameters are the masters
                    piece.master, piece.own_master = piece.param_view, False

    def _make_piece(self, bucket, norm_excluded: AbstractSet[str]) -> ShardPiece:
        lo, hi = bucket.shard_range(self.dp_rank, self.dp) if self.zero else (bucket.start, bucket.end)
        view = self.param_buffer[lo:hi]
        piece = ShardPiece(bucket.index, lo, hi, view, view if self.compute_dtype == torch.float32 else view.clone())
        for name, param, offset in bucket.params:
            a, b = max(lo, offset), min(hi, offset + param.numel())
            if a >= b:
                continue
            piece.params.append((name, a - lo, b - lo, a - offset))
            if param.ndim >= 2:
                piece.decay.append((a - lo, b - lo))
            if name not in norm_excluded:
                piece.counted.append((a - lo, b - lo))
        return piece

    @property
    def device(self) -> torch.device:
        return self.param_buffer.device

    def publish(self) -> None:
        """The updated fp32 masters into the (bf16) parameters, after a rule changed them."""
        for piece in self.pieces:
            if piece.own_master:
                piece.param_view.copy_(piece.master)

    def gather_parameters(self) -> int:
        """ZeRO-1/2: every rank's updated pieces into every rank's flat buffer; returns the bytes passed."""
        sent = 0
        if self.zero:
            for bucket, piece in zip(self.buckets, self.pieces):
                full = self.param_buffer[bucket.start : bucket.end]
                sent += piece.param_view.numel() * piece.param_view.element_size()
                all_gather_single(full, piece.param_view, group=self.group)
        return sent

    def by_name(self, per_piece: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full per-parameter tensors (fp32) of one piece-sized state, gathered over dp under ZeRO (collective)."""
        out = {}
        for bucket, piece, tensor in zip(self.buckets, self.pieces, per_piece):
            local = tensor.float()
            if self.zero:
                full = torch.empty(bucket.numel, dtype=local.dtype, device=local.device)
                all_gather_single(full, local.contiguous(), group=self.group)
                base = bucket.start
            else:
                full, base = local, piece.lo
            for name, param, offset in bucket.params:
                out[name] = full[offset - base : offset - base + param.numel()].view(param.shape).clone()
        return out

    @torch.no_grad()
    def load_by_name(self, per_piece: list[torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
        """The inverse of `by_name`: this rank's parts of the saved full tensors into piece-sized states."""
        for piece, tensor in zip(self.pieces, per_piece):
            for name, a, b, start in piece.params:
                tensor[a:b].copy_(saved[name].reshape(-1)[start : start + b - a])

    def masters(self) -> list[torch.Tensor]:
        """The distinct fp32 masters (none under fp32 parameters or bf16_sr)."""
        return [p.master for p in self.pieces if p.own_master]

    def state_dict(self) -> dict:
        """The fp32 masters by name under bf16 compute (collective under ZeRO), else nothing."""
        if self.compute_dtype == torch.float32:
            return {}
        return {"master": self.by_name([p.master for p in self.pieces])}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if "master" in state:
            self.load_by_name([p.master for p in self.pieces], state["master"])
            for piece in self.pieces:
                if piece.own_master:
                    piece.param_view.copy_(piece.master)

    def reload_parameters(self) -> None:
        """After parameters were loaded into the model (views of the flat buffer), refresh fp32 masters."""
        for piece in self.pieces:
            if piece.own_master:
                piece.master.copy_(piece.param_view)
