"""`--optimizer adamw`: the update rule AdamW on this rank's pieces of the flat parameter buffer.

Why our own AdamW (the same update as torch.optim.AdamW, element for element): it works on flat shards that
cut across parameters (ZeRO-1/2 as Megatron-LM's distributed optimizer). Every parameter lives in one flat
buffer in the compute dtype; this rank owns a piece [lo, hi) of each bucket (the whole bucket under ZeRO-0)
with fp32 masters under bf16 (parallel/pieces.py); this rule keeps the moments of those pieces and updates
them, the engine publishes and, under ZeRO-1/2, all-gathers the updated pieces. State is saved and loaded by
parameter name, so a checkpoint moves between dp sizes and ZeRO stages.

Two ways to step, one moment update (`_moments`): `step` applies AdamW to the dp-averaged gradient; under
update compression (ZeRO-0) it turns this rank's own gradient into an update, has the comm hook
average it over dp and applies the average (parallel/dp_engine.py says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from large_model_training.mesh import runs_on_host
from large_model_training.parallel.pieces import FlatShards, ShardPiece
from large_model_training.parallel.update_rule import RuleContext, UpdateRule

STEP_SLICE = 1 << 17
"""Elements per slice of the AdamW step on a CPU (`step_slice_elements` chooses per device). The
update makes about eight passes over each element; over a whole piece (millions of elements, four tensors)
every pass streams from memory, over 128K-element slices (512 KB per fp32 tensor) the later passes find the
slice in cache: on the 2-core CPU here a step of 12.3M parameters takes ~23 ms instead of ~41
(torch.optim.AdamW(foreach=False), one tensor per parameter: ~28). Slices start at multiples of every SIMD
width, so each element takes the same vectorised path as in a whole-piece pass and the result is bit for bit
the same (the weight-decay multiply, one rounding per element, is exact on any split)."""


def step_slice_elements(t: torch.Tensor) -> int:
    """Elements per slice of the update of `t`: STEP_SLICE on a host CPU. On an accelerator the passes stream
    from memory anyway and each operator is a launch, so slices are 16M elements: ~8 launches per 16M instead of
    per 128K (12K slices for a 1.6B-parameter llama-100b rank), with temporaries bounded at 64 MB where one pass
    over a whole piece would allocate gigabytes."""
    return STEP_SLICE if runs_on_host(t) else 1 << 24


class RoundingNoise:
    """Stochastic rounding fp32 -> bf16 for one step: up or down with probability by distance, so the result is
    unbiased where round-to-nearest is not. An update far below a bf16 ulp still moves a weight on average, and
    a moment's EMA keeps moving: Adam's second moment changes by (1 - beta2) = 0.1% of itself a step, under half
    a bf16 ulp (2^-9 relative), so rounded to nearest it stops decaying and lags a shrinking gradient
    (tests/test_optimizer_states.py measures the drift). Random low 16 bits are added to the fp32 pattern, then
    cut (the sign-magnitude pattern makes this work on negatives too).

    One draw per step, seeded by the step (a resume repeats it), serves every slice: torch's CPU generator costs
    ~3 ns per number, so a draw per slice cost ten times the rounding itself (0.43 against 0.05 ms per
    128K-element slice here). A rounding is unbiased when its bits are uniform and drawn independently of the
    value, which a draw made before the update gives; elements at the same offset of different slices
    (different parameters) share bits, and the tensors of one element (`stream` 0, 1, 2: master, first and
    second moment) read the draw one element apart, which leaves each rounding unbiased."""

    STREAMS = 3

    def __init__(self, step: int, elements: int, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(step * 1_000_003)
        shape = (elements + self.STREAMS - 1,)
        self.step, self.elements = step, elements
        self.bits = torch.randint(0, 1 << 16, shape, generator=gen, device=device, dtype=torch.int32)

    def round_into(self, out: torch.Tensor, x: torch.Tensor, stream: int = 0) -> None:
        """out (bf16) = x (fp32) stochastically rounded; x's pattern is overwritten (a temporary of the step)."""
        pattern = x.view(torch.int32)
        for lo in range(0, x.numel(), self.elements):  # a whole piece (update compression) in slice-sized runs
            hi = min(lo + self.elements, x.numel())
            part = pattern[lo:hi]
            part.add_(self.bits[stream : stream + hi - lo]).bitwise_and_(-65536)
        out.copy_(x)  # exact: the low 16 bits are zero


def _is_one(scale: torch.Tensor | float) -> bool:
    return isinstance(scale, float) and scale == 1.0  # x * 1.0 == x: the caller skips the pass


Region = tuple[int, int, int]
"""[a, b) of a piece (piece-relative) that a rule's AdamW updates, and where its moments start in the rule's
compact per-piece state (c): AdamW itself takes whole pieces, Muon only its non-matrix parameters."""


