"""--compile against eager: one rank's training step time of our model, regionally compiled (regional_compile.py,
inductor) and eager, on the same batches with the same AdamW; rounds alternate so machine noise hits both.
Also checks the two trained the same losses (to 1e-4 relative), and prints the compile time.

    python bench/compile_vs_eager.py                       # tiny and small, fp32, CPU
    python bench/compile_vs_eager.py --models small --precision bf16 --batch 8 --seq-len 1024   # accelerator
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from large_model_training.assembly import build_model
from large_model_training.config import model_from_preset
from large_model_training.mesh import select_device, synchronize
from large_model_training.models.loss import cross_entropy
from large_model_training.regional_compile import compile_blocks, compile_seconds
from throughput import add_run_arguments  # bench/ is the script's folder, on sys.path


def run_steps(model, opt, batches, device, dtype) -> tuple[float, list[float]]:
    """Seconds per step over `batches`, and the losses."""
    synchronize(device)
    start, losses = time.perf_counter(), []
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    return (time.perf_counter() - start) / len(batches), [float(v) for v in losses]


def compare(preset: str, args, device, dtype) -> str:
    cfg = model_from_preset(preset)
    models = {"eager": build_model(cfg, None, seed=0, device=device),
              "compiled": build_model(cfg, None, seed=0, device=device)}
    compile_blocks(models["compiled"], "inductor")
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (args.steps * (args.rounds + 1), args.batch, args.seq_len + 1),
                         generator=g).to(device)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    before = compile_seconds()
    losses = {k: run_steps(models[k], opts[k], batches[:args.steps], device, dtype)[1] for k in models}  # warm-up
    compile_s = compile_seconds() - before
    times = {k: [] for k in models}
    for r in range(1, args.rounds + 1):
        for k in models:
            seconds, more = run_steps(models[k], opts[k], batches[r * args.steps:(r + 1) * args.steps], device, dtype)
            times[k].append(seconds)
            losses[k] += more
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses["compiled"], losses["eager"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return (f"| {preset} | {args.batch} x {args.seq_len} | {med['eager'] * 1e3:.1f} | {med['compiled'] * 1e3:.1f} | "
            f"**{med['compiled'] / med['eager']:.3f}** | {compile_s:.1f} | {drift:.1e} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,small")
    add_run_arguments(ap, batch=8, steps=4, rounds=4)
    args = ap.parse_args()
    device = select_device(0)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    print(f"device {device}, {args.precision}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("| model | batch | eager ms/step | compiled ms/step | compiled/eager | compile s | max loss drift |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.models.split(","):
        print(compare(preset, args, device, dtype), flush=True)


if __name__ == "__main__":
    main()
