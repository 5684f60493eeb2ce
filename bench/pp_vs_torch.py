"""Pipeline parallelism: our 1F1B (`parallel/pipeline/runtime.py`) against `torch.distributed.pipelining`'s
`Schedule1F1B`, on the same stage split, ranks, micro-batches and batches, at pp=2 and pp=4 in one run.

Both pipelines are built on every rank from the same config and seed, so they start from identical weights:
ours with `lmt.PipelineParallelism(mesh).split_model(cfg, seed)` (the balanced split of `partition.py`), and
PyTorch's as `PipelineStage`s around the same split: each rank's `Transformer(cfg, StageSpec(...))` from
`build_model(cfg, None, seed, stage=spec)`. Our stage module already takes what the previous stage sent (tokens
on the first stage, hidden states after it), so it goes into `PipelineStage` as is; the example input and
output of each stage are given up front (static metadata: no shape inference by running a micro-batch).
Our cross-entropy is the schedule's `loss_fn`.

Each step is one schedule over m micro-batches and an AdamW step. Loss scaling differs in form only: ours
scales each micro-batch loss by 1/m, PyTorch divides the gradients by m after the last backward. Neither
side does anything else collective in the timed step (ours is timed through its executor, as the trainer
uses it; `PipelineParallelism.train_step` would add an all-reduce of the loss over pp). A round is timed from a
barrier to a barrier, so it ends when the slowest rank is done; rounds alternate between the two.

It prints, for each pp, the median step time of each, the ratio ours/PyTorch (target <= 1.0) and the loss
each reaches (computed on the last stage; the two should agree to float rounding). It also prints the CPU
seconds per step summed over the ranks: on a shared machine (or with more ranks than cores, as pp=4 on 2)
wall time includes other processes, CPU time is closer to the work each side does.

    python bench/pp_vs_torch.py                                 # tiny preset, pp=2 and pp=4 gloo ranks on the CPU
    python bench/pp_vs_torch.py --pp 2 --micro-batches 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import large_model_training as lmt
from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.assembly import build_model
from large_model_training.models.loss import cross_entropy
from large_model_training.parallel.pipeline.partition import stage_layers, stage_specs
from large_model_training.parallel.pipeline.runtime import PipelineExecutor

WARMUP_STEPS = 2


def pipeline_stage(module, index: int, n_stages: int, mesh: ParallelMesh, micro_batch: int, seq_len: int,
                   cfg) -> PipelineStage:
    """`module` as stage `index` of `n_stages` for torch.distributed.pipelining, with its example input and output
    (static metadata: no shape inference by running a micro-batch)."""
    # Static metadata reads requires_grad from the examples: an output without it gets no gradient back.
    hidden = torch.empty(micro_batch, seq_len, cfg.hidden_size, device=mesh.device, requires_grad=True)
    tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=mesh.device)
    logits = torch.empty(micro_batch, seq_len, cfg.vocab_size, device=mesh.device, requires_grad=True)
    return PipelineStage(module, index, n_stages, mesh.device, input_args=tokens if index == 0 else hidden,
                         output_args=logits if index == n_stages - 1 else hidden, group=mesh.pp_group)


def torch_stage(cfg, spec, pp: int, mesh: ParallelMesh, seed: int, micro_batch: int, seq_len: int) -> PipelineStage:
    """This rank's stage (one per rank) for torch.distributed.pipelining."""
    return pipeline_stage(build_model(cfg, None, seed, mesh.device, stage=spec), mesh.pp_rank, pp, mesh,
                          micro_batch, seq_len, cfg)


def time_steps(step, batches) -> tuple[float, float, list[float]]:
    """Wall seconds per step over `batches`, from a barrier to a barrier (the slowest rank); this rank's CPU
    seconds per step (waits for a peer and time taken by other processes on a shared machine excluded); and
    each step's loss."""
    dist.barrier()
    t, cpu = time.perf_counter(), time.process_time()
    losses = [step(micro_batches) for micro_batches in batches]
    cpu = time.process_time() - cpu
    dist.barrier()
    return (time.perf_counter() - t) / len(batches), cpu / len(batches), losses


