"""Activation bytes: what one block saves for backward, what recomputation rebuilds, what a zero-bubble stage keeps
between a backward's B and its W, and what one (chunk, micro-batch) of a pipeline stage occupies.

The one place these formulas live: `lmt estimate`, the planner's search and the tests that compare them with
measured bytes all call the functions here (planner/memory.py re-exports them).

## Activations of one block (bytes held for backward, one micro-batch, one tp rank)

Derived term by term the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4.1) derive sbh(34 + 5as/h) for GPT, but for OUR block (models/transformer.py):
pre-norm, rmsnorm|layernorm, rope, grouped-query attention through F.scaled_dot_product_attention,
swiglu|gelu, dropout on both residual branches. Notation: s sequence, b micro-batch, n = s*b tokens, h hidden,
a heads, k kv heads, d head dim (h/a unless model.attention_head_dim sets it: attention is a*d wide, not h),
f MLP width, B bytes of the activation dtype (2 bf16, 4 fp32), t tp degree, r = t with sequence parallelism
else 1. Per tp rank: a/t query heads, k_r kv heads (k/t, or 1 when k < t), f/t MLP width.

  norm_inputs     2 norms save their input: 2nhB/r. (+ statistics, 4n or 8n bytes each.) PyTorch's CPU
                  RMSNorm is composite: it saves an fp32 copy of the input and the fp32 normalised tensor,
                  2 x 4nh/r per norm; fused accelerator kernels save the input only. qk_norm adds the same
                  saves for the per-head RMSNorms of q and k: n (a/t + k_r) rows of d, whole sequence.
  linear_inputs   the input of the q/k/v projections and of the MLP's first projection: 2nhB/r. Without SP
                  it is replicated over tp (r = 1). Under SP it is the all-gathered sequence, of which our
                  column-parallel layers keep only this rank's shard (models/linear.py, "lean" SP as in
                  Megatron) and gather it again in backward for the weight gradient.
  qkv             SDPA saves q, k, v: n d (a/t + 2 k_r) B. Rope saves only its cos/sin tables (per position,
                  not per token) because its multiplications by constant tables need no activation.
  attention_out   SDPA's output, which is also the output projection's input (same storage): n (a/t) d B.
  softmax_stats   flash / memory-efficient kernels save the log-sum-exp, fp32: 4 n a/t; they never store the
                  s x s scores (they recompute them in backward) and replay dropout from the RNG state.
  attention_scores  only on the math path (PyTorch's CPU kernel with dropout > 0, which computes in fp32):
                  softmax output, dropout mask and dropped probabilities, 3 a/t s n x 4, plus its own fp32
                  copies of q, k, v with the kv heads repeated (3 n (a/t) d x 4, replacing `qkv`). This is
                  Korthikanti's 5as/h term.
  mlp             swiglu saves gate, silu(gate), up and their product: 4 n (f/t) B; gelu saves the
                  pre-activation and the activation: 2 n (f/t) B.
  dropout_masks   dropout > 0: two residual-branch masks, 2 n h / r, 1 byte (bool) on accelerators, B on
                  the CPU.

For GPT (layernorm, gelu, f = 4h, a = k, a d = h) in bf16 with dropout this is sbh(34 + 8a/h) bytes: Korthikanti's
34 (4 norms + 4 linear inputs + 6 qkv + 2 out + 16 MLP + 2 masks), with their 5as/h score term replaced by
the flash kernel's log-sum-exp. tp alone divides every term except norm_inputs, linear_inputs and masks (the
paper's 10 sbh); with SP every term is divided by t: sbh(34/t), the paper's sequence-parallel figure.

## Recompute policies (`memory/recompute.py`)

Two quantities: what a block holds between its forward and its backward (`activation_bytes_per_layer`) and
what a recomputation rebuilds in backward (`recompute_transient_bytes`); the rebuilt forward is the same code,
so under SP it too keeps only the shards of the gathered inputs.
  none       holds every term above.
  selective  the attention core is a checkpoint: its internals go (softmax_stats, attention_scores; on the
             CPU math path also its fp32 copies of q, k, v), q, k, v stay at B bytes as the checkpoint's
             inputs, its output stays as the output projection's input. When backward reaches a block's core
             the bytes saved after it (MLP, its norm and input, masks, attention output) are already freed and
             the core's internals are rebuilt: flash path the log-sum-exp and a new output, n (a/t)(d B + 4),
             CPU math path the fp32 q, k, v and 3 s x s tensors; that transient adds to the peak only where it
             exceeds what was freed.
  full       holds only the block input, n h B / r. In backward the block is rebuilt whole: one block's set,
             less the input itself when the first norm saves that very storage (layernorm; rmsnorm in fp32 or
             fused), because that one is the kept input.
  every:K    holds one input per segment of K blocks; segments start at each chunk's first block, so a chunk
             of L blocks holds ceil(L / K) inputs. In backward segment j (0-based) is rebuilt while the inputs
             of segments 0..j are held.

## Between B and W (zero-bubble schedules)

A split backward's B computes input gradients and frees every saved tensor but what the held weight-gradient
GEMMs need (models/linear.py): each linear's input (the shard under SP) and its output gradient. Per block:
inputs 2nhB/r (q/k/v and gate/up share one each) + n (a/t) d B (wo) + n (f/t) B (w_down); output gradients
n d (a/t + 2 k_r) B (q, k, v) + 2 n h B / r (wo and w_down: the gradient of a row-parallel output is the whole
sequence, all-gathered under SP, so it is kept as this rank's shard and gathered again in W, like the inputs)
+ 2 or 1 n (f/t) B (gate and up, or up). The head keeps its input and the logits' gradient (nothing with the
fused loss: its weight gradient is complete in B). This can exceed
what the block held before B (swiglu's two f-wide gradients), so the planner counts both sets on the real
schedule (`ChunkActivations`). tests/test_zero_bubble.py measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from large_model_training.choices import RecomputePolicy
from large_model_training.config import ModelConfig
from large_model_training.planner.head_activations import (
    embedding_activation_bytes as embedding_activation_bytes,
    fused_loss_transient_bytes as fused_loss_transient_bytes,
    head_activation_bytes as head_activation_bytes,
    head_pending_bytes as head_pending_bytes,
    loss_transient_bytes as loss_transient_bytes,
)
from large_model_training.planner.recompute_sac import sac_held_bytes, sac_transient_bytes
from large_model_training.planner.shapes import kv_heads_per_rank


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one block saves for backward, one micro-batch, one tp rank, by term (see the module docstring)."""

    norm_inputs: float
    linear_inputs: float
    qkv: float
    attention_out: float
    softmax_stats: float
    attention_scores: float
    mlp: float
    dropout_masks: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def attention_core(self) -> float:
        """What selective recompute drops."""
        return self.softmax_stats + self.attention_scores


