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
  sac         op-level selective checkpointing (torchtitan's per-op SAC, memory/op_checkpoint.py): each block a
              checkpoint that keeps the attention kernel's outputs and every other matmul's output, and
              recomputes the rest (norms, rope, the activation, the other matmuls).
  selective   only the attention core (`Attention.core`: scores, softmax, dropout) is a checkpoint
              (Korthikanti et al. 2022): the memory-heavy, FLOP-light part. Its inputs q, k, v are kept (as
              they would be anyway); what SDPA saves inside (the softmax statistics of the flash kernel, or
              on the CPU math path with dropout the s x s probabilities, mask and fp32 copies) is not. A
              document mask is an input too: one tensor per chunk forward, kept once for all its blocks.

How: torch.utils.checkpoint, non-reentrant (`use_reentrant=False`). It keeps the checkpoint's inputs through
the saved-tensor hooks (so `memory.accounting` counts them and an offloader moves them) and recomputes on the
first unpack in backward. RNG-correct: `preserve_rng_state=True` stores the CPU and device RNG states at the
forward and restores them for the recomputation, so every dropout mask is replayed bit for bit. Inside
tensor-parallel blocks the collectives of the region run again in the recomputation (as in Megatron), so
`comm_bytes_tp` grows by the forward collectives of each recomputed block (minus the trailing ones the
checkpoint's early stop skips: recomputation ends once the last saved tensor is rebuilt).

Wrapping keeps names: instead of inserting a wrapper module, it replaces on the instance the Transformer's
`run_blocks` (full, every:K: the blocks run in checkpointed segments, each block still called as a module, so
module hooks such as FSDP2's unshard/reshard run inside the checkpoint and again in its recomputation) or
`Attention.core` (selective). Applying `none` (or another policy) restores the class methods.
"""

from __future__ import annotations

import contextlib
import functools
import traceback

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from large_model_training.choices import RecomputePolicy
from large_model_training.errors import ConfigError
from large_model_training.memory.accounting import active_counters
from large_model_training.memory.op_checkpoint import sac_segment

_EARLY_STOP = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


def _tensors(obj):
    """The tensors in an op's arguments or results (nested tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _RecomputeTally(TorchDispatchMode):
    """During a recomputation: which storages the recomputed ops create; at its end, report those still
    alive (what the checkpoint stored for the segment's backward) to the counters as a transient.

    The checkpoint stores recomputed tensors through its own saved-tensor hooks, which hide them from the
    counter's; an output aliasing one of its op's inputs (a view, an in-place op) is not new memory. A
    dispatch mode is the one place that sees every op of the recomputation, including those inside composite
    kernels (CPU RMSNorm's fp32 copy); it is the mechanism torch.utils.checkpoint's own selective-checkpoint
    contexts are built on, though its module is underscored. It is entered only while a counter is counting.
    """

    def __init__(self, counters):
        super().__init__()
        self.counters = counters
        self.made: dict[tuple, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = list(_tensors((args, kwargs)))
        if func.namespace == "c10d":
            # Communication buffers (tp collectives run again in recomputation): the process group may hold
            # them a while after the call (until its work object goes), but no layer keeps them for backward.
            for t in tensors:
                self.made.pop((t.device.type, t.device.index, t.untyped_storage().data_ptr()), None)
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in _tensors(out):
            if t.device.type != "meta":
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


def checkpointed(fn, *args, traced: bool = False):
    """fn(*args), keeping only args for backward and running fn again there (non-reentrant, RNG replayed).
    `traced`: inside a region torch.compile traces (--compile), which cannot trace the tally's dispatch mode:
    the recomputation's transient is then not counted."""
    if traced:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_contexts)


def _run_in_order(blocks: list[nn.Module], h: torch.Tensor, rope, mask=None) -> torch.Tensor:
    for block in blocks:
        h = block(h, rope, mask)
    return h


def checkpointed_segment(
    blocks: list[nn.Module], h: torch.Tensor, rope, mask=None, traced: bool = False
) -> torch.Tensor:
    """One checkpointed segment: `blocks` run in order, only their input kept."""
    return checkpointed(functools.partial(_run_in_order, blocks), h, rope, mask, traced=traced)


def _run_segments(chunk: nn.Module, size: int, h: torch.Tensor, rope, mask=None, segment=checkpointed_segment):
    """A chunk's blocks in checkpointed segments of `size`, from its first block (installed as `run_blocks`).
    The document mask (if any) is one tensor of the chunk's forward: every segment keeps the same storage.
    `segment`: how one segment runs (regional_compile.py gives a compiled one)."""
    blocks = list(chunk.layers.values())
    for start in range(0, len(blocks), size):
        h = segment(blocks[start : start + size], h, rope, mask)
    return h


def segment_size(model: nn.Module) -> int | None:
    """Blocks per checkpointed segment under the model's policy (full: 1, every:K: K), None if it has none."""
    policy = getattr(model, "recompute_policy", None)
    if policy is None or policy.kind not in ("full", "every"):
        return None
    return 1 if policy.kind == "full" else policy.every


def run_segments_with(chunk: nn.Module, size: int, segment) -> None:
    """Install `run_blocks` running the chunk's blocks in segments of `size`, each through `segment`."""
    chunk.run_blocks = functools.partial(_run_segments, chunk, size, segment=segment)


def _chunks(model: nn.Module) -> list[nn.Module]:
    """The Transformers of a model: a PipelineModel's chunks, or the model itself."""
    chunks = getattr(model, "chunks", None)
    return list(chunks.values()) if isinstance(chunks, dict) else [model]


def apply_recompute(model: nn.Module, policy: RecomputePolicy | str, traced: bool = False) -> nn.Module:
    """Apply a recompute policy in place; returns the model. A string ('none', 'full', 'every:K', 'selective',
    from the seed-named API) is parsed by the config's parser. `traced`: the checkpoints will be traced by
    torch.compile (--compile; `checkpointed`).

    Raises `ConfigError` (one line) for an unknown policy or K outside 1..n_layers.
    """
    policy = policy if isinstance(policy, RecomputePolicy) else RecomputePolicy.parse(policy)
    if policy.problem(model.cfg.n_layers):
        raise ConfigError(policy.problem(model.cfg.n_layers))
    kind, every = policy.kind, policy.every
    for chunk in _chunks(model):
        chunk.__dict__.pop("run_blocks", None)  # back to the class's methods: policy none
        for block in chunk.layers.values():
            block.attn.__dict__.pop("core", None)
        if kind == "selective":
            for block in chunk.layers.values():
                block.attn.core = functools.partial(
                    checkpointed, type(block.attn).core.__get__(block.attn), traced=traced
                )
        elif kind == "sac":  # every block one checkpoint under the per-op policy (memory/op_checkpoint.py)
            run_segments_with(chunk, 1, functools.partial(sac_segment, traced=traced, tally=_RecomputeTally))
        elif kind in ("full", "every"):
            run_segments_with(
                chunk, 1 if kind == "full" else every, functools.partial(checkpointed_segment, traced=traced)
            )
    model.recompute_policy = policy
    return model
