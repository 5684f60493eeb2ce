"""Tensor-parallel communication: the four autograd-aware collectives of Megatron-LM, with byte counting.

Names follow the papers. Shoeybi et al. 2019 call the pair around a tensor-parallel region "f" (identity
forward, all-reduce backward: `copy_to_tp`) and "g" (all-reduce forward, identity backward: `reduce_from_tp`).
Korthikanti et al. 2022 (sequence parallelism) replace them by "g" = all-gather along the sequence forward /
reduce-scatter backward (`gather_from_sequence`) and "g-bar" = reduce-scatter forward / all-gather backward
(`scatter_to_sequence`); `split_to_sequence` (take this rank's chunk forward, all-gather backward) enters the
sequence-parallel region without communication.

Every call adds the bytes one rank moves under the ring algorithm to `AxisGroup.bytes` (the mesh's `mesh.tp`)
(all-reduce of n bytes: 2(t-1)/t * n; all-gather or reduce-scatter of an n-byte full tensor: (t-1)/t * n), which
the trainer reports as `comm_bytes_tp`. The sequence dimension is dim 1 of (batch, seq, hidden) activations.

Under --compile (regional_compile.py) the five entry points run eagerly, each a clean graph break: the byte
count is a Python side effect dynamo cannot keep in a graph (it would guard on the counter's value and compile
again at every call), and gloo's in-place collectives are not traceable anyway. The compiled regions are the
layers between them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from large_model_training.mesh import AxisGroup

# torch >= 2.10 renamed these; keep working on the older names too.
# torch >= 2.10 renamed all_gather_into_tensor to all_gather_single (the old name warns); one alias for all.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_(t: torch.Tensor, tp: AxisGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.size > 1:
        tp.count_all_reduce(t)
        dist.all_reduce(t, op=op, group=tp.group)
    return t


def _gather_seq(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """(b, s/t, h) -> (b, s, h): all-gather along dim 1 (gathered on dim 0 of a seq-first copy)."""
    seq_first = x.transpose(0, 1).contiguous()
    out = seq_first.new_empty((seq_first.shape[0] * tp.size, *seq_first.shape[1:]))
    tp.count_gather_or_scatter(out)
    all_gather_single(out, seq_first, group=tp.group)
    # Contiguous once here: the column-parallel projections after it (q, k, v or gate, up) would otherwise each
    # make (and save for backward) their own contiguous copy of the gathered sequence.
    return out.transpose(0, 1).contiguous()


class SequenceRegather:
    """Lean sequence parallelism: the all-gathered sequence of one tp region entry, rebuilt in backward from this
    rank's shard for the region's column-parallel layers (q, k, v; or gate, up; or the head), which save only the
    shard (`models/linear.py`). Gathered once per backward, shared by the region's layers, dropped after the last.

    `start` posts the all-gather asynchronously so it overlaps the first layer's input-gradient GEMM."""

    def __init__(self, tp: AxisGroup):
        self.tp, self.users = tp, 0
        self._work: Any = None  # the all-gather in flight
        self._seq_first: torch.Tensor | None = None
        self._full: torch.Tensor | None = None

    def start(self, shard: torch.Tensor) -> None:
        if self._full is not None or self._work is not None:
            return
        seq_first = shard.transpose(0, 1).contiguous()
        self._seq_first = seq_first.new_empty((seq_first.shape[0] * self.tp.size, *seq_first.shape[1:]))
        self.tp.count_gather_or_scatter(self._seq_first)
        self._work = all_gather_single(self._seq_first, seq_first, group=self.tp.group, async_op=True)

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        if self._full is None:
            self.start(shard)
            self._work.wait()
            self._full = self._seq_first.transpose(0, 1).contiguous()
            self._work = self._seq_first = None
        return self._full

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self._full = None


def _reduce_scatter_seq(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """(b, s, h) partial sums -> (b, s/t, h) of the full sum: reduce-scatter along dim 1."""
    seq_first = x.transpose(0, 1).contiguous()
    out = seq_first.new_empty((seq_first.shape[0] // tp.size, *seq_first.shape[1:]))
    tp.count_gather_or_scatter(seq_first)
    _reduce_scatter_single(out, seq_first, group=tp.group)
    return out.transpose(0, 1)


def _split_seq(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """This rank's sequence chunk as its own storage. Why a copy: with one sequence per micro-batch the chunk is
    already contiguous, so `.contiguous()` returned a view that kept the whole (b, s, h) input alive for as long as
    the chunk was saved: at the embedding, one full-sequence tensor per micro-batch in flight (`lmt rehearse`
    found it: 4.5 GiB on llama3-405b's first stage)."""
    return x.chunk(tp.size, dim=1)[tp.rank].clone(memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum of partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce_(x.contiguous(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """SP g: all-gather along the sequence forward, reduce-scatter backward. The output carries
    `compact_input = (shard, SequenceRegather)`, so the linear layers after it keep the shard, not the sequence."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        full = _gather_seq(x, tp)
        full.compact_input = (x, SequenceRegather(tp))
        return full

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ScatterToSequence(torch.autograd.Function):
    """SP g-bar: reduce-scatter along the sequence forward, all-gather backward. The gathered gradient carries
    `compact_input = (shard, SequenceRegather)`: a row-parallel layer that holds its weight gradient for a
    zero-bubble W keeps this rank's shard of it and gathers it again there (`models/linear.py`)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        shard = grad.contiguous()
        full = _gather_seq(shard, ctx.tp)
        regather = SequenceRegather(ctx.tp)
        regather.users = 1  # the row-parallel layer before it
        full.compact_input = (shard, regather)
        return full, None


class _SplitToSequence(torch.autograd.Function):
    """Enter the sequence-parallel region from replicated activations: keep this rank's chunk; all-gather back."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.tp), None


@torch.compiler.disable
def copy_to_tp(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, tp) if tp.size > 1 else x


@torch.compiler.disable
def reduce_from_tp(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp) if tp.size > 1 else x


@torch.compiler.disable
def gather_from_sequence(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return _GatherFromSequence.apply(x, tp) if tp.size > 1 else x


@torch.compiler.disable
def scatter_to_sequence(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return _ScatterToSequence.apply(x, tp) if tp.size > 1 else x


@torch.compiler.disable
def split_to_sequence(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return _SplitToSequence.apply(x, tp) if tp.size > 1 else x
