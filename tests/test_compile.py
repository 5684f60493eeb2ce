"""--compile (regional torch.compile, regional_compile.py): every layout trains the eager curve.

The single-process runs use inductor, the backend users run: its generated kernels reorder float sums, so the
curve is held to 1e-4 relative (measured: see docs/benchmarks.md). The multi-rank layouts use aot_eager (dynamo
and AOTAutograd, the same graphs and graph breaks, no code generation): inductor's C++ compile of every rank's
graphs would cost minutes on 2 cores, and what a layout adds to compilation is the tracing around its
collectives, hooks and exchanges, which aot_eager exercises.
"""

from __future__ import annotations

import pytest

from large_model_training.cli import main
from tests.helpers import SMALL_MODEL, Runs, assert_close_curves, losses

STEPS = [
    "--steps",
    "3",
    "--eval-every",
    "0",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--model.n_layers",
    "4",
]
COMMON = [*SMALL_MODEL, *STEPS]
MOE = ["--model", "tiny-moe", *COMMON]
AOT = ["--compile", "--train.compile_backend", "aot_eager"]

LAYOUTS = {  # name: (reference run, arguments)
    "tp2-sp-pp2-dp2": ("eager", [*COMMON, *AOT, "--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2"]),
    "zero3-cp2": ("eager", [*COMMON, *AOT, "--zero", "3", "--dp", "2", "--cp", "2"]),
    "zbv-pp2": ("eager", [*COMMON, *AOT, "--pp", "2", "--schedule", "zbv", "--virtual-stages", "2"]),
    "moe-ep2": ("moe-eager", [*MOE, *AOT, "--dp", "2", "--ep", "2"]),
    "full-recompute-inductor": ("eager", [*COMMON, "--compile", "--recompute", "full"]),
    "selective-recompute-dp2": ("eager", [*COMMON, *AOT, "--recompute", "selective", "--dp", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(
        tmp_path_factory.mktemp("compile"),
        {
            "eager": COMMON,
            "inductor": [*COMMON, "--compile"],
            "moe-eager": MOE,
            **{name: args for name, (_, args) in LAYOUTS.items()},
        },
    )


@pytest.mark.slow
def test_inductor_trains_the_eager_curve_and_reports_its_compile_time(runs, capfd):
    compiled = runs["inductor"]
    assert_close_curves(losses(compiled), losses(runs["eager"]), rtol=1e-4, what="inductor")
    assert compiled[0]["compile_s"] > 0  # the first step compiles forward and backward
    assert all("compile_s" not in row for row in compiled[1:])  # and nothing compiles again


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_compiled_trains_the_eager_curve(runs, name):
    reference, _ = LAYOUTS[name]
    compiled = runs[name]
    assert_close_curves(losses(compiled), losses(runs[reference]), rtol=1e-4, what=name)
    assert compiled[0]["compile_s"] > 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--tp", "2", "--recompute", "full"], "not tp > 1"),
        (["--zero", "3", "--dp", "2", "--recompute", "every:2"], "not zero 3"),
        (["--model", "tiny-moe", "--recompute", "full"], "not MoE blocks"),
        (["--train.compile_backend", "tvm"], "train.compile_backend"),
    ],
)
def test_combinations_that_cannot_compile_are_refused_in_one_line(args, says, capsys):
    assert main(["train", *SMALL_MODEL, "--compile", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
