"""Convergence of `--precision fp8` (both recipes) against bf16 at the same seed and batches (issue 33).

    python bench/fp8_convergence.py                                    # tiny, 1,000 steps of 16 x 256 tokens
    python bench/fp8_convergence.py --model small --steps 300          # small, 300 steps

Each row is a real `lmt train` run at one rank on the embedded default corpus with the defaults (AdamW, lr 3e-3,
30 warm-up steps, cosine decay, seed 1234), so every row sees the same tokens in the same order; only
`--precision` / `--train.fp8_recipe` differ. Prints a markdown table of the validation loss at every evaluation
and the final one's difference to bf16 (target: within 1.5%). Step times on a CPU say nothing about a GPU (the
CPU's float8 GEMMs are not faster than its bf16 ones) and are not reported.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from large_model_training.cli import main as lmt

ROWS = {"bf16": ["--precision", "bf16"],
        "fp8 tensorwise": ["--precision", "fp8", "--train.fp8_recipe", "tensorwise"],
        "fp8 rowwise": ["--precision", "fp8", "--train.fp8_recipe", "rowwise"]}


def validation_losses(run: str) -> dict[int, float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("extra", nargs="*", help="more `lmt train` arguments for every row (after --)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="lmt-fp8-")
    curves = {}
    for name, flags in ROWS.items():
        run = os.path.join(root, name.replace(" ", "-"))
        code = lmt(["train", "--model", args.model, "--steps", str(args.steps), "--eval-every", str(args.eval_every),
                    *flags, *args.extra, "--out", run])
        if code != 0:
            raise SystemExit(f"{name}: lmt train exited {code}")
        curves[name] = validation_losses(run)
    steps = sorted(curves["bf16"])
    print(f"\n{args.model}, {args.steps} steps, validation loss (nats per token) at each evaluation; runs in {root}")
    print("| run | " + " | ".join(str(s) for s in steps) + " | final vs bf16 |")
    print("|---|" + "---|" * (len(steps) + 1))
    last = steps[-1]
    for name, curve in curves.items():
        diff = (curve[last] - curves["bf16"][last]) / curves["bf16"][last]
        print(f"| {name} | " + " | ".join(f"{curve[s]:.4f}" for s in steps) + f" | {diff:+.2%} |")


if __name__ == "__main__":
    main()
