"""The subprocess sections of bench/gpu_suite.py: the real `lmt train` CLI, `lmt estimate`, bench/throughput.py,
bench/fused_loss_memory.py and the CUDA-only tests, each parsed from what it writes."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from large_model_training.config import build_config
from large_model_training.models.flops import parameter_count, training_flops_per_token

from gpu_suite_sections import Context

GiB = 2**30
STEPS, SKIP = 12, 4  # steps per training row; rows averaged after the first SKIP (warm-up, compilation)
LLAMA_1B = ["--model", "llama-1b", "--precision", "bf16", "--seq-len", "2048", "--global-batch-size", "8",
            "--micro-batch-size", "8"]
# Llama 3.2 3B's shape (3.2B parameters, tied embeddings): `lmt estimate --hardware h100-sxm` puts micro-batch 2
# without recomputation at 58 GiB, inside an H100's 80 GB (micro-batch 4 needs selective recompute and 69 GiB).
SHAPE_3B = ["--model", "llama-1b", "--model.hidden_size", "3072", "--model.n_layers", "28", "--model.n_heads", "24",
            "--model.n_kv_heads", "8", "--model.ffn_hidden_size", "8192", "--precision", "bf16", "--seq-len", "2048",
            "--global-batch-size", "4", "--micro-batch-size", "2"]
QUICK = ["--model", "tiny", "--precision", "bf16", "--seq-len", "64", "--global-batch-size", "2",
         "--micro-batch-size", "2"]
QUICK_3B = QUICK + ["--model.n_layers", "2", "--model.hidden_size", "64"]


def _lmt(*args: str) -> list[str]:
    return [sys.executable, "-m", "large_model_training.cli", *args]


def _metric_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return [r for r in rows if "step_time_s" in r]


def estimate_bytes(ctx: Context, model_args: list[str]) -> float:
    """`lmt estimate --json` with the row's flags (and this device's catalogue entry): max bytes per rank."""
    hw = ctx.hardware
    cmd = _lmt("estimate", *model_args, "--json", *(["--hardware", hw.name] if hw else []))
    code, out = ctx.run(cmd, 60)
    if code != 0:
        raise RuntimeError(f"lmt estimate exit {code}: {out.strip().splitlines()[-1:] }")
    doc, _ = json.JSONDecoder().raw_decode(out[out.index("{"):])
    return float(doc["max_bytes_per_rank"])


def train_row(ctx: Context, label: str, model_args: list[str], extra: list[str], timeout_s: float) -> dict:
    """One `lmt train` run in a temporary folder, stopped once its last metrics row is written (its final
    checkpoint, up to 40 GB at 3B, is neither wanted nor worth the disk and time)."""
    steps, skip = (3, 1) if ctx.quick else (STEPS, SKIP)
    row: dict = {"row": label}
    tmp = Path(tempfile.mkdtemp(prefix="lmt_suite_"))
    try:
        metrics = tmp / "metrics.jsonl"
        cmd = _lmt("train", "--out", str(tmp), "--steps", str(steps), "--eval-every", "0", "--run.log_every", "1",
                   *model_args, *extra)
        code, out = ctx.run(cmd, timeout_s, done=lambda: len(_metric_rows(metrics)) >= steps)
        rows = _metric_rows(metrics)
        if len(rows) < steps:
            tail = " / ".join(out.strip().splitlines()[-3:])
            raise RuntimeError(f"{len(rows)} of {steps} steps (exit {code}): {tail}"[:1500])
        cfg = build_config(str(tmp / "config.toml"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    timed = rows[skip:]
    step_s = sum(r["step_time_s"] for r in timed) / len(timed)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    tps = tokens / step_s
    flops = training_flops_per_token(cfg.model, cfg.train.seq_len) * tps
    row.update(params_b=parameter_count(cfg.model) / 1e9, step_s=step_s, tokens_per_s=tps, tflops=flops / 1e12,
               first_step_s=rows[0]["step_time_s"], compile_s=sum(r.get("compile_s", 0.0) for r in rows) or None,
               final_loss=rows[-1]["loss"])
    hw = ctx.hardware
    row["mfu_datasheet"] = flops / hw.peak_flops if hw else None
    row["mfu_measured_peak"] = flops / ctx.measured_peak if ctx.measured_peak else None
    peak = max(r.get("peak_mem_bytes") or 0 for r in rows)
    row["peak_gib"] = peak / GiB
    try:
        est = estimate_bytes(ctx, model_args)
        row["estimate_gib"] = est / GiB
        row["peak_vs_estimate"] = peak / est - 1.0
    except Exception as e:
        row["estimate_error"] = f"{type(e).__name__}: {e}"[:300]
    ctx.log(f"train {label}: {tps:,.0f} tok/s, MFU {row['mfu_datasheet'] or 0:.1%} datasheet, "
            f"peak {row['peak_gib']:.2f} GiB vs estimate {row.get('estimate_gib', float('nan')):.2f}")
    return row


def _train_rows(ctx: Context, name: str, model_args: list[str], variants: list[tuple[str, list[str], float]]) -> dict:
    rows, errors = [], []
    for label, extra, cap_s in variants:
        if ctx.remaining() < (5 if ctx.quick else 40):
            rows.append({"row": f"{name} {label}", "status": "skipped: budget"})
            continue
        try:
            rows.append(train_row(ctx, f"{name} {label}", model_args, extra, cap_s))
        except Exception as e:
            errors.append(f"{label}: {type(e).__name__}: {e}"[:1500])
            rows.append({"row": f"{name} {label}", "status": f"error: {type(e).__name__}"})
            ctx.log_exception(f"train {label}")
    if not fp8_offered(ctx):
        rows.append({"row": f"{name} fp8 + compile", "status": "not available (`lmt train --help` has no fp8)"})
    result = {"rows": rows, "summary": {"flags": " ".join(model_args),
                                        "mfu": "model FLOPs (models/flops.py) x tokens/s over the datasheet "
                                               "bf16 peak / over the measured matmul peak",
                                        "peak": "metrics peak_mem_bytes: the allocator's peak on accelerators "
                                                "(the process's RSS on the CPU, not comparable to the estimate)"}}
    if errors:
        result["error"] = "; ".join(errors)
        result["status_override"] = "partial" if any("tokens_per_s" in r for r in rows) else "error"
    return result


def fp8_offered(ctx: Context) -> bool:
    """Whether `lmt train --help` mentions fp8 (the next issue's `--precision fp8`): its rows run from then on."""
    import subprocess

    done = subprocess.run(_lmt("train", "--help"), env=ctx.subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    return "fp8" in done.stdout


FP8 = ("fp8 + compile", ["--precision", "fp8", "--compile"], 200)  # the later --precision wins


def fp8_gain(result: dict, mfu_goal: float | None = None) -> None:
    """Issue 33's figures in the section's summary: fp8 + compile tokens/s over bf16 + compile (target >= 1.25x,
    torchtitan's +28%), and the fp8 row's BF16-equivalent MFU (its FLOPs over the bf16 datasheet peak)."""
    by_label = {r["row"].split(" ", 1)[1]: r for r in result["rows"] if "tokens_per_s" in r}
    fp8, bf16 = by_label.get("fp8 + compile"), by_label.get("bf16 compile")
    if fp8 is None or bf16 is None:
        return
    gain = fp8["tokens_per_s"] / bf16["tokens_per_s"]
    text = f"fp8 + compile / bf16 + compile tokens/s: {gain:.3f}x (target >= 1.25x: {'met' if gain >= 1.25 else 'missed'})"
    if mfu_goal is not None and fp8.get("mfu_datasheet") is not None:
        mfu = fp8["mfu_datasheet"]
        text += f"; fp8 BF16-equivalent MFU {mfu:.1%} (goal >= {mfu_goal:.0%}: {'met' if mfu >= mfu_goal else 'missed'})"
    result["summary"]["fp8"] = text


def section_train(ctx: Context) -> dict:
    args = QUICK if ctx.quick else LLAMA_1B
    fp8 = [FP8] if fp8_offered(ctx) else []
    result = _train_rows(ctx, "tiny" if ctx.quick else "llama-1b", args,
                         [("bf16 eager", [], 90), ("bf16 compile", ["--compile"], 200)] + fp8)
    compiled = [r for r in result["rows"] if r["row"].endswith("compile") and "mfu_datasheet" in r]
    if compiled and compiled[0]["mfu_datasheet"] is not None:
        mfu = compiled[0]["mfu_datasheet"]
        result["summary"]["target"] = f"bf16 + compile >= 50% datasheet MFU: {mfu:.1%} ({'met' if mfu >= 0.5 else 'missed'})"
    fp8_gain(result)
    return result


def section_train_3b(ctx: Context) -> dict:
    if ctx.quick:
        return _train_rows(ctx, "tiny-override", QUICK_3B, [("bf16 eager", [], 90)])
    fp8 = [FP8] if fp8_offered(ctx) else []
    result = _train_rows(ctx, "3.2b", SHAPE_3B, [("bf16 eager", [], 90), ("bf16 compile", ["--compile"], 180)] + fp8)
    fp8_gain(result, mfu_goal=0.60)
    return result


def section_small_vs_plain(ctx: Context) -> dict:
    size = (["--model", "tiny", "--batch", "2", "--seq-len", "64", "--rounds", "1", "--steps", "2"] if ctx.quick
            else ["--model", "small", "--batch", "8", "--seq-len", "1024", "--rounds", "3", "--steps", "5"])
    cmd = [sys.executable, str(ctx.root / "bench" / "throughput.py"), "--precision", "bf16", *size]
    code, out = ctx.run(cmd, 120)
    m = re.search(r"throughput ratio lmt/plain = ([0-9.]+)", out)
    if code != 0 or not m:
        raise RuntimeError(f"exit {code}: " + " / ".join(out.strip().splitlines()[-3:]))
    rows = []
    for line in out.splitlines():
        s = re.match(r"(lmt|plain)\s+step\s+([0-9.]+) ms\s+([0-9.]+) tok/s\s+MFU\s+([0-9.]+)%", line.strip())
        if s:
            rows.append({"model": s[1], "step_ms": float(s[2]), "tokens_per_s": float(s[3]),
                         "mfu_measured_peak": float(s[4]) / 100})
    ratio = float(m[1])
    return {"rows": rows, "summary": {"command": " ".join(cmd[1:]), "ratio lmt/plain": ratio,
                                      "target": f">= 1.0: {'met' if ratio >= 1.0 else 'missed'}"}}


def section_fused_loss(ctx: Context) -> dict:
    """bench/fused_loss_memory.py (fake tensors: exact allocation sizes, no kernels; it has no device flag) at
    long sequences, and its --check (fake against real CPU tensors)."""
    shape = (["--hidden", "64", "--tokens", "256", "--vocab", "512"] if ctx.quick
             else ["--tokens", "32768,131072", "--vocab", "128256"])
    cmd = [sys.executable, str(ctx.root / "bench" / "fused_loss_memory.py"), *shape]
    code, out = ctx.run(cmd, 120)
    table = [line for line in out.splitlines() if line.startswith("|")]
    if code != 0 or len(table) < 3:
        raise RuntimeError(f"exit {code}: " + " / ".join(out.strip().splitlines()[-3:]))
    rows = []
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append({"tokens": cells[0], "vocab": cells[1], "today_gib": float(cells[2]),
                     "fused_gib": float(cells[3]), "fused_over_today": float(cells[4])})
    result = {"rows": rows, "summary": {"command": " ".join(cmd[1:]),
                                        "note": "fake tensors (every allocation at its real size, no kernel): "
                                                "the bench has no device flag"}}
    if ctx.device.type != "cpu":  # the same at 32K tokens on real device tensors: the allocator's peak
        try:
            real = {name: device_loss_peak(ctx, name, 32768, 128256, 2048) / GiB for name in ("today", "fused")}
            rows.append({"tokens": "32,768 (device)", "vocab": "128,256", "today_gib": real["today"],
                         "fused_gib": real["fused"], "fused_over_today": real["fused"] / real["today"]})
        except Exception as e:
            result["summary"]["device_rows"] = f"error: {type(e).__name__}: {e}"[:300]
    return result


def device_loss_peak(ctx: Context, name: str, tokens: int, vocab: int, hidden: int) -> int:
    """Allocator peak above the live inputs of one loss forward + backward (bf16), as the bench counts it."""
    import torch
    from large_model_training.mesh import peak_memory_bytes, synchronize
    from large_model_training.models.fused_loss import fused_cross_entropy
    from large_model_training.models.loss import cross_entropy

    dev = ctx.device
    h = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=dev)
    synchronize(dev)
    base = torch.accelerator.memory_allocated(dev.index)
    torch.accelerator.reset_peak_memory_stats(dev.index)
    if name == "fused":
        fused_cross_entropy(h, w, t).backward()
    else:
        cross_entropy(torch.nn.functional.linear(h, w), t).backward()
    synchronize(dev)
    return peak_memory_bytes(dev) - base


def section_cuda_tests(ctx: Context) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    code, out = ctx.run(cmd, 150)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed)", out)}
    lines = [l for l in out.splitlines() if re.match(r"(FAILED|ERROR) ", l)]
    result = {"rows": [dict(exit_code=code, **counts)], "summary": {"command": "pytest -q -m cuda"}}
    if lines:
        result["text"] = "\n".join(f"- `{l[:300]}`" for l in lines[:20])
    if code not in (0, 5):  # 5: nothing collected
        result["status_override"] = "failed"
        result["error"] = f"pytest exit {code}: " + (lines[0] if lines else out.strip().splitlines()[-1:][0] if out.strip() else "")
    return result
