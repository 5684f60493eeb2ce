"""Expert parallelism at ep=2: our all-to-all dispatch (parallel/expert.py) against a naive all-gather baseline
(issue 18).

    python bench/ep_dispatch_vs_allgather.py                     # tiny-moe and a larger shape, top-2 and top-1
    python bench/ep_dispatch_vs_allgather.py --cases tiny-k2 --rounds 3          # a quick look

Two gloo ranks (1 thread each), each holding E / 2 experts of one MoE MLP; the same router, the same expert
weights (the same module: both contenders run its router and its `experts.compute` on this rank's experts, so
only the token movement differs) and the same tokens (T per rank, different on each rank), forward + backward:
  a2a        our `MoE` with `experts.shard(2, rank, dispatch_compute_combine)`: the copies routed to the other
             rank's experts go there by `all_to_all_single` with uneven splits (counts exchanged first), come back
             the same way; backward is the reverse exchange
  allgather  every rank all-gathers all tokens (hidden states, chosen experts and gates) over the 2 ranks, runs
             its local experts on the copies routed to them, scatters the gated outputs into a (2T, h) buffer
             and reduce-scatters it (sum) back to the token owners; backward: reduce-scatter of the gathered
             tokens' gradients, all-gather of the outputs' gradients (Megatron-Core's all-gather token
             dispatcher, without tp; no DeepSpeed or Tutel)
The aux loss is off (coefficient 0) in both; the loss is sum(y * g) for a fixed random g. Bytes are those this
rank sends to the other rank per step (forward + backward, the counter of parallel/expert.py for a2a and the
same rule, (n - 1) / n of each gathered or scattered buffer, for allgather). Rounds alternate the contenders
(bench/harness.py); times are the ranks' mean of median wall and CPU seconds per step. Outputs and gradients
(input, router, local experts) of one step are compared: the largest absolute difference on either rank.
Expected: at ep = 2 with top-2, a2a sends T k (ep - 1) / ep = T rows each way, the same as all-gathering T rows,
so the bytes are equal; with top-1 a2a sends half. allgather also gathers the routing and scatters into 2T rows.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist

from large_model_training.config import model_from_preset
from large_model_training.launch import run_on_ranks
from large_model_training.mesh import AxisGroup
from large_model_training.models.moe import MoE
from large_model_training.parallel.collectives import gather_from_sequence, scatter_to_sequence
from large_model_training.parallel.expert import dispatch_compute_combine

import harness  # bench/harness.py (this script's folder is on sys.path when run as a script)

CASES = {"tiny-k2": dict(hidden_size=128, moe_experts=8, moe_top_k=2, moe_ffn_hidden_size=128),
         "tiny-k1": dict(hidden_size=128, moe_experts=8, moe_top_k=1, moe_ffn_hidden_size=128),
         "large-k2": dict(hidden_size=512, moe_experts=16, moe_top_k=2, moe_ffn_hidden_size=512)}


def _gather_tokens(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(T, ...) -> (2T, ...): all-gather of the tokens forward, reduce-scatter backward. The tokens as the sequence
    of one batch row, so this is the library's sequence-parallel pair (as Megatron-Core's all-gather dispatcher
    uses its own), with its byte counting."""
    return gather_from_sequence(x.unsqueeze(0), group).squeeze(0)


