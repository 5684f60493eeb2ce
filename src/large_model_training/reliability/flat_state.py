"""A rank's state as one host byte buffer and a small header: the in-memory copies' format (--save-local-every).

Why not torch.save: the copy is taken after every N-th step, N as small as 1, and torch.save's pickling and zip
writing hold the interpreter lock for milliseconds in the side thread, which the training thread then waits for.
Here the training thread copies every tensor once into a host buffer (the mapped file the copy is kept in,
mapped_file.py), and the side thread pickles only the nesting with the tensors left out (names, dtypes, shapes:
microseconds), appends it and sends the bytes as they are. Reading refuses anything in the header but plain
containers and scalars, as torch.load(weights_only=True) would.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

TENSOR = "__lmt_tensor__"  # (TENSOR, dtype name, shape) stands for the next tensor in the buffer
ALIGN = 16  # every tensor starts at a multiple of this in the buffer (a dtype view needs aligned offsets)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return (TENSOR, str(value.dtype).removeprefix("torch."), list(value.shape))
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, tensors) for v in value)
    return value


class Snapshot:
    """One rank's state, snapshotted into a host buffer: `take` in the training thread (copies, nothing else),
    `header` and `payload` read by the side thread until the next `take`. `take` copies into the buffer that
    `buffer_for(nbytes)` returns (the in-memory copies hand it a mapped file, so the snapshot is the copy)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.skeleton: Any = None
        self.used = 0

    def take(self, state: dict[str, Any], buffer_for: Callable[[int], torch.Tensor]) -> None:
        tensors: list[torch.Tensor] = []
        self.skeleton = _strip(state, tensors)
        sizes = [t.numel() * t.element_size() for t in tensors]
        self.used = sum(_padded(n) for n in sizes)
        self.buffer = buffer_for(self.used)
        offset = 0
        for t, n in zip(tensors, sizes):
            if n:
                flat = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
                self.buffer[offset : offset + n].copy_(flat)  # from any device: one copy to the host
            offset += _padded(n)

    def header(self) -> bytes:
        """The nesting with the tensors left out, pickled (the side thread's work, not the training thread's)."""
        return pickle.dumps(self.skeleton, protocol=pickle.HIGHEST_PROTOCOL)

    def payload(self) -> torch.Tensor:
        return self.buffer[: self.used]


def tail(header: bytes) -> list[bytes]:
    """What follows the payload in a copy: [payload][header][8-byte header length]. The payload comes first so
    that a snapshot can be taken straight into a file before its header is known."""
    return [header, len(header).to_bytes(8, "little")]


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} in an in-memory copy's header (only plain values belong)")


def parse(data: bytes | bytearray) -> dict[str, Any]:
    """A copy's bytes back into the state."""
    import io

    size = int.from_bytes(data[-8:], "little")
    skeleton = _PlainUnpickler(io.BytesIO(data[len(data) - 8 - size : len(data) - 8])).load()
    raw = bytearray(data[: len(data) - 8 - size])
    buffer = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    offset = 0

    def fill(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, tuple) and len(value) == 3 and value[0] == TENSOR:
            dtype, shape = getattr(torch, value[1]), value[2]
            n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            flat = buffer[offset : offset + n].view(dtype) if n else torch.empty(0, dtype=dtype)
            offset += _padded(n)
            return flat.reshape(shape).clone()  # owned memory: a consumer may keep it, or resize it
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    return fill(skeleton)
