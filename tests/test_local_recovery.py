"""--save-local-every: a rank SIGKILLed mid-run comes back from the ranks' in-memory copies (own or partner's),
not from the durable checkpoint, and the run ends on the uninterrupted curve bit for bit with at most a step or
two redone; with both copies of a shard gone, one line says so and the durable checkpoint is the fallback."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from large_model_training.reliability.local_checkpoint import held_copies, holder_root, node_holder, read_copy
from tests.dist import train_together, world_size
from tests.helpers import losses, metrics
from tests.test_torchrun import COMMON, LAYOUTS, _children, _ended_on_failure, _finish, _reached

LAYOUTS = {**LAYOUTS, "pp2dp2": ["--pp", "2", "--dp", "2"], "tp2dp2-zero3": ["--tp", "2", "--dp", "2", "--zero", "3"]}


@pytest.fixture(scope="module")
def builtin(tmp_path_factory, small_corpus):
    """The uninterrupted curve of a layout, trained once for the module on first use (pooled ranks)."""
    root, curves = tmp_path_factory.mktemp("reference"), {}

    def curve(layout: str) -> list[float]:
        if layout not in curves:
            args = [*COMMON, "--data", small_corpus, *LAYOUTS[layout]]
            train_together(world_size(args), {str(root / layout): args})
            curves[layout] = losses(metrics(root / layout))
        return curves[layout]

    return curve


EVERY = 2


def _gone(pids: list[int]) -> None:
    """Wait until the first attempt's ranks have all exited (their last-gasp copies written)."""
    deadline = time.monotonic() + 60
    while (
        any(
            os.path.exists(f"/proc/{p}") and b"Z" not in open(f"/proc/{p}/stat", "rb").read().split()[2:3] for p in pids
        )
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)


def _run_and_kill(
    tmp_path: Path, corpus: str, lose_both_copies: bool, save_every: int, layout: str = "tp2dp2", kill_after: int = 6
) -> tuple[list[dict], str]:
    out = tmp_path / "run"
    try:
        return _killed_run(out, tmp_path, corpus, lose_both_copies, save_every, layout, kill_after)
    finally:
        shutil.rmtree(holder_root(str(out)), ignore_errors=True)


def _killed_run(
    out: Path, tmp_path: Path, corpus: str, lose_both_copies: bool, save_every: int, layout: str, kill_after: int
) -> tuple[list[dict], str]:
    with open(tmp_path / "lmt.log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "large_model_training.cli",
                "train",
                "--out",
                str(out),
                *COMMON,
                "--data",
                corpus,
                *LAYOUTS[layout],
                "--save-every",
                str(save_every),
                "--save-local-every",
                str(EVERY),
                "--max-restarts",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    with _ended_on_failure([proc]):
        _reached(out, kill_after, [proc])
        ranks = sorted(_children(proc.pid))
        os.kill(ranks[-1], signal.SIGKILL)  # rank 3 (spawned last); its partner is rank 0
        if lose_both_copies:
            _gone(ranks)
            shutil.rmtree(node_holder(str(out), 3))  # rank 3's node lost ...
            for step in held_copies(node_holder(str(out), 0)):  # ... and its copy on the partner's node
                with contextlib.suppress(FileNotFoundError):  # the newest may never have arrived
                    os.remove(os.path.join(node_holder(str(out), 0), f"step_{step}", "rank_3.pt"))
    _finish([proc], [tmp_path / "lmt.log"])
    assert not os.path.exists(holder_root(str(out)))  # a finished run gives the host memory back
    return metrics(out), (tmp_path / "lmt.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,save_every,kill_after", [("tp2dp2", 100, 6), ("pp2dp2", 4, 7), ("tp2dp2-zero3", 100, 6)]
)
def test_a_killed_rank_comes_back_from_the_in_memory_copies_on_the_same_curve(
    tmp_path, small_corpus, builtin, layout, save_every, kill_after
):
    """save_every 100: no durable checkpoint before the end; 4: the launcher names step_4, and the copies (of
    step 6, or of 4 when 6's was in flight) are used all the same: the metrics rows up to them are kept.
    ZeRO-3: each rank's FSDP2 shards, copied as they lie."""
    rows, log = _run_and_kill(
        tmp_path, small_corpus, lose_both_copies=False, save_every=save_every, layout=layout, kill_after=kill_after
    )
    (restart,) = [r["restart"] for r in rows if "restart" in r]
    recovery = restart["recovery"]
    assert recovery["from"] == "in-memory copies" and not recovery["durable_read"], recovery
    assert recovery["failed_rank"] == 3 and "SIGKILL" in recovery["why"], recovery
    assert restart["resumed_from"] == recovery["step"] and recovery["step"] % EVERY == 0, restart
    assert recovery["step"] >= 4, recovery
    assert recovery["steps_redone"] <= EVERY + 1, recovery  # the newest copy may still be in flight at the kill
    assert set(recovery["phases_s"]) == {"restart_to_build", "build", "agree", "load"}
    for phases in recovery["rebuild_s"].values():  # a restarted process: from the verdict to train_rank's start
        assert {"enter", "mesh", "data", "model", "agree", "load", "first_step"} <= set(phases), phases
        assert abs(sum(s for p, s in phases.items() if p != "total") - phases["total"]) < 0.02, phases
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # every step logged once
    assert losses(rows) == builtin(layout)
    assert "recovered from the in-memory copies of step" in log and "copies lost" not in log


@pytest.mark.slow
def test_both_copies_of_a_shard_lost_falls_back_to_the_durable_checkpoint(tmp_path, small_corpus, builtin):
    rows, log = _run_and_kill(tmp_path, small_corpus, lose_both_copies=True, save_every=4)
    said = [line for line in log.splitlines() if "in-memory copies lost" in line]
    assert len(said) == 1 and "rank 3" in said[0] and "checkpoints/step_" in said[0], said
    (restart,) = [r["restart"] for r in rows if "restart" in r]
    assert "recovery" not in restart and restart["resumed_from"] % 4 == 0, restart
    assert losses(rows) == builtin("tp2dp2")


def _last_gasp_rank(run_dir: str) -> None:
    """Rank 0 is SIGTERMed while its copy of a 64 MB state is in flight; rank 1 takes part in the exchange."""
    import torch
    import torch.distributed as dist

    from large_model_training.reliability.local_checkpoint import LocalCheckpoints

    copies = LocalCheckpoints(run_dir, 1)
    copies.save(1, {"w": torch.arange(16 << 20, dtype=torch.float32) + dist.get_rank()})
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGTERM)  # as the launcher stops a rank
        time.sleep(60)  # the handler ends the process once the copy is out
    copies.wait()


