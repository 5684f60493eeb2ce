"""1-bit Adam (`--optimizer onebit-adam`) against AdamW: final validation loss and dp bytes per step, on the
default corpus with the `tiny` model at dp=4 (the settings of compression_convergence.py's table).

    python bench/onebit_adam_convergence.py                      # every row (10-20 minutes a row on 2 shared cores)
    python bench/onebit_adam_convergence.py --steps 50 --only adamw sign   # a quick look

A row is NAME[:key=value,...] from ROWS; each is a real `lmt train` run (4 gloo ranks). Bytes: `comm_bytes_dp`
in the warm-up and after it (medians), and the mean over the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from large_model_training.cli import main as lmt

ROWS = {
    "adamw": [],
    "sign": ["--optimizer", "onebit-adam"],
    "int8": ["--optimizer", "onebit-adam", "--train.onebit_compression", "int8"],
    "sign-warmup30": ["--optimizer", "onebit-adam", "--train.onebit_warmup", "30"],
    "sign-refresh10": ["--optimizer", "onebit-adam", "--train.onebit_variance_refresh", "10"],
    "sign-zero1": ["--optimizer", "onebit-adam", "--zero", "1"],
    "adamw-zero1": ["--zero", "1"],
}


def run(name: str, steps: int, out: str) -> dict:
    args = ["train", "--dp", "4", "--micro-batch-size", "4", "--steps", str(steps), "--eval-every", str(steps),
            "--out", out, *ROWS[name]]
    if lmt(args) != 0:
        raise SystemExit(f"run failed: {name}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    warmup = 30 if "warmup30" in name else 100
    sent = [r["comm_bytes_dp"] for r in rows if "comm_bytes_dp" in r]
    return {"val_loss": rows[-1]["val_loss"], "warm": statistics.median(sent[:warmup]),
            "after": statistics.median(sent[warmup:]) if len(sent) > warmup else float("nan"),
            "mean": statistics.mean(sent)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", nargs="*", default=list(ROWS))
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            results[name] = run(name, args.steps, os.path.join(tmp, name))
            print(name, results[name], flush=True)
    base = results.get("adamw", next(iter(results.values())))
    print("\n| row | final val loss | vs adamw | dp bytes/step, warm-up | after it | fewer bytes after | mean over "
          "the run |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['val_loss']:.4f} | {r['val_loss'] / base['val_loss'] - 1:+.2%} | {r['warm']:,.0f} "
              f"| {r['after']:,.0f} | {base['mean'] / r['after']:.1f}x | {r['mean']:,.0f} |")


if __name__ == "__main__":
    main()
