"""Exact accounting of activation memory: the bytes autograd holds for backward, counted by saved-tensor hooks.

Every tensor an op saves for backward passes through `pack`; we count the bytes of its storage once however
many ops save it (q, k and v projections all save the same normed input: one buffer in memory), and not at
all if it is a parameter (weights are model state, not activations). The count drops when the last saved
reference to a storage is released, i.e. when backward has consumed it (or the graph is freed). So `current`
is what is held for backward at any moment and `peak` its maximum: the quantity the activation formulas
(Korthikanti et al. 2022) predict and the pipeline schedules bound.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


class _Saved:
    """The packed form of a saved tensor; when autograd drops it, the count for its storage drops."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


@dataclass
class ActivationCounter:
    """Bytes held for backward by tensors saved while `counting()` is active."""

    current: int = 0
    peak: int = 0
    _refs: dict[int, int] = field(default_factory=dict)
    _params: set[int] = field(default_factory=set)

    def exclude_parameters(self, model: nn.Module) -> "ActivationCounter":
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return self

    def reset_peak(self) -> None:
        self.peak = self.current

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or tensor.device.type == "meta" or storage.nbytes() == 0:
            return tensor
        if self._refs.get(key, 0) == 0:
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._refs[key] = self._refs.get(key, 0) + 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, key, storage.nbytes())
        return saved

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.current -= nbytes

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextmanager
    def counting(self):
        """Count what autograd saves inside this block (nests with recompute's own hooks)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
