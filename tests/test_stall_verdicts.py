"""Stall verdicts from heartbeat records (no processes): who is named, and who never is."""

from __future__ import annotations

import json

import pytest

from large_model_training.reliability.guards import SpikeGuard
from large_model_training.reliability.heartbeat import FileBoard, beat_interval
from large_model_training.reliability.stall import StallMonitor
from large_model_training.train.metrics import MetricsLogger

WINDOW = 10.0
DP = {"dp": [0, 1]}


def record(rank, beat, step=5, phase="grad_sync", seqs=None, members=None, where="x.py:1 (f)", comm="", group=""):
    return {
        "rank": rank,
        "beat": beat,
        "step": step,
        "phase": phase,
        "seqs": seqs or {},
        "members": members or {},
        "where": where,
        "comm": comm,
        "group": group,
    }


def feed(monitor, frames):
    """frames: [(time, {rank: record})]; returns the last verdict."""
    verdict = None
    for now, records in frames:
        verdict = monitor.observe(records, now)
    return verdict


def test_a_rank_without_heartbeat_is_named_after_the_window_and_not_before():
    mon = StallMonitor(2, WINDOW, 1.0)
    waiting = dict(seqs={"dp": 7}, members=DP, comm="all_reduce", group="dp")
    early = [(t, {0: record(0, t, **waiting), 1: record(1, 0, seqs={"dp": 6}, members=DP)}) for t in range(0, 10)]
    assert feed(mon, early) is None
    verdict = mon.observe({0: record(0, 10, **waiting), 1: record(1, 0, seqs={"dp": 6}, members=DP)}, 10.0)
    assert verdict is not None and verdict.ranks == [1] and verdict.kind == "stalled"
    assert "no heartbeat" in str(verdict) and "rank 0 in step 5 grad_sync, all_reduce on dp #7" in str(verdict)


def test_a_rank_stuck_in_its_own_work_is_named_and_its_waiting_peers_are_not():
    # tp2 x dp2 (ranks 0,1 | 2,3 by tp): rank 3 hangs in compute; rank 2 waits on it over tp, ranks 0 and 1 over
    # dp, and rank 2 is behind on dp because of it: only rank 3 is a cause.
    members = {
        0: {"tp": [0, 1], "dp": [0, 2]},
        1: {"tp": [0, 1], "dp": [1, 3]},
        2: {"tp": [2, 3], "dp": [0, 2]},
        3: {"tp": [2, 3], "dp": [1, 3]},
    }
    seqs = {0: {"tp": 40, "dp": 9}, 1: {"tp": 40, "dp": 9}, 2: {"tp": 41, "dp": 8}, 3: {"tp": 40, "dp": 8}}
    mon = StallMonitor(4, WINDOW, 1.0)
    frames = [
        (
            t,
            {
                r: record(
                    r,
                    t,
                    seqs=seqs[r],
                    members=members[r],
                    comm="" if r == 3 else "all_reduce",
                    where="models/transformer.py:113 (forward)" if r == 3 else "y.py:2 (g)",
                )
                for r in range(4)
            },
        )
        for t in range(12)
    ]
    verdict = feed(mon, frames)
    assert verdict is not None and verdict.ranks == [3], str(verdict)
    assert "transformer.py:113" in str(verdict)


def test_progress_anywhere_means_no_verdict():
    mon = StallMonitor(2, WINDOW, 1.0)
    frames = [
        (t, {0: record(0, t, seqs={"dp": 7}, members=DP), 1: record(1, t, step=t, seqs={"dp": 6}, members=DP)})
        for t in range(30)
    ]
    assert feed(mon, frames) is None


