"""`--train.optimizer_states bf16`: Adam's moments stored in bf16. The planner's bytes per parameter, the estimate
against what a run holds, and a short run that differs from fp32 states but stays close; ZeRO-3 refuses it."""

from __future__ import annotations

import pytest
import torch

from large_model_training.config import build_config
from large_model_training.errors import ConfigError
from large_model_training.layout import validate
from large_model_training.planner import memory as mem
from large_model_training.planner.estimate import estimate_memory
from tests.helpers import Runs, assert_close_curves, losses

MODEL = [
    "--model.hidden_size",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.ffn_hidden_size",
    "128",
    "--seq-len",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--eval-every",
    "0",
    "--steps",
    "12",
]


def test_bytes_per_parameter_drop_by_the_moments_half():
    assert mem.state_bytes_per_parameter("bf16", optimizer_states="bf16") == (2, 2, 8)  # 12 -> 8
    assert mem.state_bytes_per_parameter("fp32", optimizer_states="bf16") == (4, 4, 4)
    assert sum(mem.model_state_bytes(1000, "bf16", 1, 4, optimizer_states="bf16")) == 2000 + 2000 + 2000
    assert mem.state_bytes_per_parameter("bf16", optimizer_states="bf16_sr") == (2, 2, 4)  # 12 -> 4: no fp32 master


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    from large_model_training.parallel.adamw import RoundingNoise

    x = torch.full((200_000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16, 1 + 2^-7
    x[1::2] *= -1  # negatives round by magnitude
    noise = RoundingNoise(step=3, elements=1 << 17, device=torch.device("cpu"))  # a whole piece: two runs of it
    for stream in range(RoundingNoise.STREAMS):
        rounded = torch.empty(x.shape, dtype=torch.bfloat16)
        noise.round_into(rounded, x.clone(), stream)
        assert set(rounded.abs().float().unique().tolist()) == {1.0, 1.0 + 2**-7}
        for half in (rounded[0::2], -rounded[1::2]):
            assert half.float().mean().item() == pytest.approx(1.0 + 2**-10, abs=4e-5)
    again = torch.empty(x.shape, dtype=torch.bfloat16)
    RoundingNoise(3, 1 << 17, torch.device("cpu")).round_into(again, x.clone(), 1)
    first = torch.empty_like(again)
    noise.round_into(first, x.clone(), 1)
    assert torch.equal(again, first)  # seeded by the step: a resume repeats it


def _adamw(states: torch.dtype, n: int):
    from large_model_training.parallel.adamw import AdamW
    from tests.test_planner_passes import _shards

    _, shards = _shards(n, torch.float32)
    return AdamW(shards, weight_decay=0.0, betas=(0.9, 0.999), state_dtype=states)


def test_bf16_moments_follow_fp32_moments_where_rounding_to_nearest_drifts():
    """600 steps of a gradient whose scale shrinks 0.5% a step: the second moment should decay with it. Its 0.1%
    change a step is under half a bf16 ulp, so kept rounded to nearest it stays behind (shown on the same EMA,
    +10% and more); AdamW's bf16 moments, rounded stochastically, stay within 1% of fp32 moments."""
    n = 1 << 14
    exact, kept = _adamw(torch.float32, n), _adamw(torch.bfloat16, n)
    nearest = torch.zeros(n, dtype=torch.bfloat16)
    start = [opt.shards.pieces[0].master.clone() for opt in (exact, kept)]
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand(n, generator=gen) * 2 + 0.1
    for t in range(1, 601):
        grad = (torch.randn(n, generator=gen) + 0.3) * scale * 0.995**t
        for opt in (exact, kept):
            opt.step(opt.shards.pieces, [grad], 1e-4, 1.0)
        nearest = (nearest.float() * 0.999).addcmul_(grad, grad, value=0.001).to(torch.bfloat16)
    v32, v16 = exact.exp_avg_sq[0], kept.exp_avg_sq[0].float()
    assert (nearest.float().sum() / v32.sum()).item() > 1.10  # the premise: nearest stays behind
    assert (v16.sum() / v32.sum()).item() == pytest.approx(1.0, abs=0.01)
    assert (kept.exp_avg[0].float().sum() / exact.exp_avg[0].sum()).item() == pytest.approx(1.0, abs=0.01)
    moved = [opt.shards.pieces[0].master - s for opt, s in zip((exact, kept), start)]
    assert ((moved[1] - moved[0]).norm() / moved[0].norm()).item() < 0.02  # the weights moved alike (0.8% here)


def test_zero_3_refuses_bf16_states():
    with pytest.raises(ConfigError, match="optimizer_states bf16"):
        validate(build_config(overrides={"train.optimizer_states": "bf16", "parallel.zero": 3, "parallel.dp": 2}))
    with pytest.raises(ConfigError, match="needs --precision bf16"):
        validate(build_config(overrides={"train.optimizer_states": "bf16_sr"}))
    with pytest.raises(ConfigError, match="train.optimizer_states must be one of"):
        validate(build_config(overrides={"train.optimizer_states": "fp8"}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    root = tmp_path_factory.mktemp("states")
    common = [*MODEL, "--data", small_corpus]
    return Runs(
        root,
        {
            "fp32": common,
            "bf16": [*common, "--train.optimizer_states", "bf16"],
            "mixed-bf16": [*common, "--precision", "bf16", "--train.optimizer_states", "bf16"],
            "mixed-fp32": [*common, "--precision", "bf16"],
            "mixed-sr": [*common, "--precision", "bf16", "--train.optimizer_states", "bf16_sr"],
            "muon-bf16": [*common, "--optimizer", "muon", "--train.optimizer_states", "bf16"],
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "mixed-bf16", "mixed-sr"])
def test_estimate_counts_bf16_states_as_measured(runs, name):
    args = dict(zip(runs.args[name][::2], runs.args[name][1::2]))
    overrides = {
        "model.hidden_size": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.ffn_hidden_size": 128,
        "train.seq_len": 32,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "train.optimizer_states": args["--train.optimizer_states"],
        "train.precision": args.get("--precision", "fp32"),
    }
    predicted = estimate_memory(build_config(None, overrides))
    assert predicted.model_states == pytest.approx(runs[name][-1]["model_state_bytes"], rel=1e-6)


@pytest.mark.slow
def test_bf16_states_differ_from_fp32_but_stay_close(runs):
    fp32, bf16 = losses(runs["fp32"]), losses(runs["bf16"])
    assert fp32[0] == bf16[0] and fp32[2:] != bf16[2:]  # the same start; the rounded moments show after it
    assert_close_curves(bf16, fp32, rtol=0.01, what="bf16 vs fp32 optimizer states")
    assert all(x == x for x in losses(runs["muon-bf16"]))  # composes with Muon (its AdamW half)


@pytest.mark.slow
def test_bf16_masters_with_stochastic_rounding_stay_close_to_fp32_masters(runs):
    fp32, sr = losses(runs["mixed-fp32"]), losses(runs["mixed-sr"])
    assert fp32[0] == sr[0] and fp32[2:] != sr[2:]
    assert_close_curves(sr, fp32, rtol=0.01, what="bf16_sr vs fp32 masters and states")
