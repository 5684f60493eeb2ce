"""`lmt calibrate`: measure this machine and store it as the `cpu` hardware entry.

What is measured, and why each number is the one the time model needs:
  - matmul rate, fp32 and bf16, all cores on one square GEMM (best of a few): the 'peak' of the entry, with
    gemm_efficiency 1.0 since the rate is already an achieved one. Local ranks share the cores
    (hardware.per_rank divides it);
  - memory bandwidth: a large tensor copy (read + write), for the memory-bound kernels and the optimizer;
  - gloo all-reduce between 2 spawned ranks (launch.run_on_ranks, the launcher `lmt train` uses): a 4 KiB
    all-reduce gives the per-step latency alpha, a 16 MiB one the bandwidth beta, from the ring model
    t = 2(n-1) alpha + 2(n-1)/n bytes/beta with n = 2.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from large_model_training.planner.hardware import Hardware, save_measured


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_rate(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` with all threads."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2.0 * n**3 / _best_time(lambda: torch.mm(a, b), repeats)


def memory_bandwidth(nbytes: int = 128 * 1024**2, repeats: int = 5) -> float:
    """Bytes/s moved by a tensor copy (counting the read and the write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _best_time(lambda: dst.copy_(src), repeats)


def _allreduce_probe(sizes: tuple[int, ...], repeats: int) -> list[float]:
    """Runs on each spawned rank: best time of an all-reduce of each size (bytes of fp32)."""
    import torch.distributed as dist

    out = []
    for size in sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32)
        dist.barrier()
        out.append(_best_time(lambda: dist.all_reduce(x), repeats))
    return out


def measure_collectives(small: int = 4096, large: int = 16 * 1024**2, repeats: int = 5) -> tuple[float, float]:
    """(latency per ring step, bus bandwidth) of gloo all-reduce between 2 local ranks."""
    from large_model_training.launch import run_on_ranks

    times = run_on_ranks(_allreduce_probe, 2, ((small, large), repeats))
    t_small, t_large = (max(r[i] for r in times) for i in range(2))
    alpha = t_small / 2  # 2 (n - 1) steps with n = 2
    beta = large / max(t_large - 2 * alpha, 1e-9)  # 2 (n - 1) / n = 1 for n = 2
    return alpha, beta


def calibrate(name: str = "cpu", collectives: bool = True) -> tuple[Hardware, str]:
    """Measure this machine, store the entry; returns (entry, path of the hardware file)."""
    fp32 = matmul_rate(torch.float32)
    bf16 = matmul_rate(torch.bfloat16)
    bandwidth = memory_bandwidth()
    alpha, beta = measure_collectives() if collectives else (1e-4, bandwidth / 4)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 * 1024**3
    cores = os.cpu_count() or 1
    entry = Hardware(name=name, peak_flops=bf16, peak_flops_fp32=fp32, memory_bytes=float(memory),
                     memory_bandwidth=bandwidth, intra_node_bandwidth=beta, intra_node_latency=alpha,
                     inter_node_bandwidth=beta, inter_node_latency=alpha, devices_per_node=cores, compute_units=1,
                     gemm_efficiency=1.0, reserved_fraction=0.2, fused_kernels=False,
                     source=f"lmt calibrate on {socket.gethostname()} at {time.strftime('%Y-%m-%d %H:%M')} "
                            f"({cores} cores, torch {torch.__version__})")
    return entry, save_measured(entry)
