"""--precision fp8 (models/float8.py) composed with every axis: each layout trains the tp=1 fp8 curve.

Tolerance 1e-2 relative over 5 steps (the issue's): a layout changes which tokens a scale is computed over (dp,
cp and micro-batches scale each part on its own) and float8's rounding of the values it moves, not the
arithmetic. tp is held tighter: its amaxes are reduced over the group, so tp=2 computes tp=1's scales."""

from __future__ import annotations

import pytest

from large_model_training.cli import main
from large_model_training.config import build_config
from large_model_training.planner.activations import float8_input_saving
from large_model_training.planner.comm import zero3_bytes_per_step
from large_model_training.planner.memory import block_norm_parameters, block_parameters_per_rank, stage_parameters
from tests.helpers import SMALL_MODEL, Runs, assert_close_curves, losses

COMMON = [*SMALL_MODEL, "--steps", "5", "--eval-every", "0", "--global-batch-size", "8", "--micro-batch-size", "2"]
FP8 = [*COMMON, "--precision", "fp8"]
ROWWISE = [*FP8, "--train.fp8_recipe", "rowwise"]
GW_HP = [*FP8, "--train.fp8_recipe", "rowwise_with_gw_hp"]
ENDS = [*FP8, "--model.n_layers", "4", "--train.fp8_bf16_first_last", "1"]  # blocks 0 and 3 in bf16

