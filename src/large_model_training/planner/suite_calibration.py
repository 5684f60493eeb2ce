"""`lmt calibrate --from gpu_suite.json`: a catalogue entry updated from what bench/gpu_suite.py measured.

The suite measures, on the device itself: bf16 (and fp8) GEMMs at the planner's own block shapes
(sections.matmul.rows: m, n, k, bf16_tflops, fp8_tflops), causal flash attention forward + backward
(sections.attention.rows: seq, fwd_bwd_tflops, over 3.5x the causal forward FLOPs, the planner's convention),
and a device-to-device copy (sections.copy.rows: gb_per_s, bytes read + written). Of these the entry takes:
  - gemm_table: every measured GEMM, so the efficiency curve equals them at their shapes
    (planner/kernel_time.py);
  - gemm_efficiency: the median, over the measured shapes, of the large-GEMM level that makes the curve's
    model predict each shape (rate / peak / the shape's wave and k factors): the level between measured shapes;
  - attention_efficiency: forward + backward at the longest measured sequence (training's regime) / peak;
  - memory_efficiency: the copy's rate / the datasheet bandwidth.
Links, memory and everything else stay the catalogue's: the suite runs on one device.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

from large_model_training.errors import ConfigError
from large_model_training.planner.hardware import Hardware, get_hardware
from large_model_training.planner.kernel_time import modelled_efficiency


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the GPU suite's JSON {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sections"), dict):
        raise ConfigError(f"{path} is not bench/gpu_suite.py's JSON (no 'sections')")
    return doc


def _rows(doc: dict, section: str) -> list[dict]:
    sec = doc["sections"].get(section)
    rows = sec.get("rows") if isinstance(sec, dict) else None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def entry_from_suite(path: str, base: str | None = None, name: str | None = None) -> tuple[Hardware, list[str]]:
    """(the updated entry, what was taken from the suite, one line each). `base`: the catalogue entry to update
    (default: the one the suite named for its device); `name`: the stored entry's name (default: base's, so
    `--hardware <base>` then plans with the measured figures)."""
    doc = _load(path)
    base = base or (doc.get("env") or {}).get("hardware")
    if not base:
        raise ConfigError(f"{path}: the suite's device has no catalogue entry; name one with --base")
    hw = get_hardware(base)
    taken = []
    table = []
    for row in _rows(doc, "matmul"):
        for precision in ("bf16", "fp8"):
            rate = row.get(f"{precision}_tflops")
            if isinstance(rate, (int, float)) and rate > 0 and all(isinstance(row.get(x), int) for x in "mnk"):
                table.append((row["m"], row["n"], row["k"], precision, float(rate) * 1e12))
    changes: dict = {}
    if table:
        levels = [
            rate / hw.peak_flops / (modelled_efficiency(hw, m, n, k) / hw.gemm_efficiency)
            for m, n, k, p, rate in table
            if p == "bf16"
        ]
        changes["gemm_table"] = tuple(table)
        if levels:
            changes["gemm_efficiency"] = statistics.median(levels)
        taken.append(
            f"{len(table)} measured GEMMs; large-GEMM efficiency "
            f"{hw.gemm_efficiency:.3f} -> {changes.get('gemm_efficiency', hw.gemm_efficiency):.3f}"
        )
    attention = [r for r in _rows(doc, "attention") if isinstance(r.get("fwd_bwd_tflops"), (int, float))]
    if attention:
        longest = max(attention, key=lambda r: r.get("seq", 0))
        changes["attention_efficiency"] = longest["fwd_bwd_tflops"] * 1e12 / hw.peak_flops
        changes["attention_backward_efficiency"] = None  # the measured rate is forward and backward together
        taken.append(
            f"attention efficiency {hw.attention_fraction:.3f} -> {changes['attention_efficiency']:.3f} "
            f"(sequence {longest.get('seq')})"
        )
    copy = [r for r in _rows(doc, "copy") if isinstance(r.get("gb_per_s"), (int, float))]
    if copy:
        changes["memory_efficiency"] = copy[0]["gb_per_s"] * 1e9 / hw.memory_bandwidth
        taken.append(f"memory efficiency {hw.memory_efficiency:.3f} -> {changes['memory_efficiency']:.3f}")
    if not changes:
        raise ConfigError(f"{path}: no matmul, attention or copy measurement to calibrate from")
    device = (doc.get("env") or {}).get("device_name", "?")
    entry = replace(hw, name=name or hw.name, **changes, source=f"{hw.source}; calibrated from {path} ({device})")
    return entry, taken
