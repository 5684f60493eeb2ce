"""The model's linear layers: one autograd function whose weight gradient can wait, and whose input can be kept
compactly.

Why our own function rather than `F.linear`'s autograd:
  - zero-bubble pipeline schedules (Qi et al. 2023) split a backward into B (input gradients, which the
    previous stage waits for) and W (weight gradients, which nobody waits for). While a `WeightGradStore`
    is collecting (the executor's B action) this function computes only the input gradient and hands the
    weight-gradient GEMM to the store; the W action runs it. Running autograd's fused backward twice, once
    for dX and once for dW, would compute each GEMM twice (a probe found PyTorch's zero-bubble schedules call
    the fused backward ~1.6x as often as 1F1B does).
  - lean sequence parallelism (Korthikanti et al. 2022): the input of a column-parallel layer is the
    all-gathered sequence; keeping it for backward costs t times this rank's shard. When the input carries a
    `compact_input` (set by the tp region entry, `parallel/tensor.py`), the function saves the shard and asks
    the region to gather it again when the weight gradient is computed.

Where neither applies (no store, a whole input, the whole weight: every layer outside zero-bubble schedules
and lean SP) `linear` is plain `F.linear`, autograd's own: the Function's Python costs ~30 us per layer per
step (forward + backward), 0.5-1% of `tiny`'s CPU step and more where kernel launches bound the step (`small`
on a GPU), and torch.compile traces F.linear best. Both compute the same GEMMs with the same operands (dX =
dY W, dW = dY^T X) and accumulate through autograd's AccumulateGrad (hooks included), so a zero-bubble step's
gradients stay bit-identical to 1F1B's (tests/test_zero_bubble.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from large_model_training.models.float8 import Float8Cast, Float8Gemms, float8_weight


class Regather(Protocol):
    """What a compact input needs to become whole again: `start(shard)` may begin an asynchronous gather,
    `full(shard)` returns the whole input (shared by the region's layers), `release()` drops it after a user."""

    users: int

    def start(self, shard: torch.Tensor) -> None: ...

    def full(self, shard: torch.Tensor) -> torch.Tensor: ...

    def release(self) -> None: ...


class WeightGradStore:
    """Weight-gradient GEMMs held from a B action until the W action of the same (stage, micro-batch).

    Explicit state owned by the pipeline executor (one per rank), which hands it to every linear layer of its
    chunks (`PipelineExecutor.__init__`).
    `runs` counts the W GEMMs per parameter (tests check: once per parameter and micro-batch).
    """

    def __init__(self) -> None:
        self.collecting = False
        self._current: list[tuple[nn.Parameter, Callable[[], torch.Tensor], list]] = []
        self._held: dict[tuple[int, int], list[tuple[nn.Parameter, Callable[[], torch.Tensor], list]]] = {}
        self.runs: Counter = Counter()
        self.counters: list = []
        """Activation counters (`memory/accounting.py`) that count what a held GEMM keeps until its W: autograd
        has released those tensors after B, so its saved-tensor hooks no longer see them."""

    @contextmanager
    def input_gradients_only(self, key: tuple[int, int]):
        """Inside: the B of `key`; every weight-gradient GEMM is held for `run_weight_gradients(key)`."""
        if key in self._held:
            raise RuntimeError(f"weight gradients of (stage, micro-batch) {key} are already held")
        self.collecting, self._current = True, []
        try:
            yield
        finally:
            self.collecting = False
            self._held[key], self._current = self._current, []

    def hold(self, weight: nn.Parameter, compute: Callable[[], torch.Tensor], kept: tuple[torch.Tensor, ...]) -> None:
        """Hold `compute` (the weight gradient of `weight`), which keeps the tensors `kept` alive until it runs."""
        self._current.append((weight, compute, [c.keep(t) for c in self.counters for t in kept]))

    def run_weight_gradients(self, key: tuple[int, int]) -> None:
        """The W of `key`: each held GEMM, accumulated as autograd accumulates (AccumulateGrad: the dp engine's
        hooks fire). One engine call per weight: a single call for all would hold every weight gradient of the
        chunk at once (a whole layer's worth at 100B scale) to save ~50 us of Python per weight."""
        for weight, compute, _ in self._held.pop(key):  # the counters' tokens are dropped with each entry
            with torch.no_grad():  # as inside autograd's backward: the GEMM (and a re-gather) records no graph
                grad = compute()
            torch.autograd.backward(weight, grad)
            self.runs[weight] += 1

    @property
    def pending(self) -> int:
        """(stage, micro-batch) pairs whose W has not run."""
        return len(self._held)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's GEMM computes in: autocast's where it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _Linear(torch.autograd.Function):
    """y = x W^T, rows of W optionally selected; backward dX now, dW now or held by the store.

    Without a store the weight is an ordinary autograd input and its gradient is returned. With one (the
    zero-bubble kinds) autograd is given the weight detached and never reaches the parameter: its
    post-accumulate-grad hooks (the dp engine's bucket counts) fire even for a gradient of None, so the
    parameter's only accumulation is `torch.autograd.backward(param, dW)`, in W or, outside a B, right away.
    """

    @staticmethod
    def forward(ctx, x, weight, param, store, rows, shard, regather, paired, fp8):
        ctx.param, ctx.store, ctx.rows, ctx.regather, ctx.paired = param[0], store, rows, regather, paired
        ctx.fp8, ctx.input_scale = fp8, None
        if regather is not None:
            regather.users += 1
        used = _operand(weight, rows, paired, fp8)
        if fp8 is None:
            ctx.save_for_backward(shard if regather is not None else x)
            return torch.nn.functional.linear(x, used)
        dtype = compute_dtype(x)  # torchao casts the input to it first
        with torch.autocast(x.device.type, enabled=False):  # dtypes explicit (CPU autocast changed the result)
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            if fp8.keep_float8_input and regather is None:  # kept as forward casts it (models/float8.py)
                x2 = fp8.cast_input(x2)
            y = fp8.forward(x2, used, dtype)
        kept = x2 if isinstance(x2, Float8Cast) else None
        ctx.input_scale = kept.inverse_scale if kept is not None else None
        ctx.save_for_backward(shard if regather is not None else kept.bits if kept is not None else x)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        param, rows, regather, store, paired = ctx.param, ctx.rows, ctx.regather, ctx.store, ctx.paired
        fp8, input_scale = ctx.fp8, ctx.input_scale
        wanted = param.requires_grad if store is not None else ctx.needs_input_grad[1]
        deferred = wanted and store is not None and store.collecting
        if regather is not None and wanted and not deferred:
            regather.start(saved)  # the gather runs while the input-gradient GEMM below computes
        used = _operand(param, rows, paired, fp8)
        if fp8 is not None:
            grad_input = (
                fp8.input_grad(grad.reshape(-1, grad.shape[-1]), used, grad.dtype).view(*grad.shape[:-1], -1)
                if ctx.needs_input_grad[0]
                else None
            )
        else:
            if used.dtype != grad.dtype:  # under autocast the forward's GEMM ran in the autocast dtype: so does this
                used = used.to(grad.dtype)
            grad_input = grad.matmul(used) if ctx.needs_input_grad[0] else None

        # Held for W, a sequence-parallel output gradient is kept as this rank's shard too (a row-parallel
        # layer's, gathered from the residual stream's shard): W gathers it again.
        grad_compact = getattr(grad, "compact_input", None) if deferred else None
        grad_kept = grad if grad_compact is None else grad_compact[0]

        def weight_grad() -> torch.Tensor:
            x = saved if regather is None else regather.full(saved)
            out_grad = grad_kept if grad_compact is None else grad_compact[1].full(grad_kept)
            if fp8 is not None:
                x = (
                    Float8Cast(x, input_scale)
                    if input_scale is not None
                    else x.reshape(-1, x.shape[-1]).to(out_grad.dtype)
                )
                part = fp8.weight_grad(out_grad.reshape(-1, out_grad.shape[-1]), x, out_grad.dtype)
            else:
                part = _weight_grad(out_grad, x.to(out_grad.dtype))
            part = part.to(param.dtype)  # no-op outside autocast
            if regather is not None:
                regather.release()
            if grad_compact is not None:
                grad_compact[1].release()
            if paired:
                part = halves_to_pairs(part)
            if rows is None:
                return part
            whole = torch.zeros_like(param)
            whole[rows] = part
            return whole

        if not wanted:
            if regather is not None:
                regather.release()
            return grad_input, None, None, None, None, None, None, None, None
        if store is None:
            return grad_input, weight_grad(), None, None, None, None, None, None, None
        if deferred:
            # No copy of the gradient: autograd accumulates into a gradient buffer in place only when nothing
            # else references it, and the held closure does (tested bit for bit against 1F1B).
            store.hold(param, weight_grad, (saved, grad_kept))
        else:
            torch.autograd.backward(param, weight_grad())
        return grad_input, None, None, None, None, None, None, None, None


def _operand(
    weight: torch.Tensor, rows: slice | None, paired: bool, fp8: Float8Gemms | None
) -> torch.Tensor | Float8Cast:
    """The matrix a GEMM multiplies: the weight (detached), its selected rows, paired rows as halves. A weight
    that FSDP2 gathered in float8 stays float8: its bits are selected and reordered, its one scale kept."""
    gathered = float8_weight(weight) if fp8 is not None else None
    if gathered is not None:
        bits = gathered.bits if rows is None else gathered.bits[rows]
        return Float8Cast(pairs_to_halves(bits) if paired else bits, gathered.inverse_scale)
    used = weight.detach() if rows is None else weight.detach()[rows]
    return pairs_to_halves(used) if paired else used


def pairs_to_halves(w: torch.Tensor) -> torch.Tensor:
    """Rows interleaved in pairs (2i, 2i+1) -> the even rows, then the odd ones (a copy)."""
    return w.unflatten(0, (-1, 2)).transpose(0, 1).flatten(0, 1)


def halves_to_pairs(w: torch.Tensor) -> torch.Tensor:
    """Inverse of `pairs_to_halves`."""
    return w.unflatten(0, (2, -1)).transpose(0, 1).flatten(0, 1)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    store: WeightGradStore | None = None,
    rows: slice | None = None,
    paired: bool = False,
    fp8: Float8Gemms | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight[rows])`, through `_Linear` when a store, a compact input (`x.compact_input = (shard,
    regather)`, saved as its shard), a row selection or `paired` needs it. The parameter travels in a tuple, out
    of autograd's sight, for the store's path.

    `paired`: the weight's rows are interleaved pairs (the fused gate/up, `models/fused.py`) and the output's
    columns come as halves, [all even rows' | all odd rows'], so that gate and up are contiguous. The weight is
    reordered (a transient copy, in forward and again in backward) rather than the output: the weight is
    tokens / hidden times smaller, and elementwise ops on stride-2 halves cost 2.5x contiguous ones on a CPU
    (the swiglu of `tiny` took 9.0 ms against 3.7 ms per layer forward + backward). Only the parameter is
    saved, so activation memory is F.linear's.

    `fp8`: the layer's three GEMMs in float8 (`models/float8.py`, `--precision fp8`)."""
    compact = getattr(x, "compact_input", None)
    if store is None and compact is None and rows is None and not paired and fp8 is None:
        return torch.nn.functional.linear(x, weight)
    shard, regather = compact if compact is not None else (None, None)
    # With a store: a stand-in leaf, so the output still needs a gradient when x does not (a frozen embedding).
    tracked = weight if store is None else weight.detach().requires_grad_(weight.requires_grad)
    return _Linear.apply(x, tracked, (weight,), store, rows, shard, regather, paired, fp8)


class Linear(nn.Linear):
    """nn.Linear without bias through `linear` (same parameter names and state dict as nn.Linear).
    `weight_grads`: the executor's store under a zero-bubble schedule, else None (weight gradient at once)."""

    weight_grads: WeightGradStore | None = None

    def __init__(self, in_features: int, out_features: int, paired: bool = False):
        super().__init__(in_features, out_features, bias=False)
        self.paired = paired  # rows interleaved in pairs, output as halves (`linear`)
        self.fp8: Float8Gemms | None = None  # --precision fp8: set by assembly (models/float8.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_grads, paired=self.paired, fp8=self.fp8)
