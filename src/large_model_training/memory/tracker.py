"""Every allocation a rank makes, and its peak: storages counted from creation until Python frees them.

Why not `torch.distributed._tools.mem_tracker.MemTracker`: it attributes memory to modules and refuses a module
that runs twice before its backward, which every pipeline schedule and gradient accumulation do. This tracker
only needs the storages: a dispatch mode sees each operator's outputs, notes the storages it has not seen
(with their bytes), and a weak reference to each takes them off when they are freed. It also counts operators
dispatched: the launches an accelerator would pay. It works on real tensors and on fake ones (`lmt rehearse`),
where it is the only way to know a huge rank's memory.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


def _storage_holders(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold `t`'s bytes: a wrapper subclass (a DTensor: FSDP2's shards, its AdamW
    moments) has a storage of its own that reports the *global* size and holds nothing; its inner tensors (the
    local shard) hold the bytes."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])  # DTensor's also names its mesh
    return [leaf for i in inner if isinstance(i, torch.Tensor) for leaf in _storage_holders(i)]


class AllocationTracker(TorchDispatchMode):
    """Live bytes (`current`), their high-water mark (`peak`) and operators dispatched (`ops`) while active;
    with `record`, every allocation and free in order (`events`: (key, bytes), bytes 0 for a free), which
    memory/caching_allocator.py replays into what a device's allocator would reserve."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.ops = 0
        self.events: list[tuple[int, int]] | None = [] if record else None
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # live storage -> [bytes, key]
        self._cells: dict[weakref.ref, list[int]] = {}  # its weak reference -> the same [bytes, key]
        self._keys = 0
        self._resize = None

    def _note(self, storage: torch.UntypedStorage) -> None:
        if storage in self._sizes:
            return
        self._keys += 1
        cell = [storage.nbytes(), self._keys]  # a cell: resize_ may change its bytes before the storage is freed
        self._sizes[storage] = cell
        self._cells[weakref.ref(storage, self._freed)] = cell
        self._add(cell[0])
        self._record(cell[1], cell[0])

    def _freed(self, ref: weakref.ref) -> None:
        nbytes, key = self._cells.pop(ref)
        self._add(-nbytes)
        self._record(key, 0)

    def _record(self, key: int, nbytes: int) -> None:
        if self.events is not None:
            self.events.append((key, nbytes))

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for inner in _storage_holders(t):
                    self._note(inner.untyped_storage())
        return out

    def __enter__(self):
        # FSDP2 grows and shrinks its all-gather buffers with UntypedStorage.resize_, which no dispatch mode sees.
        self._resize = torch.UntypedStorage.resize_
        tracker, original = self, self._resize

        def resize_(storage, size):
            original(storage, size)
            cell = tracker._sizes.get(storage)
            if cell is not None:  # the allocator frees the old block and allocates one of the new size
                tracker._add(storage.nbytes() - cell[0])
                cell[0] = storage.nbytes()
                tracker._record(cell[1], 0)
                tracker._record(cell[1], cell[0])

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)
