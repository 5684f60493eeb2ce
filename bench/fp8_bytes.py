"""What `--precision fp8` saves against bf16, measured by the runs' counters, against the planner's figures (issue 33).

    python bench/fp8_bytes.py                      # tiny, ZeRO-3 over dp=2, 2 steps per row
    python bench/fp8_bytes.py --model small --seq-len 256 --micro-batch-size 2

Three rows at the same layout (bf16; fp8 tensorwise; fp8 rowwise), each a real `lmt train` run:
  - activations: `activation_bytes` (the autograd saved-tensor counter, memory/accounting.py) of the first
    step, against `lmt estimate`'s (tensorwise linears keep their inputs as float8, `float8_input_saving`;
    rowwise keeps bf16's);
  - ZeRO-3 traffic: `comm_bytes_dp` (FSDP2's all-gathers and reduce-scatters, counted at its collectives:
    parallel/fsdp_counters.py), against the planner's `zero3_bytes_per_step` (tensorwise gathers the block
    linears' weights in float8, parallel/fsdp_float8.py; rowwise gathers bf16).
Prints a markdown table: measured, planned, and their relative difference (target: within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from large_model_training.cli import main as lmt
from large_model_training.config import build_config
from large_model_training.layout import job_and_layout, validate
from large_model_training.planner.estimate import estimate_memory
from large_model_training.planner.comm import zero3_bytes_per_step
from large_model_training.planner.memory import block_norm_parameters, block_parameters_per_rank, stage_parameters

ROWS = {"bf16": ["--precision", "bf16"],
        "fp8 tensorwise": ["--precision", "fp8", "--train.fp8_recipe", "tensorwise"],
        "fp8 rowwise": ["--precision", "fp8", "--train.fp8_recipe", "rowwise"]}


def first_step(run: str) -> dict:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return next(r for r in map(json.loads, f) if "activation_bytes" in r)


def planned(run: str) -> tuple[float, float]:
    """(activation bytes, ZeRO-3 bytes per step) the planner gives for this row's run: `lmt estimate`'s
    activations, and FSDP2's traffic as `zero3_bytes_per_step` counts it."""
    cfg = validate(build_config(os.path.join(run, "config.toml")))
    m, t, p = cfg.model, cfg.train, cfg.parallel
    micro = t.global_batch_size // (p.dp * t.micro_batch_size)
    comm = zero3_bytes_per_step(micro, p.dp, m.n_layers, block_parameters_per_rank(m, p.tp), block_norm_parameters(m),
                                stage_parameters(m, p.tp, 0, True, True), 2, 4 if t.grad_reduce_fp32 else 2,
                                float8_gather=job_and_layout(cfg)[0].fp8_tensorwise)
    return estimate_memory(cfg).activations, comm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", default="256")
    ap.add_argument("--micro-batch-size", default="4")
    ap.add_argument("--dp", default="2")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="lmt-fp8-bytes-")
    measured = {}
    for name, flags in ROWS.items():
        run = os.path.join(root, name.replace(" ", "-"))
        code = lmt(["train", "--model", args.model, "--seq-len", args.seq_len, "--micro-batch-size",
                    args.micro_batch_size, "--global-batch-size", str(2 * int(args.micro_batch_size) * int(args.dp)),
                    "--dp", args.dp, "--zero", "3", "--steps", "2", "--eval-every", "0", *flags, "--out", run])
        if code != 0:
            raise SystemExit(f"{name}: lmt train exited {code}")
        measured[name] = (run, first_step(run))
    bf16 = measured["bf16"][1]
    print(f"\n{args.model}, seq {args.seq_len} x micro-batch {args.micro_batch_size}, ZeRO-3 over dp={args.dp}; "
          f"runs in {root}")
    print("| run | activations measured | planned | saved vs bf16 measured | planned | ZeRO-3 bytes/step measured | "
          "planned | saved vs bf16 measured | planned |")
    print("|---|---|---|---|---|---|---|---|---|")
    plans = {name: planned(run) for name, (run, _) in measured.items()}
    for name, (run, row) in measured.items():
        (act_plan, comm_plan), (bf16_act_plan, bf16_comm_plan) = plans[name], plans["bf16"]
        act, comm = row["activation_bytes"], row["comm_bytes_dp"]
        saved_act, saved_comm = bf16["activation_bytes"] - act, bf16["comm_bytes_dp"] - comm
        print(f"| {name} | {act:,} | {act_plan:,.0f} ({act / act_plan - 1:+.2%}) | {saved_act:,} | "
              f"{bf16_act_plan - act_plan:,.0f} | {comm:,} | {comm_plan:,.0f} ({comm / comm_plan - 1:+.2%}) | "
              f"{saved_comm:,} | {bf16_comm_plan - comm_plan:,.0f} |")


if __name__ == "__main__":
    main()
