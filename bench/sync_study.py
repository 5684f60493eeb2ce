"""Infrequent or partial synchronisation of AdamW replicas, simulated in one process: a screen for the slow-link
methods of issue 20 before a real `lmt train --dp 4` run.

    python bench/sync_study.py dense                       # gradient averaging, one shared AdamW
    python bench/sync_study.py local --every 2 --lr 6e-3   # --sync local:2 --sync.outer_lr 1 --sync.outer_momentum 0
    python bench/sync_study.py local --every 2 --codec sign --lr 6e-3
    python bench/sync_study.py rotate --parts 2 --codec sign --lr 6e-3
    python bench/sync_study.py local --every 8 --codec int4 --lr 1.5e-3 --steps 1000 --eval-every 250 --device cuda \
        --set model.hidden_size=512 --set model.n_layers=10 --set model.n_heads=8 --set model.ffn_hidden_size=1280

dp = 4 replicas run one after another in this process, each with its own AdamW moments and clipping by its own
gradient norm (as DiLoCo's inner steps), on the `tiny` preset, the default corpus, global batch 16 x 256 tokens,
`lmt train`'s schedule and AdamW settings. The exchange of the parameter change (anchor - params, plus the
worker residual) is the runtime's own code: compression/two_stage.py with compression/sign.py's codecs, the
server residuals kept per shard; after it every replica takes the new anchor (plain averaging by default;
`--outer-lr` and `--outer-momentum` give the runtime's Nesterov outer step). With `--log-train` the per-step
training losses match `lmt train --dp 4 --micro-batch-size 4 --global-batch-size 16` with the same `--sync` flags
to float rounding (docs/benchmarks.md, "On a GPU, 30M parameters"). Variants:
  local     every `--every` steps the whole change is exchanged (the runtime's --sync local:H);
  rotate    after every step 1/`--parts` of the coordinates (256-element blocks taken in turn) is exchanged and
            every replica restarts from the anchor; the change of the other blocks waits in the worker
            residual: replicas never drift apart, each block is synchronised `--parts` steps late instead.
Bytes per rank on the wire per step, ring algorithms, against the dense fp32 all-reduce: 4 x every / b for local,
4 x parts / b for rotate (b: the codec's bytes per element, 4 for none, 1/8 + 4/256 for sign), and
dp / 2 times more with `--stages 1` (an all-gather of every replica's message: one rounding, no server).
One 300-step variant of `tiny` takes a few minutes on one core (a 3.9x wider model, `--set model.hidden_size=256
--set model.ffn_hidden_size=768`, about 25 minutes); `--device cuda` runs the same screen on an accelerator, for
larger models and more steps (TF32 matmuls there). `--batch` changes the global batch, `--eval-every` prints the
validation curve. The validation loss is the anchor's (or, for dense, the model's) at the last step,
on the simulation's validation batches (compare variants of this script with each other, not with runs).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from large_model_training.compression.sign import OUTER_SIGN_CHUNK, Codec
from large_model_training.compression.two_stage import encode_shards, serve_shard
from large_model_training.parallel.diloco import nesterov_step
from large_model_training.train.optim import learning_rate
from simulated_dp import DP, SimulatedRanks  # bench/simulated_dp.py (this script's folder is on sys.path)

EPS, BLOCK = 1e-8, 256


def two_stage_average(codec: Codec, deltas: list[torch.Tensor], server: list[torch.Tensor],
                      stages: int = 2) -> tuple:
    """The runtime's exchange of the replicas' vectors (stages 1: every replica's whole message gathered and
    averaged, one rounding, (dp - 1) x the message on each link); returns (the average every replica decodes,
    what each replica's message carried)."""
    numel = deltas[0].numel()
    if stages == 1:
        sent = [codec.encode(d)[1] for d in deltas]
        return torch.stack(sent).mean(dim=0), sent
    padded = [F.pad(d, (0, -numel % DP)) for d in deltas]
    encoded = [encode_shards(codec, p, DP) for p in padded]
    shard = padded[0].numel() // DP
    served = [serve_shard(codec, torch.stack([encoded[i][0][j] for i in range(DP)]), shard,
                          server[j] if codec.lossy else None)[1] for j in range(DP)]
    return torch.cat(served)[:numel], [sent[:numel] for _, sent in encoded]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=["dense", "local", "rotate"])
    ap.add_argument("--every", type=int, default=1, help="local: steps between exchanges")
    ap.add_argument("--parts", type=int, default=2, help="rotate: blocks exchanged 1/parts at a time")
    ap.add_argument("--codec", default="none", choices=["none", "int8", "int4", "sign"])
    ap.add_argument("--stages", type=int, default=2, choices=[1, 2],
                    help="the exchange: 2 the runtime's two-stage average, 1 an all-gather of whole messages")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=16, help="global batch in sequences of 256 tokens, split over dp 4")
    ap.add_argument("--outer-lr", type=float, default=1.0, help="local: the outer Nesterov step's lr (1: averaging)")
    ap.add_argument("--outer-momentum", type=float, default=0.0, help="local: its momentum (DiLoCo: 0.9, lr 0.7)")
    ap.add_argument("--eval-every", type=int, default=0, help="also print the validation loss every N steps")
    ap.add_argument("--log-train", action="store_true",
                    help="print every step's training loss, the replicas' mean (as `lmt train` logs it)")
    ap.add_argument("--device", default="cpu", help="where the replicas train (cuda: larger models, more steps)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="a model setting, e.g. model.hidden_size=256 (a larger model; repeatable)")
    args = ap.parse_args()
    model = {key: int(value) for key, _, value in (item.partition("=") for item in args.set)}
    torch.set_float32_matmul_precision("high")  # TF32 on CUDA (a screen compares variants, all alike); no-op on CPU
    sim = SimulatedRanks(torch.device(args.device), global_batch=args.batch,
                         **{"train.steps": args.steps, "train.lr": args.lr, "train.seed": args.seed, **model})
    t, decayed, anchor = sim.cfg.train, sim.decayed, sim.initial
    n = anchor.numel()

    def adamw(x: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, step: int) -> None:
        g = g * min(1.0, t.grad_clip / (float(g.norm()) + 1e-6))
        m.lerp_(g, 1 - t.beta1)
        v.mul_(t.beta2).addcmul_(g, g, value=1 - t.beta2)
        c1, c2 = 1 - t.beta1 ** (step + 1), 1 - t.beta2 ** (step + 1)
        x.mul_(1 - lr * t.weight_decay * decayed).sub_(lr * (m / c1) / ((v / c2).sqrt() + EPS))

    codec = Codec(args.codec, OUTER_SIGN_CHUNK)
    replicas = 1 if args.variant == "dense" else DP
    xs = [anchor.clone() for _ in range(replicas)]
    zeros = lambda numel: torch.zeros(numel, device=anchor.device)  # noqa: E731
    ms, vs = [zeros(n) for _ in range(replicas)], [zeros(n) for _ in range(replicas)]
    worker = [zeros(n) for _ in range(DP)]
    blocks = torch.arange(n, device=anchor.device) // BLOCK % args.parts  # rotate: which turn each element is in
    turn_numel = [n] if args.variant == "local" else [int((blocks == k).sum()) for k in range(args.parts)]
    server = [[zeros(math.ceil(numel / DP)) for _ in range(DP)] for numel in turn_numel]
    momentum = zeros(n)

    def log_train(step: int, losses: list[torch.Tensor]) -> None:
        if args.log_train:
            print(json.dumps({"step": step + 1, "loss": float(sum(losses)) / len(losses)}), flush=True)

    print(json.dumps({"parameters": n}), flush=True)
    start = time.perf_counter()
    for step in range(args.steps):
        if args.eval_every and step and step % args.eval_every == 0:
            print(json.dumps({"step": step, "val_loss": round(sim.val_loss(anchor), 4),
                              "seconds": round(time.perf_counter() - start)}), flush=True)
        lr = learning_rate(step, t)
        if args.variant == "dense":
            grads, losses = [], []
            for r in range(DP):
                grads.append(sim.gradient(r, xs[0]))
                losses.append(sim.last_loss)
            log_train(step, losses)
            adamw(xs[0], sum(grads) / DP, ms[0], vs[0], lr, step)
            anchor = xs[0]
            continue
        losses = []
        for r in range(DP):
            adamw(xs[r], sim.gradient(r, xs[r]), ms[r], vs[r], lr, step)
            losses.append(sim.last_loss)
        log_train(step, losses)
        if args.variant == "local":
            if (step + 1) % args.every:
                continue
            deltas = [anchor - xs[r] + worker[r] for r in range(DP)]
            average, sent = two_stage_average(codec, deltas, server[0], args.stages)
            worker = [d - s for d, s in zip(deltas, sent)]
            anchor = anchor.clone()
            nesterov_step(anchor, momentum, average, args.outer_lr, args.outer_momentum)
            xs = [anchor.clone() for _ in range(DP)]
            continue
        turn = blocks == step % args.parts  # rotate: this step's blocks
        deltas = [(anchor - xs[r] + worker[r]) for r in range(DP)]
        average, sent = two_stage_average(codec, [d[turn] for d in deltas], server[step % args.parts],
                                         args.stages)
        anchor = anchor.clone()
        anchor[turn] -= average
        for r in range(DP):
            worker[r][turn] = deltas[r][turn] - sent[r]
            worker[r][~turn] = deltas[r][~turn]  # every replica restarts from the anchor; the rest waits here
            xs[r] = anchor.clone()
    val_loss = sim.val_loss(anchor)
    print(json.dumps({**vars(args), "val_loss": round(val_loss, 4)}))


if __name__ == "__main__":
    main()
