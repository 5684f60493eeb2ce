"""Step time of lmt's AdamW with fp32 moments, bf16 moments kept by stochastic rounding (`--train.optimizer_states
bf16`) and, for what the rounding costs, bf16 moments rounded to nearest; against torch.optim.AdamW(foreach=True)
on the same parameters (fp32 states), the peer. One process, one thread, rounds alternating between the four,
median step per variant, as ratios to torch's.

    python bench/optimizer_states_step.py [--elements 12300000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _ours(n: int, states: torch.dtype, nearest: bool = False):
    from large_model_training.parallel.adamw import AdamW
    from tests.test_planner_passes import _shards

    _, shards = _shards(n, torch.float32)
    opt = AdamW(shards, weight_decay=0.1, betas=(0.9, 0.95), state_dtype=states)
    if nearest:  # the same rule, its bf16 moments rounded to nearest (what the rounding replaced)
        opt._noise = lambda elements: _Nearest()
    grads = [torch.randn(p.hi - p.lo) for p in shards.pieces]
    return lambda: opt.step(shards.pieces, grads, 1e-3, 1.0)


class _Nearest:
    """Stands for parallel/adamw.RoundingNoise: a plain cast."""

    @staticmethod
    def round_into(out: torch.Tensor, x: torch.Tensor, stream: int = 0) -> None:
        out.copy_(x)


def _torch(n: int):
    p = nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    return opt.step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=12_300_000, help="parameters (default: about `small`)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.elements // 4 * 4
    steps = {
        "torch AdamW (fp32 states)": _torch(n),
        "lmt, fp32 moments": _ours(n, torch.float32),
        "lmt, bf16 moments, stochastic": _ours(n, torch.bfloat16),
        "lmt, bf16 moments, nearest": _ours(n, torch.bfloat16, nearest=True),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for step in steps.values():
        step()  # states created, caches warm
    for r in range(args.rounds):
        names = list(steps)
        for name in names[r % len(names) :] + names[: r % len(names)]:  # the order rotates
            t = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["torch AdamW (fp32 states)"])
    print(f"{n:,} parameters, 1 thread, median of {args.rounds} steps each")
    print("| step | ms | ratio to torch.optim.AdamW |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {statistics.median(ts) / base:.3f} |")


if __name__ == "__main__":
    main()
