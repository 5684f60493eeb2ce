"""Launching: results come back from every rank; a failing or killed rank ends the job, named, without a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from large_model_training.launch import RankFailure, run_on_ranks


def _sum_of_ranks() -> tuple[int, int]:
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return dist.get_rank(), int(t)


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # the others wait on the dead rank: they must be stopped, not hang


def _rank2_is_killed() -> None:
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_results_come_back_in_rank_order():
    assert run_on_ranks(_sum_of_ranks, 3) == [(0, 3), (1, 3), (2, 3)]


def test_a_raising_rank_is_named_with_its_error():
    started = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_rank1_raises, 3, timeout_s=60)
    assert e.value.rank == 1 and "ValueError: bad shard on purpose" in str(e.value)
    assert "_rank1_raises" in e.value.traceback
    assert time.monotonic() - started < 60


def test_a_killed_rank_is_named_and_nothing_hangs():
    started = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_on_ranks(_rank2_is_killed, 3, timeout_s=60)
    assert e.value.rank == 2 and "SIGKILL" in str(e.value)
    assert time.monotonic() - started < 60


def _sleep_forever() -> None:
    time.sleep(600)


ORPHAN_SCRIPT = """
from large_model_training.launch import run_on_ranks
from tests.test_launch import _sleep_forever
run_on_ranks(_sleep_forever, 2)
"""


def test_ranks_die_with_a_killed_launcher(tmp_path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], cwd=os.path.dirname(os.path.dirname(__file__)))
    deadline = time.monotonic() + 60
    children: list[str] = []
    while time.monotonic() < deadline and len(children) < 3:  # 2 ranks + the resource tracker
        time.sleep(0.2)
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    time.sleep(1.0)  # the ranks have set up
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{c}") and
                                              open(f"/proc/{c}/stat").read().split()[2] != "Z" for c in children):
        time.sleep(0.2)
    alive = [c for c in children if os.path.exists(f"/proc/{c}") and open(f"/proc/{c}/stat").read().split()[2] != "Z"
             and b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]
    assert not alive, f"orphaned ranks: {alive}"


def test_torchrun_launch_trains_the_same_curve_as_the_builtin_launcher(tmp_path, small_corpus):
    """Across machines ranks come from torchrun: same curve as spawned ranks, and every rank exits 0."""
    import json
    import subprocess
    import sys

    from tests.helpers import SMALL_MODEL, assert_close_curves, losses, train

    common = [*SMALL_MODEL, "--data", small_corpus, "--dp", "2", "--steps", "4", "--eval-every", "0",
              "--global-batch-size", "4", "--micro-batch-size", "2"]
    spawned = train(str(tmp_path / "spawned"), *common)
    out = tmp_path / "torchrun"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "large_model_training.cli", "train", "--out", str(out), *common],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert_close_curves(losses(rows), losses(spawned), rtol=1e-6, what="torchrun vs spawned")
