"""Data parallelism at dp=2: our engine (`parallel/dp_engine.py`, ZeRO-0) against PyTorch's DistributedDataParallel.

Both models are built on every rank with `build_model(cfg, None, seed)` (identical starting weights). Ours goes
into `DataParallelEngine(zero=0)`, which moves the parameters into its flat buffers and steps its own AdamW;
DDP wraps the other with the same `bucket_cap_mb` (its first bucket gets the same cap when the cap is given) and
`gradient_as_bucket_view=True` (gradients are views of its buckets, as ours are of our buffers), and steps
`torch.optim.AdamW(foreach=False)` with the same lr, betas, eps and weight decay (decay on matrices only, as
ours). No clipping on either side. Each rank reads its half of the same global batches of the embedded corpus,
in the same order, for both. Timing rounds alternate between the two; each round starts at a barrier.

Part 1 prints the median step time of each, the ratio ours/DDP (target <= 1.0) and the loss each reaches (the
mean over ranks; they should agree to float rounding: same weights, same data, same arithmetic: both divide
by dp before summing).

Part 2 measures how much of our reduction time is hidden behind backward, in rounds of two modes (no
optimizer step, so the weights do not move; forward is outside every timed region):
  overlap   prepare_step; forward; barrier; t0; backward + finish_grad_sync (buckets reduce while backward
            runs, as in training); t1.                                   t_overlap  = t1 - t0
  deferred  the same, but every bucket's pending count is raised by one after prepare_step, so no bucket
            reaches zero in backward and nothing launches; finish_grad_sync then launches every bucket.
            t0; backward; t1; barrier; t2; finish_grad_sync; t3.   t_backward = t1 - t0, t_comm = t3 - t2
  hidden = 1 - (t_overlap - t_backward) / t_comm
i.e. the share of the standalone reduction time that did not add to backward when overlapped. (The barrier in
deferred mode keeps the peer's lateness out of t_comm; in overlap mode any lateness counts against us.) It is
computed from the median of the rounds, and from the fastest round of each kind (the least disturbed by other
processes on a shared machine). The CPU seconds of the same pieces (all threads of a rank, gloo's and the
kernel's TCP copies included) show whether the reduction is CPU work: on a CPU-only machine where every core
runs a rank's backward, it competes with backward for the cores instead of running beside it.

The default shape is chosen so that both are visible: 12.3M parameters (49 MB of fp32 gradients, 11 buckets of
4 MB) and 2 x 64 tokens per rank, so backward takes a few times as long as the reductions alone.

    python bench/dp_vs_ddp.py                     # 4 layers, hidden 512 (12.3M params), 2 gloo ranks on the CPU
    python bench/dp_vs_ddp.py --batch 8 --seq-len 128 --bucket-mb 25
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.assembly import build_model
from large_model_training.parallel.dp_engine import DataParallelEngine

from harness import alternate_rounds, summarise  # bench/harness.py (python puts the script's folder on the path)

WARMUP_STEPS = 2


def model_config(args: argparse.Namespace):
    cfg = model_from_preset(args.model)
    overrides = {"hidden_size": args.hidden, "n_layers": args.layers, "ffn_hidden_size": args.ffn}
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v})


def torch_adamw(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with our engine's hyper-parameters: weight decay on tensors of 2 or more dims only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _rank(args: argparse.Namespace) -> dict:
    mesh = ParallelMesh.for_this_rank(1, args.dp, 1)
    device = mesh.device
    cfg = model_config(args)
    ours = build_model(cfg, None, args.seed, device)
    engine = DataParallelEngine(ours, mesh, zero=0, bucket_mb=args.bucket_mb, precision="fp32",
                                grad_reduce_fp32=False, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    theirs = DistributedDataParallel(build_model(cfg, None, args.seed, device), process_group=mesh.grad_group,
                                     bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    opt = torch_adamw(theirs, args)

    def step_ours(x, y):
        engine.prepare_step(1)
        loss = ours.loss_fn(ours(x), y)
        loss.backward()
        engine.finish_grad_sync()
        engine.step(args.lr)
        synchronize(device)
        return float(loss.detach())

    def step_ddp(x, y):
        loss = theirs.module.loss_fn(theirs(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # zero the bucket views in place, as prepare_step zeroes our buffers
        synchronize(device)
        return float(loss.detach())

    def backward_timings(x, y, deferred: bool) -> dict[str, tuple[float, float]]:
        """(wall, cpu) seconds of backward + reduction overlapped, or of backward and the reductions apart."""
        engine.prepare_step(1)
        if deferred:  # no bucket's count reaches zero in backward: finish_grad_sync launches them all
            engine.grads._pending = [n + 1 for n in engine.grads._pending]
        loss = ours.loss_fn(ours(x), y)
        dist.barrier()
        t0 = (time.perf_counter(), time.process_time())
        loss.backward()
        if not deferred:
            engine.finish_grad_sync()
            t1 = (time.perf_counter(), time.process_time())
            return {"overlap": (t1[0] - t0[0], t1[1] - t0[1])}
        t1 = (time.perf_counter(), time.process_time())
        dist.barrier()
        t2 = (time.perf_counter(), time.process_time())
        engine.finish_grad_sync()
        t3 = (time.perf_counter(), time.process_time())
        return {"backward": (t1[0] - t0[0], t1[1] - t0[1]), "comm": (t3[0] - t2[0], t3[1] - t2[1])}

    tokens = load_training_data(DataConfig(), prepare_missing=True).train
    loader = BatchLoader(tokens, args.seq_len, Shard(mesh.grad_rank, args.dp, args.batch, args.batch // args.dp),
                         args.seed, device, prefetch=False)
    batches = [loader.next()[0] for _ in range(WARMUP_STEPS + args.rounds * args.steps)]
    steps = {"ours": step_ours, "ddp": step_ddp}
    wall, cpu, losses = alternate_rounds(steps, batches, WARMUP_STEPS, args.rounds, args.steps)

    parts = {"overlap": [], "backward": [], "comm": []}
    x, y = batches[0]
    for _ in range(args.overlap_rounds):
        for deferred in (False, True):
            for k, v in backward_timings(x, y, deferred).items():
                parts[k].append(v)
    params = sum(p.numel() for p in ours.parameters())
    return {"wall": wall, "cpu": cpu, "losses": losses, "parts": parts, "params": params,
            "buckets": len(engine.buckets), "ddp_buckets": len(theirs.reducer._get_zeros_like_grad_buckets()),
            "threads": torch.get_num_threads(), "device": str(device)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset the shape starts from")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1280)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over dp)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=4, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--overlap-rounds", type=int, default=20)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = run_on_ranks(_rank, args.dp, (args,))
    r0 = results[0]
    steps = WARMUP_STEPS + args.rounds * args.steps
    med, cpu, loss = summarise(results, steps)
    print(f"device {r0['device']}, fp32, {r0['params']/1e6:.2f}M params (hidden {args.hidden or '-'}, "
          f"{args.layers or '-'} layers), dp={args.dp}, global batch {args.batch} x {args.seq_len}, bucket "
          f"{args.bucket_mb} MB ({r0['buckets']} ours, {r0['ddp_buckets']} DDP), {args.rounds} rounds x "
          f"{args.steps} steps, {r0['threads']} thread(s) per rank")
    for k in med:
        print(f"{k:5s} step {med[k]*1e3:8.1f} ms  cpu {cpu[k]*1e3:8.1f} ms/rank  "
              f"loss {loss[k][0]:.4f} -> {loss[k][-1]:.4f} after {steps} steps")
    gap = max(abs(a - b) for a, b in zip(loss["ours"], loss["ddp"]))
    print(f"step-time ratio ours/ddp = {med['ours']/med['ddp']:.3f}  (cpu-time ratio {cpu['ours']/cpu['ddp']:.3f})  "
          f"largest loss difference over the {steps} steps = {gap:.2e}")
    for name, pick in (("median", statistics.median), ("fastest", min)):
        t = {k: statistics.mean(pick(wall for wall, _ in r["parts"][k]) for r in results) for k in r0["parts"]}
        hidden = 1 - (t["overlap"] - t["backward"]) / t["comm"]
        print(f"overlap ({name} of {args.overlap_rounds} rounds, mean over ranks): backward+sync overlapped "
              f"{t['overlap']*1e3:.1f} ms, backward alone {t['backward']*1e3:.1f} ms, reductions alone "
              f"{t['comm']*1e3:.1f} ms -> hidden behind backward = {hidden:.1%}")
    c = {k: statistics.mean(statistics.median(cpu for _, cpu in r["parts"][k]) for r in results) for k in r0["parts"]}
    print(f"  cpu ms/rank (medians): overlapped {c['overlap']*1e3:.1f}, backward alone {c['backward']*1e3:.1f}, "
          f"reductions alone {c['comm']*1e3:.1f} (their sum {(c['backward'] + c['comm'])*1e3:.1f})")


if __name__ == "__main__":
    main()
