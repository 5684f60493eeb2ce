"""Wire messages and the counted collectives every compressor sends them through.

A compressed contribution is several tensors of different dtypes (int32 indices + fp32 values; fp32 scales +
uint8 payload). `pack` lays them out as one uint8 message so one all-gather carries them: one collective's
latency instead of two, and the bytes on the wire are literally the format documented here. Segments are laid
out in order of decreasing element size, so every segment starts at a multiple of its own element size and
`unpack` can reinterpret the bytes in place (`Tensor.view(dtype)` needs that alignment).

`all_gather`, `all_to_all` and `all_reduce` add numel x element_size of their input to `state.bytes_sent` (per
rank, count exchanges included) before issuing the collective: `wire_bytes` in hook.py states the same count as a
formula. All are asynchronous and gloo-compatible (gloo on this build supports all_gather_single/
all_gather_into_tensor, all_reduce, reduce_scatter and all_to_all_single for int8/uint8/int32/int64/fp32/bf16;
all_to_all_single serves the two-stage average, compression/two_stage.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from large_model_training.parallel.collectives import all_gather_single

Layout = Sequence[tuple[torch.dtype, int]]


class CountingState(Protocol):
    group: dist.ProcessGroup
    group_size: int
    bytes_sent: int


def _order(dtypes: Sequence[torch.dtype]) -> list[int]:
    """Wire order of segments: decreasing element size (stable), so each segment is aligned to its own size."""
    return sorted(range(len(dtypes)), key=lambda i: -dtypes[i].itemsize)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 message holding the tensors' bytes, in wire order."""
    order = _order([t.dtype for t in tensors])
    return torch.cat([tensors[i].contiguous().view(-1).view(torch.uint8) for i in order])


def message_nbytes(layout: Layout) -> int:
    return sum(dtype.itemsize * numel for dtype, numel in layout)


def unpack(messages: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Split messages (one per row: shape (rows, nbytes)) back into tensors of shape (rows, numel), layout order."""
    rows = messages if messages.dim() == 2 else messages.unsqueeze(0)
    assert rows.shape[1] == message_nbytes(layout), "the message does not match its layout"
    out: list[torch.Tensor | None] = [None] * len(layout)
    offset = 0
    for i in _order([dtype for dtype, _ in layout]):
        dtype, numel = layout[i]
        size = dtype.itemsize * numel
        out[i] = rows[:, offset : offset + size].contiguous().view(dtype)
        offset += size
    return out


class DensePayload:
    """An uncompressed tensor: 'none', a 1-D tensor under PowerSGD, or the values a rank's two-stage messages
    decode to (two_stage.py)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def decompress(self) -> torch.Tensor:
        return self.tensor


def all_gather(state: CountingState, message: torch.Tensor) -> tuple[torch.Tensor, dist.Work]:
    """Start gathering every rank's equally long message; returns (rows: (group_size, numel), work)."""
    state.bytes_sent += message.numel() * message.element_size()
    out = message.new_empty((state.group_size, message.numel()))
    work = all_gather_single(out.view(-1), message, group=state.group, async_op=True)
    return out, work


def all_to_all(state: CountingState, messages: torch.Tensor) -> tuple[torch.Tensor, dist.Work]:
    """Start sending row j of messages (group_size, nbytes) to rank j; returns (rows received, one per rank, work)."""
    state.bytes_sent += messages.numel() * messages.element_size()
    received = torch.empty_like(messages)
    return received, dist.all_to_all_single(received, messages, group=state.group, async_op=True)


def all_reduce(state: CountingState, tensor: torch.Tensor) -> dist.Work:
    """Start summing tensor over the group, in place."""
    state.bytes_sent += tensor.numel() * tensor.element_size()
    return dist.all_reduce(tensor, group=state.group, async_op=True)


def completed(value: torch.Tensor) -> torch.futures.Future:
    """An already-finished future (for a reduction with nothing to send)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
