"""Memory per device: model states under tp, pp and ZeRO; a pipeline rank's activations on the real schedule.

The activation formulas (per block, recomputation, between B and W, per chunk) are in planner/activations.py,
re-exported here; this module adds model states, buffers and the per-device sum. A rank's activations are the
peak over its schedule of what its (virtual stage, micro-batch) pairs occupy (planner/pipeline.py walks the
runtime's own action lists: which pairs are between F and B, which between B and W), weighted per chunk, so
uneven chunks, the embedding and head chunks and a V placement (zbv: stage 0 and the last on rank 0) count
what each pair really holds. A recomputation's rebuild in backward runs after that micro-batch's head
backward has already freed the head.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

from large_model_training.choices import bf16_compute, splits_backward
from large_model_training.config import ModelConfig
from large_model_training.layout import Job, Layout
from large_model_training.models.float8 import bf16_blocks
from large_model_training.models.flops import (
    attention_norm_parameters,
    attention_parameters,
    block_parameters,
    mean_mlp_parameters,
    mtp_extra_parameters,
)
from large_model_training.parallel.grad_buffer import IN_FLIGHT
from large_model_training.parallel.tensor import padded_vocab
from large_model_training.planner import moe

# Re-exported ("as" marks it for ruff and mypy): tests and benches read the activation formulas as memory.*,
# beside the model states.
from large_model_training.planner.activations import (
    ChunkActivations,
    LayerActivations as LayerActivations,
    activation_bytes_per_layer as activation_bytes_per_layer,
    block_input_bytes,
    chunk_activations,
    embedding_activation_bytes as embedding_activation_bytes,
    float8_input_saving,
    head_activation_bytes as head_activation_bytes,
    head_pending_bytes as head_pending_bytes,
    layer_activation_terms as layer_activation_terms,
    loss_transient_bytes,
    recompute_transient_bytes as recompute_transient_bytes,
    stage_activation_bytes as stage_activation_bytes,
    weight_pending_bytes_per_layer as weight_pending_bytes_per_layer,
)
from large_model_training.planner.context import held_extra_per_layer, local_tokens, transient_bytes
from large_model_training.planner.pipeline import Occupancy
from large_model_training.planner.shapes import kv_weight_heads_per_rank
from large_model_training.planner.sync import outer_state_bytes

DEFAULT_BUCKET_BYTES = 25 * 1024**2
"""Gradient bucket of the dp engine (PyTorch DDP's default bucket_cap_mb of 25); two are in flight."""


# ---- model states -------------------------------------------------------------------------------------------


def block_parameters_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Parameters of one block held by one tp rank (norms replicated; kv weights replicated when k < tp). The
    attention is a*d wide (d = head_dim, which need not be h / a)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q = cfg.n_heads // tp
    kv = kv_weight_heads_per_rank(cfg, tp)
    mlp = mean_mlp_parameters(cfg) // tp  # MoE: every expert's parameters (total, not active)
    if cfg.attention == "mla":  # the down-projections replicated, the rest split by heads
        down = cfg.hidden_size * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return down + (attention_parameters(cfg) - down) // tp + mlp + block_norm_parameters(cfg)
    return h * q * d + 2 * h * kv * d + q * d * h + mlp + block_norm_parameters(cfg)


def block_norm_parameters(cfg: ModelConfig) -> int:
    """A block's norm weights (and biases), replicated over tp: the block's parameters that are not linear."""
    return 2 * cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1) + attention_norm_parameters(cfg)


def gathered_block_bytes(cfg: ModelConfig, tp: int, param_bytes: int, float8: bool) -> float:
    """One block's weights as ZeRO-3 all-gathers them: at `param_bytes`, or with its linear weights in float8
    (fp8 tensorwise, parallel/fsdp_float8.py), the norms still at `param_bytes`."""
    norms = block_norm_parameters(cfg)
    return (block_parameters_per_rank(cfg, tp) - norms) * (1 if float8 else param_bytes) + norms * param_bytes


