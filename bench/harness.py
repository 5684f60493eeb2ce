"""Timing shared by the benchmarks that race two implementations on the same ranks in one run."""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist


def timed(fn, batches) -> tuple[float, float, list[float]]:
    """Wall and CPU seconds per step over `batches` (from a barrier), and the loss of each step."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    losses = [fn(x, y) for x, y in batches]
    return (time.perf_counter() - wall) / len(batches), (time.process_time() - cpu) / len(batches), losses


def alternate_rounds(steps: dict, batches: list, warmup: int, rounds: int, per_round: int):
    """Warm every contender up, then time them in alternating rounds so machine noise hits all alike.

    Returns per contender: wall seconds per step of each round, CPU seconds likewise, and every step's loss.
    """
    wall, cpu = {k: [] for k in steps}, {k: [] for k in steps}
    losses = {k: timed(fn, batches[:warmup])[2] for k, fn in steps.items()}
    for r in range(rounds):
        chunk = batches[warmup + r * per_round: warmup + (r + 1) * per_round]
        for k, fn in steps.items():
            w, c, round_losses = timed(fn, chunk)
            wall[k].append(w)
            cpu[k].append(c)
            losses[k] += round_losses
    return wall, cpu, losses


def summarise(results: list[dict], steps: int) -> tuple[dict, dict, dict]:
    """Per contender over the ranks' results of alternate_rounds: the mean of each rank's median wall and CPU
    seconds per step, and the ranks' mean loss at every one of `steps` steps."""
    r0 = results[0]
    wall = {k: statistics.mean(statistics.median(r["wall"][k]) for r in results) for k in r0["wall"]}
    cpu = {k: statistics.mean(statistics.median(r["cpu"][k]) for r in results) for k in r0["cpu"]}
    loss = {k: [statistics.mean(r["losses"][k][i] for r in results) for i in range(steps)] for k in r0["losses"]}
    return wall, cpu, loss
