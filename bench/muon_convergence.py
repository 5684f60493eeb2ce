"""Muon against AdamW at equal tokens on the embedded corpus (issue 34), same seed and batches.

    python bench/muon_convergence.py                                   # tiny, 1,000 steps of 16 x 256 tokens
    python bench/muon_convergence.py --model small --steps 300 --eval-every 50

Rows: AdamW at two learning rates (the default 3e-3 and 1e-2: "tuned AdamW" is the better of the two) and Muon
(parallel/muon.py: Newton-Schulz orthogonalised momentum for the blocks' matrices, its update scaled to AdamW's
RMS as Moonlight does, so it takes AdamW's learning rate; AdamW for embeddings, head and norms) at the default
3e-3. Each row is a real `lmt train` run at one rank with the defaults otherwise (fp32, 30 warm-up steps, cosine
decay, seed 1234). Prints the validation loss at every evaluation and each final value against the best AdamW
row's (target: Muon at or below it). Runs in one torch thread: on a shared 2-core machine two threads wait for
each other at every operator's barrier (see bench/mtp_convergence.py).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from convergence import print_table, train_rows

LRS = ("3e-3", "1e-2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = args.out or tempfile.mkdtemp(prefix="lmt-muon-")
    common = ["--model", args.model, "--steps", str(args.steps), "--eval-every", str(args.eval_every)]
    rows = {f"adamw lr {lr}": ["--optimizer", "adamw", "--train.lr", lr] for lr in LRS}
    rows["muon lr 3e-3"] = ["--optimizer", "muon", "--train.lr", "3e-3"]
    curves = train_rows(rows, common, root)
    last = max(next(iter(curves.values())))
    best = min((name for name in curves if name.startswith("adamw")), key=lambda name: curves[name][last])
    print_table(curves, best, f"{args.model}, {args.steps} steps, validation loss (nats per token); runs in {root}")


if __name__ == "__main__":
    main()
