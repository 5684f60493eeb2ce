"""`--recompute sac`: op-level selective activation checkpointing, torchtitan's per-op SAC.

Each block is one checkpoint (as `full`), run under torch.utils.checkpoint's selective policy
(`create_selective_checkpoint_contexts`): the outputs of the ops the policy names are kept from the forward and
handed back when backward recomputes the block, every other op runs again. The policy is torchtitan's: keep the
attention kernel's outputs (the expensive, memory-light part: its output and log-sum-exp) and every other matmul's
output in the block's forward order (the 1st and 3rd of our four: qkv and gate/up; the output projection and the
down projection run again), recompute norms, rope, the activation and the residual adds. The mm count restarts for
each checkpoint call and separately for the recomputation, so forward and recomputation agree on which ones are
kept (torchtitan's `_get_custom_policy`). Values are the same ops on the same inputs: the loss curve is `none`'s.

Counting: the policy's cache lives inside the checkpoint, not in autograd's saved tensors, so the activation
counters (memory/accounting.py) would not see it. A dispatch mode on top of the caching one hands each kept output
to every counting counter (`ActivationCounter.keep`); the tokens live as long as the cache (the checkpoint's
recomputation context holds both), so the count drops when the block's backward is done. The recomputation is
tallied as `full`'s is (memory/recompute.py: what it rebuilds, beyond what the cache returns, is a transient).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from large_model_training.memory.accounting import active_counters

_ops = torch.ops.aten
MATMULS = {_ops.mm.default, _ops.addmm.default}
ATTENTION = {
    getattr(_ops, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_ops, name)
}


class KeepPolicy:
    """torchtitan's per-op policy: keep attention kernels' outputs and the odd-numbered matmuls' of each pass."""

    def __init__(self):
        self.count = {False: 0, True: 0}  # matmuls seen in the forward, in the recomputation
        self.last_kept = False

    def __call__(self, ctx, func, *args, **kwargs):
        keep = func in ATTENTION
        if func in MATMULS:
            self.count[ctx.is_recompute] += 1
            keep = self.count[ctx.is_recompute] % 2 == 1
        self.last_kept = keep
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class _CountKept(TorchDispatchMode):
    """Above the caching mode in the forward: each output the policy kept is handed to the counters."""

    def __init__(self, policy: KeepPolicy, counters, tokens: list):
        super().__init__()
        self.policy, self.counters, self.tokens = policy, counters, tokens

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.policy.last_kept:
            self.policy.last_kept = False
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.tokens.extend(counter.keep(t) for counter in self.counters)
        return out


class _Both(contextlib.ExitStack):
    """Two dispatch modes entered in order (the second on top); keeps `held` alive as long as itself."""

    def __init__(self, first, second, held=None):
        super().__init__()
        self.first, self.second, self.held = first, second, held

    def __enter__(self):
        super().__enter__()
        self.enter_context(self.first)
        self.enter_context(self.second)
        return self


def _contexts(traced: bool, tally):
    """checkpoint's context_fn: the selective policy's caching and cached modes, with counting when counted;
    `tally(counters)`: the dispatch mode that reports what the recomputation rebuilds (memory/recompute.py)."""
    policy = KeepPolicy()
    forward, recompute = create_selective_checkpoint_contexts(policy)
    counters = [] if traced else active_counters()
    if not counters:
        return forward, recompute
    tokens: list = []
    # forward: the cache below, the counting above it; recomputation: the tally below the cache, so it sees
    # only what is computed again (what the cache returns is counted already)
    return _Both(forward, _CountKept(policy, counters, tokens)), _Both(tally(counters), recompute, tokens)


def _run_block(block, h, rope, mask):
    return block(h, rope, mask)


def sac_segment(blocks, h, rope, mask=None, traced: bool = False, tally=None):
    """Each block of `blocks` one checkpoint under the per-op policy (installed as full's segments of one)."""
    for block in blocks:
        h = checkpoint(
            functools.partial(_run_block, block),
            h,
            rope,
            mask,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=functools.partial(_contexts, traced, tally),
        )
    return h
