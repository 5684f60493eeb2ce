"""What a device's caching allocator reserves for a run: PyTorch's CUDA caching allocator, replayed.

`torch.cuda.max_memory_reserved` (what torchtitan, Megatron and nvidia-smi report) exceeds the peak of live
tensors by the blocks the allocator keeps cached but cannot reuse: a free 30 MB block cannot hold a 40 MB
tensor, so the allocator asks the driver for more. How much depends on the order and sizes of the allocations,
which `lmt rehearse` records (memory/tracker.py) at any shape without a device. This module replays them through
the allocator's rules (c10/cuda/CUDACachingAllocator.cpp), so the gap is computed rather than assumed:

- sizes round up to 512 bytes; requests up to 1 MiB come from the small pool, larger ones from the large pool;
- a request takes the smallest free block of its pool that fits (lowest address among equals), split when
  what is left is at least 512 bytes (small pool) or more than 1 MiB (large pool);
- with none free, a new segment: 2 MiB for small requests, 20 MiB below 10 MiB, else the size rounded up to
  2 MiB; with `expandable_segments:True` (torchtitan's `run_train.sh` sets it) each pool is one address range
  that maps pages (2 MiB small, 20 MiB large) at its end instead, taking in a free block that ends there;
- a freed block merges with free neighbours of its segment; nothing is returned to the driver (no
  `empty_cache`; the allocator's release-and-retry on an out-of-memory is not modelled: a replay reserving more
  than the device holds says the run would be slowed by it, or fail).

Not modelled: per-stream pools (FSDP2's all-gathers and NCCL's buffers live on their own streams on a device,
in one pool here), `max_split_size_mb` and the `garbage_collection_threshold` (both off by default), and
memory outside the allocator (CUDA context, NCCL's own buffers, cuBLAS workspaces).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # the largest small-pool request
SMALL_BUFFER = 2 << 20  # a small segment, and an expandable small pool's page
LARGE_BUFFER = 20 << 20  # a segment for 1-10 MiB requests, and an expandable large pool's page
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-nbytes // MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """cudaMalloc size for a new segment holding a (rounded) request of `nbytes`."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-nbytes // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    start: int
    size: int
    segment: int
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class _Pool:
    small: bool
    free: list[tuple[int, int]] = field(default_factory=list)  # (size, start) of free blocks, sorted
    by_start: dict[int, _Block] = field(default_factory=dict)  # free blocks by start
    top: _Block | None = None  # expandable: the block that ends at the mapped end

    @property
    def mapped(self) -> int:
        """Expandable: bytes mapped, up to the end of the top block."""
        return self.top.start + self.top.size if self.top is not None else 0

    def add_free(self, block: _Block) -> None:
        bisect.insort(self.free, (block.size, block.start))
        self.by_start[block.start] = block

    def remove_free(self, block: _Block) -> None:
        del self.free[bisect.bisect_left(self.free, (block.size, block.start))]
        del self.by_start[block.start]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.free, (size, -1))
        return self.by_start[self.free[i][1]] if i < len(self.free) else None


@dataclass(frozen=True)
class Replay:
    """Peaks of a replayed trace: live tensor bytes as requested, as the allocator rounds them, and reserved."""

    requested_peak: int
    allocated_peak: int
    reserved_peak: int

    @property
    def gap(self) -> float:
        """Reserved over allocated at their peaks, less one: the fragmentation the caching costs."""
        return self.reserved_peak / self.allocated_peak - 1 if self.allocated_peak else 0.0


class CachingAllocator:
    """PyTorch's CUDA caching allocator, one stream (module docstring): `malloc`/`free` by key, peaks kept."""

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self.pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self.live: dict[object, tuple[_Block, int]] = {}  # key -> (block, requested bytes)
        self.requested = self.allocated = self.reserved = 0
        self.requested_peak = self.allocated_peak = self.reserved_peak = 0
        self._next_address = 0
        self._segments = 0  # segments made (expandable: the small pool's range is segment 0, the large's -1)
        self._pool_of_segment: dict[int, _Pool] = {}

    def malloc(self, key: object, nbytes: int) -> None:
        if nbytes <= 0:
            return  # PyTorch hands out no block for an empty tensor
        size = round_size(nbytes)
        pool = self.pools[size <= SMALL_SIZE]
        block = pool.best_fit(size)
        if block is not None:
            pool.remove_free(block)
        else:
            block = self._grow(pool, size)
        self._split(pool, block, size)
        block.allocated = True
        self.live[key] = (block, nbytes)
        self.requested += nbytes
        self.allocated += block.size
        self.requested_peak = max(self.requested_peak, self.requested)
        self.allocated_peak = max(self.allocated_peak, self.allocated)

    def free(self, key: object) -> None:
        entry = self.live.pop(key, None)
        if entry is None:
            return
        block, nbytes = entry
        pool = self._pool_of_segment[block.segment]
        self.requested -= nbytes
        self.allocated -= block.size
        block.allocated = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and neighbour.segment == block.segment:
                pool.remove_free(neighbour)
                self._merge(pool, block, neighbour)
        pool.add_free(block)

    def replay(self, events: Iterable[tuple[object, int]]) -> Replay:
        """Events in order: (key, bytes > 0) allocates, (key, 0) frees."""
        for key, nbytes in events:
            if nbytes:
                self.malloc(key, nbytes)
            else:
                self.free(key)
        return Replay(self.requested_peak, self.allocated_peak, self.reserved_peak)

    # ---- internals ------------------------------------------------------------------------------------
    def _grow(self, pool: _Pool, size: int) -> _Block:
        """A free block of at least `size` from the driver: a new segment, or pages mapped at the pool's end."""
        if not self.expandable:
            nbytes = segment_size(size)
            self._segments += 1
            block = _Block(self._next_address, nbytes, self._segments)
            self._pool_of_segment[block.segment] = pool
            self._next_address += nbytes
            self._reserve(nbytes)
            return block
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        segment = 0 if pool.small else -1  # one address range per pool
        self._pool_of_segment[segment] = pool
        tail = pool.top if pool.top is not None and not pool.top.allocated else None
        have = tail.size if tail is not None else 0
        more = page * -(-(size - have) // page)
        self._reserve(more)
        if tail is not None:  # the free block at the end grows into the new pages
            pool.remove_free(tail)
            tail.size += more
            return tail
        block = _Block(pool.mapped, more, segment, prev=pool.top)
        if pool.top is not None:
            pool.top.next = block
        pool.top = block
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def _split(self, pool: _Pool, block: _Block, size: int) -> None:
        rest = block.size - size
        if rest < MIN_BLOCK if pool.small else rest <= SMALL_SIZE:
            return  # the request takes the whole block
        remainder = _Block(block.start + size, rest, block.segment, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = remainder
        elif pool.top is block:
            pool.top = remainder
        block.next, block.size = remainder, size
        pool.add_free(remainder)

    def _merge(self, pool: _Pool, block: _Block, neighbour: _Block) -> None:
        """Fold a free neighbour into `block` (which keeps its identity; its start moves back if needed)."""
        if neighbour is block.prev:
            block.start, block.prev = neighbour.start, neighbour.prev
            if neighbour.prev is not None:
                neighbour.prev.next = block
        else:
            block.next = neighbour.next
            if neighbour.next is not None:
                neighbour.next.prev = block
            if pool.top is neighbour:
                pool.top = block
        block.size += neighbour.size
