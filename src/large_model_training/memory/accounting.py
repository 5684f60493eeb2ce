"""Exact accounting of activation memory: the bytes autograd holds for backward, counted by saved-tensor hooks.

Every tensor an op saves for backward passes through `pack`; we count the bytes of its storage once however
many ops save it (q, k and v projections all save the same normed input: one buffer in memory), and not at
all if it is a parameter (weights are model state, not activations). The count drops when the last saved
reference to a storage is released, i.e. when backward has consumed it (or the graph is freed). So `current`
is what is held for backward at any moment and `peak` its maximum: the quantity the activation formulas
(Korthikanti et al. 2022) predict and the pipeline schedules bound.

Recomputation (`memory/recompute.py`) keeps only a checkpoint's inputs, which torch.utils.checkpoint saves
through the saved-tensor hooks, so they are counted like any other saved tensor. What it recomputes in
backward is stored by the checkpoint's own hooks, which hide it from ours; the recompute pass therefore
reports the bytes it holds at its end to every counter that was counting when its forward ran
(`note_transient`), and `peak` includes that transient: a recomputed segment is alive in full while its
backward starts, on top of everything still held.

Offload (`memory/offload.py`) composes with counting: `counting(offload=...)` passes each saved tensor through
the offloader, and the counter counts what is kept (the host copy), so `current`/`peak` stay "bytes held for
backward" wherever they live, and `offloaded_peak` tells how much of it was on the host.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_local = threading.local()


def active_counters() -> list[ActivationCounter]:
    """Counters whose `counting()` block is open in this thread, innermost last.

    A stack beside torch's own saved-tensor hook stack (which is thread-local too): read by recompute at
    forward time, so the recompute pass, which may run on an autograd worker thread, knows whom to tell.
    """
    return list(getattr(_local, "stack", ()))


class _Saved:
    """The packed form of a saved tensor (and the offloader that packed it, if any); when autograd drops it,
    the count for its storage drops."""

    __slots__ = ("payload", "offload", "__weakref__")

    def __init__(self, payload, offload):
        self.payload, self.offload = payload, offload


def _storage_key(t: torch.Tensor) -> tuple[str, int | None, int]:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _storage_pointers(t: torch.Tensor) -> list[int]:
    """The storages behind a tensor; a wrapper subclass (ZeRO-3's float8-gathering weight) has none of its own,
    only its inner tensors'."""
    if is_traceable_wrapper_subclass(t):
        return [ptr for name in t.__tensor_flatten__()[0] for ptr in _storage_pointers(getattr(t, name))]
    return [t.untyped_storage().data_ptr()]


@dataclass
class ActivationCounter:
    """Bytes held for backward by tensors saved while `counting()` is active."""

    current: int = 0
    peak: int = 0
    offloaded: int = 0
    """Of `current`, the bytes kept in host memory by an offloader."""
    offloaded_peak: int = 0
    _refs: dict[tuple, int] = field(default_factory=dict)
    _params: set[int] = field(default_factory=set)
    _offload: Any = None  # an offloader (memory/offload.py) with pack/unpack, or None

    def exclude_parameters(self, model: nn.Module) -> ActivationCounter:
        """Do not count parameters' storage (for sharded DTensor parameters, their local shards)."""
        locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        self._params = {ptr for t in locals_ for ptr in _storage_pointers(t)}
        return self

    def reset_peak(self) -> None:
        self.peak = self.current
        self.offloaded_peak = self.offloaded

    def note_transient(self, nbytes: int) -> None:
        """Bytes alive for backward that the hooks did not see (a recomputed segment): they count for the peak."""
        self.peak = max(self.peak, self.current + nbytes)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if (
            tensor.device.type == "meta"
            or storage.data_ptr() in self._params
            or storage.nbytes() == 0
            or isinstance(tensor if tensor._base is None else tensor._base, nn.Parameter)
        ):
            # A parameter (or its transpose, which F.linear's backward keeps) is model state. The storage test
            # alone misses ZeRO-3's gathered weights: FSDP2's unsharded parameters, not the shards excluded.
            return tensor
        payload = self._offload.pack(tensor) if self._offload is not None else tensor
        kept = payload.kept if hasattr(payload, "kept") else payload  # the tensor whose storage stays alive
        key, nbytes = _storage_key(kept), kept.untyped_storage().nbytes()
        on_host = kept is not tensor
        if self._refs.get(key, 0) == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            if on_host:
                self.offloaded += nbytes
                self.offloaded_peak = max(self.offloaded_peak, self.offloaded)
        self._refs[key] = self._refs.get(key, 0) + 1
        saved = _Saved(payload, self._offload if on_host else None)
        weakref.finalize(saved, self._release, key, nbytes, on_host)
        return saved

    def keep(self, tensor: torch.Tensor):
        """Count a tensor held for backward outside autograd's saved tensors (a weight-gradient GEMM's input and
        output gradient, held from a zero-bubble B to its W) until the returned token is dropped."""
        return self._pack(tensor)

    def _release(self, key: tuple, nbytes: int, on_host: bool) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.current -= nbytes
            if on_host:
                self.offloaded -= nbytes

    @staticmethod
    def _unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        return saved.offload.unpack(saved.payload) if saved.offload is not None else saved.payload

    @contextmanager
    def counting(self, offload=None):
        """Count what autograd saves inside this block (nests with recompute's own hooks).

        `offload`: an object with `pack(tensor) -> tensor | record with .kept` and `unpack(record) -> tensor`
        (`memory.offload.HostOffload`) through which saved tensors pass; saved-tensor hooks do not stack (only
        the innermost pair runs), so counting and offloading must be one pair.
        """
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        self._offload = offload
        stack.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            stack.remove(self)
            self._offload = None


@dataclass(frozen=True)
class ActivationMeasurement:
    """What one forward + backward of a module held for backward."""

    held: int
    """Bytes held for backward when the forward returned (the steady state the per-layer formula predicts)."""
    peak: int
    """Most bytes held at any moment of forward and backward, recompute transients included."""


def measure_activations(module: nn.Module, *inputs, grad: torch.Tensor | None = None) -> ActivationMeasurement:
    """Run module(*inputs) and backward under a fresh counter (parameters excluded); inputs are not counted
    unless an op saves them. The output's gradient is `grad` or ones."""
    counter = ActivationCounter().exclude_parameters(module)
    with counter.counting():
        out = module(*inputs)
        held = counter.current
        out.backward(torch.ones_like(out) if grad is None else grad)
    del out
    return ActivationMeasurement(held, counter.peak)


def measure_layer_activation_bytes(stage: nn.Module, hidden: torch.Tensor) -> tuple[float, ActivationMeasurement]:
    """(bytes held per block, the whole measurement) of a stage that has only blocks (no embedding, no head).

    `stage` is a `Transformer` built with `StageSpec(first, last, False, False)`, any recompute policy
    applied; `hidden` its (batch, seq / seq_shards, hidden) input. The rope tables (per position, shared by
    all blocks) are in the figure, as they are in a real stage. The peak is the stage's, not per block: with
    recomputation it is the held bytes plus one recomputed segment (`planner.memory.stage_activation_bytes`).
    """
    m = measure_activations(stage, hidden.detach().requires_grad_())
    return m.held / len(stage.layers), m
