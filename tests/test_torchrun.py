"""torchrun: its ranks (one node, or two agents on this machine acting as two nodes) train the built-in launcher's
curve; a SIGKILLed rank is restarted, by torchrun's agents and by the built-in launcher alike (--max-restarts),
resumes from the newest checkpoint (--resume auto) and ends on the uninterrupted curve, bit for bit; a lost node
(of tp=2 x dp=2 across two nodes) leaves the survivors to go on at the smaller world size."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist import train_together, world_size
from tests.helpers import SMALL_MODEL, assert_close_curves, losses, metrics, train

slow = pytest.mark.slow  # every test here but the first trains, most start torchrun agents or spawn ranks

# A kill comes once step 5 is logged: the run resumes from step_4 (or a later checkpoint, should the kill land late;
# 16 steps leave room for that).
STEPS, SAVE_EVERY = 16, 4
COMMON = [
    *SMALL_MODEL,
    "--steps",
    str(STEPS),
    "--eval-every",
    "0",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
]
LAYOUTS = {"dp2": ["--dp", "2"], "dp4": ["--dp", "4"], "tp2dp2": ["--tp", "2", "--dp", "2"]}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def builtin(tmp_path_factory, small_corpus):
    """The built-in launcher's uninterrupted curve of a layout, trained once for the module on first use."""
    root, curves = tmp_path_factory.mktemp("builtin"), {}

    def curve(layout: str) -> list[float]:
        if layout not in curves:  # on the pooled ranks: no torch import per reference
            args = [*COMMON, "--data", small_corpus, *LAYOUTS[layout]]
            train_together(world_size(args), {str(root / layout): args})
            curves[layout] = losses(metrics(root / layout))
        return curves[layout]

    return curve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# With --nnodes 1:2, a lost node leaves the rendezvous after 3 missed heartbeats 1 s apart (default 3 x 5 s), and a
# round that may still grow waits 2 s for late nodes (default 30 s). Tighter settings (2 x 1 s, 1 s), with a worker
# killed rather than a node, once had two one-node worlds train side by side into one run folder here, under load.
QUICK_RENDEZVOUS = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"


def _agents(logs: Path, nodes: int, args: list[str], *flags: str, nnodes: str = "") -> list[subprocess.Popen]:
    """`nodes` torchrun agents of 2 ranks each on this machine, one c10d rendezvous: one node each, as on a
    cluster. The first hosts the rendezvous store (is_host), so the others can be lost without it."""
    port = _free_port()
    agents = []
    for node in range(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            nnodes or str(nodes),
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            logs.name,
            "--rdzv-conf",
            f"is_host={int(node == 0)}{',' + QUICK_RENDEZVOUS if nnodes else ''}",
            "--monitor-interval",
            "0.1",
            *flags,
            "-m",
            "large_model_training.cli",
            "train",
            *args,
        ]
        with open(logs / f"agent{node}.log", "w") as log:
            agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    return agents