def _scatter_tokens(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(2T, ...) -> (T, ...): reduce-scatter (sum) back to the token owners forward, all-gather backward."""
    return scatter_to_sequence(x.unsqueeze(0), group).squeeze(0)


def allgather_moe(moe: MoE, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The baseline: route locally, gather everything, run this rank's experts, reduce-scatter the outputs."""
    scores, chosen, gates = moe.router(x)
    k, local = chosen.shape[1], moe.n_experts // group.size
    xs = _gather_tokens(x, group)
    flat = _gather_tokens(chosen, group).reshape(-1)  # (2T k,) global experts, no gradient
    gate = _gather_tokens(gates.contiguous(), group).reshape(-1)
    first = group.rank * local
    mine = ((flat >= first) & (flat < first + local)).nonzero().squeeze(1)
    order = mine[torch.argsort(flat[mine], stable=True)]  # copies for this rank's experts, by expert
    counts = torch.zeros(local, dtype=torch.long).scatter_add_(0, flat[order] - first, torch.ones_like(order))
    token = order // k
    out = moe.experts.compute(xs[token], torch.cumsum(counts, 0)) * gate[order].unsqueeze(-1).to(x.dtype)
    return _scatter_tokens(torch.zeros_like(xs).index_add_(0, token, out), group)


def _rank(case: str, tokens: int, rounds: int, iters: int) -> dict:
    rank = dist.get_rank()
    ep = AxisGroup(dist.group.WORLD, 2, rank)
    base = AxisGroup(dist.group.WORLD, 2, rank)  # the baseline's byte counter
    cfg = model_from_preset("tiny-moe")
    for key, value in CASES[case].items():
        setattr(cfg, key, value)
    cfg.moe_aux_loss_coef = 0.0
    torch.manual_seed(0)  # the same full weights on both ranks
    moe = MoE(cfg, layer=0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
        moe.router.weight.normal_(0.0, 0.2)
    full = {n: getattr(moe.experts, n).detach().clone() for n in ("w_gate", "w_up", "w_down")}
    moe.experts.shard(2, rank, partial(dispatch_compute_combine, ep=ep))
    local = cfg.moe_experts // 2
    with torch.no_grad():
        for n, w in full.items():
            getattr(moe.experts, n).copy_(w[rank * local:(rank + 1) * local])
    moe.train()
    gen = torch.Generator().manual_seed(100 + rank)  # different tokens on each rank
    steps = 2 + rounds * iters
    batches = [(torch.randn(tokens, cfg.hidden_size, generator=gen), torch.randn(tokens, cfg.hidden_size,
                                                                                  generator=gen))
               for _ in range(steps)]

    def run(kind: str, x: torch.Tensor, g: torch.Tensor):
        moe.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        y = moe(xi) if kind == "a2a" else allgather_moe(moe, xi, base)
        loss = (y * g).sum()
        loss.backward()
        moe.reset_stats()
        return y.detach(), [xi.grad, moe.router.weight.grad, *(p.grad for p in moe.experts.parameters())], loss

    fns = {kind: (lambda x, g, kind=kind: float(run(kind, x, g)[2].detach())) for kind in ("a2a", "allgather")}
    # bytes of one step each, and the values compared
    ep.bytes = base.bytes = 0
    ya, ga, _ = run("a2a", *batches[0])
    a2a_bytes = ep.bytes
    yb, gb, _ = run("allgather", *batches[0])
    ag_bytes = base.bytes
    diff = max(float((u - v).abs().max()) for u, v in zip([ya, *ga], [yb, *gb]))
    wall, cpu, losses = harness.alternate_rounds(fns, batches, 2, rounds, iters)
    return {"wall": wall, "cpu": cpu, "losses": losses, "bytes": {"a2a": a2a_bytes, "allgather": ag_bytes},
            "diff": diff, "scale": float(ya.abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    print("| case | a2a bytes/step | allgather bytes/step | allgather/a2a bytes | a2a ms | allgather ms "
          "| allgather/a2a time | allgather/a2a CPU | max abs diff (y and grads) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        results = run_on_ranks(_rank, 2, (case, args.tokens, args.rounds, args.iters))
        steps = 2 + args.rounds * args.iters
        wall, cpu, _ = harness.summarise(results, steps)
        b = results[0]["bytes"]
        diff = max(r["diff"] for r in results)
        print(f"| {case} | {b['a2a']:,.0f} | {b['allgather']:,.0f} | {b['allgather'] / b['a2a']:.2f} | "
              f"{wall['a2a'] * 1e3:.0f} | {wall['allgather'] * 1e3:.0f} | **{wall['allgather'] / wall['a2a']:.2f}** "
              f"| {cpu['allgather'] / cpu['a2a']:.2f} | {diff:.1e} (of max abs y {results[0]['scale']:.2f}) |",
              flush=True)


if __name__ == "__main__":
    main()
