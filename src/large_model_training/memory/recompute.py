"""Activation recomputation: trade backward compute for activation memory (`--recompute POLICY`).

`apply_recompute(model, policy)` changes how the blocks of a `Transformer` (or of every chunk of a
`PipelineModel`) run, in place, without changing a parameter name (`layers.5.attn.wq.weight` stays), so
checkpoints, initialisation and the optimizer do not notice. Policies:

  none        autograd keeps everything each op saves.
  full        every block is one checkpoint: only its input is kept, and in backward the block runs again
              from it (Chen et al. 2016; Megatron's `--recompute-granularity full --recompute-method uniform
              --recompute-num-layers 1`).
  every:K     K consecutive blocks are one checkpoint: the input of every K-th block is kept and the segment
              runs again as a whole in backward (the seed's "checkpoint every 10 layers": K = 10). Segments
              start at each pipeline chunk's first block and never span chunks (a chunk's input is already a
              kept tensor, the received activation), as Megatron's uniform method does: a chunk of L blocks
              keeps ceil(L / K) inputs and its last segment may be shorter. With pp = 1 the kept inputs are
              those of blocks 0, K, 2K, ...
  selective   only the attention core (`Attention.core`: scores, softmax, dropout) is a checkpoint
              (Korthikanti et al. 2022): the memory-heavy, FLOP-light part. Its inputs q, k, v are kept (as
              they would be anyway); what SDPA saves inside (the softmax statistics of the flash kernel, or
              on the CPU math path with dropout the s x s probabilities, mask and fp32 copies) is not.

How: torch.utils.checkpoint, non-reentrant (`use_reentrant=False`). It keeps the checkpoint's inputs through
the saved-tensor hooks (so `memory.accounting` counts them and an offloader moves them) and recomputes on the
first unpack in backward. RNG-correct: `preserve_rng_state=True` stores the CPU and device RNG states at the
forward and restores them for the recomputation, so every dropout mask is replayed bit for bit. Inside
tensor-parallel blocks the collectives of the region run again in the recomputation (as in Megatron), so
`comm_bytes_tp` grows by the forward collectives of each recomputed block (minus the trailing ones the
checkpoint's early stop skips: recomputation ends once the last saved tensor is rebuilt).

Wrapping keeps names by replacing `forward` (or `core`) on the instance, never by inserting a wrapper
module: for `every:K` the first block of a segment runs the whole segment inside one checkpoint, calling
the blocks' own forwards, and the other blocks of the segment become pass-throughs (their work already ran
inside the first block's checkpoint). Applying `none` (or another policy) restores the class methods.
"""

from __future__ import annotations

import contextlib
import functools
import traceback

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from large_model_training.config import parse_recompute
from large_model_training.memory.accounting import active_counters

_EARLY_STOP = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


