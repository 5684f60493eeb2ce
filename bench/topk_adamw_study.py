"""Why top-k of the gradient costs so much under AdamW, and what to compress instead: a one-process study.

    python bench/topk_adamw_study.py dense
    python bench/topk_adamw_study.py gradient 0.01     # top-k of gradient + residual (what --compression does)
    python bench/topk_adamw_study.py update 0.01       # top-k of each rank's AdamW update + residual

dp=4 is simulated in one process (the four ranks' micro-batches one after another, each with its own residual
and, for `update`, its own AdamW moments) on the `tiny` preset, the default corpus, 300 steps, global batch
16 x 256 tokens, the same schedule, clipping and AdamW settings as `lmt train`, so one variant takes a few
minutes on one core and the variants differ only in what is compressed and how it is chosen. Other variants:
  gradient-age     AdamW treats a coordinate arriving after K silent steps as K steps of gradient/K
  gradient-scaled  coordinates chosen by |x| / sqrt(v) (AdamW's shared second moment), not by |x|
  gradient-local   the same with each rank's own second moment of its gradients
The runtime version of `update` is `lmt train --compression-target update` (parallel/dp_engine.py); results and the
reading of them are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from large_model_training.train.optim import learning_rate
from simulated_dp import DP, SimulatedRanks  # bench/simulated_dp.py (this script's folder is on sys.path)

STEPS, EPS = 300, 1e-8
VARIANTS = ["dense", "gradient", "gradient-age", "gradient-scaled", "gradient-local", "update"]


def topk(x: torch.Tensor, ratio: float, score: torch.Tensor | None = None) -> torch.Tensor:
    """x where `score` (default |x|) is among the ratio largest, zeros elsewhere."""
    k = max(1, math.ceil(ratio * x.numel()))
    idx = (x.abs() if score is None else score).topk(k, sorted=False).indices
    out = torch.zeros_like(x)
    out[idx] = x[idx]
    return out


def clipped(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    return g * min(1.0, max_norm / (float(g.norm()) + 1e-6))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("ratio", type=float, nargs="?", default=0.01)
    args = ap.parse_args()
    sim = SimulatedRanks(**{"train.steps": STEPS})
    t = sim.cfg.train
    decayed, flat = sim.decayed, sim.initial
    n = flat.numel()

    b1, b2 = t.beta1, t.beta2
    m, v, age = torch.zeros(n), torch.zeros(n), torch.zeros(n)  # the shared AdamW state (gradient variants)
    local_m, local_v = [torch.zeros(n) for _ in range(DP)], [torch.zeros(n) for _ in range(DP)]
    residual = [torch.zeros(n) for _ in range(DP)]
    for step in range(STEPS):
        grads = [sim.gradient(r, flat if r == 0 else None) for r in range(DP)]
        lr = learning_rate(step, t)
        c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        if args.variant == "update":
            rms_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads) / DP)  # as the engine clips
            scale = min(1.0, t.grad_clip / (rms_norm + 1e-6))
            sent = []
            for r in range(DP):
                g = grads[r] * scale
                local_m[r].lerp_(g, 1 - b1)
                local_v[r].mul_(b2).addcmul_(g, g, value=1 - b2)
                x = lr * (local_m[r] / c1) / ((local_v[r] / c2).sqrt() + EPS) + residual[r]
                sent.append(topk(x, args.ratio))
                residual[r] = x - sent[-1]
            step_update = sum(sent) / DP
        else:
            if args.variant == "dense":
                g = sum(grads) / DP
            else:
                sent = []
                for r in range(DP):
                    x = grads[r] + residual[r]
                    score = None
                    if args.variant == "gradient-scaled":
                        score = x.abs() / ((v / c2).sqrt() + EPS)
                    elif args.variant == "gradient-local":
                        local_v[r].mul_(b2).addcmul_(grads[r], grads[r], value=1 - b2)
                        score = x.abs() / ((local_v[r] / c2).sqrt() + EPS)
                    sent.append(topk(x, args.ratio, score))
                    residual[r] = x - sent[-1]
                g = sum(sent) / DP
            g = clipped(g, t.grad_clip)
            if args.variant == "gradient-age":  # lazy AdamW: K silent steps, then K steps' worth at once
                age += 1
                hit = g != 0
                k = age[hit]
                g_step = g[hit] / k
                m[hit] = b1 ** k * m[hit] + (1 - b1 ** k) * g_step
                v[hit] = b2 ** k * v[hit] + (1 - b2 ** k) * g_step * g_step
                step_update = torch.zeros(n)
                step_update[hit] = lr * k * (m[hit] / c1) / ((v[hit] / c2).sqrt() + EPS)
                age[hit] = 0
            else:
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                step_update = lr * (m / c1) / ((v / c2).sqrt() + EPS)
        flat = flat * (1 - lr * t.weight_decay * decayed) - step_update
    val_loss = sim.val_loss(flat)
    print(json.dumps({"variant": args.variant, "ratio": args.ratio, "val_loss": round(val_loss, 4)}))


if __name__ == "__main__":
    main()