def stage_parameters(cfg: ModelConfig, tp: int, layers: int, first: bool, last: bool) -> int:
    """Parameters one tp rank of a pipeline stage holds: its blocks, plus embedding and/or head.

    The vocabulary is padded to a multiple of tp. With tied embeddings and pp > 1 the last stage keeps its
    own copy of the embedding matrix as the head (kept in sync by an all-reduce of their gradients).
    """
    h = cfg.hidden_size
    vocab_rank = padded_vocab(cfg.vocab_size, tp) // tp * h
    out = layers * block_parameters_per_rank(cfg, tp)
    if first:
        out += vocab_rank + (cfg.max_seq_len * h if cfg.position == "learned" else 0)
    if last:
        out += h * (2 if cfg.norm == "layernorm" else 1)
        out += cfg.mtp_depth * (block_parameters_per_rank(cfg, tp) + mtp_extra_parameters(cfg))  # beside the head
        if not (cfg.tie_embeddings and first):
            out += vocab_rank
        if cfg.mtp_depth and not first and not cfg.tie_embeddings:  # the prediction modules' embedding copy
            out += vocab_rank
    return out


def rank_parameters(cfg: ModelConfig, tp: int, ep: int, chunks: list[int], stages) -> tuple[int, int]:
    """(dense, expert) parameters one device of a pipeline rank running virtual stages `stages` holds, summed per
    chunk. Expert: its E/ep routed experts of each MoE block (planner/moe.py), reduced and ZeRO-sharded over
    edp; dense: everything else (an MoE block's router and shared experts included), over dp x cp."""
    final = len(chunks) - 1
    if not cfg.moe_experts:
        return sum(stage_parameters(cfg, tp, chunks[j], j == 0, j == final) for j in stages), 0
    dense_cfg, counts = moe.dense_view(cfg), moe.chunk_moe_layers(cfg, chunks)
    counts[final] += sum(cfg.is_moe_layer(cfg.n_layers + k) for k in range(cfg.mtp_depth))  # prediction blocks
    swap = moe.replicated_parameters(cfg) - mean_mlp_parameters(dense_cfg) // tp  # an MoE block's MLP, less dense
    dense = sum(stage_parameters(dense_cfg, tp, chunks[j], j == 0, j == final) + counts[j] * swap for j in stages)
    return dense, sum(counts[j] for j in stages) * moe.expert_parameters(cfg, ep)


def muon_matrix_parameters(cfg: ModelConfig, tp: int, chunks: list[int], stages) -> int:
    """Of a rank's dense parameters (`rank_parameters`), the matrices Muon orthogonalises (parallel/muon.py): every
    block's 2-D weights (an MoE block's router and shared experts too, not its 3-D expert stacks), and each MTP
    module's block and projection; not the norms, embeddings or head, which AdamW updates."""
    dense_cfg, final = moe.dense_view(cfg), len(chunks) - 1
    per_block = block_parameters_per_rank(dense_cfg, tp) - block_norm_parameters(dense_cfg)
    out = sum(chunks[j] for j in stages) * per_block
    if final in stages:
        out += cfg.mtp_depth * (per_block + 2 * cfg.hidden_size * cfg.hidden_size)
    if cfg.moe_experts:
        swap = moe.replicated_parameters(cfg) - mean_mlp_parameters(dense_cfg) // tp
        out += sum(moe.chunk_moe_layers(cfg, chunks)[j] for j in stages) * swap
    return out


def muon_state_difference(matrices: int, zero: int, dp: int, optimizer_states: str = "fp32") -> float:
    """Muon's optimizer bytes less AdamW's for `matrices` parameters: no Adam moments for them, one fp32 momentum
    per element instead, held by the matrix's owner rank (spread over dp at every ZeRO stage)."""
    moments = 8 if optimizer_states == "fp32" else 4
    return matrices * (4 / dp - moments / (dp if zero >= 1 else 1))


def state_bytes_per_parameter(
    precision: str, grad_reduce_fp32: bool = False, optimizer_states: str = "fp32"
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter for our AdamW.

    fp32: 4 + 4 + 8 (Adam m and v). bf16 mixed precision: 2 (bf16 weights) + 2 or 4 (gradient, fp32 when
    reduced in fp32) + 12 (fp32 master weights, m, v). bf16 optimizer states: m and v 2 bytes each (12 -> 8);
    bf16_sr: no fp32 master either, the bf16 parameters are stochastically rounded (12 -> 4).
    """
    moments = 8 if optimizer_states == "fp32" else 4
    if precision == "fp32":
        return 4, 4, moments
    return 2, 4 if grad_reduce_fp32 else 2, (0 if optimizer_states == "bf16_sr" else 4) + moments


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device (one tp rank of one pipeline stage)."""

    stage: int
    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    buffers: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    def to_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}


