"""--precision fp8 (models/float8.py) composed with every axis: each layout trains the tp=1 fp8 curve.

Tolerance 1e-2 relative over 5 steps (the issue's): a layout changes which tokens a scale is computed over (dp,
cp and micro-batches scale each part on its own) and float8's rounding of the values it moves, not the
arithmetic. tp is held tighter: its amaxes are reduced over the group, so tp=2 computes tp=1's scales."""

from __future__ import annotations

import pytest

from large_model_training.cli import main
from tests.helpers import SMALL_MODEL, Runs, assert_close_curves, losses

COMMON = [*SMALL_MODEL, "--steps", "5", "--eval-every", "0", "--global-batch-size", "8", "--micro-batch-size", "2"]
FP8 = [*COMMON, "--precision", "fp8"]
ROWWISE = [*FP8, "--train.fp8_recipe", "rowwise"]

LAYOUTS = {  # name: (reference run, arguments, relative tolerance)
    "tp2-sp-pp2-dp2": ("fp8", [*FP8, "--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2"], 1e-2),
    "tp2": ("fp8", [*FP8, "--tp", "2"], 2e-3),
    "rowwise-tp2-sp": ("rowwise", [*ROWWISE, "--tp", "2", "--sequence-parallel"], 2e-3),
    "zb-h1-pp2": ("fp8", [*FP8, "--pp", "2", "--schedule", "zb-h1"], 1e-2),
    "zero3-cp2": ("fp8", [*FP8, "--zero", "3", "--dp", "2", "--cp", "2"], 1e-2),
    "compiled": ("fp8", [*FP8, "--compile", "--train.compile_backend", "aot_eager"], 1e-3),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return Runs(root, {
        "bf16": [*COMMON, "--precision", "bf16"], "fp8": [*FP8, "--save-every", "3"], "rowwise": ROWWISE,
        "fp8-resumed": [*FP8, "--resume", str(root / "fp8" / "checkpoints" / "step_3")],
        "fp8-resumed-tp2": [*FP8, "--tp", "2", "--resume", str(root / "fp8" / "checkpoints" / "step_3")],
        **{name: args for name, (_, args, _) in LAYOUTS.items()}})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_trains_the_one_process_fp8_curve(runs, name):
    reference, _, rtol = LAYOUTS[name]
    assert_close_curves(losses(runs[name]), losses(runs[reference]), rtol=rtol, what=f"fp8 {name}")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8", "rowwise"])
def test_fp8_follows_the_bf16_curve_and_differs_from_it(runs, recipe):
    fp8, bf16 = losses(runs[recipe]), losses(runs["bf16"])
    assert_close_curves(fp8, bf16, rtol=3e-2, what=f"{recipe} against bf16")
    assert fp8 != bf16  # the GEMMs did run in float8


@pytest.mark.slow
def test_an_fp8_checkpoint_resumes_on_its_curve_exactly_and_reshards(runs):
    assert losses(runs["fp8-resumed"]) == losses(runs["fp8"])[3:]
    assert_close_curves(losses(runs["fp8-resumed-tp2"]), losses(runs["fp8"])[3:], rtol=2e-3, what="fp8 tp1 -> tp2")


@pytest.mark.parametrize("args, says", [
    (["--train.fp8_recipe", "blockwise"], "train.fp8_recipe must be one of tensorwise, rowwise"),
    (["--model.hidden_size", "72", "--model.n_heads", "4"], "float8 GEMMs need multiples of 16"),
    (["--seq-len", "60", "--micro-batch-size", "1", "--global-batch-size", "1"], "tokens per rank"),
])
def test_fp8_refusals_are_one_line_and_exit_2(args, says, capsys, tmp_path):
    code = main(["train", *FP8, *args, "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err, err


@pytest.mark.slow
def test_fp8_saves_what_bf16_saves(runs):
    """Like torchao, the forward saves the bf16 input and weight (backward casts them again), so the activation
    counter measures bf16's bytes and the planner's bf16 activation terms hold for fp8 unchanged."""
    assert runs["fp8"][0]["activation_bytes"] == runs["bf16"][0]["activation_bytes"] > 0
