"""The compression comm hook: compress a bucket, reduce it over dp on a real wire format, decompress, keep the error.

Shape of PyTorch's DDP comm hooks (see parallel/comm_hooks.py): `CompressionState` holds the group, the spec,
the error-feedback residuals and PowerSGD's warm-start factors; `compression_hook(state, bucket)` is pure
apart from that state and returns a future of the dp-averaged dense gradient (the bucket's shape and dtype).

How the engine drives it:
    state = CompressionState(dp_group, dp_size, cfg.train.compression, seed=cfg.train.seed)
    per step:  for each full bucket, in the same order on every rank: futures.append(compression_hook(state, b))
               wait for all futures, copy the results into the buffers, optimizer step, then state.new_step()
    on a skipped step (non-finite gradients): state.reset(), or NaN residuals would poison every later step
    checkpoints: state.state_dict() / state.load_state_dict() (residuals and Q are training state; the trainer
               keeps them in each rank's loop-state file and restores them in the same layout only)
With `--compression-target update` the engine calls the hook from `step()` on each bucket's AdamW update
instead of from backward on its gradient (parallel/dp_engine.py says why); the hook cannot tell the difference.
The step counter seeds random-k's coordinates and stochastic rounding, so every rank must call new_step() the
same number of times; with gradient accumulation the hook runs once per bucket per optimizer step (on the
last micro-batch), and each bucket index must be reduced at most once per step.

Ordering: every collective is issued by the thread that calls the hook, in program order, never from a future
callback. Backends match collectives by issue order; one issued from a callback thread could interleave with the
next bucket's and pair up differently on different ranks. Where a collective needs the result of an earlier one
(threshold's counts, PowerSGD's P, two-stage's all-to-all), the hook waits for it and says so; the last collective
of every kind is asynchronous and only local decoding runs in its callback.

Under ZeRO-2/3 the engine needs only its shard of the average. The hook is still correct there (keep the shard of
the returned bucket), and its compressed all-gathers already move less than a dense reduce-scatter when the ratio
is small; the better wires are a compressed reduce-scatter (sparse pairs or quantised chunks sent by all-to-all to
the shard's owner, which decodes and sums only its shard: two-stage's first half) and, for PowerSGD, the same two
small all-reduces with each rank expanding only its shard of P Q^T. Note that error feedback keeps a full-bucket
residual per rank either way, which gives back the gradient memory ZeRO-2 saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from large_model_training.compression.powersgd import factor_dtype, matrix_rank, reduce_powersgd
from large_model_training.compression.quantize import quantized_nbytes, reduce_quantized
from large_model_training.compression.sign import Codec
from large_model_training.compression.sparse import index_dtype, reduce_sparse
from large_model_training.compression.spec import CompressionSpec, parse_compression, seeded_generator, sparse_count
from large_model_training.compression.two_stage import start_average
from large_model_training.compression.wire import DensePayload
from large_model_training.parallel.comm_hooks import GradBucket, allreduce_hook

STOCHASTIC_STREAM = 3
"""Key mixed into stochastic rounding's seed, so its stream differs from other seeded draws."""


