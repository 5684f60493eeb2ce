"""--spares: a rank SIGKILLed mid-run is replaced in place (an idle spare, or a process started then when the spare
itself died) while the survivors keep their processes; the replacement loads its shard from the partner's
in-memory copy, everyone rolls back to the newest complete copy, and the run ends on the uninterrupted curve bit
for bit without reading a durable checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from large_model_training.reliability.local_checkpoint import holder_root
from tests.helpers import losses, metrics
from tests.test_local_recovery import (  # noqa: F401 - the module's reference curves
    EVERY,
    LAYOUTS,  # tp2dp2, pp2dp2
    builtin,
)
from tests.test_torchrun import COMMON, _children, _ended_on_failure, _finish, _reached


def _run(
    tmp_path: Path, corpus: str, kill_spare_first: bool, layout: str = "tp2dp2"
) -> tuple[list[dict], str, list[int]]:
    """A layout of 4 ranks with one spare; rank 3 SIGKILLed once step 6 is logged (the idle spare first, at step 3, when
    `kill_spare_first`). Returns the metrics rows, the launcher's output and the first processes' PIDs."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "large_model_training.cli", "train", "--out", str(out), *COMMON, "--data", corpus]
    cmd += [*LAYOUTS[layout], "--save-every", "100", "--save-local-every", str(EVERY), "--spares", "1"]
    try:
        with open(tmp_path / "lmt.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        with _ended_on_failure([proc]):
            _reached(out, 3, [proc])
            pids = sorted(_children(proc.pid))  # ranks 0-3, then the spare (spawned in that order)
            assert len(pids) == 5, pids
            if kill_spare_first:
                os.kill(pids[4], signal.SIGKILL)
            _reached(out, 6, [proc])
            os.kill(pids[3], signal.SIGKILL)
        _finish([proc], [tmp_path / "lmt.log"])
        assert not os.path.exists(holder_root(str(out)))  # a finished run gives the host memory back
        return metrics(out), (tmp_path / "lmt.log").read_text(), pids
    finally:
        shutil.rmtree(holder_root(str(out)), ignore_errors=True)


def _check_recovered_in_place(
    rows: list[dict],
    log: str,
    pids: list[int],
    builtin,  # noqa: F811
    layout: str = "tp2dp2",
) -> dict:
    (restart,) = [r["restart"] for r in rows if "restart" in r]
    recovery = restart["recovery"]
    assert recovery["in_place"] and not recovery["durable_read"], recovery
    assert recovery["failed_rank"] == 3 and "SIGKILL" in recovery["why"], recovery
    assert recovery["copies"] == {"3": "partner rank 0"}, recovery  # the replacement is a new machine
    assert recovery["step"] >= 4 and recovery["steps_redone"] <= EVERY + 1, recovery
    kept = [r for r in range(3) if r not in recovery["restarted_stuck"]]  # a stuck survivor restarts (in_place.py)
    assert [recovery["pids"][r] for r in kept] == [pids[r] for r in kept], (recovery, pids)  # the others kept theirs
    assert len(kept) >= 2 and ("process is restarted in place" in log) == (len(kept) < 3), recovery
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # every step logged once
    assert losses(rows) == builtin(layout)
    assert "replaced in place" in log and "recovered in place from the in-memory copies" in log
    assert "restart 1 of" not in log and "checkpoints/step_" not in log.split("replaced in place")[1].split("\n")[0]
    _check_phases(recovery, log)
    return recovery


def _check_phases(recovery: dict, log: str) -> None:
    """Every rank's phases, from the launcher's verdict to the first step completed again, add up to its total;
    the ranks meet at the first step, so their totals agree; one line in the log says the slowest per phase."""
    by_rank = recovery["rebuild_s"]
    assert set(by_rank) == {"0", "1", "2", "3"}, by_rank
    for phases in by_rank.values():
        assert {"abort", "rejoin", "mesh", "model", "copies_group", "load", "first_step"} <= set(phases), phases
        assert all(s >= 0 for s in phases.values()), phases
        assert abs(sum(s for p, s in phases.items() if p != "total") - phases["total"]) < 0.02, phases
    totals = [phases["total"] for phases in by_rank.values()]
    assert max(totals) - min(totals) < 0.1, totals  # the first step ends on every rank at about the same time
    (said,) = [line for line in log.splitlines() if line.startswith("lmt: recovery took")]
    assert "first_step" in said and "rejoin" in said, said


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2dp2", "pp2dp2"])
def test_a_killed_rank_is_replaced_by_the_spare_and_the_survivors_keep_their_processes(
    tmp_path,
    small_corpus,
    builtin,  # noqa: F811
    layout,
):
    rows, log, pids = _run(tmp_path, small_corpus, kill_spare_first=False, layout=layout)
    recovery = _check_recovered_in_place(rows, log, pids, builtin, layout)
    assert recovery["pids"][3] == pids[4], (recovery, pids)  # rank 3 is now the spare


@pytest.mark.slow
def test_a_spare_that_died_is_stood_in_for_by_a_process_started_then(tmp_path, small_corpus, builtin):  # noqa: F811
    rows, log, pids = _run(tmp_path, small_corpus, kill_spare_first=True)
    assert "spare process 4 died" in log
    recovery = _check_recovered_in_place(rows, log, pids, builtin)
    assert recovery["pids"][3] not in pids, (recovery, pids)  # a fresh process took rank 3


def _cut_in_this_process() -> None:
    import socket

    from large_model_training.reliability.in_place import cut_connections

    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    store_port = listeners[1].getsockname()[1]
    pair = socket.create_connection(listeners[0].getsockname())  # a gloo pair stands for it
    store = socket.create_connection(("127.0.0.1", store_port))  # the store's connection
    accepted = [listener.accept()[0] for listener in listeners]
    try:
        assert cut_connections(store_port) >= 2  # both ends of the pair live in this process
        assert pair.recv(1) == b"" and accepted[0].recv(1) == b""  # shut down: the peer sees the end at once
        store.sendall(b"x")
        assert accepted[1].recv(1) == b"x"  # the store's connection still works
        late = socket.create_connection(listeners[0].getsockname())  # the listener still accepts
        late.close()
    finally:
        for s in (pair, store, *accepted, *listeners):
            s.close()


@pytest.mark.slow
def test_the_cut_takes_same_host_connections_but_the_stores_and_leaves_listeners_alone():
    """In a process of its own: the cut takes every same-host connection of the process it runs in."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_cut_in_this_process)
    child.start()
    child.join(60)
    assert child.exitcode == 0


class _MovedStore:
    def get(self, key: str) -> bytes:
        return b"1"  # the launcher has moved the job to generation 1


def _stuck_survivor(leaves: bool) -> None:
    """A survivor's training thread after the job moved on: it waits and never leaves (or leaves in time)."""
    import threading

    from large_model_training.reliability import in_place

    in_place.STUCK_AFTER_CUT_S = 0.5
    watcher = in_place._Watcher(_MovedStore(), 0, store_port=1, rank=2)
    if leaves:
        time.sleep(0.2)  # its collective failed at the cut
        watcher.stop()
        time.sleep(1.0)
        return
    threading.Event().wait(30)  # a collective the cut did not end


@pytest.mark.slow
@pytest.mark.parametrize("leaves", [False, True])
def test_a_survivor_still_waiting_after_the_cut_exits_for_a_fresh_process(leaves):
    """In a process of its own: the watcher cuts, and a training thread still in the failed generation
    STUCK_AFTER_CUT_S later ends the process with EXIT_STUCK (the launcher then starts a fresh one for the rank)."""
    import multiprocessing

    from large_model_training.launch import EXIT_STUCK

    child = multiprocessing.get_context("spawn").Process(target=_stuck_survivor, args=(leaves,))
    started = time.monotonic()
    child.start()
    child.join(60)
    assert child.exitcode == (0 if leaves else EXIT_STUCK)
    assert time.monotonic() - started < 20


def _rank_stuck_after_the_kill(restart) -> dict:
    """Generation 0: rank 1 is killed; rank 0 then waits on something the cut cannot end. Generation 1 (rank 0 a
    fresh process, rank 1 the spare): one collective, and what each process was told."""
    import signal
    import threading

    import torch
    import torch.distributed as dist

    if restart is None:
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait(120)  # as a gloo send lost at the cut: only the process's end ends it
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"sum": float(total), "restarted_stuck": bool(restart.get("restarted_stuck"))}


