"""The optimizer half of the data-parallel engine: AdamW on this rank's shard of the flat parameter buffer.

Why our own AdamW (the same update as torch.optim.AdamW, element for element): it works on flat shards that
cut across parameters (ZeRO-1/2 as Megatron-LM's distributed optimizer). Every parameter lives in one flat
buffer in the compute dtype; this rank owns a piece [lo, hi) of each bucket (the whole bucket under ZeRO-0)
with fp32 masters (under bf16) and moments, updates it, and under ZeRO-1/2 all-gathers the updated pieces in
place. State is saved and loaded by parameter name, so a checkpoint moves between dp sizes and ZeRO stages.

Two ways to step, one moment update (`_moments`): `step` applies AdamW to the dp-averaged gradient;
`step_update` (update compression, ZeRO-0) turns this rank's own gradient into an update, has the comm hook
average it over dp and applies the average (parallel/dp_engine.py says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set as AbstractSet

import torch

from large_model_training.memory.buffers import FlatLayout, adopt_parameters
from large_model_training.mesh import ParallelMesh, optimizer_slice_elements
from large_model_training.parallel.collectives import all_gather_single
from large_model_training.parallel.pieces import ShardPiece

STEP_SLICE = 1 << 17
"""Elements per slice of the AdamW step on a CPU (`mesh.optimizer_slice_elements` chooses per device). The
update makes about eight passes over each element; over a whole piece (millions of elements, four tensors)
every pass streams from memory, over 128K-element slices (512 KB per fp32 tensor) the later passes find the
slice in cache: on the 2-core CPU here a step of 12.3M parameters takes ~23 ms instead of ~41
(torch.optim.AdamW(foreach=False), one tensor per parameter: ~28). Slices start at multiples of every SIMD
width, so each element takes the same vectorised path as in a whole-piece pass and the result is bit for bit
the same (the weight-decay multiply, one rounding per element, is exact on any split)."""


def stochastic_round(x: torch.Tensor, step: int, position: int) -> torch.Tensor:
    """fp32 -> bf16 rounding up or down with probability by distance (unbiased: an update far below a bf16
    ulp still moves the weight on average, where round-to-nearest would drop it). Random low 16 bits added to
    the fp32 pattern, then cut; the draw is seeded by the step and flat position, so a resume repeats it."""
    gen = torch.Generator(device=x.device).manual_seed(step * 1_000_003 + position)
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, device=x.device, dtype=torch.int32)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def _is_one(scale: torch.Tensor | float) -> bool:
    return isinstance(scale, float) and scale == 1.0  # x * 1.0 == x: the caller skips the pass


class ShardedAdamW:
    """AdamW over this rank's pieces of the flat parameter buffer; the parameters become views of that buffer."""

    def __init__(
        self,
        layout: FlatLayout,
        mesh: ParallelMesh,
        *,
        zero: int,
        compute_dtype: torch.dtype,
        weight_decay: float,
        betas: tuple[float, float],
        norm_excluded: AbstractSet[str] = frozenset(),
        state_dtype: torch.dtype = torch.float32,
        sr_master: bool = False,
    ):
        self.buckets, self.zero, self.state_dtype = layout.buckets, zero, state_dtype
        self.sr_master = sr_master and compute_dtype == torch.bfloat16  # bf16 masters, stochastically rounded
        self.dp, self.dp_rank, self.group = mesh.dp_size, mesh.dp_rank, mesh.dp_group
        self.compute_dtype, self.weight_decay, self.betas = compute_dtype, weight_decay, betas
        self.step_count = 0
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
        piece = ShardPiece(
            bucket.index, lo, hi, view, view if self.compute_dtype == torch.float32 else view.clone(), self.state_dtype
        )
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

    def norm_sq(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Squared L2 norm of the counted parts of `grads` (one per piece), in fp32 on this rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.param_buffer.device)
        for piece, grad in zip(self.pieces, grads):
            for a, b in piece.counted:
                total += grad[a:b].float().pow(2).sum()
        return total

    # ---- the update --------------------------------------------------------------------------------
    def begin_step(self) -> tuple[float, float]:
        """Count the step; its bias corrections (an update rule built on these pieces calls it once per step)."""
        self.step_count += 1
        beta1, beta2 = self.betas
        return 1 - beta1**self.step_count, 1 - beta2**self.step_count

    def _moments(
        self, piece: ShardPiece, lo: int, hi: int, grad: torch.Tensor, grad_scale: torch.Tensor | float, bias2: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's moments of elements [lo, hi) of a piece from its gradient: (m, sqrt(v / bias2) + eps)."""
        beta1, beta2 = self.betas
        grad = grad.float()
        if not _is_one(grad_scale):
            grad = grad * grad_scale
        stored_m, stored_v = piece.exp_avg[lo:hi], piece.exp_avg_sq[lo:hi]
        exp_avg, exp_avg_sq = stored_m.float(), stored_v.float()  # bf16 states: updated in fp32, stored rounded
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if exp_avg is not stored_m:
            stored_m.copy_(exp_avg)
            stored_v.copy_(exp_avg_sq)
        return exp_avg, (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(1e-8)

    @staticmethod
    def publish(piece: ShardPiece) -> None:
        """The updated fp32 master into the (bf16) parameters (after any rule changed `piece.master`)."""
        if piece.own_master:
            piece.param_view.copy_(piece.master)

    @torch.no_grad()
    def step(self, lr: float, grad_scale: torch.Tensor | float, grads: list[torch.Tensor]) -> int:
        """AdamW with the averaged gradient of each piece, slice by slice, then the ZeRO re-gather; returns the
        bytes this rank passed to the all-gathers."""
        bias1, bias2 = self.begin_step()
        for piece, full_grad in zip(self.pieces, grads):
            decay = iter(piece.decay)
            span = next(decay, None)
            slice_elements = optimizer_slice_elements(piece.master, STEP_SLICE)
            for lo in range(0, piece.master.numel(), slice_elements):
                hi = min(lo + slice_elements, piece.master.numel())
                stored = piece.master[lo:hi]
                master = stored.float()  # fp32 masters: themselves; bf16 ones: updated in fp32, rounded back
                while span is not None and span[0] < hi:  # decayed parameters (sorted spans) in this slice
                    master[max(span[0], lo) - lo : min(span[1], hi) - lo].mul_(1 - lr * self.weight_decay)
                    if span[1] > hi:
                        break  # it goes on into the next slice
                    span = next(decay, None)
                exp_avg, denom = self._moments(piece, lo, hi, full_grad[lo:hi], grad_scale, bias2)
                master.addcdiv_(exp_avg, denom, value=-lr / bias1)
                if master is not stored:
                    stored.copy_(stochastic_round(master, self.step_count, piece.lo + lo))
            self.publish(piece)
        return self.gather_parameters()

    def gather_parameters(self) -> int:
        """ZeRO-1/2: every rank's updated pieces into every rank's flat buffer; returns the bytes passed."""
        sent = 0
        if self.zero:
            for bucket, piece in zip(self.buckets, self.pieces):
                full = self.param_buffer[bucket.start : bucket.end]
                sent += piece.param_view.numel() * piece.param_view.element_size()
                all_gather_single(full, piece.param_view, group=self.group)
        return sent

    @torch.no_grad()
    def step_update(
        self,
        lr: float,
        grad_scale: torch.Tensor | float,
        grads: list[torch.Tensor],
        reduce: Callable[[int, torch.Tensor], torch.futures.Future],
    ) -> None:
        """AdamW's update from this rank's moments and own gradients, averaged by `reduce(bucket, update)` (the
        comm hook), applied to every rank's identical parameters (ZeRO-0: a piece is its whole bucket)."""
        bias1, bias2 = self.begin_step()
        futures = []
        for piece, grad in zip(self.pieces, grads):
            exp_avg, denom = self._moments(piece, 0, piece.master.numel(), grad, grad_scale, bias2)
            futures.append(reduce(piece.bucket_index, exp_avg / denom * (lr / bias1)))
        for piece, future in zip(self.pieces, futures):
            result = future.wait()
            average = result[0] if isinstance(result, list) else result
            for a, b in piece.decay:
                piece.master[a:b].mul_(1 - lr * self.weight_decay)
            piece.master.sub_(average)
            self.publish(piece)

    # ---- state -------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The storage this optimizer holds: parameters, distinct fp32 masters, moments."""
        masters = [p.master for p in self.pieces if p.own_master]
        return [self.param_buffer, *masters, *[t for p in self.pieces for t in (p.exp_avg, p.exp_avg_sq)]]

    def _gathered(self, attr: str) -> dict[str, torch.Tensor]:
        """Full per-parameter tensors of one optimizer state (gathered over dp under ZeRO)."""
        out = {}
        for bucket, piece in zip(self.buckets, self.pieces):
            local = getattr(piece, attr).float()
            if self.zero:
                full = torch.empty(bucket.numel, dtype=local.dtype, device=local.device)
                all_gather_single(full, local.contiguous(), group=self.group)
                base = bucket.start
            else:
                full, base = local, piece.lo
            for name, param, offset in bucket.params:
                out[name] = full[offset - base : offset - base + param.numel()].view(param.shape).clone()
        return out

    def state_dict(self) -> dict:
        """Optimizer state by parameter name, independent of dp size and ZeRO stage (collective under ZeRO)."""
        state = {
            "step": torch.tensor(self.step_count),
            "exp_avg": self._gathered("exp_avg"),
            "exp_avg_sq": self._gathered("exp_avg_sq"),
        }
        if self.compute_dtype != torch.float32:
            state["master"] = self._gathered("master")
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        for piece in self.pieces:
            for name, a, b, start in piece.params:
                n = b - a
                piece.exp_avg[a:b].copy_(state["exp_avg"][name].reshape(-1)[start : start + n])
                piece.exp_avg_sq[a:b].copy_(state["exp_avg_sq"][name].reshape(-1)[start : start + n])
                if "master" in state:
                    piece.master[a:b].copy_(state["master"][name].reshape(-1)[start : start + n])
                    piece.param_view[a:b].copy_(piece.master[a:b])

    def rank_moments(self) -> list[list[torch.Tensor]]:
        """This rank's own moments, piece by piece (they differ between ranks under update compression)."""
        return [[p.exp_avg, p.exp_avg_sq] for p in self.pieces]

    @torch.no_grad()
    def load_rank_moments(self, moments: list) -> None:
        for piece, (exp_avg, exp_avg_sq) in zip(self.pieces, moments):
            piece.exp_avg.copy_(exp_avg)  # (cast to the state dtype)
            piece.exp_avg_sq.copy_(exp_avg_sq)

    def reload_parameters(self) -> None:
        """After parameters were loaded into the model (views of the flat buffer), refresh fp32 masters."""
        for piece in self.pieces:
            if piece.own_master:
                piece.master.copy_(piece.param_view)
