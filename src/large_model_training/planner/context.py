"""Context parallelism's terms in the planner: which cp degrees to search, what cp adds to a rank's memory and to a
block's attention time, as the runtime runs it (parallel/ring_attention.py, parallel/context.py).

Each cp rank holds s/cp tokens of every sequence (zig-zag: 2cp chunks, rank r holding chunks r and 2cp-1-r, so
every rank does the same share of the causal triangle). Everything per token therefore scales by 1/cp (the
callers pass s/cp as the sequence to the activation and GEMM formulas); what is left is attention's traffic:

  ring       key/value blocks of the local s/cp tokens (kv heads only) go round the cp ring, cp-1 transfers
             per forward, each posted before the attention of the block already here: a transfer is hidden only
             while a block's attention outlasts it. Backward is a ring too: K/V blocks (B bytes) and the running
             dK/dV (fp32 in the runtime: 4/B times the bytes) travel together, cp-1 times under a block's
             backward, and one last dK/dV hop brings it home (exposed). Saved for backward: the local q, k, v,
             output and fp32 log-sum-exp, the same terms as cp = 1 at s/cp tokens. In flight (backward, the
             most): the K/V block here and the one arriving, three fp32 dK/dV blocks (this block's, the
             travelling sum, the one arriving) and the fp32 dQ accumulator.
  allgather  Llama 3's: K, V all-gathered over cp before the local queries' attention, dK, dV reduce-scattered
             in backward; neither overlapped. SDPA saves its inputs: without recomputation each block keeps the
             gathered s x k_r x d K and V (not its s/cp share) and the s/cp x s zig-zag causal mask (which SDPA
             turns from bool into an additive mask of the activation dtype) until backward; with recomputation
             both are rebuilt in backward, gathered again. In flight in backward: the full dK, dV and their
             contiguous copy for the reduce-scatter. Time: with an explicit mask SDPA
             cannot skip the masked blocks, so the local queries run the whole s/cp x s rectangle: twice the
             causal work a flash kernel (or the ring's per-block causal calls) does.

The cp group is the t*cp consecutive ranks inside dp (mesh dp, cp, tp; tp innermost): intra-node while t*cp
fits a node. Gradients and ZeRO shards span dp x cp.
"""

from __future__ import annotations

from large_model_training.choices import bf16_compute
from large_model_training.layout import Job, Layout
from large_model_training.planner.shapes import kv_heads_per_rank

ATTENTIONS = ("ring", "allgather")
MIN_CP_TOKENS = 4096
"""The search tries cp > 1 only while each rank keeps at least this many tokens of a sequence (Llama 3 ran cp=16
at 128K: 8K per rank). A bound on the search space, like MAX_MICRO_BATCH; a fixed --cp is not limited by it."""


def cp_degrees(seq_len: int, devices: int, fixed: int | None = None) -> list[int]:
    """The cp degrees to search: divisors of `devices` whose zig-zag chunks divide the sequence and that leave
    each rank MIN_CP_TOKENS tokens or more (cp = 1 always)."""
    if fixed:
        return [fixed]
    return [
        c
        for c in range(1, devices + 1)
        if devices % c == 0 and (c == 1 or (seq_len % (2 * c) == 0 and seq_len // c >= MIN_CP_TOKENS))
    ]


def local_tokens(job: Job, layout: Layout) -> int:
    """Tokens of one sequence a cp rank holds."""
    return job.seq_len // layout.cp


def kv_block_bytes(job: Job, layout: Layout, dtype_bytes: int) -> float:
    """One K/V block of a cp rank: 2 (K and V) x s/cp x b x kv heads per tp rank x d x B."""
    cfg = job.model
    return (
        2.0
        * local_tokens(job, layout)
        * layout.micro_batch_size
        * kv_heads_per_rank(cfg, layout.tp)
        * cfg.head_dim
        * dtype_bytes
    )


def mask_bytes(job: Job, layout: Layout, dtype_bytes: int) -> float:
    """The all-gather variant's mask of the local queries against the whole sequence (s/cp x s), as SDPA saves it:
    turned from bool into an additive mask in the activation dtype (measured: 4 bytes per element in fp32)."""
    return float(local_tokens(job, layout) * job.seq_len * dtype_bytes)


def held_extra_per_layer(job: Job, layout: Layout, dtype_bytes: int) -> float:
    """Bytes a block keeps beyond its local q, k, v until backward: the all-gathered K, V of the other cp-1 ranks
    and the mask, saved by SDPA as its inputs (allgather without recomputation; 0 otherwise)."""
    if layout.cp == 1 or layout.cp_attention != "allgather" or layout.recompute.kind != "none":
        return 0.0
    return (layout.cp - 1) * kv_block_bytes(job, layout, dtype_bytes) + mask_bytes(job, layout, dtype_bytes)


def transient_bytes(job: Job, layout: Layout, dtype_bytes: int) -> float:
    """The most cp's attention has in flight at once, one block at a time (the module docstring): the ring's
    backward buffers; the all-gather's full dK, dV and their copy, plus the regathered K, V and mask when the
    block's forward is rebuilt."""
    if layout.cp == 1:
        return 0.0
    block = kv_block_bytes(job, layout, dtype_bytes)
    if layout.cp_attention == "ring":
        dq = (
            4.0
            * local_tokens(job, layout)
            * layout.micro_batch_size
            * (job.model.n_heads // layout.tp)
            * job.model.head_dim
        )
        return 2 * block + 3 * block * 4 / dtype_bytes + dq
    gathered = layout.cp * block
    rebuilt = 0.0 if held_extra_per_layer(job, layout, dtype_bytes) else gathered + mask_bytes(job, layout, dtype_bytes)
    return 2 * gathered + rebuilt


def attention_work(layout: Layout) -> float:
    """Attention FLOPs of a cp rank relative to its 1/cp of the causal work (2: the masked rectangle)."""
    return 2.0 if layout.cp > 1 and layout.cp_attention == "allgather" else 1.0


def ring_exposed(step_compute: float, transfer: float, cp: int) -> float:
    """Seconds a ring of cp steps adds to its attention: each of the cp-1 transfers runs under one block's
    attention (step_compute) and shows only by what it outlasts it."""
    return (cp - 1) * max(0.0, transfer - step_compute)


def attention_comm(
    job: Job, layout: Layout, attention_s: float, link: tuple[float, float], collective
) -> tuple[float, float]:
    """(forward, backward) seconds cp's traffic adds to one block's attention, whose forward compute on this
    rank (its 1/cp of the causal work) is `attention_s`; link: (bandwidth, latency) of the cp group;
    collective: planner.timing.collective_time (passed in: timing imports this module)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    B = 2 if bf16_compute(job.precision) else 4
    block = kv_block_bytes(job, layout, B)
    if layout.cp_attention == "allgather":
        full = cp * block
        return (collective("all_gather", full, cp, *link), collective("reduce_scatter", full, cp, *link))
    kv_hop = collective("p2p", block, 2, *link)
    dkv_hop = collective("p2p", block * 4 / B, 2, *link)  # the running dK/dV travels in fp32
    forward = ring_exposed(attention_s / cp, kv_hop, cp)
    # under each block's backward (2.5x its forward) K/V and dK/dV travel together; then dK/dV's last hop home
    backward = ring_exposed(2.5 * attention_s / cp, kv_hop + dkv_hop, cp) + dkv_hop
    return forward, backward