class _RecomputeTally(TorchDispatchMode):
    """During a recomputation: which storages the recomputed ops create; at its end, report those still
    alive (what the checkpoint stored for the segment's backward) to the counters as a transient.

    The checkpoint stores recomputed tensors through its own saved-tensor hooks, which hide them from the
    counter's; an output aliasing one of its op's inputs (a view, an in-place op) is not new memory.
    """

    def __init__(self, counters):
        super().__init__()
        self.counters = counters
        self.made: dict[tuple, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d":
            # Communication buffers (tp collectives run again in recomputation): the process group may hold
            # them a while after the call (until its work object goes), but no layer keeps them for backward.
            for t in tensors:
                self.made.pop((t.device.type, t.device.index, t.untyped_storage().data_ptr()), None)
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = (t.device.type, t.device.index, storage.data_ptr())
                if storage.data_ptr() not in inputs and storage.nbytes():
                    self.made[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)
        if isinstance(exc, _EARLY_STOP):
            # The checkpoint stops recomputing by raising once the last saved tensor is rebuilt; until it is
            # caught, the finished frames of the traceback still hold their locals (e.g. the input of that
            # last op), which are not kept for backward: drop them before looking at what is alive.
            traceback.clear_frames(tb)
        alive = sum(nbytes for ref, nbytes in self.made.values() if not ref.expired())
        for counter in self.counters:
            counter.note_transient(alive)
        self.made.clear()
        return result


def _contexts():
    """checkpoint's context_fn, called at forward time: tally the recomputation if anyone is counting."""
    counters = active_counters()
    return contextlib.nullcontext(), (_RecomputeTally(counters) if counters else contextlib.nullcontext())


def checkpointed(fn, *args):
    """fn(*args), keeping only args for backward and running fn again there (non-reentrant, RNG replayed)."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_contexts)


class _Segment:
    """Consecutive blocks of one chunk, run as one checkpoint from the first block's input."""

    def __init__(self, blocks: list[nn.Module]):
        self.forwards = [functools.partial(type(b).forward, b) for b in blocks]  # the class's, not our override

    def run(self, h: torch.Tensor, rope):
        for forward in self.forwards:
            h = forward(h, rope)
        return h

    def __call__(self, h: torch.Tensor, rope):
        return checkpointed(self.run, h, rope)


def _pass_through(h: torch.Tensor, rope):
    """A block whose work ran inside its segment's first block."""
    return h


def _chunks(model: nn.Module) -> list[nn.Module]:
    """The Transformers of a model: a PipelineModel's chunks, or the model itself."""
    chunks = getattr(model, "chunks", None)
    return list(chunks.values()) if isinstance(chunks, dict) else [model]


def _reset(block: nn.Module) -> None:
    block.__dict__.pop("forward", None)
    block.attn.__dict__.pop("core", None)


def apply_recompute(model: nn.Module, policy: str) -> nn.Module:
    """Apply a recompute policy ('none', 'full', 'every:K', 'selective') in place; returns the model.

    Raises `ConfigError` (one line) for an unknown policy or K outside 1..n_layers.
    """
    kind, every = parse_recompute(policy, model.cfg.n_layers)
    for chunk in _chunks(model):
        blocks = list(chunk.layers.values())
        for block in blocks:
            _reset(block)
        if kind == "selective":
            for block in blocks:
                block.attn.core = functools.partial(checkpointed, type(block.attn).core.__get__(block.attn))
        elif kind in ("full", "every"):
            size = 1 if kind == "full" else every
            for start in range(0, len(blocks), size):
                segment = blocks[start:start + size]
                segment[0].forward = _Segment(segment)
                for follower in segment[1:]:
                    follower.forward = _pass_through
    model.recompute_policy = policy
    return model


class GradientCheckpointing:
    """The seed's `GradientCheckpointing`, made real: a recompute policy applied to a model.

        gc = lmt.GradientCheckpointing(policy="every:10")   # the seed's default: every 10 layers
        gc.apply(model)                                      # in place; parameter names unchanged
        out = gc.forward_with_checkpoint(model, tokens)      # = model(tokens) with the policy applied
        gc.backward_with_checkpoint(loss)                    # = loss.backward(): recomputes as it goes

    The seed copied the output of layers 0, 10, 20, ... in forward (`checkpoint`) and handed them back to
    its layers in backward (`restore`). Here every:10 keeps (by reference, no copy) the input of blocks 0,
    10, 20, ... and autograd re-runs the 10 blocks after each kept input when backward reaches them, with
    the same dropout masks. `policy` also accepts 'full', 'selective' and 'none'.
    """

    def __init__(self, policy: str = "every:10"):
        self.policy = policy

    def apply(self, model: nn.Module) -> nn.Module:
        return apply_recompute(model, self.policy)

    def forward_with_checkpoint(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        if getattr(model, "recompute_policy", None) != self.policy:
            self.apply(model)
        return model(inputs)

    @staticmethod
    def backward_with_checkpoint(output: torch.Tensor, grad_output: torch.Tensor | None = None) -> None:
        torch.autograd.backward(output, grad_output)
