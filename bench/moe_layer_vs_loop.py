"""Our MoE layer (models/moe.py, grouped GEMM through F.grouped_mm) against per-expert loops, one process (issue 18).

    python bench/moe_layer_vs_loop.py                        # both shapes, fp32 and bf16, 1 thread
    python bench/moe_layer_vs_loop.py --shapes tiny --dtypes fp32 --rounds 3      # a quick look

Three contenders, forward + backward of one MoE MLP on the same weights and the same tokens (4096 by default):
  grouped   our `MoE` as it trains: token copies sorted by expert, each expert matrix a grouped GEMM
  loop      the same module with `experts.use_grouped_mm = False`: the same sort, then a Python loop of matmuls
  naive     a plain-PyTorch MoE as a user would write it (Hugging Face's Mixtral block): one nn.Linear triple
            per expert in an nn.ModuleList, a one-hot mask of the chosen experts, and per expert `torch.where` on
            its mask, index the rows, run the expert, scale by the gate and `index_add_` into the output
Every contender computes the same router (fp32 logits, softmax, top-k on the scores, gates not renormalised: the
tiny-moe preset's settings) and the same Switch aux loss with coefficient 0.01 (ours through its backward hook,
the naive one added to the loss), so the outputs and all gradients must agree; the largest absolute differences
against `grouped` are printed. The loss is sum(y * g) for a fixed random g. Rounds alternate the contenders
(grouped, loop, naive, grouped, ...); each round times --iters steps; the table gives the median per step
(CPU time of this process, then wall time) and the ratios loop/grouped and naive/grouped (> 1: ours is faster).
With one thread (the default, --threads) the CPU time is the work done and does not depend on how busy the shared
machine is; wall time does.
Shapes: tiny (tiny-moe: h=128, E=8, k=2, f=128) and large (h=512, E=16, k=2, f=512).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from large_model_training.config import model_from_preset
from large_model_training.models.moe import MoE

SHAPES = {"tiny": dict(hidden_size=128, moe_experts=8, moe_top_k=2, moe_ffn_hidden_size=128),
          "large": dict(hidden_size=512, moe_experts=16, moe_top_k=2, moe_ffn_hidden_size=512)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class NaiveMoE(nn.Module):
    """Hugging Face's MixtralSparseMoeBlock, written out: experts as separate modules, a loop with masks."""

    def __init__(self, ours: MoE):
        super().__init__()
        self.top_k, self.n_experts, self.aux_coef = ours.top_k, ours.n_experts, ours.aux_coef
        e, f, h = ours.experts.w_gate.shape
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(
            nn.ModuleDict(dict(w1=nn.Linear(h, f, bias=False), w3=nn.Linear(h, f, bias=False),
                               w2=nn.Linear(f, h, bias=False))) for _ in range(e))
        with torch.no_grad():  # the same weights as ours
            self.gate.weight.copy_(ours.router.weight)
            for i, ex in enumerate(self.experts):
                ex.w1.weight.copy_(ours.experts.w_gate[i])
                ex.w3.weight.copy_(ours.experts.w_up[i])
                ex.w2.weight.copy_(ours.experts.w_down[i])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.gate.weight.float()).softmax(-1)  # (T, E) fp32, as ours
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=self.n_experts).permute(2, 1, 0)  # (E, k, T)
        for e in range(self.n_experts):
            idx, rows = torch.where(mask[e])
            ex = self.experts[e]
            h = x[rows]
            y = ex.w2(F.silu(ex.w1(h)) * ex.w3(h)) * weights[rows, idx, None]
            out.index_add_(0, rows, y.to(x.dtype))
        share = mask.sum((1, 2)).float() / chosen.numel()  # Switch aux loss E * sum_e f_e P_e
        aux = self.n_experts * (share * scores.mean(0)).sum()
        return out, aux


