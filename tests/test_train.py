"""End-to-end training: data-parallel parity with one process, resume parity, non-finite steps, outputs."""

from __future__ import annotations

import os

import pytest

from large_model_training.cli import main
from tests.helpers import SMALL_MODEL, Runs, assert_close_curves, losses, train, val_losses

pytestmark = pytest.mark.slow  # every test here trains

DP_LAYOUTS = {
    "dp2": ["--dp", "2", "--micro-batch-size", "4"],
    "dp4": ["--dp", "4", "--micro-batch-size", "1"],
}  # 2 micro-batches each, as the one process


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    root = tmp_path_factory.mktemp("train")
    parity = [
        *SMALL_MODEL,
        "--data",
        small_corpus,
        "--steps",
        "4",
        "--global-batch-size",
        "8",
        "--eval-every",
        "2",
        "--train.eval_batches",
        "2",
    ]
    dropout = [
        *SMALL_MODEL,
        "--data",
        small_corpus,
        "--steps",
        "6",
        "--micro-batch-size",
        "4",
        "--dp",
        "2",
        "--model.dropout",
        "0.1",
    ]
    return Runs(
        root,
        {
            "dp1": [*parity, "--micro-batch-size", "4"],  # 2 accumulated micro-batches
            **{name: [*parity, *layout] for name, layout in DP_LAYOUTS.items()},
            "full": [*dropout, "--save-every", "3"],
            "resumed": [*dropout, "--resume", str(root / "full" / "checkpoints" / "step_3")],
        },
    )


@pytest.mark.parametrize("name", list(DP_LAYOUTS))
def test_dp_layout_matches_one_process(runs, name):
    single, rows = runs["dp1"], runs[name]
    assert_close_curves(losses(rows), losses(single), rtol=1e-5, what=name)
    assert len(val_losses(rows)) == 2
    assert_close_curves(val_losses(rows), val_losses(single), rtol=1e-5, what=f"{name} val")
    assert losses(single)[-1] < losses(single)[0]


def test_resume_repeats_the_same_losses(runs):
    assert (runs.folder("full") / "checkpoints" / "step_3" / "meta.json").exists()
    resumed = runs["resumed"]
    assert [r["step"] for r in resumed] == list(range(4, 7))
    assert losses(resumed) == losses(runs["full"])[3:]  # bit for bit, dropout included


def test_run_folder_contents_and_generate(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    rows = train(
        str(out), *SMALL_MODEL, "--data", small_corpus, "--steps", "4", "--eval-every", "2", "--train.eval_batches", "1"
    )
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert all(key in r for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert (out / "config.toml").exists() and (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoints" / "step_4" / "meta.json").exists()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
    # The written config is accepted back by --config and reproduces the run.
    again = train(str(tmp_path / "again"), "--config", str(out / "config.toml"), "--out", str(tmp_path / "again"))
    assert losses(again) == losses(rows)
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "20", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > 4


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, small_corpus, capsys):
    from large_model_training.config import build_config
    from large_model_training.launch import run_in_process
    from large_model_training.layout import validate
    from large_model_training.train.trainer import TrainingError
    from tests.test_train import _train_with_poisoned_weights

    cfg = validate(
        build_config(
            overrides={
                "data.path": small_corpus,
                "model.hidden_size": 64,
                "model.n_layers": 2,
                "train.seq_len": 64,
                "train.steps": 20,
                "train.max_bad_steps": 3,
            }
        )
    )
    with pytest.raises(TrainingError, match="not finite for 3 consecutive steps"):
        run_in_process(_train_with_poisoned_weights, (cfg, str(tmp_path)))
    rows = [line for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3 and all('"skipped": true' in r for r in rows)


def _train_with_poisoned_weights(cfg, run_dir):
    import torch

    from large_model_training.mesh import ParallelMesh
    from large_model_training.train.trainer import Trainer

    trainer = Trainer(cfg, ParallelMesh.for_this_rank(1, 1, 1), run_dir)
    with torch.no_grad():
        trainer.model.output.weight.fill_(float("nan"))
    return trainer.fit()
