"""A stalled rank ends the job quickly and is named (never a victim that timed out); the straggler report and
the loss-spike guard in real runs."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import SMALL_MODEL, metrics, train

pytestmark = pytest.mark.slow


def _start(out, data, *args):
    cmd = [
        sys.executable,
        "-m",
        "large_model_training.cli",
        "train",
        "--out",
        str(out),
        "--data",
        data,
        "--steps",
        "1000",
        "--eval-every",
        "0",
        "--micro-batch-size",
        "2",
        *SMALL_MODEL,
        *args,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop_rank_after_steps(proc, out, rank, steps=3):
    """SIGSTOP `rank` (its pid from its heartbeat) once rank 0 has logged `steps` steps; returns the time."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            done = len(open(os.path.join(out, "metrics.jsonl")).read().splitlines())
            pid = json.load(open(os.path.join(out, "heartbeat", f"rank_{rank}.json")))["pid"]
        except (OSError, ValueError):
            done = 0
        if done >= steps:
            os.kill(pid, signal.SIGSTOP)
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError("the run did not reach its first steps")


@pytest.mark.parametrize(
    "layout,victim,settings",
    [
        # The stall timeout ends the job: the launcher's monitor of the heartbeats.
        (["--tp", "2", "--pp", "2", "--global-batch-size", "4"], 2, ["--stall-timeout", "6"]),
        # The peers' collective timeout (10 s: 4 fired during start-up on an overloaded 2-core machine) fires first:
        # the heartbeats still name the stopped rank, not the victim.
        (["--dp", "2"], 1, ["--stall-timeout", "60", "--run.timeout", "10"]),
    ],
    ids=["tp2-pp2", "dp2-victim-timed-out-first"],
)
def test_a_stopped_rank_ends_the_job_and_is_named(tmp_path, small_corpus, layout, victim, settings):
    out = tmp_path / "run"
    proc = _start(out, small_corpus, *layout, *settings)
    try:
        stopped = _stop_rank_after_steps(proc, out, victim)
        _, err = proc.communicate(timeout=6 + 30 + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - stopped
    assert proc.returncode == 1, err[-2000:]
    assert took <= 6 + 30, took
    line = [x for x in err.splitlines() if x.startswith("lmt: ")][-1]
    assert line.startswith(f"lmt: rank {victim} stalled"), line
    assert "rank 0 stalled" not in line and "rank 0 failed" not in line
    assert "no complete checkpoint yet" in line or "last complete checkpoint" in line
    assert (out / "stall.log").read_text().strip() in line


def test_under_torchrun_the_ranks_own_watchdogs_end_the_job_and_name_the_stopped_rank(tmp_path, small_corpus):
    """torchrun --standalone (its one-node mode; two-node runs: tests/test_torchrun.py)."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "large_model_training.cli",
        "train",
        "--out",
        str(out),
        "--data",
        small_corpus,
        "--steps",
        "1000",
        "--eval-every",
        "0",
        "--micro-batch-size",
        "2",
        "--stall-timeout",
        "10",
        *SMALL_MODEL,
    ]  # 6 fired during start-up on an overloaded 2-core machine
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.1)
        workers = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        rank1 = [w for w in workers if "RANK=1" in open(f"/proc/{w}/environ").read().split("\0")]
        os.kill(int(rank1[0]), signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=10 + 30 + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - stopped <= 10 + 30
    line = [x for x in err.splitlines() if x.startswith("lmt: ")][-1]
    assert line.startswith("lmt: rank 1 stalled"), line
    assert (out / "stall.log").read_text().strip() == line[len("lmt: ") :]


def test_straggler_report_is_in_every_step_of_a_dp_run(tmp_path, small_corpus):
    """Wiring only: which rank is slower in a real run is up to the machine (the verdict is tested below)."""
    from tests.dist import train_together

    out = str(tmp_path / "run")
    train_together(2, {out: ["--dp", "2", "--steps", "3", "--eval-every", "0", "--data", small_corpus, *SMALL_MODEL]})
    rows = metrics(out)
    assert len(rows) == 3
    for row in rows:
        assert row["straggler_rank"] in (0, 1) and row["straggler_lag_s"] >= 0


# Busy seconds by (pp, dp) coordinate: stage 1 is slower by its schedule, (0, 1) is the straggler of its stage.
BUSY = {(0, 0): 1.0, (0, 1): 1.8, (1, 0): 5.0, (1, 1): 5.2}


def _straggler_verdict() -> tuple[dict, dict]:
    from large_model_training.mesh import ParallelMesh
    from large_model_training.reliability.guards import StragglerReport

    mesh = ParallelMesh.for_this_rank(pp=2, dp=2, tp=1)
    report = StragglerReport(mesh)(BUSY[(mesh.pp_rank, mesh.grid.coordinate(mesh.rank)["dp"])])
    return report, mesh.grid.coordinate(report["straggler_rank"])


def test_straggler_is_the_rank_furthest_above_its_own_stage():
    """Injected busy times on pp2 x dp2: the report names (pp 0, dp 1), 0.4 s above its stage's median, not the
    slowest rank overall (stage 1's, which a median over all ranks would name), and every rank says the same."""
    from tests.dist import run_ranks

    for report, where in run_ranks(_straggler_verdict, 4):
        assert (where["pp"], where["dp"]) == (0, 1)
        assert report["straggler_lag_s"] == pytest.approx(0.4, abs=1e-6)


def _spoil(monkeypatch, batches: tuple[int, ...]) -> None:
    """The given batches (0-based: batch 7 is step 8's when nothing was skipped) get every target set to byte
    0x01, which the Python corpus never contains: a loss spike far above any wobble of the loss (the guard's
    factor here is 1.5), on a batch, not a step number, so a rollback that skips the batch leaves it behind."""
    from large_model_training.data.loader import BatchLoader

    build = BatchLoader._build

    def spoiled(self, step):
        micro = build(self, step)
        return [(x, torch.full_like(y, 1)) for x, y in micro] if step in batches else micro

    monkeypatch.setattr(BatchLoader, "_build", spoiled)


def _spiky(out, data, *args):
    return train(
        str(out),
        "--data",
        data,
        "--steps",
        "14",
        "--eval-every",
        "0",
        "--lr",
        "0.01",
        "--train.warmup_steps",
        "0",
        "--train.spike_factor",
        "1.5",
        "--train.spike_window",
        "3",
        "--train.max_bad_steps",
        "20",
        *SMALL_MODEL,
        *args,
    )


def test_spike_guard_skips_exactly_the_steps_above_the_running_median(tmp_path, small_corpus, monkeypatch):
    _spoil(monkeypatch, (7, 11))
    rows = _spiky(tmp_path / "run", small_corpus)
    accepted: list[float] = []
    for row in rows:
        expected = len(accepted) >= 3 and row["loss"] > 1.5 * statistics.median(accepted[-3:])
        assert ("spike" in row) == expected, row
        assert row["skipped"] == expected
        if expected:
            assert row["spike"]["threshold"] == pytest.approx(1.5 * statistics.median(accepted[-3:]))
        else:
            accepted.append(row["loss"])
    assert [r["step"] for r in rows if "spike" in r] == [8, 12]  # a skipped step still consumes its batch


def test_spike_rollback_reloads_the_checkpoint_and_skips_the_batches(tmp_path, small_corpus, monkeypatch):
    _spoil(monkeypatch, (7,))
    rows = _spiky(tmp_path / "run", small_corpus, "--train.spike_action", "rollback", "--save-every", "2")
    assert [r["step"] for r in rows] == list(range(1, 15)), "one row per step after rollbacks"
    notes = [r["rollback"] for r in rows if "rollback" in r]
    # Step 8 (batch 7) spikes: back to step 6's checkpoint, batches 6 and 7 skipped, steps 7-14 read batches 8-15.
    assert [(n["spike_step"], n["resumed_from"], n["skipped_batches"]) for n in notes] == [(8, 6, 2)]
    assert not any("spike" in r for r in rows)
    assert metrics(tmp_path / "run") == rows


def test_a_second_rollback_skips_past_its_own_bad_batch(tmp_path, small_corpus, monkeypatch):
    _spoil(monkeypatch, (7, 11))
    rows = _spiky(tmp_path / "run", small_corpus, "--train.spike_action", "rollback", "--save-every", "2")
    notes = [r["rollback"] for r in rows if "rollback" in r]
    # After the first rollback steps 7.. read batches 8..: batch 11 spikes at step 10, back to step 8's checkpoint.
    assert [(n["spike_step"], n["resumed_from"], n["skipped_batches"]) for n in notes] == [(8, 6, 2), (10, 8, 2)]
