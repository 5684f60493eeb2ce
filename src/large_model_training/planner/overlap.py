"""What a collective overlapped with compute costs the compute: the SMs its kernel occupies.

FSDP2's prefetched gathers, ZeRO's reduce-scatters and the dp buckets run on their own stream beside the
compute, but an NCCL (or RCCL) collective is itself a kernel: its thread blocks sit on SMs for as long as it
runs, and the GEMMs beside it get the rest. Measured: an FSDP-like all-gather on an H100 launches 24 blocks on
its 132 SMs while a GEMM runs beside it (NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM
Performance Degradation because of Tail Effect", 2025: a one-wave GEMM twice as slow; a many-wave GEMM loses
about the blocks' share). So while a collective of duration g overlaps compute of duration c, the compute runs
at 1 - share of its rate: the pair takes max(g, c + g x share). share = COLLECTIVE_BLOCKS / compute units;
Ascend's HCCL moves data with the SDMA engines, not the AI cores (assumed share 0), and a CPU entry's
calibration holds its own contention (share 0).
"""

from __future__ import annotations

from large_model_training.planner.hardware import Hardware

COLLECTIVE_BLOCKS = 24
"""Thread blocks (one per SM) an NCCL ring collective occupies on an H100 (the measurement above)."""

NO_SM_COLLECTIVES = ("ascend", "cloudmatrix")


def sm_share(hw: Hardware) -> float:
    """Fraction of the compute units a running collective takes from the compute."""
    if not hw.fused_kernels or hw.name.startswith(NO_SM_COLLECTIVES):
        return 0.0
    return min(0.5, COLLECTIVE_BLOCKS / max(1, hw.compute_units))


def overlapped(compute: float, comm: float, hw: Hardware) -> float:
    """Seconds of `compute` with a collective of `comm` seconds beside it (see the module docstring)."""
    return max(comm, compute + comm * sm_share(hw))
