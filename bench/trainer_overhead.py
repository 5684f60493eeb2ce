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
    python bench/trainer_overhead.py --profile                # then: where the trainer's extra time goes
    python bench/trainer_overhead.py --set train.fused_loss=false   # a config override, trainer side
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
        "train.warmup_steps": 0, **dict(kv.split("=", 1) for kv in args.set)}))
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
    paired = statistics.median(t / b for t, b in zip(times["trainer"], times["bare"]))
    print(f"median of the rounds' own ratios (each round's two halves back to back): {paired:.3f}")
    if args.profile:
        profile_phases(trainer, logger, bare, opt, read, step, args.profile_steps)
    logger.close()


def timed(fn, into: list):
    """fn, with the wall seconds of each call appended to `into`."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)
    return wrapper


def profile_phases(trainer, logger, bare, opt, read, first_step: int, steps: int) -> None:
    """Median ms per step of each phase, trainer and bare side alternating step by step on the same batches;
    then cProfile's cumulative times of one trainer step's functions (which of ours the time is in)."""
    phases: dict[str, list[float]] = {}
    eng, ex = trainer.engine, trainer.executor
    for obj, name in [(ex, "forward_backward"), (eng, "prepare_step"), (eng, "finish_grad_sync"),
                      (eng, "grad_norm"), (eng, "step"), (logger, "log")]:
        setattr(obj, name, timed(getattr(obj, name), phases.setdefault(f"trainer {name}", [])))
    bare_phases = {k: [] for k in ("bare forward_backward", "bare optimizer step", "bare zero_grad")}
    device = trainer.mesh.device
    whole = {"trainer step (all)": [], "bare step (all)": []}
    for s in range(first_step, first_step + steps):
        start = time.perf_counter()
        logger.log(trainer.timed_step(s))
        whole["trainer step (all)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for x, y in read[-1]:
            cross_entropy(bare(x), y).backward()
        synchronize(device)
        mid = time.perf_counter()
        opt.step()
        synchronize(device)
        end = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        bare_phases["bare forward_backward"].append(mid - start)
        bare_phases["bare optimizer step"].append(end - mid)
        bare_phases["bare zero_grad"].append(time.perf_counter() - end)
        whole["bare step (all)"].append(time.perf_counter() - start)
    print("| phase | ms per step (median) |\n|---|---|")
    for k, v in {**whole, **phases, **bare_phases}.items():
        print(f"| {k} | {statistics.median(v) * 1e3:.1f} |")
    prof = cProfile.Profile()
    prof.enable()
    logger.log(trainer.timed_step(first_step + steps))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats("large_model_training", 30)
    print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the trainer side, e.g. train.fused_loss=false")
    ap.add_argument("--profile", action="store_true", help="then time each phase and cProfile a step")
    ap.add_argument("--profile-steps", type=int, default=5)
    run_in_process(run, (ap.parse_args(),))


if __name__ == "__main__":
    main()
