"""`lmt calibrate`: measure this machine and store it as the `cpu` hardware entry.

What is measured, and why each number is the one the time model needs. Every rate is the median of
repeated runs, not the best: a training step runs its kernels back to back on a machine whose clocks and
neighbours vary, and the median is the rate it sustains (best-of over-predicted step time by ~1.5x here):
  - matmul rate, fp32 and bf16, all cores on one square GEMM: the 'peak' of the entry. Local ranks share the
    cores (hardware.per_rank divides it);
  - attention: causal scaled_dot_product_attention (PyTorch's CPU flash kernel) forward and backward, its
    rate over the FLOPs a causal kernel executes (flops.attention_core_flops; backward 2.5x forward) as a
    fraction of the fp32 matmul rate: `attention_efficiency` (about 0.3 here: the kernel's softmax and small
    head-dim tiles do not reach the GEMM rate);
  - memory bandwidth: an out-of-place elementwise product of 64 MiB tensors, as the memory-bound kernels of
    a model run (the result newly allocated);
  - then one real training step of the `tiny` preset against what the time model predicts from the rates
    above: that ratio (`step_efficiency`, 1.2-1.4 here) becomes the entry's gemm, attention and memory
    efficiency. One number per machine, from one reference workload; every other model and layout is a
    prediction.
  - gloo all-reduce between 2 spawned ranks (launch.run_on_ranks, the launcher `lmt train` uses): a 4 KiB
    all-reduce gives the per-step latency alpha, a 16 MiB one the bandwidth beta, from the ring model
    t = 2(n-1) alpha + 2(n-1)/n bytes/beta with n = 2.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from large_model_training.mesh import synchronize
from large_model_training.planner.hardware import Hardware, save_measured


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype, n: int = 1024, repeats: int = 15, device: torch.device | None = None) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (on the CPU: with all of this process's threads), the median of
    `repeats`: the peak of `lmt calibrate`'s entry, of a CPU run's MFU (train/mfu.py) and of bench/throughput.py.
    An accelerator needs n of several thousand to be filled."""
    device = device or torch.device("cpu")
    # Its own generator: a run measures this after restoring a checkpoint's RNG state, which the global
    # generator's draws would shift (dropout would no longer repeat the uninterrupted run's masks).
    own = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=own)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=own)

    def run() -> None:
        torch.mm(a, b)
        synchronize(device)

    return 2.0 * n**3 / _median_time(run, repeats)


def attention_rate(batch: int = 4, heads: int = 8, seq_len: int = 512, head_dim: int = 64, repeats: int = 7) -> float:
    """FLOP/s of causal fp32 attention forward + backward, counting what a causal kernel executes."""
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, requires_grad=True) for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    forward = 0.5 * 2 * 2 * seq_len * seq_len * heads * head_dim * batch  # = flops.attention_core_flops
    return (1 + 2.5) * forward / _median_time(step, repeats)


def memory_bandwidth(nbytes: int = 64 * 1024**2, repeats: int = 9) -> float:
    """Bytes/s of an elementwise kernel as a model runs it: out-of-place x * y (two reads and a write, the
    result newly allocated), on tensors larger than the caches."""
    x = torch.rand(nbytes // 4)
    y = torch.rand(nbytes // 4)
    return 3.0 * nbytes / _median_time(lambda: x * y, repeats)


def _allreduce_probe(sizes: tuple[int, ...], repeats: int) -> list[float]:
    """Runs on each spawned rank: best time of an all-reduce of each size (bytes of fp32)."""
    import torch.distributed as dist

    out = []
    for size in sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32)
        dist.barrier()
        out.append(_median_time(lambda x=x: dist.all_reduce(x), repeats))
    return out


def measure_collectives(small: int = 4096, large: int = 16 * 1024**2, repeats: int = 5) -> tuple[float, float]:
    """(latency per ring step, bus bandwidth) of gloo all-reduce between 2 local ranks."""
    from large_model_training.launch import run_on_ranks

    times = run_on_ranks(_allreduce_probe, 2, ((small, large), repeats))
    t_small, t_large = (max(r[i] for r in times) for i in range(2))
    alpha = t_small / 2  # 2 (n - 1) steps with n = 2
    beta = large / max(t_large - 2 * alpha, 1e-9)  # 2 (n - 1) / n = 1 for n = 2
    return alpha, beta


REFERENCE_MODEL = "tiny"
"""The preset whose real training step sets the entry's achieved fraction (`step_efficiency`)."""


def step_efficiency(raw: Hardware, repeats: int = 5) -> float:
    """Predicted / measured seconds of one real training step of REFERENCE_MODEL (defaults of `lmt train`: one
    process, fp32, AdamW) on the microbenchmark rates of `raw`.

    Microbenchmarks do not run kernels as a step does: there caches are cold after the previous op, shapes are
    skinnier, outputs are allocated at other sizes, and the framework dispatches several hundred ops. Alone,
    the rates above predicted real steps 18-57% too fast (without the allocating elementwise probe) or, with
    it, somewhat too slow; the ratio for the reference step (1.2-1.4 on this CPU), measured once per machine,
    scales the compute, attention and memory rates of the entry. Every other model and layout is then a
    prediction (docs/benchmarks.md)."""
    from large_model_training.assembly import build_model
    from large_model_training.config import build_config
    from large_model_training.layout import validate
    from large_model_training.planner.estimate import predict_step_time

    cfg = validate(build_config(overrides={"model.preset": REFERENCE_MODEL}))
    t = cfg.train
    model = build_model(cfg.model, None, t.seed, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )

    def step() -> None:
        model(tokens[:, :-1], None, tokens[:, 1:]).backward()  # the loss as lmt train runs it (fused by default)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return predict_step_time(cfg, raw) / _median_time(step, repeats)


def calibrate(name: str = "cpu", collectives: bool = True) -> tuple[Hardware, str]:
    """Measure this machine, store the entry; returns (entry, path of the hardware file)."""
    fp32 = matmul_rate(torch.float32)
    bf16 = matmul_rate(torch.bfloat16)
    attention = attention_rate() / fp32
    bandwidth = memory_bandwidth()
    alpha, beta = measure_collectives() if collectives else (1e-4, bandwidth / 4)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 * 1024**3
    cores = os.cpu_count() or 1
    entry = Hardware(
        name=name,
        peak_flops=bf16,
        peak_flops_fp32=fp32,
        memory_bytes=float(memory),
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=beta,
        intra_node_latency=alpha,
        inter_node_bandwidth=beta,
        inter_node_latency=alpha,
        devices_per_node=cores,
        compute_units=1,
        gemm_efficiency=1.0,
        attention_efficiency=attention,
        memory_efficiency=1.0,
        reserved_fraction=0.2,
        fused_kernels=False,
    )
    achieved = step_efficiency(entry)
    entry = replace(
        entry,
        gemm_efficiency=achieved,
        attention_efficiency=attention * achieved,
        memory_efficiency=achieved,
        source=f"lmt calibrate on {socket.gethostname()} at {time.strftime('%Y-%m-%d %H:%M')} "
        f"({cores} cores, torch {torch.__version__}; a {REFERENCE_MODEL} step reached "
        f"{achieved:.2f} of the microbenchmark rates)",
    )
    return entry, save_measured(entry)
