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
    from large_model_training.parallel.adamw import stochastic_round

    x = torch.full((200_000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16, 1 + 2^-7
    rounded = stochastic_round(x, step=3, position=0).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(x[0].item(), abs=2e-5)
    assert torch.equal(stochastic_round(x, 3, 0), stochastic_round(x, 3, 0))  # seeded: a resume repeats it


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
