"""Convergence of `--precision fp8` (both recipes) against bf16 at the same seed and batches (issue 33).

    python bench/fp8_convergence.py                                    # tiny, 1,000 steps of 16 x 256 tokens
    python bench/fp8_convergence.py --model small --steps 300          # small, 300 steps
    python bench/fp8_convergence.py --model small --steps 300 --rows "bf16,fp8 rowwise" -- --lr 1e-3
    python bench/fp8_convergence.py --model small --steps 300 --seeds 1234,4321 --out DIR   # per seed, and the mean

Each row is a real `lmt train` run at one rank on the embedded default corpus with the defaults (AdamW, lr 3e-3,
30 warm-up steps, cosine decay, seed 1234), so every row sees the same tokens in the same order; only
`--precision` / `--train.fp8_recipe` (/ `--train.fp8_bf16_first_last`) differ. The `bf16 accumulation` row
changes only the order bf16 sums the gradients in: how far rounding alone moves the curve at this lr. Prints a
markdown table of the validation loss at every evaluation and the final one's difference to bf16 (target: within
1.5%). With `--seeds` every row runs at each seed (DIR/seed_<seed>/<row>: other initial weights and batch order,
the same validation set), each seed's table is printed, then each row's final difference at every seed and its
mean: how far the seed alone moves a curve decides how much one seed's difference says. With `--out`, a row
already run to the last step there is read rather than trained again, so rows can be run one at a time (one per
core) and gathered after. Step times on a CPU say nothing about a GPU (the CPU's float8 GEMMs are not faster than
its bf16 ones) and are not reported.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from convergence import final_difference, print_table, train_rows

ROWS = {"bf16": ["--precision", "bf16"],
        "fp8 tensorwise": ["--precision", "fp8", "--train.fp8_recipe", "tensorwise"],
        "fp8 rowwise": ["--precision", "fp8", "--train.fp8_recipe", "rowwise"],
        "fp8 rowwise_with_gw_hp": ["--precision", "fp8", "--train.fp8_recipe", "rowwise_with_gw_hp"],
        "fp8 rowwise first-last-bf16": ["--precision", "fp8", "--train.fp8_recipe", "rowwise",
                                        "--train.fp8_bf16_first_last", "1"],
        "fp8 tensorwise first-last-bf16": ["--precision", "fp8", "--train.fp8_recipe", "tensorwise",
                                           "--train.fp8_bf16_first_last", "1"],
        # the bf16 run with its 16 sequences in two micro-batches of 8: the same gradients summed in another
        # order, a rounding change only; how far it moves the curve is the comparison's noise floor
        "bf16 accumulation": ["--precision", "bf16", "--global-batch-size", "16", "--micro-batch-size", "8"]}
DEFAULT_ROWS = "bf16,fp8 tensorwise,fp8 rowwise"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default: lmt's, one table)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("extra", nargs="*", help="more `lmt train` arguments for every row (after --)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="lmt-fp8-")
    common = ["--model", args.model, "--steps", str(args.steps), "--eval-every", str(args.eval_every), *args.extra]
    chosen = args.rows.split(",")
    if unknown := [r for r in chosen if r not in ROWS]:
        raise SystemExit(f"unknown row(s) {unknown}; choose from {list(ROWS)}")
    reference = "bf16" if "bf16" in chosen else chosen[0]  # (a row run by itself: against itself)
    title = f"{args.model}, {args.steps} steps, validation loss (nats per token) at each evaluation"
    if args.seeds is None:
        curves = train_rows({r: ROWS[r] for r in chosen}, common, root, reuse_at=args.steps)
        print_table(curves, reference, f"{title}; runs in {root}")
        return
    if not all(seed.strip().isdigit() for seed in args.seeds.split(",")):
        raise SystemExit(f"--seeds takes comma-separated non-negative integers, not {args.seeds!r}")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    by_seed = {}
    for seed in seeds:
        folder = os.path.join(root, f"seed_{seed}")
        by_seed[seed] = train_rows({r: ROWS[r] for r in chosen}, [*common, "--seed", str(seed)], folder,
                                   reuse_at=args.steps)
        print_table(by_seed[seed], reference, f"{title}, seed {seed}; runs in {folder}")
    print(f"\nfinal validation loss vs {reference} at each seed, and the mean over the {len(seeds)} seeds")
    print("| run | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean |")
    print("|---|" + "---|" * (len(seeds) + 1))
    for row in chosen:
        diffs = [final_difference(by_seed[seed], row, reference) for seed in seeds]
        print(f"| {row} | " + " | ".join(f"{d:+.2%}" for d in diffs) + f" | {sum(diffs) / len(diffs):+.2%} |")


if __name__ == "__main__":
    main()