@dataclass
class CompressionState:
    """Everything the compression hook keeps between steps, for one dp group."""

    group: dist.ProcessGroup
    group_size: int
    spec: CompressionSpec | str = "none"
    """A parsed spec, or a spec string (parsed here)."""
    error_feedback: bool = True
    """Add what a rank did not send to its next gradient (memory: one bucket-sized residual per bucket)."""
    seed: int = 0
    """Seeds random-k's coordinates, stochastic rounding and PowerSGD's first Q."""
    step: int = 0
    """Optimizer steps completed; advanced by new_step()."""
    rank: int = -1
    """This rank in the group (stochastic rounding draws differ per rank); -1 asks the group."""
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per bucket index: what this rank did not send last time (error feedback)."""
    powersgd_q: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Per bucket index: the dp-averaged Q of each compressed matrix, PowerSGD's warm start."""
    server_residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per bucket index, two-stage int8 / int4: what the shard this rank serves did not send (its second rounding)."""
    bytes_sent: int = 0
    """Bytes this rank passed to collectives (numel x element size of each input, count exchanges included)."""
    dense_steps: int = 0
    """Steps (by `step`) that are all-reduced densely before compression starts (train.compression_warmup)."""

    def __post_init__(self) -> None:
        if isinstance(self.spec, str):
            self.spec = parse_compression(self.spec)
        if self.rank < 0:
            self.rank = dist.get_rank(self.group)

    def new_step(self) -> None:
        """Call once per optimizer step, after every bucket's future has been waited on, on every rank."""
        self.step += 1

    def reset(self) -> None:
        """Forget residuals and warm-start factors (after a skipped non-finite step, or a change of buckets)."""
        self.residuals.clear()
        self.powersgd_q.clear()
        self.server_residuals.clear()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "residuals": dict(self.residuals),
            "powersgd_q": {i: list(qs) for i, qs in self.powersgd_q.items()},
            "server_residuals": dict(self.server_residuals),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Copies the tensors: the hook updates residuals in place, which must not reach the caller's dict."""
        self.step = int(sd["step"])
        self.residuals = {int(i): r.clone() for i, r in sd["residuals"].items()}
        self.powersgd_q = {int(i): [q.clone() for q in qs] for i, qs in sd["powersgd_q"].items()}
        self.server_residuals = {int(i): r.clone() for i, r in sd.get("server_residuals", {}).items()}


