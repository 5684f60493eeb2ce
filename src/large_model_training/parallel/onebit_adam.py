"""`--optimizer onebit-adam`: 1-bit Adam (Tang et al. 2021), an update rule around AdamW, composing with ZeRO 0-2.

1. Warm-up (`train.onebit_warmup` steps): the ordinary engine, dense gradient reduction and AdamW, bit for bit
   `--optimizer adamw`. The second moment v is then frozen (with its bias correction), as 1-bit Adam's.
2. After it, gradients stay local (the gradient buffer's `defer`: tp and pipeline sums still happen, nothing is
   reduced over dp) and `step` runs the two-stage compressed average (compression/two_stage.py) of the momentum
   increments:
   worker, every rank i: x_i = (1 - beta1) g_i + e_i over the whole (flat) model, bucket by bucket; each bucket
       cut into the dp shards ZeRO uses (`Bucket.shard_range`), each shard compressed on its own (signs and
       per-chunk mean |x|, or int8), e_i = x_i - what was sent (the worker error: full-size, as DeepSpeed's);
       one all-to-all sends shard j's message to rank j (real packed bytes on the wire).
   server, rank j for its shard: a = mean_i(received) + s_j, compressed again, s_j = a - sent (the server error,
       shard-sized); inc = decompress(a).
   update, on this rank's piece: m = beta1 m + inc (+ v from inc / (1 - beta1) every `variance_refresh` steps,
       0/1 Adam's occasional refresh; 0 keeps v frozen), then AdamW's step m / (sqrt(v) + eps) with weight decay.
   ZeRO-0 all-gathers the compressed `inc` messages (every rank decodes the same bytes: m stays identical on
   every rank); ZeRO-1/2 apply inc to the shard they own and all-gather the parameters, as ZeRO always does.

Why the increment, not the momentum itself: m = beta1 m + (1 - beta1) g is linear, so averaging the increments
over ranks and adding beta1 m gives the averaged momentum, and the state m stays sharded and exact (1-bit Adam
compresses m_i = beta1 m + (1 - beta1) g_i whole, which quantises the large, slowly moving m again every step,
its error bounded by |m| rather than by |(1 - beta1) g|). Why the server compression under ZeRO-1/2 too, where
no second message needs it: so that one run gives the same numbers at ZeRO 0, 1 and 2 (the library's
layout-independence), at the price of one extra rounding of the average.

What each layout holds: m, v and the server error for this rank's shard only under ZeRO-1/2 (the whole model
under ZeRO-0, as AdamW's), the worker error for the whole model on every rank (1 fp32 per parameter; ZeRO-2's
full local gradient lives only between backward and `step`). Clipping after the warm-up uses the ranks' root-
mean-square local gradient norm (as `--compression-target update`). The reduction leaves backward for `step`.
Measured (docs/benchmarks.md, "1-bit Adam"): int8 matches AdamW at 3.2x fewer dp bytes, sign ends 8.7% behind at
24.8x on `tiny`, 300 steps; with v frozen at step 100 int8 loses nothing, so the cost is the 1-bit compressor.
A v refreshed from sign increments is worse (+11.8%: one magnitude per chunk); use the refresh with int8.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from large_model_training.compression.sign import Codec
from large_model_training.compression.two_stage import encode_shards, serve_shard
from large_model_training.parallel.adamw import AdamW
from large_model_training.parallel.collectives import all_gather_single
from large_model_training.parallel.pieces import ShardPiece
from large_model_training.parallel.update_rule import RuleContext, UpdateRule


def variance_updates(step: int, warmup: int, refresh: int) -> int:
    """How many times v has been updated after `step` optimizer steps (its bias correction's exponent)."""
    if step <= warmup:
        return step
    return warmup + ((step - warmup) // refresh if refresh else 0)


class OnebitAdam(UpdateRule):
    """AdamW (`adamw`, whose moments and step count it shares) during the warm-up, then the compressed momentum
    increments; gradients stay local after the warm-up (`local_grads`)."""

    def __init__(self, ctx: RuleContext, *, warmup: int, compression: str = "sign", variance_refresh: int = 0):
        self.adamw = AdamW(ctx.shards, weight_decay=ctx.weight_decay, betas=ctx.betas, state_dtype=ctx.state_dtype)
        self.shards, self.buckets = ctx.shards, ctx.shards.buckets
        self.dp, self.group = ctx.mesh.grad_size, ctx.mesh.grad_group
        self.warmup, self.refresh, self.codec = warmup, variance_refresh, Codec(compression)
        self.worker_error: dict[int, torch.Tensor] = {}  # bucket index -> full bucket, this rank's own
        self.server_error: dict[int, torch.Tensor] = {}  # bucket index -> this rank's shard of the bucket
        self._sent = 0

    @property
    def compressed_from(self) -> int:  # type: ignore[override]
        return self.warmup

    @property
    def local_grads(self) -> bool:  # type: ignore[override]
        """Whether the coming (or current) step is past the warm-up: its gradients stay local."""
        return self.adamw.step_count >= self.warmup

    def prepare_step(self) -> None:
        self._sent = 0

    def comm_bytes(self) -> int:
        return self._sent

    def step(
        self, pieces: list[ShardPiece], grads: list[torch.Tensor], lr: float, grad_scale: torch.Tensor | float
    ) -> None:
        if self.local_grads:
            self._compressed_step(pieces, grads, lr, grad_scale)
        else:
            self.adamw.step(pieces, grads, lr, grad_scale)

    # ---- the compressed step -----------------------------------------------------------------------
    def _exchange(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        """Compress each dp shard of x (error feedback in and out), start the all-to-all of the messages."""
        if self.codec.lossy:
            error = self.worker_error.get(index)
            if error is not None and error.shape == x.shape:
                x.add_(error)
        send, sent = encode_shards(self.codec, x, self.dp)
        if self.codec.lossy:  # x (a fresh fp32 buffer, already encoded) becomes the error in place
            self.worker_error[index] = x.sub_(sent)
        self._sent += send.numel()
        if self.dp == 1:
            return send, None
        received = torch.empty_like(send)
        return received, dist.all_to_all_single(received, send, group=self.group, async_op=True)

    def _serve(self, index: int, received: torch.Tensor, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard: the mean of what the ranks sent, plus the server error, compressed again;
        returns (message, the increment it decodes to)."""
        error = self.server_error.get(index)
        if self.codec.lossy and (error is None or error.shape != (shard,)):
            error = self.server_error[index] = torch.zeros(shard, device=received.device)
        return serve_shard(self.codec, received, shard, error if self.codec.lossy else None)

    def _increments(self, grads: list[torch.Tensor], beta1: float, grad_scale) -> list[torch.Tensor]:
        """The averaged momentum increment of each piece (the two-stage compressed average)."""
        dp = self.dp
        # Worker: every bucket's all-to-all is started before any is waited on.
        exchanges = [
            self._exchange(b.index, grad.float() * ((1 - beta1) * grad_scale)) for b, grad in zip(self.buckets, grads)
        ]
        served = []
        for b, (received, work) in zip(self.buckets, exchanges):
            if work is not None:
                work.wait()
            served.append(self._serve(b.index, received, b.numel // dp))
        if self.shards.zero:
            return [inc for _, inc in served]
        gathered = []  # ZeRO-0: every rank needs every shard's increment: all-gather the compressed messages
        for message, _ in served:
            rows = message.new_empty((dp, message.numel()))
            self._sent += message.numel()
            work = all_gather_single(rows.view(-1), message, group=self.group, async_op=True) if dp > 1 else None
            gathered.append((rows if dp > 1 else message.unsqueeze(0), work))
        increments = []
        for b, (rows, work) in zip(self.buckets, gathered):
            if work is not None:
                work.wait()
            increments.append(self.codec.decode(rows, b.numel // dp).reshape(-1))
        return increments

    @torch.no_grad()
    def _compressed_step(self, pieces: list[ShardPiece], grads: list[torch.Tensor], lr: float, grad_scale) -> None:
        opt = self.adamw
        beta1, beta2 = opt.betas
        opt.begin_step()  # counts the step; 1-bit Adam's own bias corrections follow
        t = opt.step_count
        refresh = bool(self.refresh) and (t - self.warmup) % self.refresh == 0
        bias1 = 1 - beta1**t
        bias2 = 1 - beta2 ** variance_updates(t, self.warmup, self.refresh)
        increments = self._increments(grads, beta1, grad_scale)
        for piece, inc, m, v in zip(pieces, increments, opt.exp_avg, opt.exp_avg_sq):
            m.mul_(beta1).add_(inc)
            if refresh:
                g_hat = inc / (1 - beta1)
                v.mul_(beta2).addcmul_(g_hat, g_hat, value=1 - beta2)
            for lo, hi in piece.decay:
                piece.master[lo:hi].mul_(1 - lr * opt.weight_decay)
            denom = v.sqrt().div_(math.sqrt(bias2)).add_(1e-8)
            piece.master.addcdiv_(m, denom, value=-lr / bias1)

    # ---- state -------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return [*self.adamw.tensors(), *self.worker_error.values(), *self.server_error.values()]

    def state_dict(self) -> dict:
        return self.adamw.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.adamw.load_state_dict(state)

    def rank_state_dict(self) -> dict:
        """This rank's worker and server errors (m, v and the step counter are AdamW's, by name; "step" is for a
        resume under gradient compression, whose counter it becomes)."""
        return {
            "onebit_worker": dict(self.worker_error),
            "onebit_server": dict(self.server_error),
            "step": self.adamw.step_count,
        }

    def load_rank_state_dict(self, saved: dict, same_layout: bool) -> None:
        """The errors come back in the layout they were saved in; elsewhere they start from zero."""
        if not same_layout or "onebit_worker" not in saved:
            self.worker_error, self.server_error = {}, {}
            return
        self.worker_error = {int(i): e.clone() for i, e in saved["onebit_worker"].items()}
        self.server_error = {int(i): e.clone() for i, e in saved["onebit_server"].items()}

    def compression_note(self, sent: int) -> str:
        return (
            f"onebit-adam ({self.codec.kind}): dense AdamW for {self.warmup} steps, then compressed momentum "
            f"increments; {sent:,} dp bytes this step"
        )


def make_rule(ctx: RuleContext) -> OnebitAdam:
    """`--optimizer onebit-adam` (choices.Optimizer)."""
    t = ctx.train
    return OnebitAdam(
        ctx, warmup=t.onebit_warmup, compression=t.onebit_compression, variance_refresh=t.onebit_variance_refresh
    )