def layer_activation_terms(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    dtype_bytes: int,
    fused_kernels: bool = True,
    flash_attention: bool = True,
) -> LayerActivations:
    """The named terms of one block's saved activations, without recomputation.

    flash_attention=False describes a stack that materialises the scores (Korthikanti's 5 a s^2 b bytes:
    softmax output, 1-byte dropout mask, dropped probabilities), for comparisons with such runs."""
    n, h, d, B = seq_len * micro_batch, cfg.hidden_size, cfg.head_dim, dtype_bytes
    r = tp if sp else 1
    a_r, k_r, f_r = cfg.n_heads // tp, kv_heads_per_rank(cfg, tp), cfg.ffn_hidden_size // tp
    if cfg.norm == "rmsnorm" and not fused_kernels:
        norm = 2 * (n * h * 8 + n * 4) / r
    else:
        norm = 2 * (n * h * B + n * 4 * (2 if cfg.norm == "layernorm" else 1)) / r
    if cfg.qk_norm:  # RMSNorm over each of the n (a/t + k_r) query and key heads' d values, whole sequence
        rows = n * (a_r + k_r)
        norm += rows * d * (B if fused_kernels else 8) + rows * 4
    math_path = cfg.dropout > 0 and not fused_kernels
    scores: float  # whole bytes on the math path, 0.0 on the fused one
    if math_path:  # PyTorch's CPU math kernel computes in fp32 whatever the input dtype
        qkv, stats, scores = 3 * n * a_r * d * 4, 0.0, 3 * a_r * seq_len * n * 4
    else:
        qkv, stats, scores = n * d * (a_r + 2 * k_r) * B, 4.0 * n * a_r, 0.0
    if not flash_attention:
        qkv, stats, scores = n * d * (a_r + 2 * k_r) * B, 0.0, a_r * seq_len * n * (2 * B + 1)
    mlp = (4 if cfg.mlp == "swiglu" else 2) * n * f_r * B
    masks = 2 * n * h / r * (1 if fused_kernels else B) if cfg.dropout > 0 else 0.0
    terms = LayerActivations(
        norm_inputs=norm,
        linear_inputs=2 * n * h * B / r,
        qkv=qkv,
        attention_out=n * a_r * d * B,
        softmax_stats=stats,
        attention_scores=scores,
        mlp=mlp,
        dropout_masks=masks,
    )
    if cfg.attention == "mla":
        return _latent_attention_terms(cfg, terms, seq_len, n, tp, sp, B, fused_kernels)
    return terms


