"""Pipeline parallelism: stage splits, every schedule on the pp=1 loss curve, activation memory per stage."""

from __future__ import annotations

import json

import pytest
import torch

from large_model_training.config import ModelConfig, model_from_preset
from large_model_training.errors import ConfigError
from large_model_training.mesh import ParallelMesh
from large_model_training.assembly import build_model
from large_model_training.api import PipelineParallelism
from large_model_training.parallel.pipeline.partition import balanced_split, stage_layers
from tests.dist import run_ranks, world_size
from tests.helpers import Runs, assert_close_curves, losses, val_losses


def test_balanced_split_gives_the_heavy_head_fewer_blocks():
    cfg = model_from_preset("llama3-8b")  # a 128k vocabulary: the head costs about 2 blocks
    split = balanced_split(cfg, 4, 8192)
    assert sum(split) == 32 and split[-1] < split[0]
    tiny = model_from_preset("tiny")
    assert balanced_split(tiny, 2, 256) == [2, 2]
    # An odd block goes to the stage without the head.
    assert balanced_split(tiny.__class__(**{**tiny.__dict__, "n_layers": 5}), 2, 256) == [3, 2]


@pytest.mark.parametrize("args,message", [
    ((4, 2, "1f1b", "1,1,1,2"), "lists 4 stages but"),
    ((2, 1, "1f1b", "1,2"), "adds up to 3"),
    ((2, 1, "1f1b", "10,0"), "at least 1 layer"),
    ((16, 1, "1f1b", ""), "more than the 10 layers"),
    ((2, 3, "interleaved", ""), "divisible by pp x virtual_stages"),
])
def test_splits_that_cannot_add_up_are_refused(args, message):
    pp, v, kind, explicit = args
    with pytest.raises(ConfigError, match=message):
        stage_layers(model_from_preset("small"), pp, v, kind, 256, explicit)


PP_MODEL = ["--model.hidden_size", "32", "--model.n_layers", "8", "--model.n_heads", "4", "--model.ffn_hidden_size",
            "64", "--seq-len", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--eval-every", "2",
            "--train.eval_batches", "1", "--steps", "4"]  # 8 micro-batches a step and a validation (4 at dp=2)
TIED = ["--model.tie_embeddings", "true"]
LAYOUTS = {
    "pp2-gpipe": ["--pp", "2", "--schedule", "gpipe"],
    "pp2-1f1b": ["--pp", "2", "--schedule", "1f1b"],
    "pp2-interleaved": ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"],
    "pp4-gpipe": ["--pp", "4", "--schedule", "gpipe"],
    "pp4-1f1b-uneven": ["--pp", "4", "--schedule", "1f1b", "--pp-layers", "1,3,3,1"],
    "pp4-interleaved": ["--pp", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
    "tp2-pp2-dp2-tied": ["--tp", "2", "--pp", "2", "--dp", "2", *TIED],
}
M = 8  # micro-batches of a step of pp2-gpipe and pp2-1f1b, whose activation bytes the memory test reads
MEMORY_RUNS = {"memory-m1": ["--pp", "2", "--steps", "2", "--eval-every", "0", "--global-batch-size", "1"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    """The pp=1 references and every pipeline run of this module, each trained once, when first read."""
    common = [*PP_MODEL, "--data", small_corpus]
    return Runs(tmp_path_factory.mktemp("pp"), {"ref": common, "ref-tied": [*common, *TIED],
                                                **{name: [*common, *extra] for name, extra in LAYOUTS.items()},
                                                **{name: [*common, *extra] for name, extra in MEMORY_RUNS.items()}})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_reproduces_the_pp1_curve(runs, name):
    rows, expected = runs[name], runs["ref-tied" if "tied" in name else "ref"]
    assert_close_curves(losses(rows), losses(expected), rtol=1e-4, what=name)
    assert len(val_losses(rows)) == 2
    assert_close_curves(val_losses(rows), val_losses(expected), rtol=1e-4, what=f"{name} val")
    assert all(0.0 <= r["bubble_fraction"] < 1.0 and r["comm_bytes_pp"] > 0 for r in rows)
    trace = json.load(open(runs.folder(name) / "timeline.json"))
    assert {e["tid"] for e in trace["traceEvents"]} == set(range(world_size(LAYOUTS[name])))
    assert (runs.folder(name) / "timeline.png").stat().st_size > 1000


@pytest.mark.slow
def test_activation_memory_per_stage_follows_the_schedule(runs):
    """gpipe holds all m micro-batches on every stage; 1f1b at most p - stage (saved-tensor bytes, by hooks)."""
    one = runs["memory-m1"][-1]["activation_bytes_per_stage"]
    for kind in ("gpipe", "1f1b"):
        row = runs[f"pp2-{kind}"][-1]
        for stage, (held, per_microbatch) in enumerate(zip(row["activation_bytes_per_stage"], one)):
            expected = M if kind == "gpipe" else min(M, 2 - stage)
            assert row["in_flight_per_stage"][stage] == expected
            assert abs(held / per_microbatch - expected) < 0.05 * expected, (kind, stage, held / per_microbatch)


def _seed_flow(schedule: str):
    mesh = ParallelMesh.for_this_rank(2, 1, 1)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, n_layers=4, n_heads=4, ffn_hidden_size=64, max_seq_len=16)
    tokens = torch.randint(0, 64, (4, 2, 17), generator=torch.Generator().manual_seed(0))
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens]
    full = build_model(cfg, None, seed=2)
    ref = sum(full.loss_fn(full(x), y) for x, y in micro) / 4
    ref.backward()
    pipe = PipelineParallelism(mesh, schedule=schedule)
    stage = pipe.split_model(cfg, seed=2)
    if schedule == "gpipe":
        loss = pipe.forward(micro)
        pipe.backward()
    else:
        loss = pipe.train_step(micro)
    full_params = dict(full.named_parameters())
    worst = max(float((p.grad - full_params[n].grad).abs().max()) for n, p in stage.named_parameters())
    return float(loss), float(ref), worst


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_seed_api_split_forward_backward(schedule):
    for loss, ref, worst_grad_error in run_ranks(_seed_flow, 2, schedule):
        assert abs(loss - ref) < 1e-5 * abs(ref) and worst_grad_error < 1e-6
    assert PipelineParallelism.grid("1f1b", 2, 3)[0][:2] == ["0F0", "0F1"]
