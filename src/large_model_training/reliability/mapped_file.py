"""A holder's file, mapped into the process: where an in-memory copy is written (local_checkpoint.py).

A copy is written once, where it is kept: the training thread's snapshot goes straight into the mapped file of
its own copy, and the partner's copy is received straight into one (copy_ring.py). Each copy used to be written
into a host buffer and then into a file: one more pass over the state per copy, a third of the copies' CPU on
this machine. A file goes round: written in the holder's free folder, renamed into its step's folder once whole
(a copy whose name is visible is whole), renamed back to be written again when it falls out of the copies kept,
so its tmpfs pages and its mapping are made once.
"""

from __future__ import annotations

import mmap
import os

import torch


class MappedFile:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.size = os.fstat(self.fd).st_size
        self._map: mmap.mmap | None = None

    def view(self, nbytes: int) -> memoryview:
        """The file's first `nbytes`, writable (the file grows to hold them; a bigger mapping is made if needed)."""
        if nbytes == 0:
            return memoryview(bytearray(0))
        if self.size < nbytes:
            os.ftruncate(self.fd, nbytes)
            self.size = nbytes
        if self._map is None or len(self._map) < nbytes:
            self._map = mmap.mmap(self.fd, nbytes)  # (the old one closes when no view holds it)
        return memoryview(self._map)[:nbytes]

    def tensor(self, nbytes: int) -> torch.Tensor:
        view = self.view(nbytes)
        return torch.frombuffer(view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def finish(self, written: int, tail: list[bytes]) -> None:
        """`tail` after the first `written` bytes, and the file cut to end there (it may have held a longer copy)."""
        end = written
        for part in tail:
            end += os.pwrite(self.fd, part, end)
        os.ftruncate(self.fd, end)
        self.size = end

    def move(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(self.path, path)
        self.path = path

    def close(self) -> None:
        self._map = None
        os.close(self.fd)
