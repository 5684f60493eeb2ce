"""Convergence of the tiny MoE against dense models of the same ACTIVE and the same TOTAL parameters (issue 18).

    python bench/moe_convergence.py --only moe dense-active     # the issue's comparison: 1,000 steps of 16 x 256
    python bench/moe_convergence.py --steps 300 --micro-batch-size 8 --seq-len 128 --eval-every 50   # the first,
                                                                  # shorter look (a sixteenth of the tokens)
    python bench/moe_convergence.py --only moe --moe-args --model.moe_norm_topk false   # a MoE variant alone

Each row is a real `lmt train` run (dp=1, by default the default run's global batch of 16 x 256 tokens for 1,000
steps; lr 3e-3 with 30 warm-up steps and cosine decay, AdamW, seed 1234: the defaults) on the embedded default
corpus, so every row sees the same tokens in the same order. Rows:
  moe           `--model tiny-moe`: tiny's shape, every block's MLP 8 swiglu experts of f=128, top-2 (renormalised)
  dense-active  `--model tiny --model.ffn_hidden_size 256`: the width a token runs through in the MoE (2 x 128)
  dense-total   `--model tiny --model.ffn_hidden_size 1024`: the MoE's expert parameters (8 x 128) as one MLP
Parameter counts come from `models/flops.py` (`parameter_count(cfg, active=...)`); the table is printed in
markdown for docs/benchmarks.md, with the validation loss at every evaluation and, for MoE rows, the load
imbalance (max / mean copies per expert, worst layer) and the Switch aux loss (summed over the 4 blocks; 1 per
block when balanced) at the last step, as metrics.jsonl has them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from large_model_training.cli import main as lmt
from large_model_training.config import model_from_preset
from large_model_training.models.flops import parameter_count

ROWS = {
    "moe": ["--model", "tiny-moe"],
    "dense-active": ["--model", "tiny", "--model.ffn_hidden_size", "256"],
    "dense-total": ["--model", "tiny", "--model.ffn_hidden_size", "1024"],
}


def counts(name: str) -> tuple[int, int]:
    """(total, active) parameters of a row's model, from models/flops.py."""
    cfg = model_from_preset(ROWS[name][1])
    if len(ROWS[name]) > 2:
        cfg.ffn_hidden_size = int(ROWS[name][3])
    return parameter_count(cfg), parameter_count(cfg, active=True)


def run(name: str, args_: argparse.Namespace, out: str, extra: list[str]) -> dict:
    args = ["train", *ROWS[name], "--steps", str(args_.steps), "--eval-every", str(args_.eval_every), "--out", out,
            "--micro-batch-size", str(args_.micro_batch_size), "--seq-len", str(args_.seq_len), *extra]
    start = time.perf_counter()
    if lmt(args) != 0:
        raise SystemExit(f"run failed: {name}")
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    last = rows[-1]
    return {"val": [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r], "train_loss": last["loss"],
            "imbalance": last.get("moe_load_imbalance"), "aux": last.get("moe_aux_loss"),
            "imbalance_layers": last.get("moe_load_imbalance_per_layer"), "wall_s": wall,
            "step_s": sorted(r["step_time_s"] for r in rows)[len(rows) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--micro-batch-size", type=int, default=16, help="= the global batch (dp=1)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--only", nargs="*", default=list(ROWS))
    ap.add_argument("--out", default=None, help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--moe-args", nargs=argparse.REMAINDER, default=[],
                    help="extra lmt train flags for the moe row only (last on the line)")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.out or tmp
        for name in args.only:
            extra = args.moe_args if name == "moe" else []
            results[name] = run(name, args, os.path.join(tmp, name), extra)
            print(name, json.dumps(results[name]), flush=True)
    evals = [s for s, _ in next(iter(results.values()))["val"]]
    print("\n| model | total params | active params | " + " | ".join(f"val @{s}" for s in evals)
          + " | load imbalance (end) | aux loss (end) | median step |")
    print("|---|---|---|" + "---|" * len(evals) + "---|---|---|")
    for name, r in results.items():
        total, active = counts(name)
        imb = "-" if r["imbalance"] is None else f"{r['imbalance']:.2f}"
        aux = "-" if r["aux"] is None else f"{r['aux']:.3f}"
        print(f"| {name} ({' '.join(ROWS[name][1:])}) | {total:,} | {active:,} | "
              + " | ".join(f"{v:.4f}" for _, v in r["val"]) + f" | {imb} | {aux} | {r['step_s'] * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
