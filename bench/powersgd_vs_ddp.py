"""PowerSGD at rank 4, dp=2: ours (engine + CompressionState + compression_hook) against DDP's powerSGD_hook.

Both models come from `build_model(cfg, None, seed)` on every rank (identical weights), both split their
gradients into buckets of the same `bucket_cap_mb`, and each rank reads its half of the same global batches of
the embedded corpus, in the same order, for both. Timing rounds alternate between the two from a barrier.

Ours is the trainer's `--compression powersgd:4`: `DataParallelEngine(zero=0, comm_hook=compression_hook,
hook_state=CompressionState(..., "powersgd:4"))`, error feedback on, warm start, stepping its own AdamW,
`hook_state.new_step()` after each step. Theirs: `DistributedDataParallel` with
`register_comm_hook(PowerSGDState(...), powerSGD_hook)` and `torch.optim.AdamW(foreach=False)` with the same lr,
betas, eps and weight decay (matrices only, as ours). Settings chosen for equal semantics:
  matrix_approximation_rank=4   as ours
  use_error_feedback, warm_start on, as ours
  min_compression_rate=1        a matrix is compressed when (n + m) r < n m, our rule (their default 2 would
                                send more matrices dense)
  orthogonalization_epsilon=1e-8  ours adds 1e-8 to each column norm (their default 0)
  start_powerSGD_iter=2         the least PyTorch accepts with error feedback or warm start (DDP rebuilds its
                                buckets after the first step). Ours compresses from step 1, theirs from step 3:
                                the two warm-up steps are exactly their dense steps, every timed step compresses.
Buckets: one by default (`--bucket-mb 25`, DDP's default cap; the tiny model's 3.7 MB of gradients fit in it),
because PyTorch's hook is not safe on gloo with several buckets in flight: its second and third all-reduces are
issued from future callbacks, which on gloo run on the process group's worker thread while backward issues the
next bucket's first all-reduce from the main thread, so ranks can issue them in different orders (we saw
"Received data size doesn't match expected size" aborts at 0.5 MB; on NCCL its futures complete at once and the
callbacks run inline, in order: pytorch/pytorch#48478). With a smaller `--bucket-mb`, their hook is wrapped to
wait for its future before returning (serialised: correct, but nothing of theirs overlaps backward), and the run
says so.

Remaining differences of algorithm (not settings): their error feedback keeps x - (averaged approximation),
ours x - (this rank's own approximation) (compression/powersgd.py); they also re-orthonormalise the warm-started
Q; their first Q comes from another random stream. None of these changes the update in exact arithmetic except
the first Q: P, Q and the sum over ranks of the errors depend only on the ranks' summed gradients, the two error
forms have the same sum, and orthonormalising Q first changes P by an upper-triangular factor that the QR of P
undoes. Both send the first two steps dense (`--ours-dense-steps`, default 2: theirs cannot start earlier), so
the loss gap measures the first Q alone: seed-level noise, hence one comparison per seed (`--seeds`, default
0 1 2) and their mean.

It prints the median step time of each and the ratio ours/DDP (target <= 1.0), the training loss each reaches
(last step, and the mean of the last 10 steps; mean over ranks), and the validation loss of each at the end on
the same held-out batches (target: ours no worse than theirs by more than 1%), plus the bytes our hook put on
the wire per step against a dense all-reduce.

    python bench/powersgd_vs_ddp.py                      # tiny preset, 2 gloo ranks, 2 + 8 x 10 steps, seeds 0 1 2
    python bench/powersgd_vs_ddp.py --rounds 10 --steps 10 --seeds 0
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from large_model_training.compression import CompressionState, compression_hook, parse_compression
from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.assembly import build_model
from large_model_training.parallel.dp_engine import DataParallelEngine

from harness import alternate_rounds, summarise  # bench/harness.py (python puts the script's folder on the path)

WARMUP_STEPS = 2
START_POWERSGD_ITER = 2


def model_config(args: argparse.Namespace):
    cfg = model_from_preset(args.model)
    overrides = {"hidden_size": args.hidden, "n_layers": args.layers, "ffn_hidden_size": args.ffn}
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v})


def _rank(args: argparse.Namespace) -> dict:
    mesh = ParallelMesh.for_this_rank(1, args.dp, 1)
    device = mesh.device
    cfg = model_config(args)

    ours = build_model(cfg, None, args.seed, device)
    state = CompressionState(mesh.grad_group, args.dp, parse_compression(f"powersgd:{args.rank}"), seed=args.seed)
    engine = DataParallelEngine(ours, mesh, zero=0, bucket_mb=args.bucket_mb, precision="fp32",
                                grad_reduce_fp32=False, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                comm_hook=compression_hook, hook_state=state)

    theirs = DistributedDataParallel(build_model(cfg, None, args.seed, device), process_group=mesh.grad_group,
                                     bucket_cap_mb=args.bucket_mb)
    serialise = len(engine.buckets) > 1

    def their_hook(hook_state, bucket):  # see the docstring: several buckets in flight are unsafe on gloo
        fut = powerSGD_hook(hook_state, bucket)
        if serialise:
            fut.wait()
        return fut

    theirs.register_comm_hook(PowerSGDState(mesh.grad_group, matrix_approximation_rank=args.rank,
                                            start_powerSGD_iter=START_POWERSGD_ITER, min_compression_rate=1,
                                            use_error_feedback=True, warm_start=True,
                                            orthogonalization_epsilon=1e-8, random_seed=args.seed),
                              their_hook)
    trainable = [p for p in theirs.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    sent = []

    powersgd = state.spec

    def step_ours(x, y):
        state.spec = parse_compression("none") if state.step < args.ours_dense_steps else powersgd
        engine.prepare_step(1)
        loss = ours.loss_fn(ours(x), y)
        loss.backward()
        sent.append(engine.finish_grad_sync())
        engine.step(args.lr)
        state.new_step()
        synchronize(device)
        return float(loss.detach())

    def step_ddp(x, y):
        loss = theirs.module.loss_fn(theirs(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        return float(loss.detach())

    streams = load_training_data(DataConfig(), prepare_missing=True)
    shard = Shard(mesh.grad_rank, args.dp, args.batch, args.batch // args.dp)
    loader = BatchLoader(streams.train, args.seq_len, shard, args.seed, device, prefetch=False)
    batches = [loader.next()[0] for _ in range(WARMUP_STEPS + args.rounds * args.steps)]
    val_shard = Shard(mesh.grad_rank, args.dp, args.batch * args.val_batches, args.batch // args.dp)
    val = BatchLoader(streams.val, args.seq_len, val_shard, args.seed, device, shuffle=False, prefetch=False).next()
    steps = {"ours": step_ours, "ddp": step_ddp}
    wall, cpu, losses = alternate_rounds(steps, batches, WARMUP_STEPS, args.rounds, args.steps)
    with torch.no_grad():
        val_loss = {"ours": statistics.mean(float(ours.loss_fn(ours(x), y)) for x, y in val),
                    "ddp": statistics.mean(float(theirs.module.loss_fn(theirs.module(x), y)) for x, y in val)}
    dense = sum(b.numel for b in engine.buckets) * 4
    # Free DDP and its hook's futures here, on the main thread: left to teardown, the last reference to the
    # process group can drop on gloo's worker thread, which then joins itself ("Resource deadlock avoided").
    del theirs, opt
    gc.collect()
    return {"wall": wall, "cpu": cpu, "losses": losses, "val": val_loss, "sent": sent[-1], "dense": dense,
            "params": sum(p.numel() for p in ours.parameters()), "buckets": len(engine.buckets),
            "serialised": serialise, "threads": torch.get_num_threads(), "device": str(device)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset the shape starts from")
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--ffn", type=int, default=0)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD matrix approximation rank")
    ap.add_argument("--batch", type=int, default=16, help="global batch (split over dp)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--val-batches", type=int, default=4, help="global batches of held-out text for the final loss")
    ap.add_argument("--ours-dense-steps", type=int, default=START_POWERSGD_ITER,
                    help="ours all-reduces densely for this many first steps, as theirs must (default: the same "
                         "2; 0 compresses from step 1, as `lmt train --compression powersgd:R` does)")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="one comparison per seed (weights, data order, first Q); the summary averages them")
    args = ap.parse_args()
    ratios, gaps = [], []
    for seed in args.seeds:
        ratio, gap = run_seed(argparse.Namespace(**{**vars(args), "seed": seed}))
        ratios.append(ratio)
        gaps.append(gap)
    if len(args.seeds) > 1:
        print(f"over seeds {' '.join(map(str, args.seeds))}: step-time ratio ours/ddp mean {statistics.mean(ratios):.3f} "
              f"(each {', '.join(f'{r:.3f}' for r in ratios)}); val loss ours/ddp mean {statistics.mean(gaps):+.2%} "
              f"(each {', '.join(f'{g:+.2%}' for g in gaps)})")


def run_seed(args: argparse.Namespace) -> tuple[float, float]:
    """One comparison at args.seed; prints its rows, returns (step-time ratio, relative val-loss gap)."""
    results = run_on_ranks(_rank, args.dp, (args,))
    r0 = results[0]
    steps = WARMUP_STEPS + args.rounds * args.steps
    med, cpu, loss = summarise(results, steps)
    val = {k: statistics.mean(r["val"][k] for r in results) for k in r0["val"]}
    print(f"device {r0['device']}, fp32, model {args.model} ({r0['params']/1e6:.2f}M params), dp={args.dp}, "
          f"powersgd rank {args.rank}, global batch {args.batch} x {args.seq_len}, bucket {args.bucket_mb} MB "
          f"({r0['buckets']} ours), {WARMUP_STEPS} + {args.rounds} rounds x {args.steps} steps, "
          f"{r0['threads']} thread(s) per rank, seed {args.seed}"
          + (f", ours dense for {args.ours_dense_steps} steps" if args.ours_dense_steps else "")
          + (", PyTorch's hook serialised (several buckets)" if r0["serialised"] else ""))
    for k in med:
        print(f"{k:5s} step {med[k]*1e3:8.1f} ms  cpu {cpu[k]*1e3:8.1f} ms/rank  loss {loss[k][0]:.4f} -> "
              f"{loss[k][-1]:.4f} at step {steps} (mean of last 10: {statistics.mean(loss[k][-10:]):.4f})  "
              f"val loss {val[k]:.4f}")
    print(f"step-time ratio ours/ddp = {med['ours']/med['ddp']:.3f}  (cpu-time ratio {cpu['ours']/cpu['ddp']:.3f})  "
          f"val loss ours/ddp = {val['ours']/val['ddp']:.4f} ({(val['ours']/val['ddp'] - 1):+.2%})")
    print(f"our dp bytes per step: {r0['sent']:,} vs {r0['dense']:,} dense ({r0['dense']/r0['sent']:.1f}x fewer)")
    return med["ours"] / med["ddp"], val["ours"] / val["ddp"] - 1


if __name__ == "__main__":
    main()
