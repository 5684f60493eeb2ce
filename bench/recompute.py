"""Activation memory and step time of every recompute policy, as ratios to `none`, from one run.

One model per policy, all from the same seed (identical weights), each with its own AdamW, train on the same
tokens with the same dropout seeds; rounds alternate between the policies (the order rotates each round) so
machine noise hits all alike. Beside the wall time: the process's CPU time (user + system), which suffers
less when other jobs share the cores, and its user time alone (the compute; on the CPU the system time is
mostly page faults of freshly mapped activation memory, which the policies that keep less also fault less).
Activation memory is the per-step peak of bytes held for backward, measured by
the saved-tensor hook counter the trainer uses (`memory/accounting.py`; recompute transients included), next
to the planner's formula for the same shape (`planner/memory.py`: blocks, embedding and head).

    python bench/recompute.py                           # 8 x 512-wide blocks, batch 2 x 512, dropout 0.1, CPU
    python bench/recompute.py --dropout 0               # CPU flash kernel: no s x s scores to remove
    python bench/recompute.py --layers 32 --hidden 2048 --heads 16 --seq-len 2048 --batch 4   # on an accelerator

Why dropout 0.1 by default: PyTorch's CPU SDPA runs its flash kernel without dropout, which never stores the
attention scores (only a log-sum-exp), so there is no 5as/h term for `selective` to remove; with dropout it
runs the math kernel, which saves the s x s probabilities, the mask and the dropped probabilities in fp32:
Korthikanti's score term, which `selective` removes.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from large_model_training.config import ModelConfig
from large_model_training.memory.accounting import ActivationCounter
from large_model_training.memory.recompute import apply_recompute
from large_model_training.mesh import select_device, synchronize
from large_model_training.assembly import build_model
from large_model_training.planner import memory as mem
from large_model_training.choices import RecomputePolicy

POLICIES = ["none", "selective", "every:2", "full"]


def run_steps(model, opt, counter: ActivationCounter, batches, first_step: int,
              device) -> tuple[tuple[float, float, float], list[float]]:
    """(wall, user CPU, system CPU) seconds per step over `batches` (dropout seeded by step index); losses."""
    synchronize(device)
    started, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    losses = []
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(first_step + i)
        counter.reset_peak()
        with counter.counting():
            loss = model.loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    synchronize(device)
    wall, now = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    n = len(batches)
    return (wall / n, (now.ru_utime - usage.ru_utime) / n, (now.ru_stime - usage.ru_stime) / n), losses


def formula_peak(cfg: ModelConfig, policy: str, seq: int, batch: int, fused: bool) -> float:
    """The planner's peak for the whole model on one device, fp32."""
    blocks = mem.stage_activation_bytes(cfg, seq, batch, 1, False, RecomputePolicy.parse(policy), 4, cfg.n_layers, 1,
                                        fused_kernels=fused)
    return blocks + mem.head_activation_bytes(cfg, seq, batch, 1, False, 4, fused) + \
        mem.embedding_activation_bytes(cfg, seq, batch, 1, False, fused, 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1376, help="swiglu width (Llama's 8h/3, rounded)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = select_device(0)
    cfg = ModelConfig(vocab_size=256, hidden_size=args.hidden, n_layers=args.layers, n_heads=args.heads,
                      ffn_hidden_size=args.ffn, max_seq_len=args.seq_len, dropout=args.dropout)
    models = {p: apply_recompute(build_model(cfg, None, seed=0, device=device).train(), p) for p in POLICIES}
    opts = {p: torch.optim.AdamW(m.parameters(), lr=1e-4) for p, m in models.items()}
    counters = {p: ActivationCounter().exclude_parameters(m) for p, m in models.items()}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (args.steps, args.batch, args.seq_len + 1), generator=g).to(device)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    losses = {p: [] for p in POLICIES}
    for p in POLICIES:  # warm-up, one step each
        losses[p] += run_steps(models[p], opts[p], counters[p], batches[:1], 0, device)[1]
    times = {p: [] for p in POLICIES}
    peaks = {p: 0 for p in POLICIES}
    for r in range(args.rounds):
        order = POLICIES[r % len(POLICIES):] + POLICIES[:r % len(POLICIES)]
        for p in order:
            seconds, step_losses = run_steps(models[p], opts[p], counters[p], batches, 1 + r * args.steps, device)
            times[p].append(seconds)
            losses[p] += step_losses
            peaks[p] = max(peaks[p], counters[p].peak)
    wall = {p: statistics.median(t[0] for t in ts) for p, ts in times.items()}
    cpu = {p: statistics.median(t[1] + t[2] for t in ts) for p, ts in times.items()}
    user = {p: statistics.median(t[1] for t in ts) for p, ts in times.items()}
    system = {p: statistics.median(t[2] for t in ts) for p, ts in times.items()}
    fused = device.type != "cpu"
    worst = max(abs(a - b) / abs(b) for p in POLICIES for a, b in zip(losses[p], losses["none"]))
    print(f"device {device}, fp32, {args.layers} blocks h={args.hidden} a={args.heads} swiglu {args.ffn}, "
          f"batch {args.batch} x {args.seq_len}, dropout {args.dropout}, {args.rounds} rounds x {args.steps} steps, "
          f"threads {torch.get_num_threads()}; largest loss difference to none {worst:.1e} (relative)")
    print(f"{'policy':10s} {'peak MB':>9s} {'formula MB':>11s} {'memory/none':>12s} {'cut':>6s} "
          f"{'step ms':>8s} {'wall/none':>9s} {'cpu/none':>8s} {'user/none':>9s} {'sys ms':>7s}")
    for p in POLICIES:
        print(f"{p:10s} {peaks[p] / 2**20:9.1f} {formula_peak(cfg, p, args.seq_len, args.batch, fused) / 2**20:11.1f} "
              f"{peaks[p] / peaks['none']:12.3f} {1 - peaks[p] / peaks['none']:6.1%} {wall[p] * 1e3:8.0f} "
              f"{wall[p] / wall['none']:9.3f} {cpu[p] / cpu['none']:8.3f} {user[p] / user['none']:9.3f} "
              f"{system[p] * 1e3:7.0f}")
    terms = mem.layer_activation_terms(cfg, args.seq_len, args.batch, 1, False, 4, fused_kernels=fused)
    removed = peaks["none"] - peaks["selective"]
    print(f"selective removed {removed / 2**20:.1f} MB; the score term (Korthikanti's 5as/h, here "
          f"{'fp32 probabilities, mask, dropped probabilities' if terms.attention_scores else 'absent: flash kernel'}) "
          f"is {args.layers * terms.attention_scores / 2**20:.1f} MB over {args.layers} blocks")


if __name__ == "__main__":
    main()
