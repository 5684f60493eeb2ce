"""Shared by the convergence benches (fp8_convergence.py, mtp_convergence.py): rows of `lmt train` runs that
differ only in their flags, at the same seed and batches, and their validation curves as one markdown table."""

from __future__ import annotations

import json
import os

from large_model_training.cli import main as lmt


def validation_losses(run: str) -> dict[int, float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def train_rows(rows: dict[str, list[str]], common: list[str], root: str,
               reuse_at: int | None = None) -> dict[str, dict[int, float]]:
    """Each row's run (in root/<its name, dashed>) with `common` + its flags; its validation curve.

    reuse_at: a step; a row whose folder already holds a validation loss at that step is read, not trained again
    (a long comparison run in pieces, or one row added to finished ones: same --out)."""
    curves = {}
    for name, flags in rows.items():
        run = os.path.join(root, "-".join(name.replace("(", "").replace(")", "").replace("+", "").split()))
        if reuse_at is not None and os.path.isfile(os.path.join(run, "metrics.jsonl")):
            if reuse_at in (done := validation_losses(run)):
                print(f"{name}: reusing {run} (it reached step {reuse_at})")
                curves[name] = done
                continue
        code = lmt(["train", *common, *flags, "--out", run])
        if code != 0:
            raise SystemExit(f"{name}: lmt train exited {code}")
        curves[name] = validation_losses(run)
    return curves


def final_difference(curves: dict[str, dict[int, float]], name: str, reference: str) -> float:
    """The row's last validation loss relative to the reference row's at the same step."""
    last = max(curves[reference])
    return (curves[name][last] - curves[reference][last]) / curves[reference][last]


def print_table(curves: dict[str, dict[int, float]], reference: str, title: str) -> None:
    """The curves at every evaluation, and each final value against the reference row's."""
    steps = sorted(curves[reference])
    print(f"\n{title}")
    print("| run | " + " | ".join(str(s) for s in steps) + f" | final vs {reference} |")
    print("|---|" + "---|" * (len(steps) + 1))
    for name, curve in curves.items():
        diff = final_difference(curves, name, reference)
        print(f"| {name} | " + " | ".join(f"{curve[s]:.4f}" for s in steps) + f" | {diff:+.2%} |")
