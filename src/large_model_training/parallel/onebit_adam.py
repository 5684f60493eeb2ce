"""`--optimizer onebit-adam`: 1-bit Adam (Tang et al. 2021) on our sharded AdamW, composing with ZeRO 0, 1 and 2.

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
from collections.abc import Set as AbstractSet

import torch
import torch.distributed as dist

from large_model_training.compression.sign import Codec
from large_model_training.compression.two_stage import encode_shards, serve_shard
from large_model_training.parallel.collectives import all_gather_single
from large_model_training.parallel.dp_engine import DataParallelEngine
from large_model_training.parallel.grad_norm import reduce_norm_sq


def variance_updates(step: int, warmup: int, refresh: int) -> int:
    """How many times v has been updated after `step` optimizer steps (its bias correction's exponent)."""
    if step <= warmup:
        return step
    return warmup + ((step - warmup) // refresh if refresh else 0)


class OnebitAdamEngine(DataParallelEngine):
    """The data-parallel engine with 1-bit Adam's compressed momentum after a dense AdamW warm-up (ZeRO 0-2)."""

    def __init__(
        self,
        model,
        mesh,
        *,
        warmup: int,
        compression: str = "sign",
        variance_refresh: int = 0,
        norm_excluded: AbstractSet[str] = frozenset(),
        **kwargs,
    ):
        super().__init__(model, mesh, norm_excluded=norm_excluded, **kwargs)
        self.warmup, self.refresh, self.codec = warmup, variance_refresh, Codec(compression)
        self.worker_error: dict[int, torch.Tensor] = {}  # bucket index -> full bucket, this rank's own
        self.server_error: dict[int, torch.Tensor] = {}  # bucket index -> this rank's shard of the bucket
        self.counted = [
            [(off - b.start, off - b.start + p.numel()) for name, p, off in b.params if name not in norm_excluded]
            for b in self.buckets
        ]
        self._sent = 0

    @property
    def compressed_from(self) -> int:
        return self.warmup

    @property
    def compressing(self) -> bool:
        """Whether the coming (or current) step is past the warm-up."""
        return self.optimizer.step_count >= self.warmup

    # ---- one step ----------------------------------------------------------------------------------
    def prepare_step(self, micro_batches: int) -> None:
        self.grads.defer = self.compressing  # gradients stay local after the warm-up
        super().prepare_step(micro_batches)
        self._sent = 0

    def comm_bytes(self) -> int:
        return super().comm_bytes() + self._sent

    def grad_norm(self) -> torch.Tensor:
        """During the warm-up AdamW's; after it the root-mean-square over dp of the local gradients' norms."""
        if not self.compressing:
            return super().grad_norm()
        total = torch.zeros((), dtype=torch.float32, device=self.param_buffer.device)
        for spans, grad in zip(self.counted, self.grads.bucket_grads):
            for a, b in spans:
                total += grad[a:b].float().pow(2).sum()
        return reduce_norm_sq(total, self.mesh, ("tp", "pp", "dp"), local_dp=True).sqrt()

    def step(self, lr: float, grad_scale: torch.Tensor | float = 1.0) -> None:
        if not self.compressing:
            super().step(lr, grad_scale)
            return
        self._compressed_step(lr, grad_scale)
        if self.zero == 2:
            self.grads.release_full()

    # ---- the compressed step -----------------------------------------------------------------------
    def _exchange(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        """Compress each dp shard of x (error feedback in and out), start the all-to-all of the messages."""
        dp = self.mesh.dp_size
        if self.codec.lossy:
            error = self.worker_error.get(index)
            if error is not None and error.shape == x.shape:
                x.add_(error)
        send, sent = encode_shards(self.codec, x, dp)
        if self.codec.lossy:  # x (a fresh fp32 buffer, already encoded) becomes the error in place
            self.worker_error[index] = x.sub_(sent)
        self._sent += send.numel()
        if dp == 1:
            return send, None
        received = torch.empty_like(send)
        return received, dist.all_to_all_single(received, send, group=self.mesh.dp_group, async_op=True)

    def _serve(self, index: int, received: torch.Tensor, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard: the mean of what the ranks sent, plus the server error, compressed again;
        returns (message, the increment it decodes to)."""
        error = self.server_error.get(index)
        if self.codec.lossy and (error is None or error.shape != (shard,)):
            error = self.server_error[index] = torch.zeros(shard, device=received.device)
        return serve_shard(self.codec, received, shard, error if self.codec.lossy else None)

    @torch.no_grad()
    def _compressed_step(self, lr: float, grad_scale: torch.Tensor | float) -> None:
        opt, dp = self.optimizer, self.mesh.dp_size
        beta1, beta2 = opt.betas
        opt.begin_step()  # counts the step; 1-bit Adam's own bias corrections follow
        t = opt.step_count
        refresh = bool(self.refresh) and (t - self.warmup) % self.refresh == 0
        bias1 = 1 - beta1**t
        bias2 = 1 - beta2 ** variance_updates(t, self.warmup, self.refresh)
        # Worker: every bucket's all-to-all is started before any is waited on.
        exchanges = [
            self._exchange(b.index, self.grads.bucket_grads[b.index].float() * ((1 - beta1) * grad_scale))
            for b in self.buckets
        ]
        served = []
        for b, (received, work) in zip(self.buckets, exchanges):
            if work is not None:
                work.wait()
            served.append(self._serve(b.index, received, b.numel // dp))
        if self.zero == 0:  # every rank needs every shard's increment: all-gather the compressed messages
            gathered = []
            for message, _ in served:
                rows = message.new_empty((dp, message.numel()))
                self._sent += message.numel()
                work = (
                    all_gather_single(rows.view(-1), message, group=self.mesh.dp_group, async_op=True)
                    if dp > 1
                    else None
                )
                gathered.append((rows if dp > 1 else message.unsqueeze(0), work))
            increments = []
            for b, (rows, work) in zip(self.buckets, gathered):
                if work is not None:
                    work.wait()
                increments.append(self.codec.decode(rows, b.numel // dp).reshape(-1))
        else:
            increments = [inc for _, inc in served]
        for piece, inc in zip(opt.pieces, increments):
            m, v = piece.exp_avg, piece.exp_avg_sq
            m.mul_(beta1).add_(inc)
            if refresh:
                g_hat = inc / (1 - beta1)
                v.mul_(beta2).addcmul_(g_hat, g_hat, value=1 - beta2)
            for lo, hi in piece.decay:
                piece.master[lo:hi].mul_(1 - lr * opt.weight_decay)
            denom = v.sqrt().div_(math.sqrt(bias2)).add_(1e-8)
            piece.master.addcdiv_(m, denom, value=-lr / bias1)
            opt.publish(piece)
        self._gather_bytes += opt.gather_parameters()

    # ---- state -------------------------------------------------------------------------------------
    def model_state_bytes(self) -> int:
        return super().model_state_bytes() + self._error_bytes()

    def memory_by_kind(self) -> dict[str, int]:
        kinds = super().memory_by_kind()
        kinds["optimizer_states"] += self._error_bytes()
        return kinds

    def _error_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for d in (self.worker_error, self.server_error) for e in d.values())

    def rank_state_dict(self) -> dict:
        """This rank's worker and server errors (m, v and the step counter are the optimizer's, by name; "step"
        is for a resume under gradient compression, whose counter it becomes)."""
        return {
            "onebit_worker": dict(self.worker_error),
            "onebit_server": dict(self.server_error),
            "step": self.optimizer.step_count,
            "layout": self.rank_layout,
        }

    def load_rank_state_dict(self, saved: dict | None) -> None:
        """The errors come back in the layout they were saved in; elsewhere they start from zero."""
        if not saved or saved.get("layout") != self.rank_layout or "onebit_worker" not in saved:
            self.worker_error, self.server_error = {}, {}
            return
        self.worker_error = {int(i): e.clone() for i, e in saved["onebit_worker"].items()}
        self.server_error = {int(i): e.clone() for i, e in saved["onebit_server"].items()}

    def compression_note(self, sent: int) -> str:
        return (
            f"onebit-adam ({self.codec.kind}): dense AdamW for {self.warmup} steps, then compressed momentum "
            f"increments; {sent:,} dp bytes this step"
        )
