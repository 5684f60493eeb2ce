"""The head GEMM and the cross-entropy fused, chunk by chunk over the tokens: the logits are never held whole.

Liger-Kernel's FusedLinearCrossEntropy (Hsu et al. 2024) written with PyTorch ops. The forward walks the tokens
in chunks; for each it computes the chunk's logits (in the compute dtype), their fp32 softmax statistics, the
loss, and at once the chunk's gradients: d hidden rows and its term of d weight. Backward only scales the two
stored gradients by the incoming one (a scalar). One chunk's logits are alive at a time.

Why gradients in the forward rather than recomputing the logits in backward (the other way to never hold them):
the recompute way costs one more head GEMM per token (2 n V h FLOPs, a third of the head's: ~7% of a llama-1b
step), and on an accelerator that is time. Gradients in the forward cost no FLOP beyond the plain path's; what
they hold from F to B is d hidden (n x h, hidden's dtype) and d weight (V/t x h, the weight's dtype), which a
schedule's last stage gives back at once under 1F1B (its F is followed by its B); gpipe holds them per
micro-batch in flight, and the planner counts them that way (`planner/activations.py`). Without gradients
(evaluation, `torch.no_grad`) only the statistics are computed and nothing is held.

Chunk size: `chunk_tokens(n, vocab, hidden)` cuts the n tokens into ceil(vocab / hidden) chunks (Liger's rule),
so a chunk's logits have about n x h elements: the loss never holds more logits than its input has elements.

Numerics, equal to `models/loss.py`'s path on the same inputs: logits in the compute dtype (the autocast dtype
when autocast is on, else hidden's), softmax in fp32, the same max / sum-exp / target-logit arithmetic; d weight
is summed over chunks in fp32 (each chunk's term a GEMM in the compute dtype) and rounded once to the weight's
dtype, where the plain path rounds one whole GEMM: in fp32 the two agree to ~1e-7 relative, in bf16 to its
rounding. Under tp each rank has a slice of the
(padded) vocabulary; padding columns are masked to -inf as in `models/loss.py`. Per chunk 2 all-reduces over tp
(the max; then sum-exp and target logit stacked in one) instead of the plain path's 3: the same values, summed
the same way, with a third fewer launches, which matter once per chunk. d hidden is a partial sum over the
vocabulary slices: the head's region entry (f, or SP's gather) sums it over tp in its backward, as for logits.

Nothing else changes: the loss is the mean over the tokens it is given (under cp each rank's s / cp, as before;
document masking only shapes attention; the MoE aux loss reaches backward by its own path, models/moe.py); it runs
inside the last stage's forward (`Transformer.head`), after the blocks, so recomputation policies and pipeline
schedules see a stage whose output is the loss, as they did.

The weight gradient reaches the parameter through autograd (returned from backward), so the dp engine's
post-accumulate-grad hooks fire and a tied embedding accumulates both uses. Under zero-bubble schedules it comes
in B, not held for W: it is already computed, so holding it would only hold memory longer.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from large_model_training.mesh import AxisGroup
from large_model_training.models.linear import compute_dtype
from large_model_training.parallel.collectives import all_reduce_


def chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: `tokens` cut into ceil(vocab / hidden) chunks, so a chunk's logits (chunk x vocab) are
    about tokens x hidden elements, the size of the loss's input (vocab: this rank's slice)."""
    return max(1, math.ceil(tokens / max(1, math.ceil(vocab / hidden))))


def _chunk(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    tp: AxisGroup,
    start: int,
    valid: int,
    scale: float,
    with_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: per-token losses (fp32) and, `with_grads`, the gradient of the logits (compute dtype), i.e.
    (softmax - onehot) * scale. A function of its own so that each chunk's buffers are freed when it returns, and
    a chunk's logits are given up as soon as their fp32 copy exists: at most the fp32 logits and one copy in the
    compute dtype are alive."""
    per_rank = w.shape[0]
    probs = x @ w.t()
    if probs.dtype != torch.float32:
        probs = probs.float()  # the compute-dtype logits go with this reassignment
    if valid < per_rank:  # padding columns: never predicted
        probs[:, valid:] = float("-inf")
    local = targets - start
    in_range = (local >= 0) & (local < per_rank)
    local = local.clamp(0, per_rank - 1)
    maxes = all_reduce_(probs.max(dim=-1).values, tp, op=dist.ReduceOp.MAX)
    picked = torch.where(in_range, probs.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
    probs.sub_(maxes.unsqueeze(-1)).exp_()
    sums = all_reduce_(torch.stack((probs.sum(dim=-1), picked)), tp)  # sum-exp and target logit: one all-reduce
    losses = sums[0].log() - (sums[1] - maxes)
    if not with_grads:
        return losses, None
    probs.div_(sums[0].unsqueeze(-1))
    probs[torch.arange(probs.shape[0], device=probs.device), local] -= in_range.to(probs.dtype)
    return losses, probs.mul_(scale).to(x.dtype)


class _FusedHeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of hidden (n, h) @ weight (V/t, h)^T, this rank's vocabulary slice, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, tp, vocab_size, chunk, with_grads):
        n, per_rank = hidden.shape[0], weight.shape[0]
        start = tp.rank * per_rank
        valid = max(0, min(per_rank, vocab_size - start))
        dtype = compute_dtype(hidden)
        w = weight.to(dtype)
        want_h = with_grads and ctx.needs_input_grad[0]
        want_w = with_grads and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes chosen above, explicitly
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                x = hidden[lo:hi].to(dtype)
                losses[lo:hi], grad_logits = _chunk(x, w, targets[lo:hi], tp, start, valid, 1.0 / n, want_h or want_w)
                if want_h:
                    grad_h[lo:hi] = grad_logits @ w
                if want_w and dtype == torch.float32:
                    grad_w.addmm_(grad_logits.t(), x)
                elif want_w:  # the chunk's term in the compute dtype, summed in fp32
                    grad_w.add_(grad_logits.t() @ x)
                del grad_logits
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        return losses.mean()

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        # In place: the stored gradients are ours alone (one backward, as for the plain loss's softmax buffer).
        return (
            grad_h.mul_(grad) if grad_h is not None else None,
            grad_w.mul_(grad) if grad_w is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def fused_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tp: AxisGroup | None = None,
    vocab_size: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy of the logits `hidden @ weight.T` without holding them: hidden (..., h),
    weight this rank's (padded) vocabulary slice (V/t, h), targets (...) global ids. `vocab_size`: the real
    vocabulary (columns past it are padding; default: all of weight's rows x tp); `chunk`: tokens per chunk
    (default `chunk_tokens`)."""
    tp = tp or AxisGroup.single()
    flat = hidden.flatten(0, -2)
    vocab_size = vocab_size if vocab_size is not None else weight.shape[0] * tp.size
    chunk = chunk or chunk_tokens(flat.shape[0], weight.shape[0], flat.shape[1])
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedHeadCrossEntropy.apply(flat, weight, targets.flatten(), tp, vocab_size, chunk, with_grads)
