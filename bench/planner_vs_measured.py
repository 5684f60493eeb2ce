"""The planner's memory and step-time predictions against real runs on this machine.

    lmt calibrate                                  # once: measures this machine's matmul rate and gloo bandwidth
    python bench/planner_vs_measured.py            # runs each layout briefly, prints the table

For each layout a real `lmt train` runs a few steps; measured are the bytes the engine holds for model state
(`model_state_bytes`), the bytes held for backward (`activation_bytes`, peak over the step, the most loaded
pipeline stage), and the median step time after the first step. Predicted are `lmt estimate`'s breakdown
(`planner.estimate.estimate_memory`) and `predict_step_time` with the calibrated `cpu` hardware entry.
Targets (issue 8): memory within 10%, step time within 30%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from large_model_training.cli import main as lmt
from large_model_training.config import build_config
from large_model_training.layout import validate
from large_model_training.planner.estimate import estimate_memory, predict_step_time

LAYOUTS = {
    "tiny dp1": ["--model", "tiny"],
    "tiny dp2 zero1": ["--model", "tiny", "--dp", "2", "--zero", "1", "--micro-batch-size", "8"],
    "tiny dp2 zero2": ["--model", "tiny", "--dp", "2", "--zero", "2", "--micro-batch-size", "8"],
    "tiny dp2 zero3": ["--model", "tiny", "--dp", "2", "--zero", "3", "--micro-batch-size", "8"],
    "tiny tp2": ["--model", "tiny", "--tp", "2"],
    "tiny pp2 1f1b": ["--model", "tiny", "--pp", "2", "--micro-batch-size", "4"],
    "tiny recompute full": ["--model", "tiny", "--recompute", "full"],
    "tiny recompute selective": ["--model", "tiny", "--recompute", "selective"],
    "small dp1": ["--model", "small", "--micro-batch-size", "4", "--seq-len", "256"],
    "small dp2 zero1": ["--model", "small", "--dp", "2", "--zero", "1", "--micro-batch-size", "2", "--seq-len", "256"],
}


def _overrides(args: list[str]) -> dict[str, str]:
    names = {"--model": "model.preset", "--dp": "parallel.dp", "--tp": "parallel.tp", "--pp": "parallel.pp",
             "--zero": "parallel.zero", "--micro-batch-size": "train.micro_batch_size", "--seq-len": "train.seq_len",
             "--recompute": "train.recompute"}
    return {names[k]: v for k, v in zip(args[::2], args[1::2])}


def measure(args: list[str], steps: int, out: str) -> dict:
    code = lmt(["train", *args, "--steps", str(steps), "--eval-every", "0", "--out", out])
    if code != 0:
        return {}
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    last = rows[-1]
    activations = max(last.get("activation_bytes_per_stage", [last["activation_bytes"]]))
    return {"state": last["model_state_bytes"], "act": activations,
            "time": statistics.median(r["step_time_s"] for r in rows[1:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", nargs="*", default=list(LAYOUTS))
    args = ap.parse_args()
    print("| layout | model state measured / predicted | activations measured / predicted | step s measured / "
          "predicted |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            cfg = validate(build_config(overrides=_overrides(LAYOUTS[name])))
            got = measure(LAYOUTS[name], args.steps, os.path.join(tmp, name.replace(" ", "_")))
            if not got:
                print(f"| {name} | (run failed) | | |")
                continue
            mem = estimate_memory(cfg)
            t = predict_step_time(cfg, "cpu")
            print(f"| {name} | {got['state'] / 2**20:.2f} / {mem.model_states / 2**20:.2f} MiB "
                  f"({mem.model_states / got['state'] - 1:+.1%}) | {got['act'] / 2**20:.1f} / "
                  f"{mem.activations / 2**20:.1f} MiB ({mem.activations / got['act'] - 1:+.1%}) | "
                  f"{got['time']:.3f} / {t:.3f} ({t / got['time'] - 1:+.1%}) |", flush=True)


if __name__ == "__main__":
    main()
