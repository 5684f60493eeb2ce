"""The outer step's overhead (issue 20): DiLoCo's steps between syncs against plain data parallelism, in one run.

Three contenders on the same gloo ranks, each its own copy of the model with the same starting weights, built by
the library's `build_engine` exactly as `lmt train` builds them:
  dp       `--sync every-step`: the ZeRO-0 engine, every step all-reduces the gradients over dp (today's default);
  diloco   `--sync local:H`: the same inner engine reducing over no dp group, wrapped by parallel/diloco.py;
           every H-th step ends with the outer step (the fp32 all-reduce of the parameter change, Nesterov);
  local    the inner engine alone (no wrapper, no sync ever): the compute of a step and nothing else.
Rounds alternate between the contenders (H steps each, from a barrier, so machine noise hits all alike); every
step is timed on its own, and diloco's steps are split into inner steps and the sync step by the engine's own
record (`step_record()["sync_outer"]`). Printed: the median step of each, and the ratios
  diloco inner / dp     the issue's "step times between syncs against plain data parallelism" (target <= 1.02);
  diloco inner / local  what the wrapper itself adds to a step that sends nothing (bookkeeping only);
  diloco mean / dp      the whole cost per step, the sync step amortised over H.

    python bench/diloco_overhead.py                    # dp = 4, tiny, 4 x 256 tokens per rank, H = 10
    python bench/diloco_overhead.py --hidden 512 --layers 4 --ffn 1280 --every 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch.distributed as dist

from large_model_training.assembly import build_model
from large_model_training.choices import SyncMode
from large_model_training.config import Config, DataConfig, SyncConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.parallel.engine import apply_step, build_engine

WARMUP_ROUNDS = 1


def config(args: argparse.Namespace, sync: str) -> Config:
    cfg = Config()
    overrides = {"hidden_size": args.hidden, "n_layers": args.layers, "ffn_hidden_size": args.ffn}
    cfg.model = dataclasses.replace(model_from_preset(args.model), **{k: v for k, v in overrides.items() if v})
    cfg.parallel.dp = args.dp
    cfg.sync = SyncConfig(mode=SyncMode.parse(sync))
    return cfg


def _rank(args: argparse.Namespace) -> dict:
    mesh = ParallelMesh.for_this_rank(1, args.dp, 1)
    plain, diloco = config(args, "every-step"), config(args, f"local:{args.every}")
    contenders = {}
    for name, cfg, view in (("dp", plain, mesh), ("diloco", diloco, mesh),
                            ("local", plain, mesh.reducing_over(None, 1, 0))):
        model = build_model(cfg.model, None, args.seed, mesh.device)
        contenders[name] = (model, build_engine(model, view, cfg))

    def step(name: str, x, y) -> tuple[float, bool]:
        """One training step as the trainer takes it; (seconds, whether an outer update was applied)."""
        model, engine = contenders[name]
        t0 = time.perf_counter()
        engine.prepare_step(1)
        model.loss_fn(model(x), y).backward()
        engine.finish_grad_sync()
        engine.grad_norm()
        record = apply_step(engine, args.lr, 1.0, True)
        synchronize(mesh.device)
        synced = bool(record["sync_outer"]) if name == "diloco" else False
        return time.perf_counter() - t0, synced

    tokens = load_training_data(DataConfig(), prepare_missing=True).train
    loader = BatchLoader(tokens, args.seq_len, Shard(mesh.grad_rank, args.dp, args.batch * args.dp, args.batch),
                         args.seed, mesh.device, prefetch=False)
    batches = [loader.next()[0] for _ in range(args.every)]
    times = {"dp": [], "diloco_inner": [], "diloco_sync": [], "local": []}
    for r in range(WARMUP_ROUNDS + args.rounds):
        for name in contenders:
            dist.barrier()
            for x, y in batches:  # one round = H steps: exactly one outer step for diloco
                seconds, synced = step(name, x, y)
                if r >= WARMUP_ROUNDS:
                    key = name if name != "diloco" else ("diloco_sync" if synced else "diloco_inner")
                    times[key].append(seconds)
    params = sum(p.numel() for p in contenders["dp"][0].parameters())
    return {"times": times, "params": params, "device": str(mesh.device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--ffn", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--every", type=int, default=10, help="H of --sync local:H (steps per round)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = run_on_ranks(_rank, args.dp, (args,))
    med = {k: statistics.mean(statistics.median(r["times"][k]) for r in results) for k in results[0]["times"]}
    mean = {k: statistics.mean(statistics.fmean(r["times"][k]) for r in results) for k in results[0]["times"]}
    every = args.every
    diloco_mean = ((every - 1) * mean["diloco_inner"] + mean["diloco_sync"]) / every
    print(f"device {results[0]['device']}, fp32, {results[0]['params'] / 1e6:.2f}M params, dp={args.dp}, "
          f"{args.batch} x {args.seq_len} tokens per rank, local:{every}, {args.rounds} rounds x {every} steps "
          f"per contender (after {WARMUP_ROUNDS} warm-up round)")
    for k in med:
        print(f"{k:13s} median {med[k] * 1e3:8.1f} ms   mean {mean[k] * 1e3:8.1f} ms")
    print(f"diloco inner / dp    (median) = {med['diloco_inner'] / med['dp']:.3f}   (target <= 1.02)")
    print(f"diloco inner / local (median) = {med['diloco_inner'] / med['local']:.3f}   (the wrapper's own cost)")
    print(f"diloco mean / dp     (mean, the sync step amortised over {every}) = {diloco_mean / mean['dp']:.3f}")


if __name__ == "__main__":
    main()
