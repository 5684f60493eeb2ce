"""Pipeline bubble fraction: theory, the schedule simulator, and real `lmt train` runs.

The bubble is the share of the p x step-time device time in which no forward or backward runs:
1 - (F and B time summed over the p ranks) / (p x the step's span).

1. Theory (Narayanan et al. 2021, eq. 1-2): (p-1)/(m+p-1) for GPipe and 1F1B; (p-1)/(v*m+p-1) interleaved.
2. Simulated: the action lists the runtime executes (`build_schedule`), replayed by `simulate` with equal
   stages, backward = 2 x forward and free communication. With these assumptions the simulator should give
   the theory back exactly; it is the check that the schedules we run are the ones the formulas describe.
3. Measured (p=2 only: this machine has 2 cores): `lmt train --pp 2 --schedule ...` on the tiny preset, the
   `bubble_fraction` of metrics.jsonl over the steps after the first (which warms up): mean, median (robust
   to a step in which another process took the core; step 3 is one such, see below) and range. A real step
   also spends rank time in point-to-point copies, in Python between actions and in waiting for a neighbour
   that the OS scheduled out, and its stages are not equal (the last one carries the head and the loss), so
   the measured bubble is above the theory. To tell imbalance from overhead, the run's own mean F and B
   durations per stage (from the step-2 timeline.json) are replayed in the simulator too ("sim, run's times").
   Step 3 reads high in every run: between steps 2 and 3 rank 0 draws the timeline PNG while rank 1 has
   already started step 3's clock and waits for its first activation.

    python bench/pipeline_bubble.py                      # the table over p and m, then 12 short pp=2 runs (3-6 min)
    python bench/pipeline_bubble.py --no-measure         # theory and simulator only (a second)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

from large_model_training.parallel.pipeline import build_schedule, simulate, theoretical_bubble

KINDS = ("gpipe", "1f1b", "interleaved")


def simulated(kind: str, p: int, m: int, v: int, f=1.0, b=2.0) -> float:
    return simulate(build_schedule(kind, p, m, v), p, m, v, forward_time=f, backward_time=b).bubble_fraction()


def model_table(v: int) -> None:
    print(f"theory vs simulator (equal stages, b = 2f, free p2p; interleaved with v={v})")
    print("| p | m | 1f1b theory | 1f1b sim | gpipe sim | interleaved theory | interleaved sim |")
    print("|---|---|---|---|---|---|---|")
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p, 8 * p):
            print(f"| {p} | {m} | {theoretical_bubble('1f1b', p, m):.3f} | {simulated('1f1b', p, m, 1):.3f} "
                  f"| {simulated('gpipe', p, m, 1):.3f} | {theoretical_bubble('interleaved', p, m, v):.3f} "
                  f"| {simulated('interleaved', p, m, v):.3f} |")


def stage_times(timeline_path: str) -> tuple[dict[int, float], dict[int, float]]:
    """Mean forward and backward seconds per virtual stage in a run's timeline.json (one measured step)."""
    with open(timeline_path) as f:
        events = json.load(f)["traceEvents"]
    durations = defaultdict(list)
    for e in events:
        if e.get("cat") in ("F", "B"):
            durations[(e["cat"], e["args"]["stage"])].append(e["dur"] * 1e-6)
    mean = {key: statistics.mean(values) for key, values in durations.items()}
    return ({s: t for (op, s), t in mean.items() if op == "F"}, {s: t for (op, s), t in mean.items() if op == "B"})


def measure(kind: str, p: int, m: int, v: int, args: argparse.Namespace, workdir: str) -> dict:
    out = os.path.join(workdir, f"{kind}-p{p}-m{m}")
    flags = ["--model", args.model, "--pp", str(p), "--schedule", kind,
             "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(m * args.micro_batch_size),
             "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--eval-every", "0"]
    if kind == "interleaved":
        flags += ["--virtual-stages", str(v)]
    subprocess.run([sys.executable, "-m", "large_model_training.cli", "train", *flags, "--out", out], check=True,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]  # the first step warms up
    forward, backward = stage_times(os.path.join(out, "timeline.json"))
    v_run = v if kind == "interleaved" else 1
    sim_run = simulate(build_schedule(kind, p, m, v_run), p, m, v_run, forward_time=forward.__getitem__,
                       backward_time=backward.__getitem__).bubble_fraction()
    bubbles = [r["bubble_fraction"] for r in rows]
    return {"command": "lmt train " + shlex.join(flags), "mean": statistics.mean(bubbles),
            "median": statistics.median(bubbles), "spread": (min(bubbles), max(bubbles)), "sim_run": sim_run,
            "step_s": statistics.median(r["step_time_s"] for r in rows)}


def measured_table(args: argparse.Namespace) -> None:
    p, v = 2, args.virtual_stages
    print(f"\nmeasured, p={p}: {args.model}, micro-batch {args.micro_batch_size} x {args.seq_len}, "
          f"{args.steps} steps (bubble over steps 2..{args.steps}; interleaved with v={v})")
    print("| schedule | m | theory | sim, equal stages | sim, run's times | measured median | mean (min-max) "
          "| step time |")
    print("|---|---|---|---|---|---|---|---|")
    commands = []
    with tempfile.TemporaryDirectory(prefix="lmt-bubble-") as workdir:
        for kind in KINDS:
            for m in (p, 2 * p, 4 * p, 8 * p):
                vk = v if kind == "interleaved" else 1
                r = measure(kind, p, m, v, args, workdir)
                commands.append(r["command"])
                lo, hi = r["spread"]
                print(f"| {kind} | {m} | {theoretical_bubble(kind, p, m, vk):.3f} | {simulated(kind, p, m, vk):.3f} "
                      f"| {r['sim_run']:.3f} | **{r['median']:.3f}** | {r['mean']:.3f} ({lo:.3f}-{hi:.3f}) "
                      f"| {r['step_s'] * 1e3:.0f} ms |", flush=True)
    print("\ncommands: " + commands[0] + "  (and the other --schedule / --global-batch-size values)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--virtual-stages", type=int, default=2)
    ap.add_argument("--no-measure", dest="measure", action="store_false", help="theory and simulator only")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    model_table(args.virtual_stages)
    if args.measure:
        measured_table(args)


if __name__ == "__main__":
    main()
