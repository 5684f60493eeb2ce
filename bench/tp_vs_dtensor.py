"""Tensor parallelism at tp=2: ours (`parallel/tensor.py`) against PyTorch's DTensor `parallelize_module`.

Both models are built on every rank from the same config and seed, so they start from identical weights: ours
with `build_model(cfg, mesh, seed)` (each rank materialises its shard), the DTensor one as the plain
single-device `Transformer` from `build_model(cfg, None, seed, device)`, then split by torchtitan's plan for
Llama without sequence parallelism: the attention and MLP inputs are made replicated DTensors once per region
(`PrepareModuleInput`, so the input-gradient partial sum of the fused wqkv is all-reduced once, as
our "f" does), wqkv and w_gate_up column-wise, wo and w_down row-wise, the embedding row-wise over the
vocabulary, the head column-wise with its logits left sharded for `loss_parallel` (or gathered with
`--no-loss-parallel`); the per-rank head counts are lowered as torchtitan does. Both train with the same
AdamW on the same batches of the embedded corpus (the Python standard library's source), in the same order;
timing rounds alternate between the two so machine noise hits both alike.

It prints the median step time of each and the ratio ours/DTensor (target <= 1.0), and the loss both reach
after the same steps (they should agree to float rounding: same weights, same data, same arithmetic).

    python bench/tp_vs_dtensor.py                                  # tiny preset, 2 gloo ranks on the CPU
    python bench/tp_vs_dtensor.py --model small --batch 4 --seq-len 256 --steps 3 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, loss_parallel,
                                               parallelize_module)

from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard as DataShard
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.assembly import build_model
from large_model_training.api import TensorParallelism

WARMUP_STEPS = 2


def apply_dtensor_tp(model: nn.Module, tp_mesh, use_loss_parallel: bool) -> nn.Module:
    """torchtitan's tensor-parallel plan for Llama (no sequence parallelism), applied to our plain Transformer."""
    tp = tp_mesh.size()
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1) if use_loss_parallel else Replicate(),
                                  use_local_output=not use_loss_parallel),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn": PrepareModuleInput(input_layouts=(Replicate(), None, None),  # (x, rope, mask)
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.wqkv": ColwiseParallel(),  # rows grouped per kv head: a contiguous shard is a rank's heads
            "attn.wo": RowwiseParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            ("mlp.w_gate_up" if model.cfg.mlp == "swiglu" else "mlp.w_up"): ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(),
        })
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
    return model


def _as_float(loss: torch.Tensor) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def time_steps(step, batches) -> tuple[float, list[float]]:
    """Seconds per step over `batches` (ranks start together), and the loss of each step."""
    dist.barrier()
    t = time.perf_counter()
    losses = [step(x, y) for x, y in batches]
    return (time.perf_counter() - t) / len(batches), losses


def _rank(args: argparse.Namespace) -> dict:
    mesh = ParallelMesh.for_this_rank(1, 1, args.tp)
    device = mesh.device
    cfg = model_from_preset(args.model)
    if cfg.tie_embeddings or cfg.kv_heads % args.tp or cfg.dropout:
        raise ValueError(f"preset {args.model}: the DTensor plan here needs untied embeddings, no dropout and "
                         f"kv heads ({cfg.kv_heads}) divisible by tp={args.tp}")
    tp = TensorParallelism(mesh)
    ours = build_model(cfg, mesh, args.seed)
    theirs = apply_dtensor_tp(build_model(cfg, None, args.seed, device), mesh.device_mesh["tp"], args.loss_parallel)
    fused = device.type != "cpu" or None
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=args.lr, fused=fused)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=args.lr, fused=fused)

    def step_ours(x, y):
        loss = ours.loss_fn(ours(x), y)
        loss.backward()
        tp.sync_partial_gradients(ours)
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        synchronize(device)
        return float(loss.detach())

    def step_theirs(x, y):
        with loss_parallel() if args.loss_parallel else contextlib.nullcontext():
            logits = theirs(x)  # torchtitan's loss: F.cross_entropy, which loss_parallel shards over the vocabulary
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        synchronize(device)
        return _as_float(loss)

    # Every rank reads the same global batches (tp ranks share their data); the same list feeds both models.
    tokens = load_training_data(DataConfig(), prepare_missing=True).train
    loader = BatchLoader(tokens, args.seq_len, DataShard(0, 1, args.batch, args.batch), args.seed, device,
                         prefetch=False)
    batches = [loader.next()[0] for _ in range(WARMUP_STEPS + args.rounds * args.steps)]
    steps = {"ours": step_ours, "dtensor": step_theirs}
    times = {k: [] for k in steps}
    losses = {k: time_steps(fn, batches[:WARMUP_STEPS])[1] for k, fn in steps.items()}
    for r in range(args.rounds):
        chunk = batches[WARMUP_STEPS + r * args.steps: WARMUP_STEPS + (r + 1) * args.steps]
        for k, fn in steps.items():
            seconds, round_losses = time_steps(fn, chunk)
            times[k].append(seconds)
            losses[k] += round_losses
    params = sum(p.numel() for p in build_model(cfg, None, args.seed, torch.device("meta")).parameters())
    return {"times": times, "losses": losses, "threads": torch.get_num_threads(), "device": str(device),
            "params": params}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                    help="gather the DTensor model's logits instead of DTensor's loss_parallel")
    args = ap.parse_args()
    r = run_on_ranks(_rank, args.tp, (args,))[0]
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    steps = WARMUP_STEPS + args.rounds * args.steps
    print(f"device {r['device']}, fp32, model {args.model} ({r['params']/1e6:.1f}M params), tp={args.tp}, "
          f"batch {args.batch} x {args.seq_len}, {args.rounds} rounds x {args.steps} steps, "
          f"{r['threads']} thread(s) per rank, DTensor head: {'loss_parallel' if args.loss_parallel else 'gathered'}")
    for k in med:
        print(f"{k:8s} step {med[k]*1e3:8.1f} ms  {args.batch*args.seq_len/med[k]:9.0f} tok/s  "
              f"loss {r['losses'][k][0]:.4f} -> {r['losses'][k][-1]:.4f} after {steps} steps")
    gap = max(abs(a - b) for a, b in zip(r["losses"]["ours"], r["losses"]["dtensor"]))
    print(f"step-time ratio ours/dtensor = {med['ours']/med['dtensor']:.3f}   "
          f"largest loss difference over the {steps} steps = {gap:.2e}")


if __name__ == "__main__":
    main()
