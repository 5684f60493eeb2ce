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
from tests.dist import start_process, train_together
from tests.helpers import Runs, assert_close_curves, losses, metrics, model_flags, train

pytestmark = pytest.mark.slow  # every test here trains

# vocabulary 301: padded at tp=2
MODEL = [
    *model_flags(hidden_size=32, n_layers=4, ffn_hidden_size=64, vocab_size=301, tie_embeddings=True),
    "--seq-len",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--eval-every",
    "0",
]


RESUME_LAYOUTS = {
    "single": ["--tp", "1", "--pp", "1", "--dp", "1"],
    "pp4-dp2-zero1": ["--tp", "1", "--pp", "4", "--dp", "2", "--zero", "1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    """The runs several tests read, each trained once, when first read (a resumed run after its source)."""
    root = tmp_path_factory.mktemp("checkpoint")
    three_d = [*MODEL, "--data", small_corpus, "--steps", "4"]
    saving = [*MODEL, "--data", small_corpus, "--save-every", "2"]
    return Runs(
        root,
        {
            "3d": [*three_d, "--tp", "2", "--pp", "2", "--dp", "2", "--save-every", "2"],
            **{
                f"3d-as-{name}": [*three_d, *layout, "--resume", str(root / "3d" / "checkpoints" / "step_2")]
                for name, layout in RESUME_LAYOUTS.items()
            },
            "one-process": [*saving, "--steps", "6"],
            "dp2": [*saving, "--steps", "10", "--dp", "2"],
            "dp2-async": [*saving, "--steps", "10", "--dp", "2", "--async-save", "--keep", "2"],
            "dp2-async-resumed": [
                *saving,
                "--steps",
                "12",
                "--dp",
                "2",
                "--resume",
                str(root / "dp2-async" / "checkpoints" / "step_8"),
            ],
        },
    )


@pytest.mark.parametrize("name", list(RESUME_LAYOUTS))
def test_resume_in_other_layouts(runs, name):
    full, resumed = runs["3d"], runs[f"3d-as-{name}"]  # from tp2 x pp2 x dp2, saved at step 2 of 4
    assert [r["step"] for r in resumed] == list(range(3, 5))
    assert_close_curves(losses(resumed), losses(full)[2:], rtol=1e-5, what=name)


def test_async_save_keeps_the_newest_and_resumes_exactly(runs):
    sync, rows, run = runs["dp2"], runs["dp2-async"], runs.folder("dp2-async")
    assert losses(rows) == losses(sync)
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_10", "step_8"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_10"
    resumed = runs["dp2-async-resumed"]  # from step 8 (the older one kept), on to step 12
    assert [r["step"] for r in resumed] == list(range(9, 13))
    assert losses(resumed)[:2] == losses(sync)[8:10]


def _damage(ckpt, how: str) -> str:
    path = sorted(p for p in os.listdir(ckpt) if p.endswith(".distcp"))[0]
    full = os.path.join(ckpt, path)
    data = bytearray(open(full, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    open(full, "wb").write(bytes(data))
    return path


@pytest.mark.parametrize("how,message", [("truncate", "truncated"), ("corrupt", "corrupted")])
def test_damaged_checkpoint_is_refused_naming_the_file(runs, tmp_path, small_corpus, capsys, how, message):
    common = [*MODEL, "--data", small_corpus, "--steps", "8"]
    shutil.copytree(runs.folder("one-process"), tmp_path / "run")  # the shared run stays whole
    damaged = _damage(tmp_path / "run" / "checkpoints" / "step_6", how)  # its latest
    capsys.readouterr()
    assert main(["train", *common, "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert message in err and damaged in err and len(err.strip().splitlines()) == 1


def _train_stalling_in_the_save_of_step_4(argv: list[str], marker: str) -> None:
    """`lmt train` whose save of step 4 stops half-way (as a process killed there would), after creating marker."""
    import threading

    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def stalled_save(state, checkpoint_id, **kw):
        if str(checkpoint_id).endswith(".tmp_step_4"):
            open(marker, "w").close()  # tells the test the writer is mid-save
            threading.Event().wait()  # where it hangs until the test kills it
        return real_save(state, checkpoint_id=checkpoint_id, **kw)

    dcp.save = stalled_save
    main(argv)


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_kill_during_save_then_resume_latest(runs, tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "6", "--save-every", "2"]
    reference = runs["one-process"]
    run, stalled = tmp_path / "run", tmp_path / "stalled"
    proc = start_process(_train_stalling_in_the_save_of_step_4, ["train", *common, "--out", str(run)], str(stalled))
    try:
        _wait_for(lambda: stalled.exists() or not proc.is_alive())
        assert stalled.exists(), f"the run ended (exit code {proc.exitcode}) before its save of step 4"
    finally:
        proc.kill()  # SIGKILL
        proc.join()
    assert (run / "checkpoints" / ".tmp_step_4").exists()  # the half-written save, left hidden
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    resumed = train(str(run), *common, "--resume", "latest")
    assert [r["step"] for r in resumed][-4:] == list(range(3, 7))  # lost only steps 3-4
    assert losses(resumed)[-4:] == losses(reference)[2:]


def _rank_children(pid: int) -> list[int]:
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(c) for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]


def test_a_killed_rank_ends_the_job_naming_it_then_resume_is_exact(runs, tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "10", "--save-every", "2", "--dp", "2"]
    reference = runs["dp2"]
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "large_model_training.cli", "train", *common, "--out", str(run)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rows = run / "metrics.jsonl"
        _wait_for(lambda: rows.exists() and len(rows.read_text().splitlines()) >= 3)  # step_2 is saved
        os.kill(_rank_children(proc.pid)[-1], signal.SIGKILL)
        # The launcher sees the death at once: waiting on the survivor's collective would take the default
        # run.timeout (300 s), far past this wait.
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    last = (run / "checkpoints" / "latest").read_text().strip()  # step_2, or a later one if the kill came late
    assert proc.returncode != 0 and last in ("step_2", "step_4", "step_6", "step_8")
    assert "rank 1" in err and "SIGKILL" in err and "last complete checkpoint" in err and last in err
    train_together(2, {str(run): [*common, "--resume", "latest"]})
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, 11))  # the killed run's rows up to the save, then on
    assert losses(resumed) == losses(reference)  # bit for bit