def model_state_bytes(
    params: int, precision: str, zero: int, dp: int, grad_reduce_fp32: bool = False, optimizer_states: str = "fp32"
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes of `params` parameters under a ZeRO stage over dp.

    Stage 1 shards the optimizer states over dp, 2 also the gradients, 3 also the parameters. Under stage 3
    (FSDP2) the sharded parameter is the fp32 master and its gradient takes its dtype, whatever the compute and
    reduce dtypes: 4 + 4 + the moments (the same total as bf16's 2 + 2 + 12, more than 2 + 4 + 12).
    """
    p, g, o = state_bytes_per_parameter(precision, grad_reduce_fp32, optimizer_states)
    if zero >= 3:
        p, g, o = 4, 4, state_bytes_per_parameter("fp32", optimizer_states=optimizer_states)[2]
    return (
        params * p / (dp if zero >= 3 else 1),
        params * g / (dp if zero >= 2 else 1),
        params * o / (dp if zero >= 1 else 1),
    )


def mlp_backward_bytes(cfg: ModelConfig, tokens: int, tp: int, dtype_bytes: int) -> float:
    """The gradients a block's backward has in flight at once beside what the blocks hold (not saved tensors, so
    counted with the buffers), at its widest: the SwiGLU MLP's d(product) and from it d(gate) and d(up), each
    ffn/tp wide (the rehearsed peak of a first stage: `tests/test_rehearse.py`)."""
    return 3 * tokens * (cfg.ffn_hidden_size // tp) * dtype_bytes


def chunk_bf16_blocks(job: Job, chunks: list[int]) -> list[int]:
    """Per virtual stage (chunks: blocks per virtual stage, in model order), its dense blocks that fp8 leaves in
    bf16 (`--train.fp8_bf16_first_last`; an MoE block among them is priced as the fp8 one)."""
    cfg = job.model
    if job.precision != "fp8" or not job.fp8_bf16_first_last:  # the search's common case: nothing to count
        return [0] * len(chunks)
    ends = bf16_blocks(cfg.n_layers, job.fp8_bf16_first_last)
    starts = [0, *itertools.accumulate(chunks)]
    return [sum(i in ends and not cfg.is_moe_layer(i) for i in range(a, a + c)) for a, c in zip(starts, chunks)]


def float8_saving(job: Job, layout: Layout, dtype_bytes: int, blocks: int, moe_blocks: int) -> float:
    """What fp8 tensorwise's float8-kept linear inputs save on `blocks` blocks (`moe_blocks` of them MoE) of
    one micro-batch: while held, and from B to W under a split backward (W reads the same inputs); full
    recompute holds block inputs only (its rebuilt block's saving is not counted)."""
    if not job.fp8_tensorwise or layout.recompute.kind not in ("none", "selective"):
        return 0.0
    args = (
        job.model,
        local_tokens(job, layout),
        layout.micro_batch_size,
        layout.tp,
        layout.sequence_parallel,
        dtype_bytes,
    )
    return (blocks - moe_blocks) * float8_input_saving(*args) + moe_blocks * float8_input_saving(*args, True)


def rank_activation_bytes(
    job: Job, layout: Layout, chunks: list[int], occupancy: Occupancy, fused_kernels: bool = True
) -> float:
    """Peak activation bytes of the pipeline rank whose schedule `occupancy` walked (its `stages` are the
    chunks it runs); chunks: blocks per virtual stage (all of the model's). Under cp every term is that of the
    s/cp local tokens, plus what the all-gather variant saves (planner/context.py); what cp's attention has in
    flight is a buffer (`stage_memory`), as the pipeline's send/receive tensors are."""
    cfg, t, sp = job.model, layout.tp, layout.sequence_parallel
    B = 2 if bf16_compute(job.precision) else 4
    final, split = len(chunks) - 1, splits_backward(layout.schedule)
    extra = held_extra_per_layer(job, layout, B)
    kinds: dict[tuple[int, bool, bool, int, int], ChunkActivations] = {}  # chunks of one size share their bytes
    counts = moe.chunk_moe_layers(cfg, chunks) if cfg.moe_experts else [0] * len(chunks)  # MoE blocks per chunk
    in_bf16 = chunk_bf16_blocks(job, chunks)  # fp8's bf16 first/last blocks: no float8-kept inputs
    dense_cfg = moe.dense_view(cfg)
    for key in {(chunks[j], j == 0, j == final, counts[j], in_bf16[j]) for j in occupancy.stages}:
        one = chunk_activations(
            dense_cfg,
            local_tokens(job, layout),
            layout.micro_batch_size,
            t,
            sp,
            layout.recompute,
            B,
            *key[:3],
            split,
            fused_kernels,
            job.flash_attention,
            job.fused_loss,
        )
        more = moe.chunk_delta(job, layout, key[3], B, split)  # its MoE blocks' MLPs in place of dense ones
        less = float8_saving(job, layout, B, blocks=key[0] - key[4], moe_blocks=key[3])  # inputs kept as float8
        held = one.held + key[0] * extra + more.held - less
        in_backward = one.in_backward + key[0] * extra + more.in_backward - less
        if key[2] and cfg.mtp_depth:  # the prediction modules' saves: held until the chunk's B, whose first part
            held += mtp_activation_bytes(job, layout, B, fused_kernels)  # (their backward) frees them
            in_backward = max(held, in_backward)
        kinds[key] = ChunkActivations(held, one.pending + more.pending - (less if split else 0.0), in_backward)
    return occupancy.peak([kinds[(chunks[j], j == 0, j == final, counts[j], in_bf16[j])] for j in occupancy.stages])


def mtp_activation_bytes(job: Job, layout: Layout, dtype_bytes: int, fused_kernels: bool = True) -> float:
    """The prediction modules' saves on the last stage, one micro-batch (models/transformer.py): each depth's block
    whole (no recompute policy reaches it: it is not among the chunk's blocks), the embedded tokens its norm
    keeps, the 2h-wide input of its projection, and its own head's saves."""
    cfg, t, sp, B = job.model, layout.tp, layout.sequence_parallel, dtype_bytes
    if not cfg.mtp_depth:
        return 0.0
    s, b = local_tokens(job, layout), layout.micro_batch_size
    dense_cfg, r = moe.dense_view(cfg), (t if sp else 1)
    per = layer_activation_terms(dense_cfg, s, b, t, sp, B, fused_kernels, job.flash_attention).total
    per += 3 * s * b * cfg.hidden_size * B / r  # the embedded tokens (its norm's input) and the 2h-wide proj input
    per += head_activation_bytes(cfg, s, b, t, sp, B, fused_kernels, job.fused_loss)
    out = 0.0
    for k in range(cfg.mtp_depth):
        out += per
        if cfg.is_moe_layer(cfg.n_layers + k):  # its MLP routed: the MoE terms in place of the dense ones
            out += moe.moe_mlp_activation_bytes(cfg, moe.routed_tokens(job, layout), B)
            out -= moe.dense_mlp_activation_bytes(cfg, s * b, t, B)
    return out


def stage_memory(
    job: Job,
    layout: Layout,
    rank: int,
    chunks: list[int],
    occupancy: Occupancy,
    fused_kernels: bool = True,
    activations: float | None = None,
) -> MemoryBreakdown:
    """Memory of one device of pipeline rank `rank`. chunks: blocks per virtual stage (all of the model's);
    occupancy: the walk of this rank's schedule (planner/pipeline.py), whose `stages` are the chunks it runs;
    activations: `rank_activation_bytes`, when the caller has it already (it does not depend on ZeRO)."""
    cfg, t, sp = job.model, layout.tp, layout.sequence_parallel
    s, b, d = local_tokens(job, layout), layout.micro_batch_size, layout.dp * layout.cp  # ZeRO shards over dp x cp
    B = 2 if bf16_compute(job.precision) else 4
    # Summed per chunk: each chunk is its own module, so a tied head on the embedding's rank (zbv) is a copy.
    dense, experts = rank_parameters(cfg, t, layout.ep, chunks, occupancy.stages)
    params = dense + experts
    p_bytes, g_bytes, o_bytes = model_state_bytes(
        dense, job.precision, layout.zero, d, job.grad_reduce_fp32, job.optimizer_states
    )
    if experts:  # expert states sharded over the expert-data-parallel group (dp / ep x cp)
        more = model_state_bytes(
            experts, job.precision, layout.zero, moe.expert_group(layout), job.grad_reduce_fp32, job.optimizer_states
        )
        p_bytes, g_bytes, o_bytes = p_bytes + more[0], g_bytes + more[1], o_bytes + more[2]
    if job.optimizer == "muon":  # the blocks' matrices: Muon's momentum instead of Adam's moments
        matrices = muon_matrix_parameters(cfg, t, chunks, occupancy.stages)
        o_bytes += muon_state_difference(matrices, layout.zero, d, job.optimizer_states)
    o_bytes += outer_state_bytes(params, job.sync, d)  # --sync local/streaming: anchor, momentum (planner/sync.py)
    if activations is None:
        activations = rank_activation_bytes(job, layout, chunks, occupancy, fused_kernels)
    # Buffers: pipeline send/receive of activations and gradients; cp attention's; the loss's; under ZeRO 2-3 two
    # dp buckets in flight; ZeRO-3's gathered weights of the current and the prefetched block and one block's full
    # gradient; error feedback.
    per_param, per_grad, _ = state_bytes_per_parameter(job.precision, job.grad_reduce_fp32)
    # An end rank (its one chunk the first or the last) sends on one side and receives on the other: 2 buffers
    ends = len(occupancy.stages) == 1 and occupancy.stages[0] in (0, len(chunks) - 1)
    buffers = (2 if ends else 4) * block_input_bytes(cfg, s, b, t, sp, B) if layout.pp > 1 else 0.0
    buffers += transient_bytes(job, layout, B)  # cp: K/V blocks, fp32 dK/dV, dQ (ring); dK/dV (allgather)
    buffers += moe.transient_bytes(job, layout, B)  # ep: a dispatch's send buffer
    # A block backward's gradients in flight, or (last stage) the loss's temporaries over the logits or one fused
    # chunk's: the loss runs before the blocks' backward and frees its own, so the larger of the two
    working = mlp_backward_bytes(cfg, s * b, t, B) if any(chunks[j] for j in occupancy.stages) else 0.0
    loss = loss_transient_bytes(cfg, s, b, t, B, job.fused_loss, fused_kernels)
    buffers += max(working, loss if len(chunks) - 1 in occupancy.stages else 0.0)
    # ZeRO 0-1 reduce each bucket in place, in the gradient buffer (as Megatron's); ZeRO-3 (FSDP2) reduce-scatters
    # a block's unsharded gradient (below). ZeRO-2: a bucket's full buffer filling and the previous one reducing
    # (grad_buffer.py's IN_FLIGHT); a backward starts with none reducing, so one bucket holds only the one filling
    if d > 1 and layout.zero == 2:
        buckets = math.ceil(params * per_grad / DEFAULT_BUCKET_BYTES)
        buffers += min(IN_FLIGHT, buckets) * min(DEFAULT_BUCKET_BYTES, params * per_grad)
    if layout.zero == 3 and d > 1:
        block = block_parameters_per_rank(cfg, t)
        float8 = job.fp8_tensorwise and not job.fp8_bf16_first_last  # bf16 end blocks gather the larger
        gathered = gathered_block_bytes(cfg, t, per_param, float8)
        if cfg.moe_experts:  # the largest block gathers its dense part and this ep rank's E/ep experts (bf16)
            dense_cfg = moe.dense_view(cfg)
            block = block_parameters_per_rank(dense_cfg, t) - mean_mlp_parameters(dense_cfg) // t
            block += moe.replicated_parameters(cfg) + moe.expert_parameters(cfg, layout.ep)
            gathered = block * per_param
        # A block's unsharded gradient is whole as its backward ends, when the MLP's gradients in flight
        # (`working`) are gone: the larger of the two, not both
        unsharded = max(0.0, block * per_grad - working)
        buffers += 2 * gathered + unsharded
        if job.fsdp_sync_per_step:  # FSDP2 accumulates this rank's chunks' unsharded gradients until the last
            buffers += params * per_grad * (d - 1) / d
    if job.compression.kind != "none" and d > 1:
        buffers += params * 4  # fp32 error-feedback residual of every gradient element this rank reduces
        if job.compression.two_stage:
            buffers += params * 4 / d  # the server residual of the shard this rank serves
    if job.compression_target == "update" and d > 1:
        buffers += params * 4  # every bucket's fp32 AdamW update, in flight together in the engine's step
    return MemoryBreakdown(rank, p_bytes, g_bytes, o_bytes, activations, buffers)


def total_parameters(cfg: ModelConfig) -> int:
    """All parameters of the model (for lower bounds on devices)."""
    return cfg.n_layers * block_parameters(cfg) + stage_parameters(cfg, 1, 0, True, True)


def rank_layers(chunks: list[int], stages: list[int] | tuple[int, ...]) -> int:
    """Blocks a pipeline rank runs: the sum over its virtual stages."""
    return sum(chunks[j] for j in stages)