def _rank(args: argparse.Namespace, pp: int) -> dict:
    mesh = ParallelMesh.for_this_rank(pp, 1, 1)
    device = mesh.device
    cfg = model_from_preset(args.model)
    if cfg.tie_embeddings or cfg.dropout:
        raise ValueError(f"preset {args.model}: this comparison needs untied embeddings and no dropout "
                         "(PyTorch's schedule has no embedding-gradient sync between first and last stage)")
    m = args.micro_batches
    micro = args.batch // m

    pipe = lmt.PipelineParallelism(mesh, schedule="1f1b")
    ours = pipe.split_model(cfg, args.seed, args.seq_len)
    executor = PipelineExecutor(ours.chunks, ours.loss_fn, mesh, "1f1b", m, 1)
    split = stage_layers(cfg, pp, 1, "1f1b", args.seq_len)  # the split split_model used
    stage = torch_stage(cfg, stage_specs(split)[mesh.pp_rank], pp, mesh, args.seed, micro, args.seq_len)
    schedule = Schedule1F1B(stage, m, loss_fn=cross_entropy)
    theirs = stage.submod
    mine = dict(ours.named_parameters())  # same names, same starting values: the same model
    assert mine.keys() == dict(theirs.named_parameters()).keys()
    assert all(torch.equal(mine[n], w) for n, w in theirs.named_parameters())

    fused = device.type != "cpu" or None
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=args.lr, fused=fused)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=args.lr, fused=fused)

    def step_ours(micro_batches):
        loss = executor.forward_backward(micro_batches, 1.0 / m)  # the mean loss on the last stage, 0 elsewhere
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        synchronize(device)
        return float(loss)

    def step_theirs(micro_batches):
        losses = []
        if stage.is_first:  # the whole batch: the schedule cuts it into the same m micro-batches along dim 0
            schedule.step(torch.cat([x for x, _ in micro_batches]), return_outputs=False)
        elif stage.is_last:
            schedule.step(target=torch.cat([y for _, y in micro_batches]), losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        synchronize(device)
        return float(torch.stack(losses).detach().mean()) if losses else 0.0

    # Every pipeline rank reads the same global batches (the first stage uses the tokens, the last the targets).
    tokens = load_training_data(DataConfig(), prepare_missing=True).train  # prepared once, memory-mapped
    loader = BatchLoader(tokens, args.seq_len, Shard(0, 1, args.batch, micro),
                         args.seed, device, prefetch=False)
    batches = [loader.next() for _ in range(WARMUP_STEPS + args.rounds * args.steps)]
    steps = {"ours": step_ours, "torch": step_theirs}
    times, cpu_times = {k: [] for k in steps}, {k: [] for k in steps}
    losses = {k: time_steps(fn, batches[:WARMUP_STEPS])[2] for k, fn in steps.items()}
    for r in range(args.rounds):
        chunk = batches[WARMUP_STEPS + r * args.steps: WARMUP_STEPS + (r + 1) * args.steps]
        order = list(steps.items()) if r % 2 == 0 else list(steps.items())[::-1]
        for k, fn in order:
            seconds, cpu_seconds, round_losses = time_steps(fn, chunk)
            times[k].append(seconds)
            cpu_times[k].append(cpu_seconds)
            losses[k] += round_losses
    params = sum(p.numel() for p in build_model(cfg, None, args.seed, torch.device("meta")).parameters())
    return {"times": times, "cpu_times": cpu_times, "losses": losses, "split": split,
            "threads": torch.get_num_threads(), "device": str(device), "params": params}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline degrees to run, one after another")
    ap.add_argument("--batch", type=int, default=16, help="samples per step (all micro-batches)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.batch % args.micro_batches:
        ap.error(f"--batch {args.batch} must divide into --micro-batches {args.micro_batches}")
    total = WARMUP_STEPS + args.rounds * args.steps
    for pp in args.pp:
        ranks = run_on_ranks(_rank, pp, (args, pp))
        r = ranks[-1]  # the last stage: it holds the losses
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        # CPU seconds per step summed over the ranks, median over rounds: the work each side does.
        cpu = {k: statistics.median(map(sum, zip(*(rank["cpu_times"][k] for rank in ranks)))) for k in med}
        print(f"pp={pp}: device {r['device']}, fp32, model {args.model} ({r['params'] / 1e6:.1f}M params), "
              f"stage split {r['split']}, batch {args.batch} x {args.seq_len} in {args.micro_batches} micro-batches, "
              f"{args.rounds} rounds x {args.steps} steps, {r['threads']} thread(s) per rank")
        for k in med:
            print(f"  {k:6s} step {med[k] * 1e3:8.1f} ms  {args.batch * args.seq_len / med[k]:9.0f} tok/s  "
                  f"CPU {cpu[k] * 1e3:7.1f} ms/step (all ranks)  "
                  f"loss {r['losses'][k][0]:.4f} -> {r['losses'][k][-1]:.4f} after {total} steps")
        gap = max(abs(a - b) for a, b in zip(r["losses"]["ours"], r["losses"]["torch"]))
        print(f"  step-time ratio ours/torch = {med['ours'] / med['torch']:.3f}   "
              f"CPU-time ratio {cpu['ours'] / cpu['torch']:.3f}   "
              f"largest loss difference over the {total} steps = {gap:.2e}", flush=True)


if __name__ == "__main__":
    main()
