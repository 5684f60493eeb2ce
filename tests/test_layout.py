"""The one layout check: lmt train, lmt plan and lmt estimate agree on what a valid run is; choice fields are
typed once; resuming compares the saved layout, not the world size."""

import json

import pytest
import torch

from large_model_training.choices import CompressionSpec, Precision, RecomputePolicy, Schedule
from large_model_training.cli import main
from large_model_training.config import build_config, to_toml
from large_model_training.layout import Job, Layout, job_and_layout, layout_problems, validate
from large_model_training.train import checkpoint
from large_model_training.train.checkpoint import rank_loop_state

# (flags that make a layout invalid, words of the one message all three commands give)
INVALID = [
    (["--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    (["--tp", "3"], "divisible by tp"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "4"], "8 chunks need at least 6 layers"),
    (["--virtual-stages", "2"], "needs --schedule interleaved"),
    (["--dp", "2", "--zero", "2", "--compression", "int8"], "compose"),
    (["--recompute", "every:9"], "every:K"),
]


@pytest.mark.parametrize("flags,words", INVALID, ids=[w for _, w in INVALID])
def test_train_plan_and_estimate_refuse_the_same_layouts(flags, words, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.toml").exists()
    assert main(["estimate", *flags]) == 2
    assert words in capsys.readouterr().err
    job, layout = job_and_layout(_unchecked_config(flags))  # a candidate, as the planner's search holds it
    assert any(words in problem for problem in layout_problems(job, layout))


def _unchecked_config(flags: list[str]):
    """The config lmt train's flags describe, before its layout is checked."""
    from large_model_training.arguments import overrides
    from large_model_training.cli import build_parser

    return build_config(None, overrides(build_parser().parse_args(["train", *flags])))


def test_choice_fields_are_typed_once_and_round_trip_through_toml(tmp_path):
    cfg = validate(
        build_config(
            None,
            {
                "parallel.schedule": "GPipe",
                "train.precision": "bf16",
                "train.recompute": "every:2",
                "train.compression": "topk:0.01",
            },
        )
    )
    assert cfg.parallel.schedule is Schedule.GPIPE and cfg.train.precision is Precision.BF16
    assert cfg.train.recompute == RecomputePolicy("every", 2)
    assert cfg.train.compression == CompressionSpec("topk", ratio=0.01)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    again = validate(build_config(str(path)))
    assert again.to_dict() == cfg.to_dict()
    assert json.loads(json.dumps(cfg.to_dict()))["train"]["recompute"] == "every:2"


def test_a_layout_the_planner_builds_is_checked_by_the_same_rules():
    cfg = validate(build_config(None, {}))
    job = Job(cfg.model, 256, 16)
    assert layout_problems(job, Layout(1, 1, 1, 16)) == []
    assert layout_problems(job, Layout(2, 1, 1, 16, sequence_parallel=True)) == []
    assert any("needs --tp > 1" in p for p in layout_problems(job, Layout(1, 1, 1, 16, sequence_parallel=True)))
    assert any("micro-batches" in p for p in layout_problems(job, Layout(1, 2, 1, 16, Schedule.INTERLEAVED, 2)))


def test_resume_compares_the_saved_layout_not_the_world_size(tmp_path):
    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    meta = {
        "format": checkpoint.FORMAT,
        "version": checkpoint.VERSION,
        "step": 4,
        "layout": {"tp": 2, "pp": 1, "dp": 2, "zero": 0},
    }
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / ".metadata").write_bytes(b"")  # what DCP writes; its content is not read here
    for rank in range(4):
        torch.save({"loader": {"step": 4}, "rng": {"cpu": torch.tensor([rank])}}, ckpt / f"rank_{rank}.pt")
    same = rank_loop_state(str(ckpt), {"tp": 2, "pp": 1, "dp": 2}, rank=1)
    assert int(same["rng"]["cpu"]) == 1, "in the saved layout each rank gets its own RNG state back"
    other = rank_loop_state(str(ckpt), {"tp": 1, "pp": 1, "dp": 4}, rank=1)
    assert "rng" not in other and other["loader"] == {"step": 4}, "dp4 has 4 ranks too, but not the same ranks"


def test_dp_zero_is_explained_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0: what is left" in text
