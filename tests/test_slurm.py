"""examples/slurm/train.sbatch, the file itself, run by bash (its #SBATCH lines are comments) against a fake `srun`
and `scontrol` on PATH: two "nodes" as two local torchrun agents of one rank each (gloo), the c10d rendezvous on
the first host of the node list. A rank SIGKILLed mid-run fails the job (no torchrun restarts here), the script
requeues it (`scontrol requeue`), and the job run again, as Slurm would run it, resumes from the newest checkpoint
(--resume auto) and finishes: every step once, the steps the first attempt had logged recomputed bit for bit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SMALL_MODEL, losses, metrics

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "train.sbatch"
STEPS, SAVE_EVERY, JOB_ID = 12, 3, str(400000 + os.getpid() % 100000)
TIMEOUT_S = 240

# Slurm's srun, for a job on this one machine: the task once per node of the job, SLURM_NODEID and SLURM_PROCID set,
# all tasks ended when one fails (the script asks for --kill-on-bad-exit), the first failure's exit code returned.
FAKE_SRUN = """#!/usr/bin/env bash
args="$*"
echo "srun ${args//$'\\n'/ }" >> "$FAKE_SLURM_LOG"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
status=0
for ((left = ${#pids[@]}; left > 0; left--)); do
    wait -n
    code=$?
    if ((code != 0 && status == 0)); then status=$code; kill -TERM "${pids[@]}" 2>/dev/null; fi
done
exit $status
"""
# scontrol: the node list expanded (a plain comma list here), and a requeue recorded (the test runs the job again).
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
case "$1 $2" in
    "show hostnames") tr ',' '\\n' <<< "$3" ;;
    "requeue $SLURM_JOB_ID") ;;
    *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_env(tmp_path: Path, corpus: str, restart_count: int) -> dict[str, str]:
    """What Slurm sets for the batch script, the fakes first on PATH, then this Python's torchrun."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    train_args = [
        *SMALL_MODEL,
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--eval-every",
        "0",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
    ]
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2",
        "SLURM_RESTART_COUNT": str(restart_count),
        "RUN_DIR": str(tmp_path / "shared" / "run"),
        "DATA": corpus,
        "NPROC_PER_NODE": "1",
        "TRAIN_ARGS": " ".join(train_args),
        "RDZV_PORT": str(_free_port()),
        "MAX_RESTARTS": "0",
    }


def _rank_pid(rank: int) -> int | None:
    """The pid of this job's torchrun worker of global rank `rank` (found by its environment), if it runs."""
    want = {f"RANK={rank}".encode(), f"TORCHELASTIC_RUN_ID=lmt-{JOB_ID}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= environ:
            return int(pid)
    return None


def _job(tmp_path: Path, env: dict[str, str], name: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(
        ["bash", str(SCRIPT)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _ended(proc: subprocess.Popen, tmp_path: Path, name: str) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the script, the fake srun, the agents and their ranks
            proc.wait()
    return code, (tmp_path / f"{name}.log").read_text()


@pytest.mark.slow
def test_the_sbatch_script_trains_requeues_a_failed_job_and_resumes(tmp_path, small_corpus):
    run = tmp_path / "shared" / "run"
    first = _job(tmp_path, _job_env(tmp_path, small_corpus, 0), "attempt1")
    deadline = time.monotonic() + TIMEOUT_S
    try:  # once step 4 is logged (a checkpoint at step 3 exists), rank 1, on the second node, is SIGKILLed
        while not ((run / "metrics.jsonl").exists() and len(metrics(run)) >= 4):
            assert first.poll() is None, (tmp_path / "attempt1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "step 4 not reached"
            time.sleep(0.01)
        pid = _rank_pid(1)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signal.SIGKILL)
    finally:
        code, log = _ended(first, tmp_path, "attempt1")
    assert code != 0 and "requeueing job" in log, log[-3000:]
    calls = (tmp_path / "slurm.log").read_text().splitlines()
    assert calls[0] == "scontrol show hostnames 127.0.0.1,127.0.0.2", calls
    assert calls[1].startswith("srun --nodes=2 --ntasks-per-node=1 ") and "--kill-on-bad-exit=1" in calls[1], calls
    assert calls[2] == f"scontrol requeue {JOB_ID}", calls
    before = metrics(run)

    # Slurm runs the requeued job again, the same script with SLURM_RESTART_COUNT=1; it must finish the run.
    code, log = _ended(_job(tmp_path, _job_env(tmp_path, small_corpus, 1), "attempt2"), tmp_path, "attempt2")
    assert code == 0, log[-3000:]
    assert "attempt 2, 2 nodes x 1 ranks, rendezvous 127.0.0.1:" in log and "requeue" not in log, log[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    (record,) = [r["restart"] for r in rows if "restart" in r]
    assert record["world_size"] == 2 and record["resumed_from"] % SAVE_EVERY == 0, record
    recomputed = [r["step"] for r in before if r["step"] > record["resumed_from"]]
    assert recomputed, (record, before)  # the first attempt got past its last checkpoint before the kill
    assert losses(rows)[: len(before)] == losses(before)
    assert all(r["loss"] > 0 for r in rows) and len(os.listdir(run / "checkpoints")) >= 1
