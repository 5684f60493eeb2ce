"""Running `lmt` in-process from tests and reading what a run wrote."""

from __future__ import annotations

import json
import os

from large_model_training.cli import main


# A model small enough that a few-step run takes well under a second per step on one core.
SMALL_MODEL = ["--model.hidden_size", "64", "--model.n_layers", "2", "--model.n_heads", "4",
               "--model.ffn_hidden_size", "128", "--seq-len", "64"]


def train(out: str, *args: str) -> list[dict]:
    """Run `lmt train ... --out out` and return its metrics rows; fails the test on a non-zero exit."""
    code = main(["train", "--out", out, *args])
    assert code == 0, f"lmt train exited {code}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def assert_close_curves(a: list[float], b: list[float], rtol: float, what: str = "") -> None:
    assert len(a) == len(b), (what, len(a), len(b))
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= rtol * abs(y), f"{what} step {step}: {x} vs {y} (rtol {rtol})"
