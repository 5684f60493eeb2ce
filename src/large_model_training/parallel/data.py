"""The data-parallel engine: flat buffers, bucketed reduction overlapped with backward, ZeRO 1/2, mixed precision.

Why by hand rather than DDP: one engine that also shards the optimizer (ZeRO, Rajbhandari et al. 2020, as
Megatron-LM's distributed optimizer), lets gradient compression replace a bucket's reduction (a comm hook),
and runs the same on gloo, NCCL and HCCL. `bench/dp_vs_ddp.py` holds it to DDP's speed.

One step, in order:
  1. `prepare_step(m)`: gradient buffers zeroed (ZeRO-2: allocated), each bucket expects (params x m) gradient
     accumulations.
  2. Backward: every parameter's post-accumulate-grad hook counts down its bucket (bf16 with fp32 reduction:
     the hook first adds the bf16 gradient into the fp32 buffer). When a bucket's last gradient of the last
     micro-batch has arrived, its reduction starts asynchronously while backward continues:
     ZeRO-0: the comm hook (average over dp, or compression); ZeRO-1/2: an in-place reduce-scatter, so each
     rank gets the averaged gradient of its shard of every bucket.
  3. `finish_grad_sync()`: `presync` runs on the full gradients of the "late" parameters (tied embeddings
     across pipeline stages, tp-partial gradients), then their bucket reduces; every handle is waited on.
     ZeRO-2 keeps the shard and frees the full bucket buffers.
  4. `grad_norm()` over what this rank owns (dp-summed under ZeRO), `step(lr, scale)`: AdamW on this rank's
     shard in fp32 (master weights under bf16), then ZeRO-1/2 all-gather the updated parameters in place.

The optimizer is ours (the same update as torch.optim.AdamW, element for element) because it works on flat
shards that cut across parameters.

Compressing the update instead of the gradient (`compress_update`, ZeRO-0 only): backward reduces nothing;
each rank runs AdamW's moments on its own gradient, and the comm hook (compression, with error feedback)
averages the resulting updates, lr x m / (sqrt(v) + eps), which every rank then applies to its identical
parameters. Why: error feedback on the update is plain bookkeeping of motion not yet made, so a coordinate
sent late still moves as far as the steps it waited for; on the gradient, AdamW turns the late, accumulated
sums into motion non-linearly, and top-1% of the gradient ends 40% behind dense on `tiny` where top-1% of the
update ends 16% behind (docs/benchmarks.md, with the rescalings of the gradient path that did not help). 1-bit
Adam (Tang et al. 2021) compresses the momentum for the same reason. The moments are per rank (from the
rank's own gradients), clipping uses the ranks' root-mean-square gradient norm, and the cost is the overlap
with backward: the reduction happens in `step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.memory.buffers import FlatLayout, adopt_parameters, tensor_bytes
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.comm_hooks import AllReduceState, GradBucket, allreduce_hook

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

STEP_SLICE = 1 << 17
"""Elements per slice of the AdamW step. The update makes about eight passes over each element; over a whole
piece (millions of elements, four tensors) every pass streams from memory, over 128K-element slices (512 KB per
fp32 tensor) the later passes find the slice in cache: on the 2-core CPU here a step of 12.3M parameters takes
~23 ms instead of ~41 (torch.optim.AdamW(foreach=False), one tensor per parameter: ~28). Slices start at
multiples of every SIMD width, so each element takes the same vectorised path as in a whole-piece pass and the
result is bit for bit the same (the weight-decay multiply, one rounding per element, is exact on any split)."""


class _Piece:
    """The part [lo, hi) of one bucket this rank updates, with its optimizer state."""

    def __init__(self, bucket_index: int, lo: int, hi: int, param_view: torch.Tensor, master: torch.Tensor):
        self.bucket_index, self.lo, self.hi = bucket_index, lo, hi
        self.param_view = param_view
        self.master = master
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.decay: list[tuple[int, int]] = []      # [a, b) slices (piece-relative) of decayed parameters
        self.counted: list[tuple[int, int]] = []    # slices counted in this rank's gradient norm
        self.params: list[tuple[str, int, int, int]] = []  # (name, piece a, piece b, offset within the param)


class DataParallelEngine:
    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, zero: int, bucket_mb: float, precision: str,
                 grad_reduce_fp32: bool, weight_decay: float, betas: tuple[float, float],
                 late_params: set[str] = frozenset(), norm_excluded: set[str] = frozenset(),
                 presync: Callable[["DataParallelEngine"], None] | None = None,
                 comm_hook: Callable | None = None, hook_state=None, compress_update: bool = False,
                 own_buckets: set[str] = frozenset()):
        self.model, self.mesh, self.zero = model, mesh, zero
        self.dp, self.dp_rank = mesh.dp_size, mesh.dp_rank
        self.group = mesh.dp_group
        self.betas, self.weight_decay = betas, weight_decay
        self.compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.grad_dtype = torch.float32 if precision == "fp32" or grad_reduce_fp32 else torch.bfloat16
        self.main_grad = self.grad_dtype != self.compute_dtype  # fp32 gradients of bf16 parameters
        self.presync = presync
        self.hook_state = hook_state or AllReduceState(self.group, self.dp)
        self.comm_hook = comm_hook or allreduce_hook
        # ZeRO-1 reduce-scatters, unless a custom hook (compression) must see whole buckets: then the hook
        # averages the bucket and this rank keeps its shard of the result.
        self.use_hook = zero == 0 or (zero == 1 and comm_hook is not None)
        self.compress_update = compress_update
        if compress_update and (zero != 0 or comm_hook is None):
            raise ValueError("compress_update needs ZeRO-0 (every rank holds whole moments) and a comm hook")
        self.bytes = 0
        self.step_count = 0
        device = mesh.device

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        element = torch.finfo(self.grad_dtype).bits // 8
        # The late parameters form the last bucket(s), after the regular ones. `own_buckets` parameters (those
        # replicated over tp, under compression) never share a bucket with others: a compressor decides per
        # bucket (top-k's threshold, int8's chunk scales), and tp peers must decide alike on identical copies.
        groups = [(late, own) for late in (False, True) for own in (False, True)]
        parts = [FlatLayout.build([x for x in named if (x[0] in late_params) == late and (x[0] in own_buckets) == own],
                                  math.inf if late else bucket_mb * 2**20, element, self.dp) for late, own in groups]
        self.buckets, self.offsets, self.numel, self.n_regular = [], {}, 0, 0
        for (late, _), part in zip(groups, parts):
            for bucket in part.buckets:
                bucket.index += len(self.buckets)
                bucket.start += self.numel
                bucket.end += self.numel
                bucket.params = [(n, p, off + self.numel) for n, p, off in bucket.params]
            self.buckets += part.buckets
            self.offsets.update({n: (o + self.numel, k) for n, (o, k) in part.offsets.items()})
            self.numel += part.numel
            self.n_regular += 0 if late else len(part.buckets)

        # fp32 master values come from the fp32 model before the parameters are cast to the compute dtype.
        self.param_buffer = torch.zeros(self.numel, dtype=torch.float32, device=device)
        layout = FlatLayout(self.buckets, self.numel, self.offsets)
        adopt_parameters(layout, self.param_buffer)
        self.pieces = [self._make_piece(b, norm_excluded) for b in self.buckets]
        if self.compute_dtype != torch.float32:
            self.param_buffer = self.param_buffer.to(self.compute_dtype)
            adopt_parameters(layout, self.param_buffer)
            for piece in self.pieces:
                piece.param_view = self.param_buffer[piece.lo:piece.hi]

        self.bucket_grads: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.shard_grads: list[torch.Tensor | None] = [None] * len(self.buckets)
        if zero == 2:
            self.shard_grads = [torch.zeros(p.hi - p.lo, dtype=self.grad_dtype, device=device) for p in self.pieces]
        else:
            self.bucket_grads = [torch.zeros(b.numel, dtype=self.grad_dtype, device=device) for b in self.buckets]
        self._pending = [0] * len(self.buckets)
        self._futures: list[tuple[int, object]] = []  # (bucket, Future from a hook, or Work of a collective)
        self._bucket_of = {id(p): b.index for b in self.buckets for _, p, _ in b.params}
        for b in self.buckets:
            for name, param, _ in b.params:
                param.register_post_accumulate_grad_hook(self._on_grad)
        if zero != 2:
            self._attach_grads()

    # ---- layout ------------------------------------------------------------------------------------
    def _make_piece(self, bucket, norm_excluded: set[str]) -> _Piece:
        lo, hi = bucket.shard_range(self.dp_rank, self.dp) if self.zero else (bucket.start, bucket.end)
        view = self.param_buffer[lo:hi]
        piece = _Piece(bucket.index, lo, hi, view, view if self.compute_dtype == torch.float32 else view.clone())
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

    def _attach_grads(self) -> None:
        """Point every parameter's .grad (or fp32 main grad) at its place in the bucket gradient buffers."""
        for b in self.buckets:
            buf = self.bucket_grads[b.index]
            for _, param, offset in b.params:
                view = buf[offset - b.start:offset - b.start + param.numel()].view_as(param)
                if self.main_grad:
                    param.main_grad, param.grad = view, None
                else:
                    param.grad = view

    def grad_of(self, name: str) -> torch.Tensor:
        """The full accumulated gradient of a parameter (valid until its bucket is reduced)."""
        offset, numel = self.offsets[name]
        b = next(b for b in self.buckets if b.start <= offset < b.end)
        return self.bucket_grads[b.index][offset - b.start:offset - b.start + numel]

    # ---- one step ----------------------------------------------------------------------------------
    def prepare_step(self, micro_batches: int) -> None:
        if self.zero == 2:  # full gradient buffers exist only between here and the bucket's reduction
            self.bucket_grads = [torch.zeros(b.numel, dtype=self.grad_dtype, device=self.mesh.device)
                                 for b in self.buckets]
            self._attach_grads()
        else:
            for buf in self.bucket_grads:
                buf.zero_()
        self._pending = [len(b.params) * micro_batches for b in self.buckets]
        self._futures = []
        self.bytes = 0
        self.hook_state.bytes_sent = 0

    def _on_grad(self, param: torch.Tensor) -> None:
        index = self._bucket_of[id(param)]
        if self.main_grad:  # bf16 gradient into the fp32 buffer; free the bf16 copy
            param.main_grad.add_(param.grad)
            param.grad = None
        self._pending[index] -= 1
        if self._pending[index] == 0 and index < self.n_regular and not self.compress_update:
            self._launch(index)

    def _launch(self, index: int) -> None:
        buf = self.bucket_grads[index]
        if self.use_hook:
            self._futures.append((index, self.comm_hook(self.hook_state, self._grad_bucket(index, buf))))
            return
        # Reduce-scatter in place: this rank's shard of the bucket becomes the dp average of that shard.
        buf.div_(self.dp)
        self.bytes += buf.numel() * buf.element_size()
        work = _reduce_scatter_single(buf.chunk(self.dp)[self.dp_rank], buf, group=self.group, async_op=True)
        self._futures.append((index, work))  # gloo's Work has no future for this collective: wait on it

    def _grad_bucket(self, index: int, buffer: torch.Tensor) -> GradBucket:
        """What the comm hook sees of bucket `index`: `buffer` (its gradient, or its update), names and shapes."""
        params = self.buckets[index].params
        return GradBucket(index, buffer, [n for n, _, _ in params], [p.shape for _, p, _ in params])

    def finish_grad_sync(self) -> int:
        """Finish every bucket's reduction (the late ones after `presync`); returns dp bytes sent this step."""
        if self.presync is not None:
            self.presync(self)
        if self.compress_update:  # the gradients stay local; the updates are reduced in step()
            return 0
        for index in range(len(self.buckets)):  # late buckets, and any a parameter never reached
            if self._pending[index] > 0 or index >= self.n_regular:
                self._launch(index)
        for index, handle in self._futures:
            result = handle.wait()
            if self.use_hook:
                value = result[0] if isinstance(result, list) else result
                if value.data_ptr() != self.bucket_grads[index].data_ptr():
                    self.bucket_grads[index].copy_(value)
            elif self.zero == 2:
                self.shard_grads[index].copy_(self.bucket_grads[index].chunk(self.dp)[self.dp_rank])
        self._futures = []
        if self.zero == 2:  # keep only the shards: drop the full buffers and the views into them
            self.bucket_grads = [None] * len(self.buckets)
            for b in self.buckets:
                for _, param, _ in b.params:
                    param.grad = None
                    if self.main_grad:
                        param.main_grad = None
        return self.bytes + self.hook_state.bytes_sent

    def comm_bytes(self) -> int:
        """Bytes this rank passed to dp collectives this step (reductions and parameter all-gathers)."""
        return self.bytes + self.hook_state.bytes_sent

    def _piece_grad(self, piece: _Piece) -> torch.Tensor:
        if self.zero == 2:
            return self.shard_grads[piece.bucket_index]
        b = self.buckets[piece.bucket_index]
        return self.bucket_grads[piece.bucket_index][piece.lo - b.start:piece.hi - b.start]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the averaged gradient: over this rank's share, summed over the axes that split it."""
        total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        for piece in self.pieces:
            grad = self._piece_grad(piece)
            for a, b in piece.counted:
                total += grad[a:b].float().pow(2).sum()
        axes = (["dp"] if self.zero else []) + ["tp", "pp"]
        for axis in axes:
            if getattr(self.mesh, f"{axis}_size") > 1:
                dist.all_reduce(total, group=self.mesh.group(axis))
        if self.compress_update and self.dp > 1:  # local gradients: the ranks' root-mean-square norm, one for all
            dist.all_reduce(total, group=self.group)
            total /= self.dp
        return total.sqrt()

    @torch.no_grad()
    def step(self, lr: float, grad_scale: torch.Tensor | float = 1.0) -> None:
        """AdamW on this rank's shard (identical, element for element, to torch.optim.AdamW), then re-gather."""
        if self.compress_update:
            return self._step_compressed_update(lr, grad_scale)
        self.step_count += 1
        beta1, beta2 = self.betas
        bias1, bias2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
        scaled = not (isinstance(grad_scale, float) and grad_scale == 1.0)  # x * 1.0 == x: skip the pass
        for piece in self.pieces:
            full_grad, decay = self._piece_grad(piece), iter(piece.decay)
            span = next(decay, None)
            for lo in range(0, piece.master.numel(), STEP_SLICE):
                hi = min(lo + STEP_SLICE, piece.master.numel())
                grad = full_grad[lo:hi].float()
                if scaled:
                    grad = grad * grad_scale
                master, exp_avg, exp_avg_sq = piece.master[lo:hi], piece.exp_avg[lo:hi], piece.exp_avg_sq[lo:hi]
                while span is not None and span[0] < hi:  # decayed parameters (sorted spans) in this slice
                    master[max(span[0], lo) - lo:min(span[1], hi) - lo].mul_(1 - lr * self.weight_decay)
                    if span[1] > hi:
                        break  # it goes on into the next slice
                    span = next(decay, None)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(1e-8)
                master.addcdiv_(exp_avg, denom, value=-lr / bias1)
            if piece.master.data_ptr() != piece.param_view.data_ptr():
                piece.param_view.copy_(piece.master)
        if self.zero:
            for bucket, piece in zip(self.buckets, self.pieces):
                full = self.param_buffer[bucket.start:bucket.end]
                self.bytes += piece.param_view.numel() * piece.param_view.element_size()
                _all_gather_single(full, piece.param_view, group=self.group)

    def _step_compressed_update(self, lr: float, grad_scale: torch.Tensor | float) -> None:
        """AdamW's update from this rank's moments, averaged over dp by the comm hook, applied on every rank."""
        self.step_count += 1
        beta1, beta2 = self.betas
        bias1, bias2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
        futures = []
        for bucket, piece in zip(self.buckets, self.pieces):  # ZeRO-0: a piece is its whole bucket
            grad = self._piece_grad(piece).float()
            if not (isinstance(grad_scale, float) and grad_scale == 1.0):  # x * 1.0 == x: skip the pass
                grad = grad * grad_scale
            piece.exp_avg.lerp_(grad, 1 - beta1)
            piece.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            update = piece.exp_avg / (piece.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(1e-8) * (lr / bias1)
            futures.append(self.comm_hook(self.hook_state, self._grad_bucket(bucket.index, update)))
        for piece, future in zip(self.pieces, futures):
            result = future.wait()
            average = result[0] if isinstance(result, list) else result
            for a, b in piece.decay:
                piece.master[a:b].mul_(1 - lr * self.weight_decay)
            piece.master.sub_(average)
            if piece.master.data_ptr() != piece.param_view.data_ptr():
                piece.param_view.copy_(piece.master)

    # ---- state -------------------------------------------------------------------------------------
    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer states this rank holds between steps."""
        masters = [p.master for p in self.pieces if p.master.data_ptr() != p.param_view.data_ptr()]
        grads = self.shard_grads if self.zero == 2 else self.bucket_grads
        return tensor_bytes(self.param_buffer, *grads, *masters, *[t for p in self.pieces
                                                                  for t in (p.exp_avg, p.exp_avg_sq)])

    def _gathered(self, attr: str) -> dict[str, torch.Tensor]:
        """Full per-parameter tensors of one optimizer state (gathered over dp under ZeRO)."""
        out = {}
        for bucket, piece in zip(self.buckets, self.pieces):
            local = getattr(piece, attr).float()
            if self.zero:
                full = torch.empty(bucket.numel, dtype=local.dtype, device=local.device)
                _all_gather_single(full, local.contiguous(), group=self.group)
                base = bucket.start
            else:
                full, base = local, piece.lo
            for name, param, offset in bucket.params:
                out[name] = full[offset - base:offset - base + param.numel()].view(param.shape).clone()
        return out

    def state_dict(self) -> dict:
        """Optimizer state by parameter name, independent of dp size and ZeRO stage."""
        state = {"step": torch.tensor(self.step_count), "exp_avg": self._gathered("exp_avg"),
                 "exp_avg_sq": self._gathered("exp_avg_sq")}
        if self.compute_dtype != torch.float32:
            state["master"] = self._gathered("master")
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        for piece in self.pieces:
            for name, a, b, start in piece.params:
                n = b - a
                piece.exp_avg[a:b].copy_(state["exp_avg"][name].reshape(-1)[start:start + n])
                piece.exp_avg_sq[a:b].copy_(state["exp_avg_sq"][name].reshape(-1)[start:start + n])
                if "master" in state:
                    piece.master[a:b].copy_(state["master"][name].reshape(-1)[start:start + n])
                    piece.param_view[a:b].copy_(piece.master[a:b])

    def model_state_dict(self) -> dict:
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def reload_parameters(self) -> None:
        """After parameters were loaded into the model (views of the flat buffer), refresh fp32 masters."""
        for piece in self.pieces:
            if piece.master.data_ptr() != piece.param_view.data_ptr():
                piece.master.copy_(piece.param_view)
