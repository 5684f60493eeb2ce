"""Activation offload (`--offload-activations`): tensors saved for backward wait in host memory.

In forward every tensor an op saves for backward is copied into pinned host memory and the device copy is let
go; in backward it is copied back when autograd unpacks it. Both copies are `non_blocking` on the current
stream: the host does not wait for them, and stream order makes them safe without events (the device-to-host
copy is queued before any later kernel can reuse the freed device memory, and the host-to-device copy in
backward after it). They do not overlap with compute kernels of the same stream; a side stream with events
(as Megatron's CPU offload does) would, and is left for later. This is PyTorch's `save_on_cpu(pin_memory=True)`
with two differences: one host copy per saved tensor however many ops save it (q, k and v all save the normed
input), and it runs through `ActivationCounter`, because saved-tensor hooks do not stack (only the innermost
pair runs), so counting and offloading must be one pair of hooks.

On the CPU there is nothing to gain: saved activations already live in host memory. There offload is a
no-op and `offload_note` gives the one line the trainer prints once.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from large_model_training.memory.accounting import ActivationCounter


class _OnHost:
    """A saved tensor's host copy (`kept`), and its device copy once backward has asked for it."""

    __slots__ = ("kept", "device", "on_device", "__weakref__")

    def __init__(self, kept: torch.Tensor, device: torch.device):
        self.kept, self.device, self.on_device = kept, device, None


class HostOffload:
    """pack/unpack of saved tensors through host memory (see the module docstring).

    `force=True` offloads CPU tensors too (a copy to another host buffer): for tests of the mechanism on
    machines without an accelerator.
    """

    def __init__(self, device: torch.device, force: bool = False):
        self.device, self.force = device, force
        self.pin = torch.accelerator.is_available() and device.type != "cpu"
        self._live: dict[tuple, tuple[StorageWeakRef, weakref.ref]] = {}

    def pack(self, tensor: torch.Tensor):
        if (tensor.device.type == "cpu" and not self.force) or tensor.is_sparse:
            return tensor
        # The same view of the same live storage saved again (q, k, v of one input): share its host copy.
        key = (
            tensor.device.type,
            tensor.device.index,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        known = self._live.get(key)
        if known is not None and not known[0].expired() and (record := known[1]()) is not None:
            return record
        host = torch.empty_like(tensor, device="cpu", pin_memory=self.pin)
        host.copy_(tensor, non_blocking=self.pin)
        record = _OnHost(host, tensor.device)
        self._live[key] = (
            StorageWeakRef(tensor.untyped_storage()),
            weakref.ref(record, lambda _: self._live.pop(key, None)),
        )
        return record

    def unpack(self, record) -> torch.Tensor:
        if not isinstance(record, _OnHost):
            return record
        if record.on_device is None:  # kept until every op that saved it is done with it, like the original
            record.on_device = record.kept.to(record.device, non_blocking=self.pin, copy=self.force)
        return record.on_device

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Offload without counting."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def offload_note(device: torch.device, offload: bool) -> str | None:
    """The line to print once (rank 0) when offload was asked for but has nothing to do, else None."""
    if offload and device.type == "cpu":
        return (
            "activation offload (--offload-activations) has no effect on the CPU: saved activations "
            "already live in host memory"
        )
    return None


def activation_context(device: torch.device, offload: bool, counter: ActivationCounter | None = None):
    """The context one forward/backward runs in: counting into `counter` (if given) and, on an accelerator
    with `offload`, saved activations in host memory. A no-op context when neither applies."""
    offloader = HostOffload(device) if offload and device.type != "cpu" else None
    if counter is not None:
        return counter.counting(offload=offloader)
    return offloader.hooks() if offloader is not None else contextlib.nullcontext()
