"""Kernel time by shape: the fraction of peak a GEMM of a given (m, n, k) and precision reaches on an entry.

One catalogue efficiency for every GEMM over-predicts small and skinny ones (issue 35). The curve here is a
tile roofline: a GEMM's m x n output is cut into tiles (cuBLAS/CUTLASS's 128 x 256 class on the large-GEMM
path, either orientation, the better taken, as its heuristics choose) that run in waves of `compute_units`;
a last partial wave idles the rest (NVIDIA's "Matrix Multiplication Background" guide). Along k each tile runs
a main loop whose fill and drain cost about K_FILL of k (an assumption: two stages of 64-deep k tiles), so
efficiency ramps as k / (k + K_FILL), normalised to 1 at K_REF, where the entry's `gemm_efficiency` was
measured (large square GEMMs). Below the curve sits the memory roofline and above it the kernel's launch
cost (timing.gemm_time).

A measured table (`Hardware.gemm_table`, from `lmt calibrate --from gpu_suite.json`) overrides the model at
its shapes exactly; between them the model is scaled by the measured-over-modelled ratio of the nearest
measured shape (in log FLOPs) of that precision, so the curve keeps the model's shape and the table's level.
"""

from __future__ import annotations

import math

from large_model_training.planner.hardware import Hardware

TILE = (128, 256)
K_FILL = 128
K_REF = 4096


def wave_efficiency(hw: Hardware, m: int, n: int) -> float:
    """Fraction of the device's compute units busy over the waves of this GEMM's output tiles (the better of the
    tile's two orientations)."""
    units = max(1, hw.compute_units)
    best = 0.0
    for tm, tn in (TILE, TILE[::-1]):
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / units)
        best = max(best, tiles / (waves * units))
    return best


def k_ramp(k: int) -> float:
    """The main loop's fill and drain along k, 1 at K_REF and above (monotone in k)."""
    return min(1.0, (k / (k + K_FILL)) / (K_REF / (K_REF + K_FILL)))


def modelled_efficiency(hw: Hardware, m: int, n: int, k: int) -> float:
    """The tile roofline's fraction of peak, before any measured table."""
    # The tile pipeline's ramp is an accelerator's; a CPU entry's calibrated step ratio already holds its BLAS's
    # behaviour (planner/calibrate.py), and one compute unit makes the waves 1: CPU predictions are unchanged.
    return hw.gemm_efficiency * wave_efficiency(hw, m, n) * (k_ramp(k) if hw.fused_kernels else 1.0)


def _table_rows(hw: Hardware, precision: str) -> list[tuple[int, int, int, float]]:
    return [(int(m), int(n), int(k), float(rate)) for m, n, k, p, rate in hw.gemm_table if p == precision]


def gemm_efficiency(hw: Hardware, precision: str, m: int, n: int, k: int, peak: float) -> float:
    """Fraction of `peak` (the GEMM's precision's peak) this GEMM reaches: the measured rate at a measured shape,
    the model scaled by the nearest measured shape's ratio elsewhere, the model alone without a table."""
    model = modelled_efficiency(hw, m, n, k)
    rows = _table_rows(hw, precision)
    if not rows:
        return model
    for tm, tn, tk, rate in rows:
        if (tm, tn, tk) == (m, n, k):
            return rate / peak
    size = math.log(2.0 * m * n * k)
    tm, tn, tk, rate = min(rows, key=lambda row: abs(math.log(2.0 * row[0] * row[1] * row[2]) - size))
    return model * (rate / peak) / modelled_efficiency(hw, tm, tn, tk)
