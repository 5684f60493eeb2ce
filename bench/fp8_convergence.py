"""Convergence of `--precision fp8` (both recipes) against bf16 at the same seed and batches (issue 33).

    python bench/fp8_convergence.py                                    # tiny, 1,000 steps of 16 x 256 tokens
    python bench/fp8_convergence.py --model small --steps 300          # small, 300 steps
    python bench/fp8_convergence.py --model small --steps 300 --rows "bf16,fp8 rowwise" -- --lr 1e-3

Each row is a real `lmt train` run at one rank on the embedded default corpus with the defaults (AdamW, lr 3e-3,
30 warm-up steps, cosine decay, seed 1234), so every row sees the same tokens in the same order; only
`--precision` / `--train.fp8_recipe` (/ `--train.fp8_bf16_first_last`) differ. Prints a markdown table of the
validation loss at every evaluation and the final one's difference to bf16 (target: within 1.5%). Step times on
a CPU say nothing about a GPU (the CPU's float8 GEMMs are not faster than its bf16 ones) and are not reported.
"""

from __future__ import annotations

import argparse
import tempfile

from convergence import print_table, train_rows

ROWS = {"bf16": ["--precision", "bf16"],
        "fp8 tensorwise": ["--precision", "fp8", "--train.fp8_recipe", "tensorwise"],
        "fp8 rowwise": ["--precision", "fp8", "--train.fp8_recipe", "rowwise"],
        "fp8 rowwise_with_gw_hp": ["--precision", "fp8", "--train.fp8_recipe", "rowwise_with_gw_hp"],
        "fp8 rowwise first-last-bf16": ["--precision", "fp8", "--train.fp8_recipe", "rowwise",
                                        "--train.fp8_bf16_first_last", "1"],
        "fp8 tensorwise first-last-bf16": ["--precision", "fp8", "--train.fp8_recipe", "tensorwise",
                                           "--train.fp8_bf16_first_last", "1"]}
DEFAULT_ROWS = "bf16,fp8 tensorwise,fp8 rowwise"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("extra", nargs="*", help="more `lmt train` arguments for every row (after --)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="lmt-fp8-")
    common = ["--model", args.model, "--steps", str(args.steps), "--eval-every", str(args.eval_every), *args.extra]
    chosen = args.rows.split(",")
    if unknown := [r for r in chosen if r not in ROWS]:
        raise SystemExit(f"unknown row(s) {unknown}; choose from {list(ROWS)}")
    curves = train_rows({r: ROWS[r] for r in chosen}, common, root)
    reference = "bf16" if "bf16" in curves else chosen[0]  # (a row run by itself: against itself)
    print_table(curves, reference, f"{args.model}, {args.steps} steps, validation loss (nats per token) at each "
                                   f"evaluation; runs in {root}")


if __name__ == "__main__":
    main()
