"""The caching allocator's replay: PyTorch's segment, split, best-fit and merge rules, and the tracker's events."""

from __future__ import annotations

import pytest
import torch

from large_model_training.memory.caching_allocator import CachingAllocator, round_size, segment_size
from large_model_training.memory.tracker import AllocationTracker

MB = 1 << 20


def test_sizes_round_as_pytorch_rounds_them():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(4096) == 4096
    assert segment_size(round_size(1000)) == 2 * MB  # small requests share 2 MiB segments
    assert segment_size(5 * MB) == 20 * MB  # 1-10 MiB requests share 20 MiB segments
    assert segment_size(31 * MB + 1) == 32 * MB  # larger ones get their own, rounded up to 2 MiB


@pytest.mark.parametrize("expandable", [False, True])
def test_a_freed_block_too_small_for_the_next_request_stays_reserved(expandable):
    replay = CachingAllocator(expandable).replay([(1, 30 * MB), (2, 30 * MB), (1, 0), (3, 40 * MB)])
    assert replay.allocated_peak == 70 * MB and replay.requested_peak == 70 * MB
    assert replay.reserved_peak == 100 * MB  # the free 30 MB cannot hold 40: 30 more reserved than live
    assert replay.gap == pytest.approx(100 / 70 - 1)


def test_medium_requests_share_a_20_mib_segment_and_small_ones_a_2_mib_one():
    assert CachingAllocator().replay([(k, 5 * MB) for k in range(5)]).reserved_peak == 40 * MB
    small = CachingAllocator().replay([(k, 600 * 1024) for k in range(4)])
    assert small.reserved_peak == 4 * MB and small.allocated_peak == 4 * 600 * 1024


def test_best_fit_takes_the_smallest_free_block_that_fits():
    a = CachingAllocator()
    a.replay([(1, 12 * MB), (2, 40 * MB), (3, 12 * MB), (2, 0), (1, 0)])  # free: 12 MiB and 40 MiB segments
    a.malloc(4, 11 * MB)
    block, _ = a.live[4]
    assert block.segment == 1 and a.reserved == 64 * MB  # into the 12 MiB block, nothing new reserved


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocator()
    a.replay([(1, 3 * MB), (2, 3 * MB), (3, 3 * MB), (1, 0), (2, 0)])  # one 20 MiB segment: 6 MiB free in front
    a.malloc(4, 6 * MB)
    assert a.reserved == 20 * MB and a.live[4][0].start == 0


def test_an_expandable_pool_grows_its_free_tail_by_pages():
    a = CachingAllocator(expandable_segments=True)
    a.replay([(1, 30 * MB)])  # 40 MiB mapped (two 20 MiB pages): 10 MiB free at the end
    a.replay([(2, 25 * MB)])  # the free 10 MiB and one more page hold it
    assert a.reserved == 60 * MB and a.live[2][0].start == 30 * MB
    default = CachingAllocator().replay([(1, 30 * MB), (2, 25 * MB)])
    assert default.reserved_peak == 30 * MB + 26 * MB  # two segments, each its request rounded to 2 MiB


def test_the_tracker_records_every_allocation_and_free_in_order():
    with AllocationTracker(record=True) as tracker:
        x = torch.empty(1000, dtype=torch.float32)
        y = torch.empty(250_000, dtype=torch.float32)
        del x
        z = y.clone()
        del y
    assert [n for _, n in tracker.events] == [4000, 1_000_000, 0, 1_000_000, 0]
    replay = CachingAllocator().replay(tracker.events)
    assert replay.requested_peak == tracker.peak == 2_000_000
    assert replay.allocated_peak == round_size(1_000_000) * 2 and replay.reserved_peak == 2 * MB  # one small segment
    del z
