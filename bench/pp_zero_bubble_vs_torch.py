"""Zero-bubble pipeline schedules: ours (`--schedule zbv`, `zb-h1`) against `torch.distributed.pipelining`'s
`ScheduleZBVZeroBubble` and `ScheduleInterleavedZeroBubble`, on the same stages, ranks, micro-batches and
batches; and our zb-h1 against our own 1F1B. All sides in one run, at pp=2 and pp=4.

Sides (each with its own copy of the model, built on every rank from the same config and seed, so all start
from the same weights; every stage holds the same number of blocks: `--layers` defaults to 2p blocks):
  zbv         ours, v = 2 in the V placement (rank r holds stages r and 2p-1-r), `PipelineExecutor(.., "zbv")`
  torch-zbv   `ScheduleZBVZeroBubble` over two `PipelineStage`s per rank around the same two stage modules
              (PyTorch's ZBV puts stage r and 2p-1-r on rank r too)
  zb-h1       ours, v = 1, `PipelineExecutor(.., "zb-h1")`
  torch-izb   `ScheduleInterleavedZeroBubble` (ZB1P) with one `PipelineStage` per rank around the same stage
              module as zb-h1 (it accepts one stage per rank; its order is then ZB-H1's, W deferred by r)
  1f1b        ours, v = 1, `PipelineExecutor(.., "1f1b")`, the same stages as zb-h1
With `--aten-torch` two more sides, torch-zbv-aten and torch-izb-aten: PyTorch's schedules on the same stages
with every linear layer calling `F.linear` (autograd's built-in nodes) instead of our `_Linear` function.

Ours splits a backward by holding the weight-gradient GEMMs of our `_Linear` (`models/linear.py`): B computes
the input gradients, W runs the held GEMMs. PyTorch's `stage_backward_input` runs `autograd.grad` towards the
stage inputs with pre-hooks that save the output gradient of each node next to a weight, then
`stage_backward_weight` runs `autograd.grad` again from those saved nodes to the weights. Built-in nodes
compute only the gradients asked for; a custom `autograd.Function` (our `_Linear`) computes both every time,
so on our modules PyTorch's split computes each linear layer's dX and dW twice (but once on stage 0: there
PyTorch's I does nothing and its W runs the whole backward). The profile at the end counts `_Linear.backward`
calls and weight-gradient GEMMs in one step, and each side's CPU seconds (thread time) in F, B (I) and W (ours
counts the loss in F, PyTorch computes it outside `forward_one_chunk`). The run also checks that PyTorch's
compute order on every rank is ours (it is: ZBV is the paper's figure 8 on both sides, and ZB1P with one
stage per rank is ZB-H1). PyTorch's interleaved ZB1P with v >= 2 loop-placed stages has no counterpart here
(our `interleaved` does not split the backward).

Each step is one schedule over m micro-batches and an AdamW step; no other collective in the timed step
(losses are gathered after timing). A round is timed from a barrier to a barrier; rounds rotate the order of
the sides. It prints median step times, CPU seconds per step summed over the ranks, the ratios ours/torch
(target <= 1.0) and zb-h1/1f1b, and each side's losses (they should agree to float rounding).

    python bench/pp_zero_bubble_vs_torch.py                       # tiny preset, pp=2 and pp=4, gloo on the CPU
    python bench/pp_zero_bubble_vs_torch.py --pp 2 --rounds 3 --aten-torch
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import types
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

from large_model_training.assembly import build_model
from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.models import linear as linear_mod
from large_model_training.models.loss import cross_entropy
from pp_vs_torch import pipeline_stage, time_steps  # bench/pp_vs_torch.py (python puts the script's folder on the path)
from large_model_training.models.transformer import Transformer
from large_model_training.parallel.pipeline.actions import Op, rank_stages
from large_model_training.parallel.pipeline.partition import stage_specs
from large_model_training.parallel.pipeline.runtime import PipelineExecutor
from large_model_training.parallel.pipeline.schedules import build_schedule

WARMUP_STEPS = 2
PAIRS = (("zbv", "torch-zbv"), ("zb-h1", "torch-izb"), ("zb-h1", "1f1b"))


def _aten_linears(module: nn.Module) -> nn.Module:
    """Every linear layer of `module` through `F.linear` (nn.Linear.forward) instead of our `_Linear`."""
    for sub in module.modules():
        if isinstance(sub, linear_mod.Linear):
            sub.forward = types.MethodType(nn.Linear.forward, sub)
    return module


def _torch_stages(modules: dict[int, nn.Module], n_stages: int, mesh, micro: int, seq_len: int, cfg):
    return [pipeline_stage(module, j, n_stages, mesh, micro, seq_len, cfg) for j, module in modules.items()]


def _build_side(name: str, cfg, args, mesh, p: int, m: int, micro: int):
    """(step function, CPU seconds per op in its last step, whether PyTorch's compute order on this rank is
    ours) of one side on this rank."""
    v = 2 if "zbv" in name else 1
    specs = stage_specs([cfg.n_layers // (p * v)] * (p * v))
    held = rank_stages(mesh.pp_rank, p, v, "v" if v == 2 else "loop")
    chunks = {j: build_model(cfg, None, args.seed, mesh.device, stage=specs[j]) for j in held}
    params = [w for c in chunks.values() for w in c.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=mesh.device.type != "cpu" or None)
    seconds = Counter()  # this rank's CPU seconds (thread time) in F, B (I) and W, while profiling

    def timed(fn, op):
        def run(*a, **kw):
            t = time.thread_time()
            out = fn(*a, **kw)
            seconds[op] += time.thread_time() - t
            return out
        return run

    if not name.startswith("torch"):
        executor = PipelineExecutor(chunks, cross_entropy, mesh, name, m, v)
        executor._forward, executor._backward = timed(executor._forward, "F"), timed(executor._backward, "B")
        if executor.weight_grads is not None:
            store = executor.weight_grads
            store.run_weight_gradients = timed(store.run_weight_gradients, "W")

        def step(micro_batches):
            seconds.clear()
            loss = executor.forward_backward(micro_batches, 1.0 / m)  # summed scaled loss on the last stage
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(mesh.device)
            return float(loss)
        return step, lambda: Counter(seconds), True

    if name.endswith("-aten"):
        chunks = {j: _aten_linears(c) for j, c in chunks.items()}
    stages = _torch_stages(chunks, p * v, mesh, micro, args.seq_len, cfg)
    kind = ScheduleZBVZeroBubble if v == 2 else ScheduleInterleavedZeroBubble
    schedule = kind(stages, m, loss_fn=cross_entropy)
    # Same work order as ours on every rank? (PyTorch spells B "I"; its order has None for idle slots.)
    theirs = [str(a).replace("I", "B") for a in schedule.pipeline_order[mesh.pp_rank] if a is not None]
    ours = build_schedule("zbv" if v == 2 else "zb-h1", p, m, v)[mesh.pp_rank]
    same_order = theirs == [str(a) for a in ours if a.op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)]
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    for stage in stages:  # the schedule calls these on the stage instances
        for method, op in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                           ("backward_weight_one_chunk", "W")):
            setattr(stage, method, timed(getattr(stage, method), op))

    def step(micro_batches):
        seconds.clear()
        losses = []
        inputs = (torch.cat([x for x, _ in micro_batches]),) if first else ()
        target = torch.cat([y for _, y in micro_batches]) if last else None
        schedule.step(*inputs, target=target, losses=losses if last else None, return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(mesh.device)
        return float(torch.stack(losses).detach().mean()) if losses else 0.0  # PyTorch divides grads by m
    return step, lambda: Counter(seconds), same_order


def _profile(step, op_seconds, batch) -> dict:
    """One more step with `_Linear.backward` calls and weight-gradient GEMMs counted, and CPU seconds per op."""
    counts = Counter()
    backward, weight_grad = linear_mod._Linear.backward, linear_mod._weight_grad

    def counted_backward(ctx, grad):
        counts["linear_backward"] += 1
        return backward(ctx, grad)

    def counted_weight_grad(grad, x):
        counts["dW_gemm"] += 1
        return weight_grad(grad, x)
    linear_mod._Linear.backward, linear_mod._weight_grad = staticmethod(counted_backward), counted_weight_grad
    try:
        time_steps(step, [batch])
    finally:
        linear_mod._Linear.backward, linear_mod._weight_grad = staticmethod(backward), weight_grad
    return {"counts": dict(counts), "seconds": dict(op_seconds())}


def _rank(args: argparse.Namespace, pp: int, names: list[str]) -> dict:
    torch.set_num_threads(1)
    mesh = ParallelMesh.for_this_rank(pp, 1, 1)
    cfg = model_from_preset(args.model)
    layers = args.layers or max(cfg.n_layers, 2 * pp)
    cfg = dataclasses.replace(cfg, n_layers=layers)
    if cfg.tie_embeddings or cfg.dropout:
        raise ValueError(f"preset {args.model}: this comparison needs untied embeddings and no dropout")
    if layers % (2 * pp):
        raise ValueError(f"{layers} layers do not split evenly into {2 * pp} zbv stages")
    m = args.micro_batches
    micro = args.batch // m
    sides = {k: _build_side(k, cfg, args, mesh, pp, m, micro) for k in names}

    tokens = load_training_data(DataConfig(), prepare_missing=True).train
    loader = BatchLoader(tokens, args.seq_len, Shard(0, 1, args.batch, micro), args.seed, mesh.device,
                         prefetch=False)
    batches = [loader.next() for _ in range(WARMUP_STEPS + args.rounds * args.steps + 1)]
    times, cpu_times = {k: [] for k in sides}, {k: [] for k in sides}
    losses = {k: time_steps(side[0], batches[:WARMUP_STEPS])[2] for k, side in sides.items()}
    order = list(sides)
    for r in range(args.rounds):
        chunk = batches[WARMUP_STEPS + r * args.steps: WARMUP_STEPS + (r + 1) * args.steps]
        shift = r % len(order)
        for k in order[shift:] + order[:shift]:
            seconds, cpu_seconds, round_losses = time_steps(sides[k][0], chunk)
            times[k].append(seconds)
            cpu_times[k].append(cpu_seconds)
            losses[k] += round_losses
    profile = {k: _profile(step, op_seconds, batches[-1]) for k, (step, op_seconds, _) in sides.items()}
    with torch.device("meta"):
        params = sum(w.numel() for w in Transformer(cfg).parameters())
    return {"same_order": {k: side[2] for k, side in sides.items()}, "times": times, "cpu_times": cpu_times,
            "losses": losses, "profile": profile, "layers": layers, "threads": torch.get_num_threads(),
            "device": str(mesh.device), "params": params}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=0, help="blocks (default: the preset's, at least 2 x pp)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline degrees to run, one after another")
    ap.add_argument("--batch", type=int, default=16, help="samples per step (all micro-batches)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aten-torch", action="store_true",
                    help="also PyTorch's schedules with F.linear layers (torch-zbv-aten, torch-izb-aten)")
    args = ap.parse_args()
    if args.batch % args.micro_batches:
        ap.error(f"--batch {args.batch} must divide into --micro-batches {args.micro_batches}")
    names = ["zbv", "torch-zbv", "zb-h1", "torch-izb", "1f1b"]
    pairs = list(PAIRS)
    if args.aten_torch:
        names += ["torch-zbv-aten", "torch-izb-aten"]
        pairs += [("zbv", "torch-zbv-aten"), ("zb-h1", "torch-izb-aten")]
    total = WARMUP_STEPS + args.rounds * args.steps
    for pp in args.pp:
        ranks = run_on_ranks(_rank, pp, (args, pp, names))
        r = ranks[0]
        med = {k: statistics.median(r["times"][k]) for k in names}
        cpu = {k: statistics.median(map(sum, zip(*(rank["cpu_times"][k] for rank in ranks)))) for k in names}
        loss = {k: [sum(step) for step in zip(*(rank["losses"][k] for rank in ranks))] for k in names}
        print(f"pp={pp}: device {r['device']}, fp32, model {args.model} with {r['layers']} blocks "
              f"({r['params'] / 1e6:.1f}M params, {r['layers'] // (2 * pp)} per zbv stage, {r['layers'] // pp} per "
              f"v=1 stage), batch {args.batch} x {args.seq_len} in {args.micro_batches} micro-batches, "
              f"{args.rounds} rounds x {args.steps} steps, {r['threads']} thread(s) per rank")
        same = [k for k in names if k.startswith("torch") and all(rank["same_order"][k] for rank in ranks)]
        print(f"  PyTorch's F/B(I)/W order equals ours on every rank for: {', '.join(same) or 'none'}")
        for k in names:
            print(f"  {k:15s} step {med[k] * 1e3:7.1f} ms  CPU {cpu[k] * 1e3:7.1f} ms/step (all ranks)  "
                  f"loss {loss[k][0]:.4f} -> {loss[k][-1]:.4f} after {total} steps")
        for a, b in pairs:
            gap = max(abs(x - y) for x, y in zip(loss[a], loss[b]))
            print(f"  {a}/{b}: step-time ratio {med[a] / med[b]:.3f}   CPU-time ratio {cpu[a] / cpu[b]:.3f}   "
                  f"largest loss difference {gap:.2e}")
        print("  profile of one step, summed over ranks: _Linear.backward calls, weight-gradient GEMMs, "
              "CPU seconds in F / B (I) / W")
        for k in names:
            counts, secs = Counter(), Counter()
            for rank in ranks:
                counts.update(rank["profile"][k]["counts"])
                secs.update(rank["profile"][k]["seconds"])
            print(f"  {k:15s} backward {counts['linear_backward']:4d}  dW GEMMs {counts['dW_gemm']:4d}  "
                  f"F {secs['F'] * 1e3:6.1f}  B {secs['B'] * 1e3:6.1f}  W {secs['W'] * 1e3:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