def compression_hook(state: CompressionState, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over dp through the spec's compressor, with error feedback.

    1. x = g + e: add the residual this rank kept from the bucket's last reduction.
    2. Compress x and start its collective(s) on the compressor's wire format (sparse.py, quantize.py,
       powersgd.py document each format and its byte count).
    3. e = x - sent, where sent is this rank's decompressed contribution: what did not travel (bit for bit
       for sparse and round-to-nearest; to one rounding for stochastic rounding and PowerSGD, see quantize.py).
       Computed while the collective is in flight; the message is a separate tensor, so this is safe.
    4. The future decodes every rank's contribution and returns their average, dense, in the bucket's dtype.
    The bucket's buffer is only read, except by 'none' (reduced in place like allreduce_hook) and 'powersgd'
    (the average is written into it, which saves the engine a bucket-sized copy).
    """
    spec = state.spec
    assert isinstance(spec, CompressionSpec)
    if spec.kind == "none" or state.step < state.dense_steps:
        return allreduce_hook(state, bucket)  # type: ignore[arg-type]  # same fields: group, group_size, bytes_sent
    # 1. Error feedback in.
    g = bucket.buffer
    residual = state.residuals.get(bucket.index) if state.error_feedback else None
    if residual is not None and residual.shape != g.shape:
        residual = None  # the buckets were rebuilt (e.g. a resumed run with another bucket size): start afresh
    # x lives in the residual's storage (or a copy of g on a bucket's first step), never in g: PowerSGD writes
    # the average into g from a callback thread while this thread computes the new residual from x.
    if not state.error_feedback:
        x = g
    else:
        x = residual.add_(g) if residual is not None else g.clone()
    # 2. Compress and start the reduction.
    payload: Any  # one of compression.Payload's kinds; PowerSGD's keeps its own error (error_)
    if spec.kind in ("topk", "randomk", "threshold"):
        payload, fut = reduce_sparse(state, spec, x, state.seed, state.step, bucket.index)
    elif spec.two_stage:
        payload, fut = _reduce_two_stage(state, x, spec.kind, bucket.index)
    elif spec.bits:
        gen = (
            seeded_generator(x.device, state.seed, STOCHASTIC_STREAM, state.step, bucket.index, state.rank)
            if spec.stochastic
            else None
        )
        payload, fut = reduce_quantized(state, x, spec.bits, spec.chunk, gen)
    else:
        payload, fut = reduce_powersgd(
            state, x, list(bucket.param_shapes), spec.rank, state.powersgd_q, state.seed, bucket.index, out=g
        )
    # 3. Error feedback out (PowerSGD in place: x is this rank's own scratch, see above).
    if state.error_feedback:
        state.residuals[bucket.index] = payload.error_(x) if spec.kind == "powersgd" else x - payload.decompress()
    # 4. The average arrives with the future.
    return fut


def _reduce_two_stage(
    state: CompressionState, x: torch.Tensor, kind: str, index: int
) -> tuple[DensePayload, torch.futures.Future]:
    """int8 / int4 through the two-stage average (two_stage.py). The all-gather needs the all-to-all's result,
    so this thread waits for it before issuing the all-gather (the ordering rule above; PowerSGD waits for P)."""
    codec, shard = Codec(kind), -(-x.numel() // state.group_size)
    server = state.server_residuals.get(index) if state.error_feedback else None
    if state.error_feedback and (server is None or server.numel() != shard):
        server = state.server_residuals[index] = torch.zeros(shard, device=x.device)
    sent, serve = start_average(state, codec, x.float(), server)
    rows, work = serve()

    def decode(_: torch.futures.Future) -> torch.Tensor:
        return codec.decode(rows, shard).view(-1)[: x.numel()].to(x.dtype)

    return DensePayload(sent.to(x.dtype)), work.get_future().then(decode)


def wire_factor(spec: CompressionSpec | str, world: int) -> float:
    """Bytes a ring algorithm puts on each rank's link per byte `bytes_sent` counts (collective input): 2 (w-1)/w
    for the all-reduces (none, random-k, PowerSGD), w-1 for the all-gathers of every rank's message (int8, int4,
    top-k, threshold), 2 (w-1) / (w+1) for the two stages (input: w shard messages, then one)."""
    spec = parse_compression(spec) if isinstance(spec, str) else spec
    if spec.two_stage:
        return 2 * (world - 1) / (world + 1)
    if spec.bits or spec.kind in ("topk", "threshold"):
        return world - 1
    return 2 * (world - 1) / world


class WireBytes(NamedTuple):
    """Bytes one rank passes to collectives (`sent`, what `state.bytes_sent` counts) and gets back (`received`)."""

    sent: int
    received: int


def wire_bytes(
    spec: CompressionSpec | str,
    numel: int,
    world: int,
    *,
    element_size: int = 4,
    param_shapes: list[torch.Size] | None = None,
    max_count: int | None = None,
) -> WireBytes:
    """The formula for what one compression_hook call on a bucket of `numel` elements moves, per rank.

    threshold's message size depends on the data: pass `max_count`, the largest number of coordinates any
    rank selected. powersgd needs the bucket's `param_shapes` (without them the bucket is one dense vector).
    `received` is the size of the collectives' outputs: it is what grows with `world` for all-gathers.
    """
    spec = parse_compression(spec) if isinstance(spec, str) else spec
    if spec.kind == "none":
        return WireBytes(numel * element_size, numel * element_size)
    pair = index_dtype(numel).itemsize + element_size
    if spec.kind == "topk":
        sent = sparse_count(numel, spec.ratio) * pair
        return WireBytes(sent, world * sent)
    if spec.kind == "randomk":
        sent = sparse_count(numel, spec.ratio) * element_size
        return WireBytes(sent, sent)
    if spec.kind == "threshold":
        if max_count is None:
            raise ValueError("wire_bytes for threshold needs max_count (the largest count selected by any rank)")
        return WireBytes(8 + max_count * pair, world * (8 + max_count * pair))
    if spec.two_stage:  # an all-to-all of w shard messages, then an all-gather of this rank's served one
        shard = quantized_nbytes(-(-numel // world), spec.bits, spec.chunk)
        return WireBytes((world + 1) * shard, 2 * world * shard)
    if spec.bits:
        sent = quantized_nbytes(numel, spec.bits, spec.chunk)
        return WireBytes(sent, world * sent)
    shapes = param_shapes if param_shapes and sum(s.numel() for s in param_shapes) == numel else [torch.Size([numel])]
    factor = factor_dtype({2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[element_size]).itemsize
    dense, factors = 0, 0
    for shape in shapes:
        r = matrix_rank(shape, spec.rank)
        if r:
            factors += (shape[0] + math.prod(shape[1:])) * r
        else:
            dense += shape.numel()
    sent = dense * element_size + factors * factor
    return WireBytes(sent, sent)