LAYOUTS = {  # name: (reference run, arguments, relative tolerance)
    "tp2-sp-pp2-dp2": ("fp8", [*FP8, "--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2"], 1e-2),
    "tp2": ("fp8", [*FP8, "--tp", "2"], 2e-3),
    "rowwise-tp2-sp": ("rowwise", [*ROWWISE, "--tp", "2", "--sequence-parallel"], 2e-3),
    "gw-hp-tp2-sp": ("gw-hp", [*GW_HP, "--tp", "2", "--sequence-parallel"], 2e-3),
    "ends-pp2": ("ends", [*ENDS, "--pp", "2"], 1e-4),  # stage 1's blocks are 2 and 3: the model's indices count
    "zb-h1-pp2": ("fp8", [*FP8, "--pp", "2", "--schedule", "zb-h1"], 1e-2),
    "zero3-cp2": ("fp8", [*FP8, "--zero", "3", "--dp", "2", "--cp", "2"], 1e-2),
    "zero3-dp2": ("fp8", [*FP8, "--zero", "3", "--dp", "2", "--save-every", "3"], 1e-2),
    "zero3-tp2-dp2": ("fp8", [*FP8, "--zero", "3", "--tp", "2", "--dp", "2"], 1e-2),
    "compiled": ("fp8", [*FP8, "--compile", "--train.compile_backend", "aot_eager"], 1e-3),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return Runs(
        root,
        {
            "bf16": [*COMMON, "--precision", "bf16"],
            "fp8": [*FP8, "--save-every", "3"],
            "rowwise": ROWWISE,
            "gw-hp": GW_HP,
            "ends": ENDS,
            "bf16-4": [*COMMON, "--precision", "bf16", "--model.n_layers", "4"],
            "fp8-resumed": [*FP8, "--resume", str(root / "fp8" / "checkpoints" / "step_3")],
            "fp8-resumed-tp2": [*FP8, "--tp", "2", "--resume", str(root / "fp8" / "checkpoints" / "step_3")],
            "zero3-dp2-resumed": [
                *LAYOUTS["zero3-dp2"][1],
                "--resume",
                str(root / "zero3-dp2" / "checkpoints" / "step_3"),
            ],
            "bf16-zero3-dp2": [*COMMON, "--precision", "bf16", "--zero", "3", "--dp", "2"],
            **{name: args for name, (_, args, _) in LAYOUTS.items()},
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_trains_the_one_process_fp8_curve(runs, name):
    reference, _, rtol = LAYOUTS[name]
    assert_close_curves(losses(runs[name]), losses(runs[reference]), rtol=rtol, what=f"fp8 {name}")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8", "rowwise", "gw-hp"])
def test_fp8_follows_the_bf16_curve_and_differs_from_it(runs, recipe):
    fp8, bf16 = losses(runs[recipe]), losses(runs["bf16"])
    assert_close_curves(fp8, bf16, rtol=3e-2, what=f"{recipe} against bf16")
    assert fp8 != bf16  # the GEMMs did run in float8


@pytest.mark.slow
def test_an_fp8_checkpoint_resumes_on_its_curve_exactly_and_reshards(runs):
    assert losses(runs["fp8-resumed"]) == losses(runs["fp8"])[3:]
    assert_close_curves(losses(runs["fp8-resumed-tp2"]), losses(runs["fp8"])[3:], rtol=2e-3, what="fp8 tp1 -> tp2")


@pytest.mark.slow
def test_zero3_gathers_fp8_weights_in_float8_half_the_bytes_the_planner_counts(runs):
    """ZeRO-3 with tensorwise fp8 all-gathers the block linears' weights at 1 byte per value
    (parallel/fsdp_float8.py); the bytes FSDP2 moves, counted at its collectives (parallel/fsdp_counters.py), are
    the planner's figure exactly, in bf16 and in fp8; the float8 run resumes on its curve exactly."""
    cfg = build_config(str(runs.folder("zero3-dp2") / "config.toml")).model
    params = dict(
        layers=cfg.n_layers,
        block_params=block_parameters_per_rank(cfg, 1),
        block_norm_params=block_norm_parameters(cfg),
        chunk_params=stage_parameters(cfg, 1, 0, True, True),
    )
    micro = 8 // (2 * 2)  # global batch / (dp x micro-batch)
    planned = {
        f8: zero3_bytes_per_step(micro, 2, param_bytes=2, grad_bytes=2, float8_gather=f8, **params)
        for f8 in (False, True)
    }
    assert runs["bf16-zero3-dp2"][-1]["comm_bytes_dp"] == planned[False]
    assert runs["zero3-dp2"][-1]["comm_bytes_dp"] == planned[True] < 0.75 * planned[False]
    assert losses(runs["zero3-dp2-resumed"]) == losses(runs["zero3-dp2"])[3:]


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--train.fp8_recipe", "blockwise"],
            "train.fp8_recipe must be one of tensorwise, rowwise, rowwise_with_gw_hp",
        ),
        (["--model.hidden_size", "72", "--model.n_heads", "4"], "float8 GEMMs need multiples of 16"),
        (["--seq-len", "60", "--micro-batch-size", "1", "--global-batch-size", "1"], "tokens per rank"),
        (["--train.fp8_bf16_first_last", "1"], "keeps all 2 blocks in bf16"),
        (["--train.fp8_bf16_first_last", "-1"], "train.fp8_bf16_first_last must be >= 0"),
    ],
)
def test_fp8_refusals_are_one_line_and_exit_2(args, says, capsys, tmp_path):
    code = main(["train", *FP8, *args, "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err, err


@pytest.mark.slow
def test_fp8_saves_its_kept_float8_inputs_as_the_planner_counts(runs):
    """Tensorwise linears keep their inputs as forward's float8 cast (models/float8.py): the activation counter
    measures bf16's bytes less exactly the planner's `float8_input_saving`; the rowwise recipes keep bf16 inputs."""
    cfg = build_config(str(runs.folder("fp8") / "config.toml"))
    per_block = float8_input_saving(cfg.model, cfg.train.seq_len, cfg.train.micro_batch_size, 1, False, 2)
    bf16 = runs["bf16"][0]["activation_bytes"]
    assert runs["rowwise"][0]["activation_bytes"] == runs["gw-hp"][0]["activation_bytes"] == bf16 > 0
    assert runs["fp8"][0]["activation_bytes"] == bf16 - cfg.model.n_layers * per_block
    # --train.fp8_bf16_first_last 1 of 4 blocks: the two middle ones keep float8 inputs, the ends bf16 ones
    assert runs["ends"][0]["activation_bytes"] == runs["bf16-4"][0]["activation_bytes"] - 2 * per_block