def _finish(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait for every process; all must exit 0 (else the tail of each log fails the test). None is left behind."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
    assert codes == [0] * len(procs), f"exit codes {codes}\n{tails}"


def _wait_for(done, procs: list[subprocess.Popen], what: str) -> None:
    """Poll done() until true; the processes must stay up meanwhile."""
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert all(p.poll() is None for p in procs), f"a process ended before {what}"
        assert time.monotonic() < deadline, f"{what}: not within {TIMEOUT_S} s"
        time.sleep(0.01)


def _reached(out: Path, step: int, procs: list[subprocess.Popen]) -> None:
    """Block until rank 0 has logged `step` (the processes must stay up meanwhile)."""
    path = out / "metrics.jsonl"
    _wait_for(lambda: path.exists() and sum(1 for _ in open(path)) >= step, procs, f"step {step}")


@contextlib.contextmanager
def _ended_on_failure(procs: list[subprocess.Popen]):
    """Kill the launchers (their ranks die with them or time out alone) if the test fails in this block."""
    try:
        yield
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise


def _children(pid: int) -> list[int]:
    """The ranks a launcher started: its child processes, the multiprocessing resource tracker aside."""
    children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    return [c for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]


def test_resume_auto_needs_a_run_folder(capsys):
    from large_model_training.cli import main

    assert main(["train", "--resume", "auto", *SMALL_MODEL]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "lmt: error: --resume auto needs --out RUN_FOLDER (the run to continue if it has a checkpoint)"


@slow
def test_resume_auto_without_a_checkpoint_starts_fresh_with_a_new_record(tmp_path, small_corpus):
    """No checkpoint in the folder: --resume auto trains from step 1, and rows an earlier attempt left behind
    (it saved nothing, so they are all redone) are not mixed into the new record."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": -1.0}\n{"step": 2, "loss": -1.0}\n{"step": 3, "lo')
    rows = train(
        str(out),
        *SMALL_MODEL,
        "--data",
        small_corpus,
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--resume",
        "auto",
    )
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 and "restart" not in r for r in rows)


def _restarts(rows: list[dict], count: int) -> list[dict]:
    """Every step logged once; `count` restart records, each on the step after the checkpoint it resumed from."""
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    restarts = [r for r in rows if "restart" in r]
    assert len(restarts) == count, restarts
    for row in restarts:
        assert row["step"] == row["restart"]["resumed_from"] + 1 and row["step"] - 1 in (4, 8, 12), row
    return [r["restart"] for r in restarts]


@slow
def test_torchrun_restarts_a_killed_worker_and_resumes_on_the_same_curve(tmp_path, small_corpus, builtin):
    """Two nodes, dp=4, torchrun --max-restarts 1 and lmt --resume auto; a worker SIGKILLed after step 5. Both
    agents restart their ranks, which rejoin through the agents' shared store (the killed round's keys are still
    there, unread) and resume from the newest checkpoint: every step logged once, the uninterrupted built-in
    curve bit for bit."""
    out = tmp_path / "run"
    args = [
        "--out",
        str(out),
        *COMMON,
        "--data",
        small_corpus,
        *LAYOUTS["dp4"],
        "--save-every",
        str(SAVE_EVERY),
        "--resume",
        "auto",
    ]
    agents = _agents(tmp_path, 2, args, "--max-restarts", "1")
    with _ended_on_failure(agents):
        _reached(out, 5, agents)
        os.kill(_children(agents[1].pid)[-1], signal.SIGKILL)
    _finish(agents, sorted(tmp_path.glob("agent*.log")))
    rows = metrics(out)
    (record,) = _restarts(rows, 1)
    assert record["attempt"] == 1 and record["world_size"] == 4, record
    assert "leaves none" in record["reason"], record  # a SIGKILLed worker leaves no error: the record says so
    assert losses(rows) == builtin("dp4")


@slow
def test_torchrun_goes_on_at_the_smaller_world_size_when_a_node_is_lost(tmp_path, small_corpus, builtin):
    """Two nodes of --nnodes 1:2, two ranks each (lmt --tp 2 --resume auto, dp from the world size): the 4-rank
    attempt trains tp=2 x dp=2 across the nodes, as two machines would; the second node is lost (agent and ranks
    SIGKILLed) after step 5: the first goes on alone and resumes at tp=2 x dp=1. The global batch is the same, so
    is the curve, to rounding: the built-in launcher's tp=2 x dp=2 curve."""
    out = tmp_path / "run"
    args = [
        "--out",
        str(out),
        *COMMON,
        "--data",
        small_corpus,
        "--tp",
        "2",
        "--save-every",
        str(SAVE_EVERY),
        "--resume",
        "auto",
    ]
    agents = _agents(tmp_path, 2, args, "--max-restarts", "1", nnodes="1:2")
    with _ended_on_failure(agents):
        _reached(out, 5, agents)
        # A node later than the first round's last call makes the ranks restart when it comes: wait for 4 ranks.
        _wait_for(lambda: "dp = 2" in (out / "config.toml").read_text(), agents, "an attempt of 4 ranks")
        for pid in [agents[1].pid, *_children(agents[1].pid)]:
            os.kill(pid, signal.SIGKILL)
    agents[1].wait()
    _finish(agents[:1], [tmp_path / "agent0.log"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    record = [r["restart"] for r in rows if "restart" in r][-1]
    assert record["world_size"] == 2 and record["resumed_from"] in (4, 8, 12), record
    assert_close_curves(losses(rows), builtin("tp2dp2"), rtol=1e-5, what="tp2 x dp1 on one node after tp2 x dp2 on two")


@slow
def test_builtin_launcher_restarts_a_killed_rank_and_resumes_on_the_same_curve(tmp_path, small_corpus, builtin):
    """lmt train --max-restarts 1 with a rank SIGKILLed after step 5: one line says so, the ranks resume from the
    newest checkpoint, and the run exits 0 on the uninterrupted curve, bit for bit."""
    out = tmp_path / "run"
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
                small_corpus,
                *LAYOUTS["dp2"],
                "--save-every",
                str(SAVE_EVERY),
                "--max-restarts",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    with _ended_on_failure([proc]):
        _reached(out, 5, [proc])
        os.kill(_children(proc.pid)[-1], signal.SIGKILL)
    _finish([proc], [tmp_path / "lmt.log"])
    rows = metrics(out)
    (record,) = _restarts(rows, 1)
    assert record["attempt"] == 1 and re.fullmatch(r"rank \d failed: process killed by SIGKILL", record["reason"])
    assert losses(rows) == builtin("dp2")
    said = [line for line in (tmp_path / "lmt.log").read_text().splitlines() if "restart 1 of 1" in line]
    assert len(said) == 1 and f"checkpoints/step_{record['resumed_from']}" in said[0], said
