"""The overlapped expert dispatch (`--parallel.ep_overlap`) against the synchronous one, ratio in one run (issue 36).

    python bench/moe_overlap.py                     # ep = 2 and 4, 3 alternating rounds of 8 steps each
    python bench/moe_overlap.py --ep 2 --rounds 5

Each round trains `tiny-moe` (fp32, dp = ep, every dp rank's experts split over ep) with the synchronous dispatch
and then the overlapped one, on the same data and seed (the curves are equal: tests/test_expert_parallel.py).
Reported per ep: the median step time of the steps after the first two (warm-up) and the ranks' CPU seconds
per step (user + system of the rank processes, `getrusage(RUSAGE_CHILDREN)` around each run), overlapped over
synchronous, as the median of the rounds' own ratios. On this CPU a rank's exchanges run on gloo's threads
beside its compute thread, so what overlap can hide is bounded by the cores the ranks share.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile

from large_model_training.cli import main as lmt

MODEL = ["--model", "tiny-moe", "--precision", "fp32", "--seq-len", "256", "--micro-batch-size", "8",
         "--eval-every", "0", "--save-every", "0"]


def run(ep: int, overlap: bool, steps: int, out: str) -> tuple[float, float]:
    """(median step seconds, CPU seconds per step) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = lmt(["train", *MODEL, "--dp", str(ep), "--ep", str(ep), "--global-batch-size", str(8 * ep),
                "--steps", str(steps), "--parallel.ep_overlap", str(overlap).lower(), "--out", out])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"ep={ep} overlap={overlap}: lmt train exited {code}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        times = [r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return statistics.median(times[2:]), cpu / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in args.ep:
            step_ratios, cpu_ratios, sync_times = [], [], []
            for r in range(args.rounds):
                sync = run(ep, False, args.steps, os.path.join(tmp, f"ep{ep}-sync-{r}"))
                over = run(ep, True, args.steps, os.path.join(tmp, f"ep{ep}-overlap-{r}"))
                step_ratios.append(over[0] / sync[0])
                cpu_ratios.append(over[1] / sync[1])
                sync_times.append(sync[0])
            rows.append((ep, statistics.median(sync_times), statistics.median(step_ratios),
                         statistics.median(cpu_ratios)))
    print("\n| ep | synchronous step s | overlapped / synchronous step time | CPU time per step |")
    print("|---|---|---|---|")
    for ep, sync_s, step, cpu in rows:
        print(f"| {ep} | {sync_s:.3f} | {step:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()
