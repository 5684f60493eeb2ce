"""The ring's own elementwise work: what parallel/ring_attention.py runs around the flash kernel at every ring step.

Issue 35, fourth round. The flash kernel's FLOPs are priced in timing.py and the K/V transfers in context.py; what
neither counts is the merge. Each ring step's partial output is folded into the fp32 accumulators
(`merge_block`): per element of the call's output rows, out[rows] * exp(..) reads and writes fp32 (8 bytes),
block_out.float() reads B and writes 4, its product with exp(..) 8, the sum reads two and writes one (12), and the
assignment into out[rows] copies (8): 40 + B bytes. Per row of the log-sum-exp (fp32): logaddexp (12), finite's
isinf and masked_fill (5 + 9), the two differences and exps (12 + 8, twice), the two products' reads of the
broadcast factor (4, twice) and the copy into lse (8): 82 bytes.
Step 0 starts the accumulators (block_out.float(), B + 4 per element) and the end casts out back (4 + B).
Backward (`RingAttention.backward`): each call's dq is added into the fp32 accumulator (dq[rows] += gq: 8 + B per
element; step 0 casts, B + 4), its lse rows copied (8 per row); each block's dK/dV start as fp32 casts (B + 4 per
kv element) or zeros plus the added columns (4, then 8 + B), the travelling sum adds two fp32 tensors (12) and the
end casts dq, dk, dv back (4 + B). These are memory-bound kernels at the entry's streaming bandwidth, each with
its launch.

At cp = 16 and 128K tokens (8,192 per rank, 16 query heads per tp rank) the forward merges move about 8 GB per
block: about 3 ms on an H100 beside 12.7 ms of attention. Which rank paces the ring: the ranks exchange K/V every
step, so a step lasts as long as its slowest rank's; at step i the ranks past i attend all their rows (a full
earlier block), and rank cp - 1 does so at every step. So the time is rank cp - 1's, the most loaded.
"""

from __future__ import annotations

from large_model_training.layout import Job, Layout
from large_model_training.parallel.ring_attention import block_calls
from large_model_training.planner.hardware import Hardware
from large_model_training.planner.shapes import kv_heads_per_rank

MERGE_BYTES = 40
"""Bytes per output element one merge_block call moves, plus the activation dtype's B (block_out read)."""
MERGE_LSE_BYTES = 82
"""Bytes per log-sum-exp row (per query row and head) one merge_block call moves."""
MERGE_KERNELS = 13
"""Kernels one merge_block call launches: logaddexp, isinf, masked_fill, two subtractions, two exps, the cast, two
products, the sum and the two copies into out and lse."""
DQ_KERNELS = 2  # the lse rows' copy and dq[rows] += gq


def _slice_len(s: slice) -> int:
    return s.stop - s.start


def rank_merge_bytes(job: Job, layout: Layout, B: int, rank: int) -> tuple[float, float, int, int]:
    """(forward bytes, backward bytes, forward kernels, backward kernels) the ring's merges cost one cp rank in
    one block and one micro-batch (the module docstring's counts), from the kernel calls the runtime makes."""
    cfg, cp = job.model, layout.cp
    local = job.seq_len // cp
    chunk = local // 2
    b, d = layout.micro_batch_size, cfg.head_dim
    rows_scale = b * (cfg.n_heads // layout.tp)  # lse rows per token of the call's query rows
    kv_scale = b * kv_heads_per_rank(cfg, layout.tp) * d  # K (or V) elements per token
    q_all, kv_all = rows_scale * local * d, kv_scale * local
    fwd = bwd = 0.0
    kf = kb = 0
    for step in range(cp):
        calls = block_calls(rank, (rank - step) % cp, cp, chunk)
        covers = any(_slice_len(cols) == local for _, cols, _ in calls)
        if step and not covers:  # dK/dV start as zeros, then the calls' columns are added in
            bwd += 2 * 4 * kv_all
            kb += 2
        for rows, cols, _ in calls:
            lse_rows = rows_scale * _slice_len(rows)
            elements = lse_rows * d
            bwd += 8 * lse_rows
            if step == 0:  # the accumulators start as the first call's output and its dq
                fwd += (B + 4) * (elements + lse_rows)
                bwd += (B + 4) * elements + 2 * (B + 4) * kv_all
                kf, kb = kf + 2, kb + 3
                continue
            fwd += (MERGE_BYTES + B) * elements + MERGE_LSE_BYTES * lse_rows
            kf += MERGE_KERNELS
            bwd += (8 + B) * elements
            kb += DQ_KERNELS
            # the call's dK/dV cast to fp32 when it covers the block, else added into the zeroed one
            bwd += 2 * (B + 4 if _slice_len(cols) == local else 8 + B) * kv_scale * _slice_len(cols)
            kb += 2
        if step:  # the travelling dK/dV sum
            bwd += 2 * 12 * kv_all
            kb += 2
    fwd += (4 + B) * q_all  # out back to the activation dtype
    bwd += (4 + B) * (q_all + 2 * kv_all)  # dq, dk, dv back
    return fwd, bwd, kf + 1, kb + 3


def ring_merge_time(job: Job, layout: Layout, hw: Hardware, B: int) -> tuple[float, float]:
    """(forward, backward) seconds the merges add to one block's attention on the rank that paces the ring;
    0 without the ring. A CPU entry keeps its calibration's count (none of this), as eager_ops does."""
    if layout.cp == 1 or layout.cp_attention != "ring" or not hw.fused_kernels:
        return 0.0, 0.0
    fwd, bwd, kf, kb = rank_merge_bytes(job, layout, B, layout.cp - 1)
    bw, launch = hw.stream_bandwidth, hw.kernel_launch_s
    return fwd / bw + kf * launch, bwd / bw + kb * launch
