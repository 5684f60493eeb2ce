"""The in-process sections of bench/gpu_suite.py (matmul, copy, attention) and the shared Context.

Timings are medians of repeated rounds, as `lmt calibrate` takes them (the rate a step sustains, not the best):
each round runs `reps` kernels back to back between two device synchronisations.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from large_model_training.config import model_from_preset
from large_model_training.mesh import device_name, synchronize
from large_model_training.models.flops import block_gemm_shapes
from large_model_training.planner.hardware import Hardware, entry_for_device
from large_model_training.planner.kernel_time import modelled_efficiency

LOG = "gpu_suite.log"


@dataclass
class Context:
    device: torch.device
    quick: bool
    out: Path
    budget_s: float
    root: Path
    start: float
    measured_peak: float | None = None
    """Best bf16 matmul FLOP/s of the matmul section, for the training rows' second MFU."""
    notes: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def log(self, msg: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {msg}"
        print(line, flush=True)
        with open(self.out / LOG, "a") as f:
            f.write(line + "\n")

    def log_exception(self, name: str) -> None:
        with open(self.out / LOG, "a") as f:
            f.write(f"--- {name} traceback\n{traceback.format_exc()}\n")

    @property
    def device_name(self) -> str:
        return device_name(self.device)

    @property
    def hardware(self) -> Hardware | None:
        """The catalogue entry of this device (by name), or None (the CPU, unknown accelerators)."""
        return entry_for_device(self.device_name)

    def env(self) -> dict:
        hw = self.hardware
        cap = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        return {"device": str(self.device), "device_name": self.device_name, "capability": cap,
                "torch": torch.__version__, "python": sys.version.split()[0], "quick": self.quick,
                "budget_s": self.budget_s, "hardware": hw.name if hw else None,
                "datasheet_bf16_flops": hw.peak_flops if hw else None}

    def subprocess_env(self) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(self.root / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if self.device.type == "cpu":
            env["LMT_DEVICE"] = "cpu"
        return env

    def run(self, cmd: list[str], timeout_s: float, done=None) -> tuple[int | None, str]:
        """Run cmd (its output appended to the log) until it exits, `done()` turns true (then it is killed: e.g.
        the last metrics row is written and only the final checkpoint save is left), or timeout_s passes
        (RuntimeError). Returns (exit code or None if stopped by done, output)."""
        timeout_s = max(1.0, min(timeout_s, self.remaining()))
        log_path = self.out / LOG
        with open(log_path, "a") as log:
            log.write(f"--- $ {' '.join(cmd)}\n")
            log.flush()
            begin = log.tell()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                    env=self.subprocess_env(), process_group=0)
            t0, code = time.perf_counter(), None
            try:
                while True:
                    code = proc.poll()
                    if code is not None:
                        break
                    if done is not None and done():
                        break
                    if time.perf_counter() - t0 > timeout_s:
                        raise RuntimeError(f"timed out after {timeout_s:.0f} s: {' '.join(cmd[:6])} ...")
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:
                    # its own process group, made above; not its own session: if this command is ended from
                    # outside (the device call's limit), the run ends with it instead of holding the GPU's memory
                    # against a rerun on the same warm machine
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        with open(log_path) as f:
            f.seek(begin)
            output = f.read()
        return code, output


def _rate(fn, device: torch.device, flops: float, reps: int, rounds: int = 3) -> float:
    """Median over rounds of flops (per call) per second, after a warm-up of two calls."""
    fn(), fn()
    synchronize(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) / reps)
    return flops / statistics.median(times)


