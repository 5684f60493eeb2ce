"""What `lmt train`'s machinery costs at one rank: the trainer's step against the bare model loop, same batches.

Trainer side: `Trainer.timed_step` (the step `fit` runs: loader with its prefetch thread, executor, activation
counting, our engine's flat gradient buffer and bucket hooks, global-norm clipping, our sliced AdamW, the
metrics record) and `MetricsLogger.log` (metrics.jsonl, TensorBoard if installed). Bare side: the harness of
bench/throughput.py (model forward, our loss, backward, torch.optim.AdamW with its CPU default, the
per-parameter loop, which is what a user's plain loop gets; no clipping), run on the batches the trainer
side read in the same round. Both models start from the same weights (checked: same first loss). Rounds
alternate between the two sides in one process, so machine noise hits both alike.

    python bench/trainer_overhead.py                          # small, 8 x 256 tokens per step, fp32
    python bench/trainer_overhead.py --model tiny --batch 16
    python bench/trainer_overhead.py --profile                # also where the trainer's extra time goes
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time

import torch

from large_model_training.assembly import build_model
from large_model_training.config import build_config
from large_model_training.launch import run_in_process
from large_model_training.layout import validate
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.models.loss import cross_entropy
from large_model_training.train.metrics import MetricsLogger
from large_model_training.train.trainer import Trainer


def bare_step(model, opt, batches, device) -> float:
    """The plain loop of bench/throughput.py over one step's micro-batches (one here); returns the loss."""
    loss = None
    for x, y in batches:
        loss = cross_entropy(model(x), y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize(device)
    return float(loss.detach())


def run(args) -> None:
    cfg = validate(build_config(overrides={
        "model.preset": args.model, "train.seq_len": args.seq_len, "train.global_batch_size": args.batch,
        "train.micro_batch_size": args.batch, "train.steps": 10_000, "train.eval_every": 0,
        "train.warmup_steps": 0}))
    run_dir = tempfile.mkdtemp(prefix="lmt-overhead-")
    trainer = Trainer(cfg, ParallelMesh.for_this_rank(1, 1, 1), run_dir)
    logger = MetricsLogger(run_dir, cfg.train.steps, stream=io.StringIO())  # not a terminal: no progress bar
    device = trainer.mesh.device
    bare = build_model(cfg.model, None, seed=cfg.train.seed, device=device)
    t = cfg.train
    opt = torch.optim.AdamW(bare.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)

    read: list = []  # the batches the trainer side read, in order: the bare side runs the same ones
    loader_next = trainer.loader.next
    trainer.loader.next = lambda: read.append(loader_next()) or read[-1]
    step = 0

    def trainer_round(n: int) -> float:
        nonlocal step
        synchronize(device)
        start = time.perf_counter()
        for _ in range(n):
            logger.log(trainer.timed_step(step))
            step += 1
        return (time.perf_counter() - start) / n

    def bare_round(batches: list) -> float:
        start = time.perf_counter()
        for b in batches:
            bare_step(bare, opt, b, device)
        return (time.perf_counter() - start) / len(batches)

    first_trainer = trainer.timed_step(step)["loss"]
    step += 1
    first_bare = bare_step(bare, opt, read[0], device)
    trainer_round(args.warmup - 1)
    bare_round(read[1:args.warmup])
    times: dict[str, list[float]] = {"trainer": [], "bare": []}
    for _ in range(args.rounds):
        done = len(read)
        times["trainer"].append(trainer_round(args.steps))
        times["bare"].append(bare_round(read[done:]))
    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()[0]
    print(f"{args.model}, batch {args.batch} x {args.seq_len}, fp32, {args.rounds} rounds x {args.steps} steps, "
          f"threads {torch.get_num_threads()}, first loss trainer {first_trainer:.6f} bare {first_bare:.6f}")
    print(f"| {time.strftime('%Y-%m-%d')} | `python bench/trainer_overhead.py --model {args.model} --batch {args.batch}"
          f" --seq-len {args.seq_len}` | {med['trainer'] * 1e3:.1f} | {med['bare'] * 1e3:.1f} | "
          f"**{med['trainer'] / med['bare']:.3f}** | {load:.1f} |")
    if args.profile:
        profile_trainer(trainer, logger, lambda: step, args.steps)
    logger.close()


def profile_trainer(trainer, logger, next_step, steps: int) -> None:
    """cProfile of `steps` trainer steps (cumulative time of our functions), then torch.profiler's top ops."""
    first = next_step()
    prof = cProfile.Profile()
    prof.enable()
    for s in range(first, first + steps):
        logger.log(trainer.timed_step(s))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats("large_model_training|bench", 40)
    print(out.getvalue())
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for s in range(first + steps, first + 2 * steps):
            logger.log(trainer.timed_step(s))
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    run_in_process(run, (ap.parse_args(),))


if __name__ == "__main__":
    main()