def _latent_attention_terms(
    cfg: ModelConfig, terms: LayerActivations, seq_len: int, n: int, tp: int, sp: bool, B: int, fused_kernels: bool
) -> LayerActivations:
    """MLA's block (models/transformer.py's LatentAttention): besides the block norms, the MLP and the input x
    that wq_a and wkv_a share (unchanged), the latent norms save their inputs (the wq_a output, n q_r; a view of
    the wkv_a output, so all of it, n (kv_r + rope)) and statistics; wq_b saves the normed query latent (its SP
    shard), wkv_b the gathered [kv latent | rotary key] it is a view of; attention saves q and k (nope + rope
    wide, the rotary key expanded into every head), v (v_head_dim wide), its output (wo's input) and, flash, the
    log-sum-exp. On the CPU (measured): the composite RMSNorm saves fp32 copies of its inputs (below fp32; in
    fp32 the inputs themselves) and the fp32 normalised tensors, and SDPA takes its math path (q and k wider than
    v), in fp32: scaled q, k, v and the probabilities (s x s per head)."""
    r, a_r = (tp if sp else 1), cfg.n_heads // tp
    ql, kl, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk, dv = cfg.qk_nope_head_dim + rope, cfg.v_head_dim
    if fused_kernels:
        latent_norms = n * (ql + kl + rope) * B / r + 2 * n * 4 / r
        qkv, stats, scores = float(n * a_r * (2 * qk + dv) * B), 4.0 * n * a_r, 0.0
    else:
        inputs = n * (ql + kl + rope) * 4 if B == 4 else n * (ql + kl) * 4
        latent_norms = (inputs + n * (ql + kl) * 4 + 2 * n * 4) / r
        qkv, stats = n * a_r * (2 * qk + dv) * 4.0, 0.0
        scores = a_r * seq_len * n * 4.0 * (3 if cfg.dropout > 0 else 1)
    return replace(
        terms,
        norm_inputs=terms.norm_inputs + latent_norms,
        linear_inputs=terms.linear_inputs + n * ql * B / r + n * (kl + rope) * B,
        qkv=qkv,
        attention_out=n * a_r * dv * B,
        softmax_stats=stats,
        attention_scores=scores,
    )