@pytest.mark.slow
def test_a_survivor_stuck_after_the_cut_is_restarted_in_place_without_a_spare():
    """The killed rank takes the one spare; the survivor that never leaves its failed generation exits with
    EXIT_STUCK and a fresh process for its rank joins the same generation; the job ends well."""
    from large_model_training.launch import run_on_ranks
    from large_model_training.reliability.in_place import Spares

    started = time.monotonic()
    first, second = run_on_ranks(_rank_stuck_after_the_kill, 2, (None,), timeout_s=60, spares=Spares(1, 0, 60))
    assert first["sum"] == second["sum"] == 2.0
    assert first["restarted_stuck"] and not second["restarted_stuck"]  # the spare stands for the killed rank
    assert time.monotonic() - started < 45  # the 10 s wait after the cut, not the 60 s collective timeout


def _own_error_rank(restart) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad shard")
    dist.barrier()  # rank 0 waits on rank 1, as in a collective of the step


@pytest.mark.slow
def test_a_ranks_own_error_ends_the_job_as_without_spares():
    """Only a killed process is replaced: an error a rank raises itself is named as before, the spare unused."""
    import time

    from large_model_training.launch import RankFailure, run_on_ranks
    from large_model_training.reliability.in_place import Spares

    started = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed: ValueError: bad shard"):
        run_on_ranks(_own_error_rank, 2, (None,), timeout_s=60, spares=Spares(1, 0, 60))
    assert time.monotonic() - started < 45  # not the 60 s collective timeout
