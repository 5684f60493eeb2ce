"""Ring attention (issue 19): ours (`parallel/ring_attention.py`) against PyTorch's private
`_templated_ring_attention` (the oracle the tests hold us to), and cp=2 against cp=1.

Both rings run on the same gloo ranks, on the same zig-zag shards of the same full q, k, v (PyTorch's default load
balancer holds chunks r and 2cp-1-r too), with the same local kernel (the CPU flash kernel, which returns the
log-sum-exp), forward then backward, causal, fp32, GQA. PyTorch's ring runs as its defaults have it: key/value
all-gathered once in the forward, dK/dV rotated with all-to-all in the backward. Timing rounds alternate between
the two so machine noise hits both alike; a round's time is the slowest rank's (a barrier before and after).

Second part: one long sequence at cp=1 (one rank, the same code, no communication) against cp=2, in CPU seconds
summed over the ranks (what context parallelism costs in total work: the per-rank split, the merges and the
transfers), and in wall seconds.

    python bench/ring_attention_vs_torch.py                 # 1 thread per rank, 2 gloo ranks on the CPU
    python bench/ring_attention_vs_torch.py --seq-lens 1024 2048 --rounds 3 --long 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel._attention import (_templated_ring_attention,
                                                                                 _templated_ring_attention_backward)

from large_model_training.launch import run_on_ranks
from large_model_training.mesh import AxisGroup
from large_model_training.parallel.ring_attention import ring_attention, zigzag_shard

aten = torch.ops.aten


def _shards(args, seq: int, heads: int, kv_heads: int, rank: int, cp: int):
    g = torch.Generator().manual_seed(seq)
    full = [torch.randn(args.batch, h, seq, args.head_dim, generator=g) for h in (heads, kv_heads, kv_heads, heads)]
    return [zigzag_shard(t, 2, rank, cp) for t in full]


def _ours(cp: AxisGroup, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, cp)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


def _torch(cp: AxisGroup, q, k, v, dout):
    out, lse = _templated_ring_attention(cp.group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                                         is_causal=True)
    grads = _templated_ring_attention_backward(cp.group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward,
                                               dout, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0)
    return [out, *grads[:3]]


def _timed(fn, *args) -> tuple[float, float, list[torch.Tensor]]:
    """(wall s of the slowest rank, cpu s of this rank, result): on a shared machine the wall time carries the
    other tenants' load, the cpu time mostly does not."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, cpu, result


def _rank(args) -> dict:
    """Ours against the oracle at each sequence length: median fwd+bwd wall seconds and cpu seconds (summed over
    the ranks) of each, and the largest difference between their results."""
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    cp = AxisGroup(group=dist.group.WORLD, size=size, rank=rank)
    rows = {}
    for seq in args.seq_lens:
        tensors = _shards(args, seq, args.heads, args.kv_heads, rank, size)
        times, cpus, last = {"ours": [], "torch": []}, {"ours": [], "torch": []}, {}
        for _ in range(args.warmup):
            _ours(cp, *tensors), _torch(cp, *tensors)
        for r in range(args.rounds):
            for name in (["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]):
                seconds, cpu, last[name] = _timed(_ours if name == "ours" else _torch, cp, *tensors)
                times[name].append(seconds)
                cpus[name].append(cpu)
        gap = torch.tensor(max(float((a - b).abs().max()) for a, b in zip(last["ours"], last["torch"])))
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        cpu = torch.tensor([statistics.median(cpus["ours"]), statistics.median(cpus["torch"])], dtype=torch.float64)
        dist.all_reduce(cpu)
        rows[seq] = {k: statistics.median(v) for k, v in times.items()} | {
            "gap": float(gap), "ours_cpu": float(cpu[0]), "torch_cpu": float(cpu[1])}
    return rows


def _long(args) -> tuple[float, float, float]:
    """Our ring's fwd+bwd at the long length on this many ranks, after one warm-up: the medians over 3 runs of
    (cpu s of this rank, wall s), and the bytes this rank sent in one run."""
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    cp = AxisGroup(group=dist.group.WORLD, size=size, rank=rank)
    tensors = _shards(args, args.long, args.long_heads, args.long_heads, rank, size)
    _ours(cp, *tensors)
    sent, cpus, walls = cp.bytes, [], []
    for _ in range(3):
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        _ours(cp, *tensors)
        cpus.append(time.process_time() - cpu)
        dist.barrier()
        walls.append(time.perf_counter() - wall)
    return statistics.median(cpus), statistics.median(walls), sent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--long", type=int, default=8192, help="the long sequence of the cp=2 against cp=1 part")
    ap.add_argument("--long-heads", type=int, default=4)
    args = ap.parse_args()
    print(f"fp32, causal, batch {args.batch}, {args.heads} heads / {args.kv_heads} kv heads, head_dim "
          f"{args.head_dim}, cp={args.cp} gloo ranks, 1 thread per rank, {args.rounds} rounds (median), "
          f"fwd+bwd, torch {torch.__version__}")
    rows = run_on_ranks(_rank, args.cp, (args,))[0]
    for seq, row in rows.items():
        print(f"seq {seq:6d}  wall: ours {row['ours'] * 1e3:7.1f} ms, torch ring {row['torch'] * 1e3:7.1f} ms, "
              f"ratio {row['ours'] / row['torch']:.3f}   cpu summed over ranks: ours {row['ours_cpu']:.3f} s, "
              f"torch ring {row['torch_cpu']:.3f} s, ratio {row['ours_cpu'] / row['torch_cpu']:.3f}   "
              f"largest difference {row['gap']:.1e}")
    one = run_on_ranks(_long, 1, (args,))
    two = run_on_ranks(_long, args.cp, (args,))
    cpu1, cpu2 = sum(r[0] for r in one), sum(r[0] for r in two)
    wall1, wall2 = max(r[1] for r in one), max(r[1] for r in two)
    print(f"seq {args.long}, {args.long_heads} heads, fwd+bwd: cp=1 {cpu1:.2f} cpu-s ({wall1:.2f} s wall); "
          f"cp={args.cp} {cpu2:.2f} cpu-s summed over ranks ({wall2:.2f} s wall, {two[0][2] / 2**20:.1f} MiB sent "
          f"per rank); cpu ratio cp{args.cp}/cp1 = {cpu2 / cpu1:.3f}, wall speed-up {wall1 / wall2:.2f}x")


if __name__ == "__main__":
    main()