def float8_input_saving(
    cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, dtype_bytes: int, moe_block: bool = False
) -> float:
    """Bytes a block saves less under fp8 tensorwise, whose linears keep their inputs as float8 (1 byte, not B;
    models/float8.py): the q/k/v projection's and the MLP's first projection's input (not under SP, where lean SP
    keeps the bf16 shard) and the MLP's second projection's (n f/t); not the output projection's (SDPA saves
    that tensor as its output), nor anything of an MoE block's MLP. MLA: of its attention only wq_b's input."""
    n, f_r = seq_len * micro_batch, cfg.ffn_hidden_size // tp
    gathered = 0 if sp else n * cfg.hidden_size  # one input: q/k/v's, or the MLP's first projection's
    attention = (0 if sp else n * cfg.q_lora_rank) if cfg.attention == "mla" else gathered  # MLA: wq_b's only
    return (dtype_bytes - 1) * (attention + (0 if moe_block else gathered + n * f_r))


def block_input_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, dtype_bytes: int) -> float:
    """The residual stream entering a block (what full recompute keeps): n h B / r."""
    return seq_len * micro_batch * cfg.hidden_size * dtype_bytes / (tp if sp else 1)


def weight_pending_bytes_per_layer(
    cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, dtype_bytes: int
) -> float:
    """Bytes one block keeps from its B to its W: every linear's input and output gradient (docstring). Under SP
    the row-parallel layers' output gradients (wo, w_down) are kept as this rank's shard, like the inputs."""
    n, h, d, B = seq_len * micro_batch, cfg.hidden_size, cfg.head_dim, dtype_bytes
    r = tp if sp else 1
    a_r, k_r, f_r = cfg.n_heads // tp, kv_heads_per_rank(cfg, tp), cfg.ffn_hidden_size // tp
    inputs = 2 * n * h * B / r + n * a_r * d * B + n * f_r * B
    gradients = n * d * (a_r + 2 * k_r) * B + 2 * n * h * B / r + (2 if cfg.mlp == "swiglu" else 1) * n * f_r * B
    return inputs + gradients


def activation_bytes_per_layer(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: RecomputePolicy | str,
    dtype_bytes: int,
    fused_kernels: bool = True,
    flash_attention: bool = True,
    layers: int | None = None,
) -> float:
    """Bytes per block held between its forward and its backward, for one micro-batch on one tp rank.

    full: the block input; every:K: one block input per segment of K blocks of a chunk of `layers` blocks
    (ceil(layers / K) / layers inputs per block; input / K when `layers` is not given). What recomputation
    rebuilds during backward is `recompute_transient_bytes`; the peak of a stage is `stage_activation_bytes`.
    """
    policy = _policy(recompute)
    terms = layer_activation_terms(cfg, seq_len, micro_batch, tp, sp, dtype_bytes, fused_kernels, flash_attention)
    if policy.kind == "none":
        return terms.total
    if policy.kind == "selective":
        kept = _kept_qkv(cfg, seq_len, micro_batch, tp, dtype_bytes, terms, flash_attention)
        return terms.total - terms.attention_core - terms.qkv + kept
    boundary = block_input_bytes(cfg, seq_len, micro_batch, tp, sp, dtype_bytes)
    if policy.kind == "sac":  # planner/recompute_sac.py
        return sac_held_bytes(cfg, seq_len * micro_batch, tp, dtype_bytes, boundary, _kept_core(terms, flash_attention))
    if policy.kind == "full":
        return boundary
    if layers is None:
        return boundary / policy.every
    return math.ceil(layers / policy.every) * boundary / layers


def _policy(recompute: RecomputePolicy | str) -> RecomputePolicy:
    return recompute if isinstance(recompute, RecomputePolicy) else RecomputePolicy.parse(recompute)


def _kept_core(terms: LayerActivations, flash_attention: bool) -> bool:
    """Whether sac's policy keeps the attention kernel's outputs (a flash kernel, not the math path)."""
    return flash_attention and not terms.attention_scores


def _math_path(terms: LayerActivations, flash_attention: bool) -> bool:
    """PyTorch's CPU math attention (dropout > 0 with CPU kernels): scores and fp32 q, k, v copies saved."""
    return bool(terms.attention_scores) and flash_attention