@pytest.mark.slow
def test_sigterm_finishes_the_copy_in_flight_before_the_rank_exits(tmp_path):
    import torch

    from large_model_training.launch import RankFailure, run_on_ranks

    run_dir = str(tmp_path / "run")
    try:
        with pytest.raises(RankFailure, match="rank 0 failed: process exited with code 143"):
            run_on_ranks(_last_gasp_rank, 2, (run_dir,), timeout_s=60)
        for holder, rank in ((0, 0), (0, 1), (1, 1), (1, 0)):  # own copies and the partner's
            saved = read_copy(os.path.join(node_holder(run_dir, holder), "step_1", f"rank_{rank}.pt"))
            assert torch.equal(saved["w"], torch.arange(16 << 20, dtype=torch.float32) + rank)
    finally:
        shutil.rmtree(holder_root(run_dir), ignore_errors=True)


def test_held_copies_lists_only_whole_copies_and_a_snapshot_reads_back_as_taken(tmp_path):
    import torch

    from large_model_training.reliability.flat_state import Snapshot, tail

    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "rank_0.pt").write_bytes(b"x")
    (tmp_path / "step_2" / "rank_1.pt.tmp").write_bytes(b"x")  # a copy being written is not held yet
    (tmp_path / "step_4").mkdir()
    assert held_copies(str(tmp_path)) == {2: [0], 4: []}
    assert held_copies(str(tmp_path / "none")) == {}
    live = {
        "w": torch.ones(3),
        "nested": [torch.zeros(2, dtype=torch.bfloat16), (torch.tensor(7, dtype=torch.int64), "a")],
        "rng": torch.arange(5, dtype=torch.uint8),  # 5 bytes: the next tensor must still start aligned
        "after": torch.full((2, 3), 2.5, dtype=torch.float64),
        "empty": torch.empty(0),
        "n": 5,
        3: None,
    }
    snapshot = Snapshot()
    snapshot.take(live, lambda n: torch.empty(n, dtype=torch.uint8))
    live["w"].add_(1)  # training goes on: the snapshot does not change with it
    path = tmp_path / "rank_0.pt"
    path.write_bytes(snapshot.payload().numpy().tobytes() + b"".join(tail(snapshot.header())))
    back = read_copy(str(path))
    assert back["w"].tolist() == [1, 1, 1] and back["n"] == 5 and back[3] is None
    assert back["nested"][0].dtype == torch.bfloat16 and back["nested"][0].tolist() == [0, 0]
    assert back["nested"][1][0].dim() == 0 and int(back["nested"][1][0]) == 7 and back["nested"][1][1] == "a"
    assert back["rng"].tolist() == [0, 1, 2, 3, 4] and torch.equal(back["after"], live["after"])
    assert back["empty"].shape == (0,)


def test_recovery_phases_add_up_to_the_total_and_a_phase_begun_before_the_verdict_counts_from_it():
    from large_model_training.train.recovery import RecoveryClock, slowest_phases

    assert RecoveryClock(None).marks == [] and RecoveryClock({"attempt": 1}).start is None
    idle = RecoveryClock(None)
    idle.mark("data")  # a fresh start: nothing is marked
    assert idle.marks == []
    # a survivor that saw the lost peer 0.05 s before the launcher's verdict: its abort phase is 0, not negative
    clock = RecoveryClock({"detected_at": 100.0, "marks": [["abort", 99.95], ["rejoin", 100.2]]})
    clock.marks += [("mesh", 100.25), ("model", 100.5), ("first_step", 100.6)]
    phases = clock.phases()
    assert phases == {"abort": 0.0, "rejoin": 0.2, "mesh": 0.05, "model": 0.25, "first_step": 0.1, "total": 0.6}
    assert abs(sum(v for k, v in phases.items() if k != "total") - phases["total"]) < 1e-9
    other = {"abort": 0.3, "rejoin": 0.1, "total": 0.4}
    assert slowest_phases({"0": phases, "3": other}) == {**phases, "abort": 0.3}
