"""The data-parallel reduction of one gradient bucket goes through one replaceable hook.

Shape (as in PyTorch DDP's comm hooks): a stateful algorithm is a state object plus a pure function
`hook(state, bucket) -> Future[Tensor]`. The engine calls the hook as soon as a bucket's gradients are all
accumulated in backward, keeps the future, and waits on it before the optimizer step. The future's value is
the dp-averaged gradient of the bucket (same shape and dtype as `bucket.buffer`); the engine copies it into
the buffer if the hook did not reduce in place. Hooks add what they passed to collectives to
`state.bytes_sent`, which the engine reports as `comm_bytes_dp`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass
class GradBucket:
    """A contiguous range of the flat gradient buffer, reduced as one message."""

    index: int
    buffer: torch.Tensor
    """1-D view into the flat gradient buffer (reduce in place, or return a new tensor)."""
    param_names: list[str] = field(default_factory=list)
    """Names of the parameters whose gradients the bucket holds, in buffer order."""
    param_shapes: list[torch.Size] = field(default_factory=list)
    """Their shapes (PowerSGD reshapes matrices), in buffer order."""


class HookState(Protocol):
    group: dist.ProcessGroup
    group_size: int
    bytes_sent: int


CommHook = Callable[[HookState, GradBucket], torch.futures.Future]


@dataclass
class AllReduceState:
    """State of the default hook: the group and a byte counter."""

    group: dist.ProcessGroup
    group_size: int
    bytes_sent: int = 0


def allreduce_hook(state: AllReduceState, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over the dp group with one asynchronous all-reduce (divide first: no overflow in bf16)."""
    buf = bucket.buffer
    if state.group_size == 1:  # nothing to average with
        done = torch.futures.Future()
        done.set_result(buf)
        return done
    buf.div_(state.group_size)
    state.bytes_sent += buf.numel() * buf.element_size()
    work = dist.all_reduce(buf, group=state.group, async_op=True)
    # The result is `buf` itself (reduced in place): wait (which raises a failed reduction's error) but do not
    # index the future's value, which some backends leave empty (the `fake` one `lmt rehearse` runs on).
    return work.get_future().then(lambda fut: (fut.wait(), buf)[1])
