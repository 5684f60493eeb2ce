"""Step time of one layout: compute from GEMM shapes, collectives by the alpha-beta model, the pipeline bubble
from the schedule simulator, and what the data-parallel reduction leaves exposed.

Compute. Each GEMM (M x K by K x N) takes max(2MNK / (peak x e(M, N, K)), bytes / memory bandwidth) plus the
entry's kernel launch cost: e is the efficiency curve by shape (planner/kernel_time.py: the entry's large-GEMM
efficiency x the wave quantisation of 128 x 256 output tiles x a ramp in K, or a measured table), the second
term the memory roofline of skinny GEMMs. On a calibrated CPU
entry e is what a real training step achieves against the microbenchmark rates (planner/calibrate.py).
Backward runs two GEMMs of the same sizes per forward GEMM. Attention cores run at the entry's attention
efficiency (forward and backward each where the entry has both; measured on the CPU) on the FLOPs a causal
flash kernel executes (backward 2.5x forward: it recomputes the scores). Norms, activations, residual adds, rope
and dropout are memory-bound: bytes moved / (memory bandwidth x the entry's memory efficiency). Recomputation
adds the forward again (full, every:K) or the attention core (selective) to the backward.

Communication (alpha-beta as NCCL's tuner models it, planner/nccl.py: per protocol a base latency, one per
  ring step, 2(n-1)/n bytes per all-reduce over the bus bandwidth NCCL reaches, half for all-gather and
  reduce-scatter; NVLS all-reduces on H100/H200 nodes; the line rate for entries without NCCL). A group uses
  the intra-node link when its ranks fit in one node (tp innermost, then cp, dp, pp), else the inter-node link.
  cp: every per-token term runs on the s/cp local tokens and attention on 1/cp of the causal work (zig-zag);
    the ring's K/V transfers show only where they outlast a block's attention, the all-gather variant's
    collectives wholly (planner/context.py), and the ring's fp32 merges of its partial outputs on the rank
    that paces it (planner/ring_merge.py). Gradients are reduced, and ZeRO shards kept, over dp x cp.
  tp: 2 all-reduces of n h B forward and 2 backward per block (SP: all-gather + reduce-scatter pairs, same
    volume), plus the embedding, head and loss collectives; not overlapped. Lean SP adds one all-gather of
    n h B per region in backward (q/k/v, gate/up, the head: the kept shards gathered again for the weight
    gradients), posted before the region's first input-gradient GEMM and exposed only where it outlasts it.
  zero-bubble kinds split the backward: W is one GEMM of each linear's two backward GEMMs (the weight
    gradient; the head's too) plus the regathers, which W waits for; B is the rest (input gradients, norms,
    attention core, embedding, recomputation).
  the fused loss (job.fused_loss, the default): the head's three GEMMs, its softmax passes and 2 all-reduces
    per chunk run in F; B scales the two gradients it kept; nothing for W.
  pp: one p2p of the stage output per micro-batch and boundary, given to the simulator.
  dp: ZeRO 0 all-reduces the gradients after the last backward; it overlaps with that backward (buckets
    leave as they fill), and the last bucket is always exposed. ZeRO 1 reduce-scatters instead, then
    all-gathers the updated parameters (exposed). ZeRO 2 reduce-scatters in every micro-batch's backward
    (to keep only the shard), overlapped per block; ZeRO 3 also all-gathers each block's weights before its
    forward and backward, prefetched one block ahead. Compression replaces the gradient volume by its wire
    format's (issue 7: int8, int4 and top-k all-gather every rank's message, so they cost more than the dense
    fp32 all-reduce past dp = 8, 16 and 1 / ratio; `int8:two-stage` / `int4:two-stage` move what a ring
    all-reduce of the quantised size does at any dp; random-k and PowerSGD all-reduce; threshold's data-dependent
    volume counts as dense); compressing AdamW's update instead (`compression_target = update`) moves the same
    volume after backward, wholly exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from large_model_training.choices import Precision, bf16_compute, splits_backward
from large_model_training.layout import Job, Layout
from large_model_training.models.flops import (
    attention_core_flops,
    block_gemm_shapes,
    recompute_flops_per_token,
    training_flops_per_token,
)
from large_model_training.models.fused_loss import chunk_tokens
from large_model_training.parallel.tensor import padded_vocab
from large_model_training.planner import moe
from large_model_training.planner.comm import tp_gradient_sync_bytes
from large_model_training.planner.context import attention_comm, attention_work
from large_model_training.planner.eager_ops import block_elementwise, host_bound, loss_elementwise
from large_model_training.planner.hardware import Hardware
from large_model_training.planner.kernel_time import gemm_efficiency
from large_model_training.planner.memory import (
    DEFAULT_BUCKET_BYTES,
    block_parameters_per_rank,
    chunk_bf16_blocks,
    gathered_block_bytes,
    rank_parameters,
    stage_parameters,
    state_bytes_per_parameter,
)
from large_model_training.planner.nccl import collective_time, link
from large_model_training.planner.optimizer_step import optimizer_time
from large_model_training.planner.overlap import overlapped, sm_share
from large_model_training.planner.pipeline import rank_stage_list
from large_model_training.planner.recompute_sac import sac_recompute_time
from large_model_training.planner.ring_merge import ring_merge_time
from large_model_training.planner.shapes import kv_heads_per_rank
from large_model_training.planner.sync import outer_exposed_time


def sixteen(precision: str) -> str:
    """The precision of what fp8 leaves in bf16 (attention, the head, routed experts); others unchanged."""
    return "bf16" if precision == "fp8" else precision


def fp8_cast_bytes(
    shapes: list[tuple[int, int, int]], precisions: list[str], B: int, weight_grad_hp: bool = False
) -> tuple[float, float]:
    """Bytes the float8 casts of one block move, forward and backward (models/float8.py): each operand is read
    twice (its amax, then the scaled cast) and written as 1 byte; forward casts x and W, backward dY and W for
    dX and, unless the weight gradient runs in bf16 (`weight_grad_hp`), dY again and x for dW (high precision is
    what forward saves)."""
    per = 2 * B + 1
    fwd = sum((m * k + n * k) * per for (m, n, k), p in zip(shapes, precisions) if p == "fp8")
    dw = 0 if weight_grad_hp else 1
    bwd = sum(((1 + dw) * m * n + n * k + dw * m * k) * per for (m, n, k), p in zip(shapes, precisions) if p == "fp8")
    return float(fwd), float(bwd)


def gemm_time(hw: Hardware, precision: str, m: int, n: int, k: int, weights: int = 1) -> float:
    """Seconds for one (m x k) @ (k x n) GEMM (see the module docstring); weights > 1: a grouped GEMM whose m rows
    are split over that many (k x n) weights (MoE experts), read once each."""
    peak = hw.gemm_peak(precision)
    compute = 2.0 * m * n * k / (peak * gemm_efficiency(hw, precision, m, n, k, peak))
    B = 2 if bf16_compute(precision) else 4
    memory = B * (m * k + weights * k * n + m * n) / hw.stream_bandwidth
    return max(compute, memory) + hw.kernel_launch_s


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    makespan_s: float
    bubble_fraction: float
    dp_exposed_s: float
    optimizer_s: float
    forward_s: float
    """Forward of one micro-batch through the slowest virtual stage."""
    backward_s: float
    tokens_per_s: float
    tflops_per_device: float
    """Model FLOPs (no recomputation) per second per device, / 1e12."""
    hardware_tflops_per_device: float
    """FLOPs executed including recomputation (Megatron 2021's 'achieved teraFLOP/s'), / 1e12."""
    mfu: float


@dataclass(frozen=True)
class StageTimes:
    """Per virtual stage forward, backward and weight-gradient seconds of one micro-batch, and the p2p time of
    a boundary. `weight` is zero unless the schedule splits its backward; then `backward` is B only."""

    forward: list[float]
    backward: list[float]
    p2p: float
    weight: list[float]
    fsdp_tail: list[float] | None = None
    """ZeRO-3, per virtual stage: what its last backward adds once per step (the once-per-step reduce-scatter
    where it outlasts the backward; the last block's and the chunk's own group's reduce-scatter, exposed)."""


@dataclass(frozen=True)
class BlockTimes:
    """One block, one micro-batch: forward; backward (B only when split) with recomputation; W (split only);
    the tp all-reduce-equivalent of one activation; the lean-SP all-gather of one region's input."""

    forward: float
    backward: float
    weight: float
    tp_one: float
    regather: float


def _block_times(job: Job, layout: Layout, hw: Hardware, devices_per_node: int) -> BlockTimes:
    """The times of one block (see BlockTimes)."""
    cfg, t, sp = job.model, layout.tp, layout.sequence_parallel
    prec, B = job.precision, (2 if bf16_compute(job.precision) else 4)
    s, b, cp = job.seq_len, layout.micro_batch_size, layout.cp
    n, h = s // cp * b, cfg.hidden_size  # the local tokens: cp divides every per-token term
    r = t if sp else 1
    shapes = block_gemm_shapes(cfg, n, t, kv_heads_per_rank(cfg, t))
    # fp8: the block linears in float8, except an MoE block's MLP (its routed experts' grouped GEMMs stay bf16)
    attention_gemms = len(shapes) - 2  # the MLP's two come last
    linear_prec = [prec if i < attention_gemms or not cfg.moe_experts else sixteen(prec) for i in range(len(shapes))]
    each = [gemm_time(hw, p, *shape) for p, shape in zip(linear_prec, shapes)]
    gemms = sum(each)
    hp = job.fp8_weight_grad_hp  # rowwise_with_gw_hp: the weight gradients' GEMMs in bf16
    w_gemms = sum(gemm_time(hw, sixteen(p), *shape) for p, shape in zip(linear_prec, shapes)) if hp else gemms
    a_r, k_r, f_r = cfg.n_heads // t, kv_heads_per_rank(cfg, t), cfg.ffn_hidden_size // t
    if job.flash_attention:
        # zig-zag gives each cp rank 1/cp of the causal work
        work = attention_core_flops(cfg, s, b, t) / cp * attention_work(layout)
        attn = work / (hw.peak(prec) * hw.attention_fraction)
        attn_b = 2.5 * work / (hw.peak(prec) * hw.attention_backward_fraction) + hw.kernel_launch_s
        attn += hw.kernel_launch_s
    else:  # batched QK^T and AV over the full square, and the scores written, softmaxed, dropped out in memory
        heads, p16 = b * a_r, sixteen(prec)  # one batched GEMM each: its tiles in waves over every head's
        attn = gemm_time(hw, p16, heads * s, s, cfg.head_dim, heads) + gemm_time(
            hw, p16, heads * s, cfg.head_dim, s, heads
        )
        attn += 5 * heads * s * s * B / hw.stream_bandwidth
        attn /= cp
        attn_b = 2.5 * attn
    # cp's K/V traffic: the ring's transfers only where they outlast a block's attention; the all-gather's whole
    cp_f, cp_b = attention_comm(job, layout, attn, link(hw, t * cp, devices_per_node), collective_time)
    merge_f, merge_b = ring_merge_time(job, layout, hw, B)  # the ring's fp32 merges of its partial outputs
    cp_f, cp_b = cp_f + merge_f, cp_b + merge_b
    # norms, residual adds, dropout, rope, the MLP's activation, copies: op by op, and the host's ops (eager_ops)
    elem_f, elem_b, ops_f, ops_b = block_elementwise(cfg, n, r, B, (a_r, k_r, f_r), hw)
    cast_f, cast_b = fp8_cast_bytes(shapes, linear_prec, B, hp)
    bw, lat = link(hw, t, devices_per_node)
    # one all-reduce, or SP's all-gather + reduce-scatter pair (the same bytes; NVLS speeds only the all-reduce)
    pair = collective_time("all_gather", n * h * B, t, bw, lat) + collective_time(
        "reduce_scatter", n * h * B, t, bw, lat
    )
    tp_one = pair if sp else collective_time("all_reduce", n * h * B, t, bw, lat)
    # Lean SP: each region's column-parallel layers kept only their shard of the gathered input, so the weight
    # gradients gather it again, once per region (q/k/v, gate/up).
    regather = collective_time("all_gather", n * h * B, t, bw, lat) if sp else 0.0
    forward = gemms + attn + cp_f + elem_f + cast_f / hw.stream_bandwidth + 2 * tp_one
    backward = gemms + attn_b + cp_b + elem_b + cast_b / hw.stream_bandwidth + 2 * tp_one
    if splits_backward(layout.schedule):
        # W: the weight-gradient GEMMs; each region's gather is waited for by its first one (nothing to hide it).
        weight = w_gemms + 2 * regather
    else:
        # The gather is posted before the region's first input-gradient GEMM in backward (v's, up's: the last
        # projections of each region run backward first) and waited for by its weight gradient.
        weight = 0.0
        backward += w_gemms + max(0.0, regather - each[2]) + max(0.0, regather - each[-2])
    policy = layout.recompute.kind
    if policy in ("full", "every"):  # the host issues the rebuilt forward's ops again
        backward, ops_b = backward + forward, ops_b + ops_f
    elif policy in ("selective", "sac"):  # the rebuilt core or what sac does not keep; both run the ring again (cp)
        backward += (attn if policy == "selective" else sac_recompute_time(elem_f, each, tp_one)) + cp_f
    return BlockTimes(host_bound(forward, ops_f, hw), host_bound(backward, ops_b, hw), weight, tp_one, regather)


def stage_times(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, chunks: list[int]) -> StageTimes:
    """Forward/backward(/weight) seconds per virtual stage (blocks, plus embedding on the first, head on the
    last); chunks: blocks per virtual stage (layout.virtual_stage_layers)."""
    cfg, t, d, cp = job.model, layout.tp, layout.dp * layout.cp, layout.cp  # d: the gradient group, dp x cp
    prec, B = job.precision, (2 if bf16_compute(job.precision) else 4)
    n, h = job.seq_len // cp * layout.micro_batch_size, cfg.hidden_size
    dense_cfg = moe.dense_view(cfg)  # MoE blocks: the dense block, its MLP swapped below (planner/moe.py)
    blk = _block_times(replace(job, model=dense_cfg), layout, hw, devices_per_node)
    split = splits_backward(layout.schedule)
    # --train.fp8_bf16_first_last K: the first and last K blocks in bf16 (models/float8.py), priced as such
    e16 = chunk_bf16_blocks(job, chunks)
    blk16 = (
        _block_times(replace(job, model=dense_cfg, precision=Precision.BF16), layout, hw, devices_per_node)
        if any(e16)
        else blk
    )
    # ZeRO-3 gathers each block's weights (forward and backward) and ZeRO 2/3 reduce-scatter its gradients,
    # one block ahead of the compute: a block takes the longer of the two, the first gather is not hidden.
    # Split kinds reduce-scatter after W, gather before B (W reuses B's weights).
    p_bytes, g_bytes, _ = state_bytes_per_parameter(prec, job.grad_reduce_fp32)
    bw_dp, lat_dp = link(hw, t * d, devices_per_node)  # dp x cp spans t * cp * dp consecutive ranks
    block_params = block_parameters_per_rank(dense_cfg, t)
    scatter = collective_time("reduce_scatter", block_params * g_bytes, d, bw_dp, lat_dp) if layout.zero >= 2 else 0.0
    # FSDP2's own kernels on the compute stream: each gather's copy-out (the gathered flat buffer read and written
    # into the parameters) and, in backward, the reduce-scatter's copy-in (the gradients read, written in the
    # reduce dtype; with the sync deferred, their accumulation moves as much).
    fsdp_f = 2 * block_params * p_bytes / hw.stream_bandwidth if layout.zero == 3 and d > 1 else 0.0
    fsdp_b = fsdp_f + block_params * (B + g_bytes) / hw.stream_bandwidth if fsdp_f else 0.0
    alone = split or (layout.zero == 3 and job.fsdp_sync_per_step)  # no reduce-scatter beside it (W's; the tail's)

    def with_collectives(times: BlockTimes, float8_gather: bool) -> tuple[float, float, float, float, float]:
        """One block's forward, backward, W, backward beside its reduce-scatter, and its gather's seconds."""
        gathered = gathered_block_bytes(dense_cfg, t, p_bytes, float8_gather)
        gather = collective_time("all_gather", gathered, d, bw_dp, lat_dp) if layout.zero == 3 else 0.0
        f = overlapped(times.forward + fsdp_f, gather, hw)  # the collectives' SMs slow the compute beside them
        both = overlapped(times.backward + fsdp_b, gather + scatter, hw)  # fsdp_sync_per_step: in the tail only
        b = overlapped(times.backward + fsdp_b, gather, hw) if alone else both
        return f, b, overlapped(times.weight, scatter, hw) if split else 0.0, both, gather

    f_blk, b_blk, w_blk, both, gather = with_collectives(blk, job.fp8_tensorwise)
    f16, b16, w16, _, _ = with_collectives(blk16, False) if any(e16) else (f_blk, b_blk, w_blk, both, gather)
    vocab = padded_vocab(cfg.vocab_size, t) // t
    head_gemm = gemm_time(hw, sixteen(prec), n, vocab, h)  # the head stays bf16 under fp8
    tp_link = link(hw, t, devices_per_node)
    c = min(n, chunk_tokens(n, vocab, h)) if job.fused_loss else None
    loss_f, loss_b, loss_ops_f, loss_ops_b = loss_elementwise(hw, n, vocab, h, B, c)  # planner/eager_ops.py
    head_f = head_gemm + loss_f + 3 * collective_time("all_reduce", n * 4, t, *tp_link) + blk.tp_one
    head_b = head_gemm + loss_b + blk.tp_one
    head_w = head_gemm + blk.regather if split else 0.0
    if not split:
        head_b += head_gemm + max(0.0, blk.regather - head_gemm)
    if c:  # models/fused_loss.py: all three GEMMs and the per-chunk softmax in F; B scales two grads
        per_chunk = sum(collective_time("all_reduce", c * 4 * k, t, *tp_link) for k in (1, 2))  # max; sum, target
        head_f = 3 * head_gemm + loss_f + math.ceil(n / c) * per_chunk + blk.tp_one
        head_b, head_w = blk.tp_one + loss_b, 0.0
    head_f, head_b = host_bound(head_f, loss_ops_f, hw), host_bound(head_b, loss_ops_b, hw)
    embed_f = 2 * n * h * B / hw.stream_bandwidth + blk.tp_one
    embed_b = 2 * n * h * 4 / hw.stream_bandwidth
    last = len(chunks) - 1
    counts = moe.chunk_moe_layers(cfg, chunks) if cfg.moe_experts else [0] * len(chunks)
    f_moe = b_moe = w_moe = 0.0
    if any(counts):  # ZeRO-2: the dense part reduce-scattered over dp x cp, the experts over edp (no ZeRO-3)
        mb = moe.moe_block_times(job, layout, hw, devices_per_node, blk, gemm_time, blk.tp_one, blk.regather)
        dense_part = block_params - (3 if dense_cfg.mlp == "swiglu" else 2) * h * dense_cfg.ffn_hidden_size // t
        dense_part += moe.replicated_parameters(cfg)
        scatter_moe = 0.0
        if layout.zero >= 2:
            scatter_moe = collective_time("reduce_scatter", dense_part * g_bytes, d, bw_dp, lat_dp) + collective_time(
                "reduce_scatter",
                moe.expert_parameters(cfg, layout.ep) * g_bytes,
                moe.expert_group(layout),
                bw_dp,
                lat_dp,
            )
        f_moe = mb.forward
        b_moe = mb.backward if split else overlapped(mb.backward, scatter_moe, hw)
        w_moe = overlapped(mb.weight, scatter_moe, hw) if split else 0.0
    forward = [
        (c - m - e) * f_blk + e * f16 + m * f_moe + (gather if c else 0.0) for c, m, e in zip(chunks, counts, e16)
    ]
    backward = [
        (c - m - e) * b_blk + e * b16 + m * b_moe + (gather if c else 0.0) for c, m, e in zip(chunks, counts, e16)
    ]
    weight = [(c - m - e) * w_blk + e * w16 + m * w_moe for c, m, e in zip(chunks, counts, e16)]
    forward[0], backward[0] = forward[0] + embed_f, backward[0] + embed_b
    forward[last] += head_f
    backward[last] += head_b
    weight[last] += head_w
    tail = None
    if layout.zero == 3 and d > 1:
        # FSDP2 (parallel/fsdp.py): each chunk is also its own group (embedding; final norm and head), the root
        # of its forward: gathered before its first block, kept through backward, its gradients reduce-scattered
        # after the chunk's backward. The gather is exposed in every micro-batch; the last backward's
        # reduce-scatters (its block's and the group's) are exposed once per step.
        tail = []
        for j, c in enumerate(chunks):
            own = stage_parameters(cfg, t, 0, j == 0, j == last)
            forward[j] += collective_time("all_gather", own * p_bytes, d, bw_dp, lat_dp) if own else 0.0
            end = collective_time("reduce_scatter", ((block_params if c else 0) + own) * g_bytes, d, bw_dp, lat_dp)
            once = c * (both - b_blk) if job.fsdp_sync_per_step else 0.0
            tail.append(end + once)
    r = t if layout.sequence_parallel else 1
    p2p = collective_time("p2p", n * h * B / r, 2, *link(hw, t * d * layout.pp, devices_per_node))
    return StageTimes(forward, backward, p2p if layout.pp > 1 else 0.0, weight, tail)


def dp_gradient_time(job: Job, layout: Layout, hw: Hardware, params: int, devices_per_node: int) -> float:
    """Seconds to reduce `params` gradients over dp x cp once (ZeRO 0: all-reduce; 1: reduce-scatter), with
    the wire format of the compression if any."""
    d = layout.dp * layout.cp
    if d == 1:
        return 0.0
    bw, lat = link(hw, layout.tp * d, devices_per_node)
    _, g_bytes, _ = state_bytes_per_parameter(job.precision, job.grad_reduce_fp32)
    kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    c = job.compression
    if c.kind in ("none", "threshold"):  # threshold's volume depends on the data: counted as dense
        return collective_time(kind, params * g_bytes, d, bw, lat)
    if c.bits:
        quantized = params * (c.bits / 8 + 4 / c.chunk)  # payload + one fp32 scale per chunk (quantize.py)
        if c.two_stage:  # all-to-all of shards, then all-gather of the served ones: a ring all-reduce's volume
            return collective_time("all_reduce", quantized, d, bw, lat)
        return collective_time("all_gather", d * quantized, d, bw, lat)  # every rank's message gathered
    if c.kind == "topk":  # int32 index + value, every rank's message gathered
        return collective_time("all_gather", d * params * c.ratio * (4 + g_bytes), d, bw, lat)
    if c.kind == "randomk":  # the same seeded coordinates on every rank: an all-reduce of the values
        return collective_time("all_reduce", params * c.ratio * g_bytes, d, bw, lat)
    # powersgd: all-reduce of the P and Q factors (fp32) of every matrix; vectors are sent as they are.
    cfg, t = job.model, layout.tp
    h, hd = cfg.hidden_size, cfg.head_dim
    mats = [
        (h, cfg.n_heads // t * hd),
        (h, kv_heads_per_rank(cfg, t) * hd),
        (h, kv_heads_per_rank(cfg, t) * hd),
        (cfg.n_heads // t * hd, h),
    ] + [(h, cfg.ffn_hidden_size // t)] * (3 if cfg.mlp == "swiglu" else 2)
    factors = sum(rows + cols for rows, cols in mats) * c.rank * 4
    blocks = max(1, round(params / max(1, block_parameters_per_rank(cfg, t))))
    return collective_time("all_reduce", blocks * factors, d, bw, lat)


def step_time(
    job: Job,
    layout: Layout,
    hw: Hardware,
    makespan: float,
    bubble: float,
    times: StageTimes,
    devices_per_node: int,
    chunks: list[int],
) -> StepTime:
    """Assemble the step: pipeline makespan + exposed dp reduction + parameter all-gather + optimizer."""
    cfg, t, d, p = job.model, layout.tp, layout.dp * layout.cp, layout.pp  # d: the gradient group, dp x cp
    final = len(chunks) - 1
    stages0 = rank_stage_list(layout.schedule, p, layout.virtual_stages, 0)

    # (dense, expert) parameters of the first and the last pipeline rank; experts reduced and sharded over edp
    dense0, experts0 = rank_parameters(cfg, t, layout.ep, chunks, stages0)
    last = rank_parameters(cfg, t, layout.ep, chunks, rank_stage_list(layout.schedule, p, layout.virtual_stages, p - 1))
    params0 = dense0 + experts0
    dense_max, experts_max = max((dense0, experts0), last, key=sum)
    edp = moe.expert_group(layout)
    p_bytes, g_bytes, _ = state_bytes_per_parameter(job.precision, job.grad_reduce_fp32)
    bw, lat = link(hw, t * d, devices_per_node)
    moe_layers = moe.chunk_moe_layers(cfg, chunks) if cfg.moe_experts else None
    replicated0 = sum(moe_layers[j] for j in stages0) * moe.replicated_parameters(cfg) if moe_layers is not None else 0
    over_edp, over_tp = moe.expert_gradient_time(
        layout, hw, experts0, replicated0, g_bytes, devices_per_node, collective_time, link
    )
    exposed = over_tp  # the MoE parts each tp rank computed from its own tokens, summed over tp
    if layout.zero <= 1 and d > 1:
        reduce = dp_gradient_time(job, layout, hw, dense0, devices_per_node) + over_edp
        buckets = max(1, math.ceil(params0 * g_bytes / DEFAULT_BUCKET_BYTES))
        # The first stage's last backward (and W) runs while the buckets leave; gloo on busy CPU cores does not
        # overlap.
        hide = times.backward[0] + times.weight[0] if hw.fused_kernels else 0.0
        if job.compression_target == "update" or not job.grad_overlap:
            hide = 0.0  # the updates exist only after backward; or the framework reduces after it
        exposed = max(reduce - hide, reduce / buckets) + min(reduce, hide) * sm_share(hw)  # planner/overlap.py
    if job.sync.mode.infrequent:  # DiLoCo: an outer exchange every H steps replaces it (planner/sync.py)
        exposed = over_tp + outer_exposed_time(params0, d, job.sync, bw, lat, makespan)
    if times.fsdp_tail:  # ZeRO-3: the first rank's chunks end the step; its last backwards' reduce-scatters
        exposed += sum(times.fsdp_tail[j] for j in stages0)
    if layout.zero in (1, 2) and d > 1:
        exposed += collective_time("all_gather", dense_max * p_bytes, d, bw, lat)
        exposed += collective_time("all_gather", experts_max * p_bytes, edp, bw, lat) if experts_max else 0.0
    if cfg.tie_embeddings and p > 1 and final not in stages0:  # the copies' gradients summed over the pp ends
        vocab = padded_vocab(cfg.vocab_size, t) // t * cfg.hidden_size
        exposed += collective_time("all_reduce", vocab * g_bytes, 2, *link(hw, t * d * p, devices_per_node))
    if t > 1:  # gradients each tp rank holds only part of (SP norms, replicated kv weights), summed over tp
        synced = tp_gradient_sync_bytes(
            cfg, t, layout.sequence_parallel, g_bytes, layers=sum(chunks[j] for j in stages0), head=final in stages0
        )
        bw_tp, lat_tp = link(hw, t, devices_per_node)
        exposed += (2 * (t - 1) * lat_tp + synced / bw_tp) if synced else 0.0
    shard = dense_max / (d if layout.zero >= 1 else 1) + experts_max / (edp if layout.zero >= 1 else 1)
    # lmt's AdamW pass by pass, the clip norm, the publish, the zeroing and accumulation of the gradients
    # (planner/optimizer_step.py); one fused pass for a framework's fused AdamW and for the other update rules
    optimizer = optimizer_time(
        hw,
        shard,
        dense_max + experts_max,
        job.micro_batches(layout),
        (2 if bf16_compute(job.precision) else 4, g_bytes),
        job.optimizer_states,
        fsdp=layout.zero == 3,
        fused=job.fused_optimizer or job.optimizer != "adamw",
    )
    total = makespan + exposed + optimizer
    tokens = job.global_batch_size * job.seq_len
    devices = layout.devices
    model_flops = training_flops_per_token(cfg, job.seq_len) * tokens
    hw_flops = model_flops + recompute_flops_per_token(cfg, job.seq_len, layout.recompute.kind) * tokens
    achieved = model_flops / total / devices
    return StepTime(
        step_time_s=total,
        makespan_s=makespan,
        bubble_fraction=bubble,
        dp_exposed_s=exposed,
        optimizer_s=optimizer,
        forward_s=max(times.forward),
        backward_s=max(times.backward),
        tokens_per_s=tokens / total,
        tflops_per_device=achieved / 1e12,
        hardware_tflops_per_device=hw_flops / total / devices / 1e12,
        mfu=achieved / hw.peak(job.precision),
    )