class AdamW(UpdateRule):
    """AdamW over regions of this rank's pieces (by default the whole pieces), its moments held per piece."""

    def __init__(
        self,
        shards: FlatShards,
        *,
        weight_decay: float,
        betas: tuple[float, float],
        state_dtype: torch.dtype = torch.float32,
        regions: list[list[Region]] | None = None,
        reduce: Callable[[int, torch.Tensor], torch.futures.Future] | None = None,
    ):
        self.shards, self.weight_decay, self.betas, self.state_dtype = shards, weight_decay, betas, state_dtype
        self.step_count = 0
        self.regions = regions if regions is not None else [[(0, p.master.numel(), 0)] for p in shards.pieces]
        sizes = [sum(b - a for a, b, _ in spans) for spans in self.regions]
        self.exp_avg = [torch.zeros(n, dtype=state_dtype, device=shards.device) for n in sizes]
        self.exp_avg_sq = [torch.zeros(n, dtype=state_dtype, device=shards.device) for n in sizes]
        self.reduce = reduce  # update compression: the comm hook's average of each rank's update (ZeRO-0)
        self.local_grads = reduce is not None
        self._rounding: RoundingNoise | None = None  # bf16 states or masters: this step's draw

    def _noise(self, elements: int) -> RoundingNoise:
        """This step's rounding bits (drawn at the first rounding of the step, a slice long)."""
        if self._rounding is None or self._rounding.step != self.step_count:
            size = step_slice_elements(self.exp_avg[0]) if self.exp_avg else max(elements, 1)
            self._rounding = RoundingNoise(self.step_count, size, self.shards.device)
        return self._rounding

    # ---- the update --------------------------------------------------------------------------------
    def begin_step(self) -> tuple[float, float]:
        """Count the step; its bias corrections (a rule built on this one calls it once per step)."""
        self.step_count += 1
        beta1, beta2 = self.betas
        return 1 - beta1**self.step_count, 1 - beta2**self.step_count

    def _moments(
        self,
        stored_m: torch.Tensor,
        stored_v: torch.Tensor,
        grad: torch.Tensor,
        grad_scale: torch.Tensor | float,
        bias2: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's moments (stored slices) moved by a gradient slice: (m, sqrt(v / bias2) + eps)."""
        beta1, beta2 = self.betas
        grad = grad.float()
        if not _is_one(grad_scale):
            grad = grad * grad_scale
        exp_avg, exp_avg_sq = stored_m.float(), stored_v.float()  # bf16 states: updated in fp32, stored rounded
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(1e-8)
        if exp_avg_sq is not stored_v:  # the step uses the fp32 values; what is kept is rounded stochastically
            self._noise(exp_avg_sq.numel()).round_into(stored_v, exp_avg_sq, stream=2)
        return exp_avg, denom

    def _keep_first_moment(self, stored_m: torch.Tensor, exp_avg: torch.Tensor) -> None:
        """bf16 states: the first moment kept, rounded stochastically, once the step has used it."""
        if exp_avg is not stored_m:
            self._noise(exp_avg.numel()).round_into(stored_m, exp_avg, stream=1)

    @torch.no_grad()
    def step(
        self, pieces: list[ShardPiece], grads: list[torch.Tensor], lr: float, grad_scale: torch.Tensor | float
    ) -> None:
        """AdamW with the averaged gradient of each piece, region by region and slice by slice; under update
        compression AdamW's update is what the comm hook averages."""
        if self.reduce is not None:
            self._step_update(pieces, grads, lr, grad_scale)
            return
        bias1, bias2 = self.begin_step()
        for i, (piece, full_grad) in enumerate(zip(pieces, grads)):
            for region in self.regions[i]:
                self._update_region(i, piece, region, full_grad, lr, grad_scale, bias1, bias2)

    def _update_region(self, i: int, piece: ShardPiece, region: Region, full_grad, lr, grad_scale, bias1, bias2):
        ra, rb, c = region
        decay = iter([(max(a, ra), min(b, rb)) for a, b in piece.decay if a < rb and b > ra])
        span = next(decay, None)
        slice_elements = step_slice_elements(piece.master)
        for lo in range(ra, rb, slice_elements):
            hi = min(lo + slice_elements, rb)
            stored = piece.master[lo:hi]
            master = stored.float()  # fp32 masters: themselves; bf16 ones: updated in fp32, rounded back
            while span is not None and span[0] < hi:  # decayed parameters (sorted spans) in this slice
                master[max(span[0], lo) - lo : min(span[1], hi) - lo].mul_(1 - lr * self.weight_decay)
                if span[1] > hi:
                    break  # it goes on into the next slice
                span = next(decay, None)
            at = c + lo - ra
            m, v = self.exp_avg[i][at : at + hi - lo], self.exp_avg_sq[i][at : at + hi - lo]
            exp_avg, denom = self._moments(m, v, full_grad[lo:hi], grad_scale, bias2)
            master.addcdiv_(exp_avg, denom, value=-lr / bias1)
            self._keep_first_moment(m, exp_avg)
            if master is not stored:
                self._noise(hi - lo).round_into(stored, master, stream=0)

    def _step_update(self, pieces: list[ShardPiece], grads: list[torch.Tensor], lr: float, grad_scale) -> None:
        """AdamW's update from this rank's moments and own gradients, averaged by the comm hook, applied to
        every rank's identical parameters (ZeRO-0: a piece is its whole bucket)."""
        assert self.reduce is not None
        bias1, bias2 = self.begin_step()
        futures = []
        for i, (piece, grad) in enumerate(zip(pieces, grads)):
            exp_avg, denom = self._moments(self.exp_avg[i], self.exp_avg_sq[i], grad, grad_scale, bias2)
            futures.append(self.reduce(piece.bucket_index, exp_avg / denom * (lr / bias1)))
            self._keep_first_moment(self.exp_avg[i], exp_avg)
        for piece, future in zip(pieces, futures):
            result = future.wait()
            average = result[0] if isinstance(result, list) else result
            for a, b in piece.decay:
                piece.master[a:b].mul_(1 - lr * self.weight_decay)
            piece.master.sub_(average)

    # ---- state -------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return [*self.exp_avg, *self.exp_avg_sq]

    def _piece_sized(self, i: int, compact: torch.Tensor) -> torch.Tensor:
        """A compact per-piece state laid out at its piece positions (zeros outside the regions)."""
        n = self.shards.pieces[i].master.numel()
        if self.regions[i] == [(0, n, 0)]:
            return compact
        out = torch.zeros(n, dtype=compact.dtype, device=compact.device)
        for a, b, c in self.regions[i]:
            out[a:b] = compact[c : c + b - a]
        return out

    def state_dict(self) -> dict:
        """Moments by parameter name (zero outside the regions), independent of dp size and ZeRO stage."""
        return {
            "step": torch.tensor(self.step_count),
            "exp_avg": self.shards.by_name([self._piece_sized(i, m) for i, m in enumerate(self.exp_avg)]),
            "exp_avg_sq": self.shards.by_name([self._piece_sized(i, v) for i, v in enumerate(self.exp_avg_sq)]),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        for i, piece in enumerate(self.shards.pieces):
            for name, a, b, start in piece.params:
                for ra, rb, c in self.regions[i]:
                    lo, hi = max(a, ra), min(b, rb)
                    if lo >= hi:
                        continue
                    for mine, key in ((self.exp_avg[i], "exp_avg"), (self.exp_avg_sq[i], "exp_avg_sq")):
                        saved = state[key][name].reshape(-1)[start + lo - a : start + hi - a]
                        mine[c + lo - ra : c + hi - ra].copy_(saved)

    def local_state_dict(self) -> dict:
        """This rank's compact moments as they lie (per piece, in the state dtype): no gather, no copy."""
        return {"step": self.step_count, "exp_avg": list(self.exp_avg), "exp_avg_sq": list(self.exp_avg_sq)}

    @torch.no_grad()
    def load_local_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        for mine, saved in zip([*self.exp_avg, *self.exp_avg_sq], [*state["exp_avg"], *state["exp_avg_sq"]]):
            mine.copy_(saved)

    def rank_moments(self) -> list[list[torch.Tensor]]:
        """This rank's own moments, piece by piece (they differ between ranks under update compression)."""
        return [[m, v] for m, v in zip(self.exp_avg, self.exp_avg_sq)]

    @torch.no_grad()
    def load_rank_moments(self, moments: list) -> None:
        for mine_m, mine_v, (exp_avg, exp_avg_sq) in zip(self.exp_avg, self.exp_avg_sq, moments):
            mine_m.copy_(exp_avg)  # (cast to the state dtype)
            mine_v.copy_(exp_avg_sq)

    def rank_state_dict(self) -> dict:
        """Under update compression each rank's moments are its own (the checkpoint's copy is one rank's)."""
        return {"moments": self.rank_moments()} if self.reduce is not None else {}

    def load_rank_state_dict(self, saved: dict, same_layout: bool) -> None:
        if self.reduce is not None and same_layout:
            self.load_rank_moments(saved.get("moments", []))


def make_rule(ctx: RuleContext) -> AdamW:
    """`--optimizer adamw` (choices.Optimizer)."""
    return AdamW(
        ctx.shards,
        weight_decay=ctx.weight_decay,
        betas=ctx.betas,
        state_dtype=ctx.state_dtype,
        reduce=ctx.reducer.reduce if ctx.compress_update else None,
    )
