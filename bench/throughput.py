"""Single-rank training throughput: our model against a plain PyTorch model of the same architecture.

The plain model below is written the nanoGPT way (one file, no parallel hooks, nothing layout-free) with the
same shapes and the same choices (swiglu, RMSNorm, interleaved rope, SDPA, untied head). Both train with the
same AdamW on the same random tokens; rounds alternate between the two so machine noise hits both alike.
Also prints model FLOPs utilisation against the matmul peak measured in the same run, and the median of each
round's own ratio (its two halves ran back to back, so slow drift of the machine cancels).

    python bench/throughput.py                                  # tiny preset, fp32, CPU
    python bench/throughput.py --model small --batch 4 --rounds 3
    python bench/throughput.py --model llama-1b --precision bf16 --batch 8 --seq-len 2048   # on an accelerator
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from large_model_training.config import model_from_preset
from large_model_training.mesh import select_device, synchronize
from large_model_training.assembly import build_model
from large_model_training.models.loss import cross_entropy
from large_model_training.models.flops import training_flops_per_token
from large_model_training.planner.calibrate import matmul_rate


class PlainBlock(nn.Module):
    def __init__(self, h, n_heads, n_kv, ffn, eps):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, h // n_heads
        self.ln1, self.ln2 = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.qkv = nn.Linear(h, (n_heads + 2 * n_kv) * self.hd, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        q, k = (rope(t.view(b, s, -1, self.hd), cos, sin).transpose(1, 2) for t in (q, k))
        v = v.view(b, s, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.ln2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def rope(x, cos, sin):
    xf = x.float().unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.stack((re * c - im * s, re * s + im * c), -1).flatten(-2).type_as(x)


class PlainGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(cfg.hidden_size, cfg.n_heads, cfg.kv_heads, cfg.ffn_hidden_size,
                                               cfg.norm_eps) for _ in range(cfg.n_layers))
        self.ln_f = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, 0, 0.02) if p.ndim == 2 else nn.init.ones_(p)

    def forward(self, idx):
        hd = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, device=idx.device).float() / hd))
        ang = torch.outer(torch.arange(idx.shape[1], device=idx.device).float(), inv)
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x, ang.cos(), ang.sin())
        return self.head(self.ln_f(x))


def time_steps(model, opt, batches, device, dtype) -> float:
    synchronize(device)
    t = time.perf_counter()
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    synchronize(device)
    return (time.perf_counter() - t) / len(batches)


def add_run_arguments(ap: argparse.ArgumentParser, batch: int, steps: int, rounds: int) -> None:
    """The shape and timing flags this bench shares with bench/compile_vs_eager.py."""
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=steps, help="steps per round")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    add_run_arguments(ap, batch=16, steps=5, rounds=5)
    args = ap.parse_args()
    device = select_device(0)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    cfg = model_from_preset(args.model)
    ours = build_model(cfg, None, seed=0, device=device)
    with device:
        plain = PlainGPT(cfg)
    models = {"lmt": ours, "plain": plain}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type != "cpu" or None) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (args.steps, args.batch, args.seq_len + 1), generator=g).to(device)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    for k in models:  # warm-up
        time_steps(models[k], opts[k], batches[:2], device, dtype)
    times = {k: [] for k in models}
    for _ in range(args.rounds):
        for k in models:
            times[k].append(time_steps(models[k], opts[k], batches, device, dtype))
    peak = matmul_rate(dtype, 2048 if device.type == "cpu" else 8192, 10, device)  # 2048 cannot fill a GPU
    flops = training_flops_per_token(cfg, args.seq_len) * args.batch * args.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"device {device}, {args.precision}, model {args.model} ({sum(p.numel() for p in ours.parameters())/1e6:.1f}M "
          f"params), batch {args.batch} x {args.seq_len}, {args.rounds} rounds x {args.steps} steps, threads {torch.get_num_threads()}")
    print(f"matmul peak measured: {peak/1e12:.3f} TFLOP/s")
    for k in models:
        print(f"{k:6s} step {med[k]*1e3:8.1f} ms  {args.batch*args.seq_len/med[k]:9.0f} tok/s  "
              f"MFU {flops/med[k]/peak:6.1%}")
    paired = statistics.median(p / o for p, o in zip(times["plain"], times["lmt"]))
    print(f"throughput ratio lmt/plain = {med['plain']/med['lmt']:.3f} (median of the rounds' own ratios {paired:.3f})")


if __name__ == "__main__":
    main()
