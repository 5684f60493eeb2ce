"""Launching: results come back from every rank; a failing or killed rank ends the job, named, without a hang."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from large_model_training.launch import RankFailure, run_on_ranks

pytestmark = pytest.mark.slow  # every test here spawns ranks


def _sum_of_ranks() -> tuple[int, int]:
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return dist.get_rank(), int(t)


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # the others wait on the dead rank: they must be stopped, not hang


def _rank1_is_killed() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_results_come_back_in_rank_order():
    assert run_on_ranks(_sum_of_ranks, 3) == [(0, 3), (1, 3), (2, 3)]


# The collective timeout of the failure tests: ranks that waited for it (a hang) would fail the test by far.
HANG_S = 600


def test_a_raising_rank_is_named_with_its_error():
    started = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_rank1_raises, 2, timeout_s=HANG_S)
    assert e.value.rank == 1 and "ValueError: bad shard on purpose" in str(e.value)
    assert "_rank1_raises" in e.value.traceback
    assert time.monotonic() - started < HANG_S / 4  # the others were stopped, not left to time out


def test_a_killed_rank_is_named_and_nothing_hangs():
    started = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_rank1_is_killed, 2, timeout_s=HANG_S)
    assert e.value.rank == 1 and "SIGKILL" in str(e.value)
    assert time.monotonic() - started < HANG_S / 4


def _wait_forever(ready_dir: str) -> None:
    """Say this rank is running (set up, tied to its launcher), then block until killed."""
    open(os.path.join(ready_dir, f"rank{dist.get_rank()}"), "w").close()
    threading.Event().wait()


ORPHAN_SCRIPT = """
import sys
from large_model_training.launch import run_on_ranks
from tests.test_launch import _wait_forever
run_on_ranks(_wait_forever, 2, (sys.argv[1],))
"""


def _all_exit(pidfds: list[int], timeout: float) -> bool:
    """Wait until the process behind every pidfd has exited (a pidfd becomes readable when its process ends)."""
    deadline, waiting = time.monotonic() + timeout, list(pidfds)
    while waiting and time.monotonic() < deadline:
        ready, _, _ = select.select(waiting, [], [], deadline - time.monotonic())
        waiting = [fd for fd in waiting if fd not in ready]
    return not waiting


def test_ranks_die_with_a_killed_launcher(tmp_path):
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SCRIPT, str(tmp_path)], cwd=os.path.dirname(os.path.dirname(__file__))
    )
    pidfds: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(tmp_path)) < 2:  # both ranks are inside the function
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        children = [int(c) for c in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        ranks = [c for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(ranks) == 2, children
        pidfds = [os.pidfd_open(pid) for pid in ranks]  # before the kill: these name the ranks, whatever follows
    finally:
        proc.kill()
        proc.wait()
    try:
        assert _all_exit(pidfds, timeout=60), f"orphaned ranks outlived their killed launcher: {ranks}"
    finally:
        for fd in pidfds:
            os.close(fd)