def _kept_qkv(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    dtype_bytes: int,
    terms: LayerActivations,
    flash_attention: bool,
) -> float:
    """q, k, v as the attention core's checkpoint keeps them (its inputs, in the activation dtype)."""
    if not _math_path(terms, flash_attention):
        return terms.qkv
    n, d = seq_len * micro_batch, cfg.head_dim
    if cfg.attention == "mla":  # q and k nope + rope wide in every head (the rotary key expanded), v v_head_dim
        return (
            n * (cfg.n_heads // tp) * (2 * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + cfg.v_head_dim) * dtype_bytes
        )
    return n * d * (cfg.n_heads // tp + 2 * kv_heads_per_rank(cfg, tp)) * dtype_bytes


def _norm_saves_block_input(cfg: ModelConfig, dtype_bytes: int, fused_kernels: bool) -> bool:
    """Whether the first norm saves the block input's own storage (then a rebuilt block does not add it again).
    LayerNorm and fused RMSNorm save their input; CPU RMSNorm saves input.float(), the input itself in fp32."""
    return cfg.norm == "layernorm" or fused_kernels or dtype_bytes == 4


def recompute_transient_bytes(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: RecomputePolicy | str,
    dtype_bytes: int,
    fused_kernels: bool = True,
    flash_attention: bool = True,
    segment: int | None = None,
) -> float:
    """Bytes a recomputation rebuilds in backward, beyond the inputs it keeps: one attention core's internals
    (selective), or `segment` blocks' full sets (full: 1; every:K: K unless given) less the kept input."""
    policy = _policy(recompute)
    terms = layer_activation_terms(cfg, seq_len, micro_batch, tp, sp, dtype_bytes, fused_kernels, flash_attention)
    if policy.kind == "none":
        return 0.0
    # The math path's backward peaks at three fp32 s x s tensors per head (the probabilities, their gradient and
    # the scores'): as many as it saves with dropout; MLA without dropout saves one (measured at 2,048 tokens:
    # 1.9 more during its backward)
    math_backward = max(0.0, 3.0 * (cfg.n_heads // tp) * seq_len * seq_len * micro_batch * 4 - terms.attention_scores)
    if policy.kind == "selective":
        if _math_path(terms, flash_attention):
            return terms.qkv + terms.attention_scores + math_backward
        if not flash_attention:
            return terms.attention_scores
        return terms.softmax_stats + terms.attention_out  # log-sum-exp and a new output
    blocks = segment if segment is not None else (1 if policy.kind in ("full", "sac") else policy.every)
    saves_input = _norm_saves_block_input(cfg, dtype_bytes, fused_kernels)
    overlap = block_input_bytes(cfg, seq_len, micro_batch, tp, sp, dtype_bytes) if saves_input else 0.0
    if policy.kind == "sac":
        kept = _kept_core(terms, flash_attention)
        return sac_transient_bytes(cfg, seq_len * micro_batch, tp, dtype_bytes, terms.total, overlap, kept)
    return blocks * terms.total - overlap


def _blocks_in_backward(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: RecomputePolicy,
    dtype_bytes: int,
    layers: int,
    pending: float,
    fused_kernels: bool,
    flash_attention: bool,
) -> float:
    """The most `layers` blocks of one micro-batch occupy during their backward: what they still hold, what a
    recomputation rebuilds, and (split backward) `pending` bytes per block whose B is done."""
    args = (cfg, seq_len, micro_batch, tp, sp)
    kinds = (fused_kernels, flash_attention)
    if layers == 0:
        return 0.0
    per = activation_bytes_per_layer(*args, recompute, dtype_bytes, *kinds, layers=layers)
    if recompute.kind == "none":
        return layers * max(per, pending)
    if recompute.kind == "sac":  # one block at a time rebuilt on top of what it holds
        transient = recompute_transient_bytes(*args, recompute, dtype_bytes, *kinds)
        return (layers - 1) * max(per, pending) + max(per, per + transient)
    if recompute.kind == "selective":
        terms = layer_activation_terms(*args, dtype_bytes, *kinds)
        # When backward reaches a block's core, what that block saved after the core is freed.
        before_core = (
            terms.norm_inputs / 2
            + terms.linear_inputs / 2
            + _kept_qkv(cfg, seq_len, micro_batch, tp, dtype_bytes, terms, flash_attention)
        )
        transient = recompute_transient_bytes(*args, recompute, dtype_bytes, *kinds)
        return (layers - 1) * max(per, pending) + max(per, before_core + transient)
    boundary = block_input_bytes(*args, dtype_bytes)
    size = min(1 if recompute.kind == "full" else recompute.every, layers)
    one_block = recompute_transient_bytes(*args, recompute, dtype_bytes, *kinds, segment=1)
    block_set = one_block + (boundary if _norm_saves_block_input(cfg, dtype_bytes, fused_kernels) else 0.0)
    worst, start, j = 0.0, 0, 0
    while start < layers:  # segment j = blocks [start, start + blocks), rebuilt after every later one
        blocks = min(size, layers - start)
        later = layers - start - blocks
        worst = max(worst, (j + 1) * boundary + one_block + (blocks - 1) * block_set + later * pending)
        start, j = start + blocks, j + 1
    return worst


def stage_activation_bytes(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: RecomputePolicy,
    dtype_bytes: int,
    layers_per_chunk: int,
    in_flight: int,
    fused_kernels: bool = True,
    flash_attention: bool = True,
) -> float:
    """Peak activations of the blocks of one pipeline rank: `in_flight` (chunk, micro-batch) pairs of
    `layers_per_chunk` blocks each, held, plus what recomputation rebuilds in one backward at its worst."""
    recompute, args, kinds = _policy(recompute), (cfg, seq_len, micro_batch, tp, sp), (fused_kernels, flash_attention)
    per = activation_bytes_per_layer(*args, recompute, dtype_bytes, *kinds, layers=layers_per_chunk)
    inside = _blocks_in_backward(*args, recompute, dtype_bytes, layers_per_chunk, 0.0, *kinds)
    return (in_flight - 1) * layers_per_chunk * per + max(layers_per_chunk * per, inside)


@dataclass(frozen=True)
class ChunkActivations:
    """What one (virtual stage, micro-batch) pair occupies on its rank, at the three moments that matter."""

    held: float
    """From the end of its F to its B: its blocks' saves, the head's on the last stage, the embedding mask
    on the first."""
    pending: float
    """From the end of its B to its W (split backward only; 0 otherwise): linear inputs and output gradients."""
    in_backward: float
    """The most it occupies during its own B: a recomputation rebuilding, after the head's backward freed the
    head (and, split, left the head's W inputs)."""


def chunk_activations(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    recompute: RecomputePolicy | str,
    dtype_bytes: int,
    layers: int,
    first: bool,
    last: bool,
    split: bool,
    fused_kernels: bool = True,
    flash_attention: bool = True,
    fused_loss: bool = False,
) -> ChunkActivations:
    """`ChunkActivations` of a virtual stage of `layers` blocks (with the embedding if `first`, the head if
    `last`); `split`: the schedule runs separate W actions; `fused_loss`: the head and loss fused."""
    policy = _policy(recompute)
    args = (cfg, seq_len, micro_batch, tp, sp)
    per = activation_bytes_per_layer(*args, policy, dtype_bytes, fused_kernels, flash_attention, layers=max(layers, 1))
    pending_layer = weight_pending_bytes_per_layer(*args, dtype_bytes) if split else 0.0
    head = head_activation_bytes(*args, dtype_bytes, fused_kernels, fused_loss) if last else 0.0
    head_pending = head_pending_bytes(*args, dtype_bytes, fused_loss) if last and split else 0.0
    embedding = embedding_activation_bytes(*args, fused_kernels, dtype_bytes) if first else 0.0
    blocks = _blocks_in_backward(*args, policy, dtype_bytes, layers, pending_layer, fused_kernels, flash_attention)
    return ChunkActivations(
        held=layers * per + head + embedding,
        pending=layers * pending_layer + head_pending,
        in_backward=blocks + head_pending + embedding,
    )
