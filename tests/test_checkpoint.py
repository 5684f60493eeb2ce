"""Checkpoints: layout changes on resume, atomic saves under kill -9, dead ranks, async saves, damaged files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from large_model_training.cli import main
from tests.helpers import assert_close_curves, losses, train

MODEL = ["--model.hidden_size", "32", "--model.n_layers", "4", "--model.n_heads", "4", "--model.ffn_hidden_size", "64",
         "--seq-len", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--eval-every", "0",
         "--model.vocab_size", "301", "--model.tie_embeddings", "true"]  # 301: padded vocabulary at tp=2


def test_resume_in_other_layouts(tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "20"]
    full = train(str(tmp_path / "a"), *common, "--tp", "2", "--pp", "2", "--dp", "2", "--save-every", "10")
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_10")
    for name, layout in {"single": ["--tp", "1", "--pp", "1", "--dp", "1"],
                         "pp4-dp2-zero1": ["--tp", "1", "--pp", "4", "--dp", "2", "--zero", "1"]}.items():
        resumed = train(str(tmp_path / name), *common, *layout, "--resume", ckpt)
        assert [r["step"] for r in resumed] == list(range(11, 21))
        assert_close_curves(losses(resumed), losses(full)[10:], rtol=1e-5, what=name)


def test_async_save_keeps_the_newest_and_resumes_exactly(tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "12", "--save-every", "4", "--dp", "2"]
    sync = train(str(tmp_path / "sync"), *common)
    run = tmp_path / "async"
    rows = train(str(run), *common, "--async-save", "--keep", "2")
    assert losses(rows) == losses(sync)
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_12", "step_8"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_12"
    resumed = train(str(tmp_path / "again"), *common, "--steps", "16", "--resume", str(run / "checkpoints" / "step_8"))
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
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, small_corpus, capsys, how, message):
    common = [*MODEL, "--data", small_corpus, "--steps", "2"]
    train(str(tmp_path / "run"), *common)
    damaged = _damage(tmp_path / "run" / "checkpoints" / "step_2", how)
    capsys.readouterr()
    assert main(["train", *common, "--steps", "4", "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert message in err and damaged in err and len(err.strip().splitlines()) == 1


KILL_DURING_SAVE = """
import sys, time
import torch.distributed.checkpoint as dcp
from large_model_training.cli import main
real_save = dcp.save
def stalled_save(state, checkpoint_id, **kw):
    if str(checkpoint_id).endswith(".tmp_step_8"):
        time.sleep(600)  # the writer hangs mid-save here until the test kills it
    return real_save(state, checkpoint_id=checkpoint_id, **kw)
dcp.save = stalled_save
sys.exit(main(sys.argv[1:]))
"""


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_kill_during_save_then_resume_latest(tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "12", "--save-every", "4"]
    reference = train(str(tmp_path / "ref"), *common)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", KILL_DURING_SAVE, "train", *common, "--out", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (run / "checkpoints" / ".tmp_step_8").exists())
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_4"
    resumed = train(str(run), *common, "--resume", "latest")
    assert [r["step"] for r in resumed][-8:] == list(range(5, 13))  # lost only steps 5-8
    assert losses(resumed)[-8:] == losses(reference)[4:]


def _rank_children(pid: int) -> list[int]:
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(c) for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]


def test_a_killed_rank_ends_the_job_naming_it_then_resume_is_exact(tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--steps", "24", "--save-every", "8", "--dp", "2",
              "--run.timeout", "60"]
    reference = train(str(tmp_path / "ref"), *common)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "large_model_training.cli", "train", *common, "--out", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 10)
    victim = _rank_children(proc.pid)[-1]
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode != 0 and time.monotonic() - started < 60
    assert "rank 1" in err and "SIGKILL" in err and "last complete checkpoint" in err and "step_8" in err
    resumed = train(str(run), *common, "--resume", "latest")
    assert losses(resumed)[-16:] == losses(reference)[8:]  # bit for bit
