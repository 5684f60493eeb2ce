"""ZeRO-3 at dp=2: our `--zero 3` path (`parallel/fsdp.py`, FSDPEngine) against plain FSDP2 written here.

Our stage 3 is FSDP2 underneath, so this measures what our wrapping costs or saves against the way FSDP2 is
used in its own docs and in torchtitan: `fully_shard` on every block, then on the root, over a 1-D device mesh,
and `torch.optim.AdamW` with the same lr, betas, eps and weight decay (matrices only, as ours); `foreach` is
left to PyTorch (on the CPU it takes the single-tensor path, as ours asks for explicitly). Ours is driven as the
trainer drives it: `prepare_step(1)`, forward, backward, `finish_grad_sync()`, `step(lr)`; the plain one
does zero_grad, forward, backward, step. No clipping on either side.

Both models come from `build_model(cfg, None, seed)` on every rank (identical weights before sharding) and
read each rank's half of the same global batches of the embedded corpus, in the same order. Timing rounds
alternate between the two and start at a barrier.

It prints the median step time of each, the ratio ours/FSDP2 (target <= 1.0), the loss each reaches (the
mean over ranks; they should agree to float rounding), CPU seconds per step (all threads of a rank), and the
bytes of parameters, gradients and AdamW states each rank holds after a step: ours from
`FSDPEngine.model_state_bytes()`, the plain run's counted here from its local shards, against the ZeRO-3
formula (4 + 4 + 8) x params / dp.

    python bench/zero3_vs_fsdp2.py                   # 4-layer, hidden 512 model (12.3M params), 2 gloo ranks
    python bench/zero3_vs_fsdp2.py --hidden 256 --ffn 768 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.assembly import build_model
from large_model_training.parallel.fsdp import FSDPEngine

from harness import alternate_rounds, summarise  # bench/harness.py (python puts the script's folder on the path)

WARMUP_STEPS = 2


def model_config(args: argparse.Namespace):
    cfg = model_from_preset(args.model)
    overrides = {"hidden_size": args.hidden, "n_layers": args.layers, "ffn_hidden_size": args.ffn}
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v})


def sharded_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameter, gradient and AdamW-state shards (the step counters, 0-dim, left out)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        tensors = [p, p.grad] + [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.ndim]
        total += sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)
    return total


def _rank(args: argparse.Namespace) -> dict:
    mesh = ParallelMesh.for_this_rank(1, args.dp, 1)
    device = mesh.device
    cfg = model_config(args)
    params = sum(p.numel() for p in build_model(cfg, None, args.seed, torch.device("meta")).parameters())

    ours = build_model(cfg, None, args.seed, device)
    engine = FSDPEngine(ours, mesh, precision="fp32", grad_reduce_fp32=False, weight_decay=args.weight_decay,
                        betas=(0.9, 0.95))

    plain = build_model(cfg, None, args.seed, device)
    dp_mesh = init_device_mesh(device.type, (args.dp,))
    for block in plain.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(plain, mesh=dp_mesh)
    trainable = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def step_ours(x, y):
        engine.prepare_step(1)
        loss = ours.loss_fn(ours(x), y)
        loss.backward()
        engine.finish_grad_sync()
        engine.step(args.lr)
        synchronize(device)
        return float(loss.detach())

    def step_fsdp2(x, y):
        opt.zero_grad(set_to_none=True)  # at the start, as prepare_step: the gradients stay readable after the step
        loss = plain.loss_fn(plain(x), y)
        loss.backward()
        opt.step()
        synchronize(device)
        return float(loss.detach())

    tokens = load_training_data(DataConfig(), prepare_missing=True).train
    loader = BatchLoader(tokens, args.seq_len, Shard(mesh.grad_rank, args.dp, args.batch, args.batch // args.dp),
                         args.seed, device, prefetch=False)
    batches = [loader.next()[0] for _ in range(WARMUP_STEPS + args.rounds * args.steps)]
    steps = {"ours": step_ours, "fsdp2": step_fsdp2}
    wall, cpu, losses = alternate_rounds(steps, batches, WARMUP_STEPS, args.rounds, args.steps)
    state = {"ours": engine.model_state_bytes(), "fsdp2": sharded_state_bytes(plain, opt)}
    return {"wall": wall, "cpu": cpu, "losses": losses, "state": state, "params": params,
            "threads": torch.get_num_threads(), "device": str(device)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset the shape starts from")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1280)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
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
          f"{args.layers or '-'} layers), dp={args.dp}, global batch {args.batch} x {args.seq_len}, "
          f"{args.rounds} rounds x {args.steps} steps, {r0['threads']} thread(s) per rank")
    for k in med:
        print(f"{k:5s} step {med[k]*1e3:8.1f} ms  cpu {cpu[k]*1e3:8.1f} ms/rank  "
              f"loss {loss[k][0]:.4f} -> {loss[k][-1]:.4f} after {steps} steps  "
              f"state {[r['state'][k] for r in results]} bytes/rank")
    gap = max(abs(a - b) for a, b in zip(loss["ours"], loss["fsdp2"]))
    formula = 16 * r0["params"] / args.dp
    print(f"step-time ratio ours/fsdp2 = {med['ours']/med['fsdp2']:.3f}  (cpu-time ratio "
          f"{cpu['ours']/cpu['fsdp2']:.3f})  largest loss difference over the {steps} steps = {gap:.2e}")
    print(f"model_state_bytes rank 0: ours {r0['state']['ours']:,}  fsdp2 {r0['state']['fsdp2']:,}  ZeRO-3 "
          f"formula 16 x params / dp = {formula:,.0f}  (ours/formula {r0['state']['ours']/formula:.4f})")


if __name__ == "__main__":
    main()