def build(shape: str, dtype: torch.dtype, tokens: int, seed: int = 0):
    cfg = model_from_preset("tiny-moe")
    for k, v in SHAPES[shape].items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    ours = MoE(cfg, layer=0)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.02)
        ours.router.weight.normal_(0.0, 0.2)  # spread scores a little, so routing is uneven as in training
    ours.to(dtype).train()
    naive = NaiveMoE(ours).to(dtype).train()
    x = torch.randn(tokens, cfg.hidden_size, dtype=dtype)
    g = torch.randn(tokens, cfg.hidden_size, dtype=dtype)
    return ours, naive, x, g


def step_ours(ours: MoE, grouped: bool, x: torch.Tensor, g: torch.Tensor):
    ours.experts.use_grouped_mm = grouped
    ours.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    y = ours(xi)
    (y * g).sum().backward()
    ours.reset_stats()
    grads = [ours.router.weight.grad, ours.experts.w_gate.grad, ours.experts.w_up.grad, ours.experts.w_down.grad]
    return y.detach(), xi.grad, grads


def step_naive(naive: NaiveMoE, x: torch.Tensor, g: torch.Tensor):
    naive.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    y, aux = naive(xi)
    ((y * g).sum() + naive.aux_coef * aux).backward()
    stack = lambda name: torch.stack([ex[name].weight.grad for ex in naive.experts])  # noqa: E731
    grads = [naive.gate.weight.grad, stack("w1"), stack("w3"), stack("w2")]
    return y.detach(), xi.grad, grads


def max_rel_diff(a, b) -> float:
    """Largest over y, the input gradient and the four weight gradients of max |a - b| / max |b|."""
    ya, xa, ga = a
    yb, xb, gb = b
    return max(float((u.float() - v.float()).abs().max() / v.float().abs().max())
               for u, v in zip([ya, xa, *ga], [yb, xb, *gb]))


def bench(shape: str, dtype_name: str, tokens: int, rounds: int, iters: int) -> dict:
    ours, naive, x, g = build(shape, DTYPES[dtype_name], tokens)
    steps = {"grouped": lambda: step_ours(ours, True, x, g), "loop": lambda: step_ours(ours, False, x, g),
             "naive": lambda: step_naive(naive, x, g)}
    first = {k: fn() for k, fn in steps.items()}  # warm-up, and the values compared
    out_diff = {k: float((first[k][0].float() - first["grouped"][0].float()).abs().max()) for k in steps}
    all_diff = {k: max_rel_diff(first[k], first["grouped"]) for k in steps}
    scale = float(first["grouped"][0].float().abs().max())
    wall, cpu = {k: [] for k in steps}, {k: [] for k in steps}
    for _ in range(rounds):
        for k, fn in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                fn()
            wall[k].append((time.perf_counter() - w0) / iters)
            cpu[k].append((time.process_time() - c0) / iters)
    return {"wall": {k: statistics.median(v) for k, v in wall.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()},
            "out_diff": out_diff, "all_diff": all_diff, "scale": scale}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2, help="steps per contender per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine's cores are shared)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| shape | dtype | CPU ms grouped / loop / naive | loop/grouped (CPU) | naive/grouped (CPU) "
          "| wall ms grouped / loop / naive | loop/grouped (wall) | naive/grouped (wall) "
          "| max abs diff y: loop, naive | max rel diff y and grads: loop, naive |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for dt in args.dtypes:
            r = bench(shape, dt, args.tokens, args.rounds, args.iters)
            w, c, od, ad = r["wall"], r["cpu"], r["out_diff"], r["all_diff"]
            ms = lambda t: " / ".join(f"{t[k] * 1e3:.0f}" for k in ("grouped", "loop", "naive"))  # noqa: E731
            print(f"| {shape} | {dt} | {ms(c)} | **{c['loop'] / c['grouped']:.2f}** | "
                  f"**{c['naive'] / c['grouped']:.2f}** | "
                  f"{ms(w)} | {w['loop'] / w['grouped']:.2f} | {w['naive'] / w['grouped']:.2f} | "
                  f"{od['loop']:.1e}, {od['naive']:.1e} (of max abs y {r['scale']:.2f}) | "
                  f"{ad['loop']:.1e}, {ad['naive']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
