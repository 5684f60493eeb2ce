"""The gradient half of the data-parallel engine: flat gradient buckets reduced while backward runs.

Every parameter's gradient accumulates into a view of one flat buffer per bucket (bf16 parameters with fp32
reduction: into an fp32 `main_grad`, added by the post-accumulate-grad hook). When a bucket's last gradient of
the last micro-batch has arrived its reduction starts asynchronously while backward goes on: under ZeRO-0 (and
ZeRO-1 with a custom hook, which must see whole buckets) the comm hook averages the bucket over dp; under
ZeRO-1 an in-place reduce-scatter leaves each rank the averaged gradient of its shard. `finish` launches what
backward did not (the late buckets, whose gradients are summed over tp or the embedding group first) and waits
on every handle.

ZeRO-2 keeps a bucket's full gradient only while it fills, as DeepSpeed's stage 2 and FSDP2 do: a bucket's
buffer is allocated at its first gradient, and once every parameter of the bucket has added one gradient (one
micro-batch's, or under zero-bubble's held W GEMMs a mix of two micro-batches') it is reduce-scattered and the
result added to this rank's shard; before a round's reduction starts the previous one is waited on and its
buffer freed, and a backward starts with none reducing (`settle_rounds`), so a step holds at most `IN_FLIGHT`
(2) full bucket buffers: one reducing, one filling (DeepSpeed's double buffer; more only while several buckets
fill at once, as under zero-bubble's deferred W). Reduction is linear, so summing the rounds' averages is the
step's average (to fp32 rounding); the price is one reduce-scatter per bucket and micro-batch instead of per step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.memory.buffers import FlatLayout
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.comm_hooks import AllReduceState, GradBucket, allreduce_hook

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
IN_FLIGHT = 2  # ZeRO-2's full bucket buffers live at once: one filling, one reducing (the planner's term)


def bucket_layout(
    named: list[tuple[str, nn.Parameter]],
    late_params: AbstractSet[str],
    own_buckets: AbstractSet[str],
    bucket_mb: float,
    element_size: int,
    dp: int,
) -> tuple[FlatLayout, int]:
    """The engine's buckets and how many of them are regular (reduced from backward); the rest are late.

    The late parameters form the last bucket(s), after the regular ones. `own_buckets` parameters (those
    replicated over tp, under compression) never share a bucket with others: a compressor decides per bucket
    (top-k's threshold, int8's chunk scales), and tp peers must decide alike on identical copies.
    """
    groups = [(late, own) for late in (False, True) for own in (False, True)]
    parts = [
        FlatLayout.build(
            [x for x in named if (x[0] in late_params) == late and (x[0] in own_buckets) == own],
            math.inf if late else bucket_mb * 2**20,
            element_size,
            dp,
        )
        for late, own in groups
    ]
    buckets: list = []
    offsets, numel, n_regular = {}, 0, 0
    for (late, _), part in zip(groups, parts):
        for bucket in part.buckets:
            bucket.index += len(buckets)
            bucket.start += numel
            bucket.end += numel
            bucket.params = [(n, p, off + numel) for n, p, off in bucket.params]
        buckets += part.buckets
        offsets.update({n: (o + numel, k) for n, (o, k) in part.offsets.items()})
        numel += part.numel
        n_regular += 0 if late else len(part.buckets)
    return FlatLayout(buckets, numel, offsets), n_regular


class _WeakHook:
    """A parameter's post-accumulate hook that reaches its GradBuffer through a weak reference. A bound method
    would make a cycle (parameter -> hook -> buffer -> bucket -> parameter) through tensor hooks, which Python's
    collector cannot see into: the model, the engine and their process groups (with gloo's threads and sockets)
    would outlive the run, one set per run in a process that trains many (the tests' pooled ranks)."""

    def __init__(self, buffer: GradBuffer):
        self.buffer = weakref.ref(buffer)

    def __call__(self, param: torch.Tensor) -> None:
        buffer = self.buffer()
        if buffer is not None:
            buffer._on_grad(param)


class GradBuffer:
    """Bucketed gradient buffers of one rank and their dp reductions; `defer` keeps gradients local (the
    reductions of compressed updates happen in the optimizer step instead)."""

    def __init__(
        self,
        layout: FlatLayout,
        n_regular: int,
        mesh: ParallelMesh,
        *,
        zero: int,
        grad_dtype: torch.dtype,
        main_grad: bool,
        comm_hook: Callable | None = None,
        hook_state=None,
        defer: bool = False,
    ):
        self.buckets, self.offsets, self.n_regular = layout.buckets, layout.offsets, n_regular
        self.mesh, self.zero = mesh, zero
        self.dp, self.dp_rank, self.group = mesh.grad_size, mesh.grad_rank, mesh.grad_group
        self.grad_dtype, self.main_grad, self.defer = grad_dtype, main_grad, defer
        self.hook_state = hook_state or AllReduceState(self.group, self.dp)
        self.comm_hook = comm_hook or allreduce_hook
        # ZeRO-1 reduce-scatters, unless a custom hook (compression) must see whole buckets: then the hook
        # averages the bucket and this rank keeps its shard of the result.
        self.use_hook = zero == 0 or (zero == 1 and comm_hook is not None)
        self.bytes = 0
        device = mesh.device
        self.bucket_grads: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.shard_grads: list[torch.Tensor | None] = [None] * len(self.buckets)
        if zero == 2:
            self.shard_grads = [torch.zeros(b.numel // self.dp, dtype=grad_dtype, device=device) for b in self.buckets]
        else:
            self.bucket_grads = [torch.zeros(b.numel, dtype=grad_dtype, device=device) for b in self.buckets]
        self._pending = [0] * len(self.buckets)
        self._futures: list[tuple[int, Any]] = []  # (bucket, Future from a hook, or Work of a collective)
        self._rounds: list[tuple[int, torch.Tensor, Any]] = []  # ZeRO-2: (bucket, full buffer, Work) in flight
        self._bucket_of = {id(p): b.index for b in self.buckets for _, p, _ in b.params}
        self._offset_of = {id(p): off - b.start for b in self.buckets for _, p, off in b.params}  # in its bucket
        hook = _WeakHook(self)
        for b in self.buckets:
            for _, param, _ in b.params:
                param.register_post_accumulate_grad_hook(hook)
        if zero != 2:
            self._attach_grads()

    def _attach_grads(self) -> None:
        """Point every parameter's .grad (or fp32 main grad) at its place in the bucket gradient buffers."""
        for b in self.buckets:
            buf = self.bucket_grads[b.index]
            if buf is None:  # ZeRO-2's regular buckets: allocated per round (_add_to_round)
                continue
            for _, param, offset in b.params:
                view = buf[offset - b.start : offset - b.start + param.numel()].view_as(param)
                if self.main_grad:
                    param.main_grad, param.grad = view, None
                else:
                    param.grad = view

    def grad_of(self, name: str) -> torch.Tensor:
        """The full accumulated gradient of a parameter (valid until its bucket is reduced)."""
        offset, numel = self.offsets[name]
        b = next(b for b in self.buckets if b.start <= offset < b.end)
        return self.bucket_grads[b.index][offset - b.start : offset - b.start + numel]

    def part(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) (flat-buffer positions: this rank's share) of bucket `index`'s gradient."""
        if self.zero == 2:
            return self.shard_grads[index]
        b = self.buckets[index]
        return self.bucket_grads[index][lo - b.start : hi - b.start]

    def tensors(self) -> list[torch.Tensor | None]:
        """The gradient storage held between steps (for the state-bytes count)."""
        return self.shard_grads if self.zero == 2 else self.bucket_grads

    @property
    def _streaming(self) -> bool:
        """ZeRO-2 reduces its regular buckets per round, unless the gradients stay local this step."""
        return self.zero == 2 and not self.defer

    # ---- one step ----------------------------------------------------------------------------------
    def prepare_step(self, micro_batches: int) -> None:
        if self.zero == 2:  # full buffers: the late buckets' (and every bucket's when gradients stay local)
            device = self.mesh.device
            kept = range(self.n_regular if self._streaming else 0, len(self.buckets))
            self.bucket_grads = [
                torch.zeros(b.numel, dtype=self.grad_dtype, device=device) if b.index in kept else None
                for b in self.buckets
            ]
            self._attach_grads()
            for shard in self.shard_grads:
                shard.zero_()
        else:
            for buf in self.bucket_grads:
                buf.zero_()
        self._pending = [len(b.params) * micro_batches for b in self.buckets]
        if self._streaming:  # a regular bucket is reduced each time every parameter has added a gradient
            self._pending[: self.n_regular] = [len(b.params) for b in self.buckets[: self.n_regular]]
        self._futures = []
        self.bytes = 0
        self.hook_state.bytes_sent = 0

    def _on_grad(self, param: torch.Tensor) -> None:
        index = self._bucket_of[id(param)]
        if self._streaming and index < self.n_regular:
            self._add_to_round(index, param)
            return
        if self.main_grad:  # bf16 gradient into the fp32 buffer; free the bf16 copy
            param.main_grad.add_(param.grad)
            param.grad = None
        self._pending[index] -= 1
        if self._pending[index] == 0 and index < self.n_regular and not self.defer:
            self._launch(index)

    def _add_to_round(self, index: int, param: torch.Tensor) -> None:
        """ZeRO-2: add a gradient into its bucket's buffer (allocated at the round's first gradient); when every
        parameter of the bucket has added one, reduce-scatter the round and start the next one empty."""
        b = self.buckets[index]
        if self.bucket_grads[index] is None:
            self.bucket_grads[index] = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.mesh.device)
        offset = self._offset_of[id(param)]
        self.bucket_grads[index][offset : offset + param.numel()].view_as(param).add_(param.grad)
        param.grad = None
        self._pending[index] -= 1
        if self._pending[index] == 0:
            self._pending[index] = len(b.params)
            self._reduce_round(index)

    def _reduce_round(self, index: int) -> None:
        """Reduce-scatter bucket `index`'s round in place and let go of it; the rounds still reducing are waited on
        and added to the shard first, so their buffers are freed."""
        buf = self.bucket_grads[index]
        self.bucket_grads[index] = None
        while len(self._rounds) >= IN_FLIGHT - 1:  # this round's buffer and the next to fill make IN_FLIGHT
            self._settle(*self._rounds.pop(0))
        buf.div_(self.dp)
        self.bytes += buf.numel() * buf.element_size()
        work = _reduce_scatter_single(buf.chunk(self.dp)[self.dp_rank], buf, group=self.group, async_op=True)
        self._rounds.append((index, buf, work))

    def settle_rounds(self) -> None:
        """ZeRO-2: wait on the rounds still reducing and free their buffers (before the next backward fills)."""
        for round_ in self._rounds:
            self._settle(*round_)
        self._rounds = []

    def _settle(self, index: int, buf: torch.Tensor, work) -> None:
        work.wait()
        self.shard_grads[index].add_(buf.chunk(self.dp)[self.dp_rank])

    def _launch(self, index: int) -> None:
        buf = self.bucket_grads[index]
        if self.use_hook:
            self._futures.append((index, self.reduce(index, buf)))
            return
        # Reduce-scatter in place: this rank's shard of the bucket becomes the dp average of that shard.
        buf.div_(self.dp)
        self.bytes += buf.numel() * buf.element_size()
        work = _reduce_scatter_single(buf.chunk(self.dp)[self.dp_rank], buf, group=self.group, async_op=True)
        self._futures.append((index, work))  # gloo's Work has no future for this collective: wait on it

    def reduce(self, index: int, buffer: torch.Tensor) -> torch.futures.Future:
        """The comm hook on bucket `index` holding `buffer` (its gradient, or its update): a future of the average."""
        params = self.buckets[index].params
        bucket = GradBucket(index, buffer, [n for n, _, _ in params], [p.shape for _, p, _ in params])
        return self.comm_hook(self.hook_state, bucket)

    def finish(self) -> int:
        """Launch what backward did not and wait on every reduction; returns dp bytes sent this step."""
        if self.defer:  # the gradients stay local
            return 0
        if self._streaming:  # ZeRO-2: the regular buckets' partial rounds, then every round's wait
            for index in range(self.n_regular):
                if self.bucket_grads[index] is not None:
                    self._reduce_round(index)
            self.settle_rounds()
        for index in range(self.n_regular if self._streaming else 0, len(self.buckets)):
            if self._pending[index] > 0 or index >= self.n_regular:  # late ones, and any never reached
                self._launch(index)
        for index, handle in self._futures:
            result = handle.wait()
            if self.use_hook:
                value = result[0] if isinstance(result, list) else result
                if value is not self.bucket_grads[index]:  # an in-place hook hands back the buffer itself
                    self.bucket_grads[index].copy_(value)
            elif self.zero == 2:
                self.shard_grads[index].add_(self.bucket_grads[index].chunk(self.dp)[self.dp_rank])
        self._futures = []
        if self.zero == 2:  # keep only the shards: drop the full buffers and the views into them
            self.release_full()
        return self.comm_bytes()

    def release_full(self) -> None:
        """ZeRO-2: drop the full bucket buffers and the gradient views into them (until the next step)."""
        self.bucket_grads = [None] * len(self.buckets)
        for b in self.buckets:
            for _, param, _ in b.params:
                param.grad = None
                if self.main_grad:
                    param.main_grad = None

    def comm_bytes(self) -> int:
        """Bytes this rank passed to the dp reductions this step."""
        return self.bytes + self.hook_state.bytes_sent