def gemm_shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """(label, m, n, k): the planner's block GEMMs (flops.block_gemm_shapes) that carry most FLOPs, for
    llama-1b at 16K tokens and llama3-8b (tp1) / llama3-70b (tp8 shard) at 8K, plus an 8192 square."""
    if quick:
        return [("square 256", 256, 256, 256), ("square 512", 512, 512, 512)]
    picks = []
    for preset, tp, tokens, which in (("llama-1b", 1, 16384, (0, 4, 6)), ("llama3-8b", 1, 8192, (4, 6)),
                                       ("llama3-70b", 8, 8192, (4, 6))):
        cfg = model_from_preset(preset)
        shapes = block_gemm_shapes(cfg, tokens, tp, max(1, cfg.n_kv_heads // tp))
        names = ["q", "k", "v", "o", "gate", "up", "down"]
        for i in which:
            picks.append((f"{preset} tp{tp} {names[i]}", *shapes[i]))
    return picks + [("square 8192", 8192, 8192, 8192)]


def _fp8_mm(m: int, n: int, k: int, device: torch.device):
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device, dtype=torch.float32)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def fp8_reason(ctx: Context) -> str | None:
    """Why fp8 is not measured here, or None."""
    if ctx.device.type == "cuda":
        cap = torch.cuda.get_device_capability(ctx.device)
        return None if cap >= (8, 9) else f"capability {cap} < (8, 9)"
    if not ctx.quick:
        return f"fp8 matmul measured on CUDA only (device {ctx.device.type})"
    try:  # quick CPU smoke: the code path, if this build has a CPU _scaled_mm
        _fp8_mm(32, 32, 32, ctx.device)()
        return None
    except Exception as e:
        return f"_scaled_mm unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def section_matmul(ctx: Context) -> dict:
    hw, dev = ctx.hardware, ctx.device
    reps = 3 if ctx.quick else 10
    fp8_skip = fp8_reason(ctx)
    rows = []
    for label, m, n, k in gemm_shapes(ctx.quick):
        row: dict = {"shape": label, "m": m, "n": n, "k": k}
        flops = 2.0 * m * n * k
        try:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            row["bf16_tflops"] = _rate(lambda: a @ w.t(), dev, flops, reps) / 1e12
        except Exception as e:
            row["bf16_error"] = f"{type(e).__name__}: {e}"[:300]
        if fp8_skip is None:
            try:
                row["fp8_tflops"] = _rate(_fp8_mm(m, n, k, dev), dev, flops, reps) / 1e12
            except Exception as e:
                row["fp8_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300]
        if hw is not None and "bf16_tflops" in row:
            shape_eff = modelled_efficiency(hw, m, n, k) / hw.gemm_efficiency  # waves x k ramp
            row["gemm_efficiency"] = row["bf16_tflops"] * 1e12 / hw.peak_flops
            row["shape_eff"] = shape_eff
            row["implied_gemm_efficiency"] = row["gemm_efficiency"] / shape_eff
        rows.append(row)
        ctx.log(f"matmul {label}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k.endswith("tflops")))
    bf16 = [r["bf16_tflops"] for r in rows if "bf16_tflops" in r]
    if not bf16:
        raise RuntimeError("no bf16 matmul ran: " + "; ".join(r.get("bf16_error", "") for r in rows))
    ctx.measured_peak = max(bf16) * 1e12
    summary = {"measured_peak_bf16_tflops": max(bf16),
               "fp8": fp8_skip or "measured (e4m3fn inputs, fp32 scales, bf16 out)"}
    fp8 = [r["fp8_tflops"] for r in rows if "fp8_tflops" in r]
    if fp8:
        summary["best_fp8_tflops"] = max(fp8)
    if hw is not None:
        implied = [r["implied_gemm_efficiency"] for r in rows]
        summary.update(catalogue_entry=hw.name, catalogue_gemm_efficiency=hw.gemm_efficiency,
                       measured_peak_over_datasheet=max(bf16) * 1e12 / hw.peak_flops,
                       suggested_gemm_efficiency=statistics.median(implied),
                       note="gemm_efficiency = rate / datasheet bf16 peak; implied_gemm_efficiency divides by "
                            "kernel_time's shape curve (waves x k ramp) too: the value of Hardware.gemm_efficiency "
                            "that makes the planner predict this shape exactly (suggested: their median)")
    return {"rows": rows, "summary": summary}


def section_copy(ctx: Context) -> dict:
    nbytes = (64 if ctx.quick else 1024) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    rate = _rate(lambda: dst.copy_(src), ctx.device, 2.0 * nbytes, 3 if ctx.quick else 20)
    hw = ctx.hardware
    row = {"bytes": nbytes, "gb_per_s": rate / 1e9}
    if hw is not None:
        row["fraction_of_datasheet"] = rate / hw.memory_bandwidth
    return {"rows": [row], "summary": {"convention": "bytes read + bytes written per second (1 GB = 1e9)"}}


def section_attention(ctx: Context) -> dict:
    dev = ctx.device
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    heads, d = (4, 64) if ctx.quick else (16, 128)
    rows = []
    for s in ((128, 256) if ctx.quick else (2048, 8192, 32768)):
        q, k, v = (torch.randn(1, heads, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, s, d, device=dev, dtype=dtype)
        fwd_flops = 0.5 * 4 * heads * s * s * d
        reps = 2 if ctx.quick else max(2, int(2e5 / s))

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        row = {"seq": s, "heads": heads, "head_dim": d, "dtype": str(dtype).replace("torch.", "")}
        row["fwd_tflops"] = _rate(fwd, dev, fwd_flops, reps) / 1e12
        row["fwd_bwd_tflops"] = _rate(fwd_bwd, dev, 3.5 * fwd_flops, reps) / 1e12
        if ctx.hardware is not None:
            row["fwd_bwd_fraction_of_datasheet"] = row["fwd_bwd_tflops"] * 1e12 / ctx.hardware.peak_flops
        rows.append(row)
        ctx.log(f"attention seq {s}: fwd {row['fwd_tflops']:.1f}, fwd+bwd {row['fwd_bwd_tflops']:.1f} TFLOP/s")
    return {"rows": rows, "summary": {"convention": "causal: forward = half of 4*b*h*s^2*d; backward 2.5x "
                                                    "forward; batch 1; scaled_dot_product_attention"}}