def test_collectives_issued_in_different_orders_are_a_desync_naming_no_rank():
    members = {"dp": [0, 1], "tp": [0, 1]}
    seqs = {0: {"dp": 5, "tp": 3}, 1: {"dp": 4, "tp": 4}}  # 0 waits on 1 over dp, 1 on 0 over tp
    mon = StallMonitor(2, WINDOW, 1.0)
    verdict = feed(
        mon,
        [(t, {r: record(r, t, seqs=seqs[r], members=members, comm="all_reduce") for r in (0, 1)}) for t in range(12)],
    )
    assert verdict is not None and verdict.kind == "desync" and verdict.ranks == []


def test_different_collectives_at_the_same_count_are_a_desync():
    mon = StallMonitor(2, WINDOW, 1.0)
    frames = [
        (
            t,
            {
                0: record(0, t, seqs={"dp": 5}, members=DP, comm="all_reduce", where="a.py:1 (f)"),
                1: record(1, t, seqs={"dp": 5}, members=DP, comm="broadcast", where="b.py:9 (g)"),
            },
        )
        for t in range(12)
    ]
    verdict = feed(mon, frames)
    assert verdict is not None and verdict.kind == "desync" and "broadcast" in str(verdict)


def test_every_rank_inside_the_same_collective_is_a_hang_not_a_rank():
    mon = StallMonitor(2, WINDOW, 1.0)
    frames = [
        (t, {r: record(r, t, seqs={"dp": 5}, members=DP, comm="all_reduce", group="dp") for r in (0, 1)})
        for t in range(12)
    ]
    verdict = feed(mon, frames)
    assert verdict is not None and verdict.kind == "hang" and verdict.ranks == []


def test_a_rank_that_never_beat_is_named_only_while_the_others_wait():
    mon = StallMonitor(3, WINDOW, 1.0)
    assert feed(mon, [(t, {}) for t in range(20)]) is None  # nobody started yet: no verdict
    frames = [(20 + t, {0: record(0, t, comm="barrier"), 1: record(1, t, comm="barrier")}) for t in range(12)]
    verdict = feed(mon, frames)
    assert verdict is not None and verdict.ranks == [2] and "never sent a heartbeat" in str(verdict)


def test_a_finishing_job_is_never_stalled():
    mon = StallMonitor(2, WINDOW, 1.0)
    frames = [(t, {0: record(0, t, phase="done"), 1: record(1, 0)}) for t in range(30)]
    assert feed(mon, frames) is None


def test_blame_names_a_silent_rank_at_once_after_a_victim_timed_out():
    mon = StallMonitor(2, 60.0, 2.0)
    for t in range(6):
        mon.observe({0: record(0, t), 1: record(1, min(t, 1))}, float(t))
    verdict = mon.blame(6.0)
    assert verdict is not None and verdict.ranks == [1]


def test_file_board_round_trip(tmp_path):
    board = FileBoard(str(tmp_path / "hb"))
    board.publish(1, record(1, 3))
    assert board.read(3) == {1: record(1, 3)}
    (tmp_path / "hb" / "rank_0.json").write_text("{half")  # a torn or foreign file reads as absent
    assert set(board.read(3)) == {1}


@pytest.mark.parametrize("timeout,expected", [(1.0, 0.2), (10.0, 1.0), (600.0, 2.0)])
def test_beat_interval(timeout, expected):
    assert beat_interval(timeout) == expected


def test_spike_guard_waits_for_a_full_window_then_compares_with_the_median():
    guard = SpikeGuard(2.0, 3)
    for loss in (3.0, 1.0, 2.0):
        assert not guard.is_spike(100.0)  # window not full yet
        guard.accept(loss)
    assert guard.threshold() == 4.0
    assert not guard.is_spike(4.0) and guard.is_spike(4.01)
    assert not SpikeGuard(0.0, 3).enabled


def test_metrics_truncate_keeps_rows_up_to_the_step(tmp_path):
    logger = MetricsLogger(str(tmp_path), 10, stream=open(tmp_path / "log.txt", "w"))
    for step in range(1, 6):
        logger.log({"step": step, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0})
    logger.truncate(3)
    logger.log({"step": 4, "loss": 2.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0})
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] == 2.0
