"""Checkpoints: layout changes on resume, atomic saves under kill -9, dead ranks, async saves, damaged files."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from large_model_training.cli import main
from tests.dist import train_together
from tests.helpers import Runs, assert_close_curves, losses, metrics, train

pytestmark = pytest.mark.slow  # every test here trains

MODEL = ["--model.hidden_size", "32", "--model.n_layers", "4", "--model.n_heads", "4", "--model.ffn_hidden_size", "64",
         "--seq-len", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--eval-every", "0",
         "--model.vocab_size", "301", "--model.tie_embeddings", "true"]  # 301: padded vocabulary at tp=2


RESUME_LAYOUTS = {"single": ["--tp", "1", "--pp", "1", "--dp", "1"],
                  "pp4-dp2-zero1": ["--tp", "1", "--pp", "4", "--dp", "2", "--zero", "1"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    """The runs several tests read, each trained once, when first read (a resumed run after its source)."""
    root = tmp_path_factory.mktemp("checkpoint")
    three_d = [*MODEL, "--data", small_corpus, "--steps", "8"]
    saving = [*MODEL, "--data", small_corpus, "--steps", "12", "--save-every", "4"]
    return Runs(root, {
        "3d": [*three_d, "--tp", "2", "--pp", "2", "--dp", "2", "--save-every", "4"],
        **{f"3d-as-{name}": [*three_d, *layout, "--resume", str(root / "3d" / "checkpoints" / "step_4")]
           for name, layout in RESUME_LAYOUTS.items()},
        "one-process": saving,
        "dp2": [*saving, "--dp", "2"],
        "dp2-async": [*saving, "--dp", "2", "--async-save", "--keep", "2"],
        "dp2-async-resumed": [*saving, "--dp", "2", "--steps", "16",
                              "--resume", str(root / "dp2-async" / "checkpoints" / "step_8")],
        "two-steps": [*MODEL, "--data", small_corpus, "--steps", "2"],
    })


@pytest.mark.parametrize("name", list(RESUME_LAYOUTS))
def test_resume_in_other_layouts(runs, name):
    full, resumed = runs["3d"], runs[f"3d-as-{name}"]  # from tp2 x pp2 x dp2, saved at step 4 of 8
    assert [r["step"] for r in resumed] == list(range(5, 9))
    assert_close_curves(losses(resumed), losses(full)[4:], rtol=1e-5, what=name)


def test_async_save_keeps_the_newest_and_resumes_exactly(runs):
    sync, rows, run = runs["dp2"], runs["dp2-async"], runs.folder("dp2-async")
    assert losses(rows) == losses(sync)
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_12", "step_8"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_12"
    resumed = runs["dp2-async-resumed"]  # from step 8, on to step 16
    assert [r["step"] for r in resumed] == list(range(9, 17))
    assert losses(resumed)[:4] == losses(sync)[8:12]


def _damage(ckpt, how: str) -> str:
    path = sorted(p for p in os.listdir(ckpt) if p.endswith(".distcp"))[0]
    full = os.path.join(ckpt, path)
    data = bytearray(open(full, "rb").read())
    if how == "truncate":
        data = data[:len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    open(full, "wb").write(bytes(data))
    return path


@pytest.mark.parametrize("how,message", [("truncate", "truncated"), ("corrupt", "corrupted")])
def test_damaged_checkpoint_is_refused_naming_the_file(runs, tmp_path, small_corpus, capsys, how, message):
    common = [*MODEL, "--data", small_corpus, "--steps", "2"]
    shutil.copytree(runs.folder("two-steps"), tmp_path / "run")  # the shared run stays whole
    damaged = _damage(tmp_path / "run" / "checkpoints" / "step_2", how)
    capsys.readouterr()
    assert main(["train", *common, "--steps", "4", "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert message in err and damaged in err and len(err.strip().splitlines()) == 1


KILL_DURING_SAVE = """
import os, sys, threading
import torch.distributed.checkpoint as dcp
from large_model_training.cli import main
real_save = dcp.save
def stalled_save(state, checkpoint_id, **kw):
    if str(checkpoint_id).endswith(".tmp_step_8"):
        open(os.environ["STALLED_MARKER"], "w").close()  # tells the test the writer is mid-save
        threading.Event().wait()  # where it hangs until the test kills it
    return real_save(state, checkpoint_id=checkpoint_id, **kw)
dcp.save = stalled_save
sys.exit(main(sys.argv[1:]))
"""


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_kill_during_save_then_resume_latest(runs, tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "12", "--save-every", "4"]
    reference = runs["one-process"]
    run, stalled = tmp_path / "run", tmp_path / "stalled"
    proc = subprocess.Popen([sys.executable, "-c", KILL_DURING_SAVE, "train", *common, "--out", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "STALLED_MARKER": str(stalled)})
    try:
        _wait_for(stalled.exists)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run / "checkpoints" / ".tmp_step_8").exists()  # the half-written save, left hidden
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_4"
    resumed = train(str(run), *common, "--resume", "latest")
    assert [r["step"] for r in resumed][-8:] == list(range(5, 13))  # lost only steps 5-8
    assert losses(resumed)[-8:] == losses(reference)[4:]


def _rank_children(pid: int) -> list[int]:
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(c) for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]


def test_a_killed_rank_ends_the_job_naming_it_then_resume_is_exact(runs, tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "12", "--save-every", "4", "--dp", "2"]
    reference = runs["dp2"]
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "large_model_training.cli", "train", *common, "--out", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        rows = run / "metrics.jsonl"
        _wait_for(lambda: rows.exists() and len(rows.read_text().splitlines()) >= 5)  # step_4 is saved
        os.kill(_rank_children(proc.pid)[-1], signal.SIGKILL)
        # The launcher sees the death at once: waiting on the survivor's collective would take the default
        # run.timeout (300 s), far past this wait.
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    last = (run / "checkpoints" / "latest").read_text().strip()  # step_4, or step_8 if the kill came late
    assert proc.returncode != 0 and last in ("step_4", "step_8")
    assert "rank 1" in err and "SIGKILL" in err and "last complete checkpoint" in err and last in err
    train_together(2, {str(run): [*common, "--resume", "latest"]})
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, 13))  # the killed run's rows up to the save, then on
    assert losses(resumed) == losses(reference)  # bit for bit
