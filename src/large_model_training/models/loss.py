"""Next-token cross-entropy, one autograd Function for whole and vocab-sharded logits (tensor parallelism).

Written by hand rather than `F.cross_entropy(logits.float(), targets)` for memory at large vocabularies: the
fp32 copy of the logits is worked in place into the softmax that backward needs, and backward turns that same
buffer into the gradient. Beyond the fp32 softmax it keeps, the loss has only the logits themselves in flight
(2 bytes per logit in bf16), where F.cross_entropy's backward holds two more fp32 tensors of the logits' size
(8 bytes per logit: 15.7 GiB for llama-1b at 8 x 2,048 tokens, measured on an H200; planner/activations.py
`loss_transient_bytes`). Under tp each rank holds a slice of the vocabulary; 3 all-reduces of one number per
token combine the slices (Megatron-LM's vocab-parallel cross-entropy), never the full logits.

`CrossEntropy` is the model's loss object: called on logits it is this path; `fused(hidden, weight, targets)`
is the same loss with the head GEMM inside, chunk by chunk, never holding the logits (`models/fused_loss.py`,
what training runs unless `train.fused_loss` is off).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from large_model_training.mesh import AxisGroup
from large_model_training.models.fused_loss import fused_cross_entropy
from large_model_training.parallel.collectives import all_reduce_


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy in fp32 over logits (tokens, vocab / t), this rank's slice of the vocabulary."""

    @staticmethod
    def forward(ctx, logits, targets, tp, vocab_size):
        # Our own fp32 buffer (a copy: bf16 logits are cast, fp32 ones cloned), worked in place into the softmax.
        probs = logits.float() if logits.dtype != torch.float32 else logits.clone()
        per_rank = probs.shape[-1]
        start = tp.rank * per_rank
        valid = max(0, min(per_rank, vocab_size - start))
        if valid < per_rank:  # padding columns: never predicted
            probs[:, valid:] = float("-inf")
        local = targets.flatten() - start
        in_range = (local >= 0) & (local < per_rank)
        local = local.clamp(0, per_rank - 1)
        maxes = all_reduce_(probs.max(dim=-1).values, tp, op=dist.ReduceOp.MAX)
        target_logit = all_reduce_(probs.gather(1, local.unsqueeze(1)).squeeze(1) * in_range, tp) - maxes
        sum_exp = all_reduce_(probs.sub_(maxes.unsqueeze(-1)).exp_().sum(dim=-1), tp)
        ctx.save_for_backward(probs.div_(sum_exp.unsqueeze(-1)), local, in_range)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        probs, local, in_range = ctx.saved_tensors
        rows = torch.arange(probs.shape[0], device=probs.device)
        probs[rows, local] -= in_range.to(probs.dtype)
        return probs.mul_(grad / probs.shape[0]), None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over all tokens, computed in fp32 (bf16 log-softmax over a large vocabulary loses precision)."""
    return _CrossEntropy.apply(logits.flatten(0, -2), targets, AxisGroup.single(), logits.shape[-1])


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, tp: AxisGroup, vocab_size: int
) -> torch.Tensor:
    """`cross_entropy` over this tp rank's slice of the (padded) vocabulary; targets are global ids."""
    return _CrossEntropy.apply(logits.flatten(0, -2), targets, tp, vocab_size)


class CrossEntropy:
    """The model's loss over this rank's slice of the (padded) vocabulary (all of it without tp): called on
    logits like `cross_entropy`, or `fused` on the head's input and weight."""

    def __init__(self, vocab_size: int, tp: AxisGroup | None = None):
        self.vocab_size, self.tp = vocab_size, tp or AxisGroup.single()

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _CrossEntropy.apply(logits.flatten(0, -2), targets, self.tp, self.vocab_size)

    def fused(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
    ) -> torch.Tensor:
        """The same loss of `hidden @ weight.T`, computed with its gradients chunk by chunk."""
        return fused_cross_entropy(hidden, weight, targets, self.tp, self.vocab_size, chunk)


class AddedLoss(torch.autograd.Function):
    """`main` unchanged in forward (what is logged stays the language-model loss); in backward `extra` also gets
    `weight` times main's gradient, as if `main + weight * extra` had been returned (multi-token prediction)."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, extra: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad * ctx.weight, None
