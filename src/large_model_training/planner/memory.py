"""Memory per device: model states under tp, pp and ZeRO; activations under tp, sp, recompute and the schedule.

The one place these formulas live: `lmt estimate`, the planner's search and the tests that compare them with
measured bytes all call the functions here.

## Activations of one block (bytes held for backward, one micro-batch, one tp rank)

Derived term by term the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4.1) derive sbh(34 + 5as/h) for GPT, but for OUR block (models/transformer.py):
pre-norm, rmsnorm|layernorm, rope, grouped-query attention through F.scaled_dot_product_attention,
swiglu|gelu, dropout on both residual branches. Notation: s sequence, b micro-batch, n = s*b tokens, h hidden,
a heads, k kv heads, d = h/a, f MLP width, B bytes of the activation dtype (2 bf16, 4 fp32), t tp degree,
r = t with sequence parallelism else 1. Per tp rank: a/t query heads, k_r kv heads (k/t, or 1 when k < t),
f/t MLP width.

  norm_inputs     2 norms save their input: 2nhB/r. (+ statistics, 4n or 8n bytes each.) PyTorch's CPU
                  RMSNorm is composite: it saves an fp32 copy of the input and the fp32 normalised tensor,
                  2 x 4nh/r per norm; fused accelerator kernels save the input only.
  linear_inputs   the input of the q/k/v projections and of the MLP's first projection: 2nhB. Replicated
                  over tp; under SP it is the all-gathered sequence, which our column-parallel layers save
                  whole (Megatron instead keeps the 1/t shard and gathers again in backward).
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

For GPT (layernorm, gelu, f = 4h, a = k) in bf16 with dropout this is sbh(34 + 8a/h) bytes: Korthikanti's
34 (4 norms + 4 linear inputs + 6 qkv + 2 out + 16 MLP + 2 masks), with their 5as/h score term replaced by
the flash kernel's log-sum-exp. tp divides every term except norm_inputs, linear_inputs and masks (the
paper's 10 sbh); sp divides norms and masks too.

Recompute policies (issue 6; `memory/recompute.py`), checked against saved-tensor bytes for every policy
(tests/test_recompute.py). Two quantities: what a block holds between its forward and its backward (per layer,
`activation_bytes_per_layer`) and the peak of a stage during backward (`stage_activation_bytes`), which adds
what a recomputation rebuilds (`recompute_transient_bytes`):
  none       holds every term above; peak = all blocks of all in-flight micro-batches.
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
             of L blocks holds ceil(L / K) inputs (per block ceil(L / K) / L inputs, 1 / K of one when K
             divides L). In backward segment j (0-based) is rebuilt while the inputs of segments 0..j are held.
A stage's peak (`stage_memory`) is the larger of the end of a forward (all blocks' saves plus the head's) and
a recomputation in backward, which runs after that micro-batch's head backward has already freed the head.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from large_model_training.choices import RecomputePolicy
from large_model_training.config import ModelConfig
from large_model_training.layout import Job, Layout
from large_model_training.models.flops import block_parameters
from large_model_training.parallel.tensor import padded_vocab
from large_model_training.planner.shapes import kv_heads_per_rank, kv_weight_heads_per_rank

DEFAULT_BUCKET_BYTES = 25 * 1024**2
"""Gradient bucket of the dp engine (PyTorch DDP's default bucket_cap_mb of 25); two are in flight."""


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


def layer_activation_terms(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool,
                           dtype_bytes: int, fused_kernels: bool = True,
                           flash_attention: bool = True) -> LayerActivations:
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
    math_path = cfg.dropout > 0 and not fused_kernels
    if math_path:  # PyTorch's CPU math kernel computes in fp32 whatever the input dtype
        qkv, stats, scores = 3 * n * a_r * d * 4, 0.0, 3 * a_r * seq_len * n * 4
    else:
        qkv, stats, scores = n * d * (a_r + 2 * k_r) * B, 4.0 * n * a_r, 0.0
    if not flash_attention:
        qkv, stats, scores = n * d * (a_r + 2 * k_r) * B, 0.0, a_r * seq_len * n * (2 * B + 1)
    mlp = (4 if cfg.mlp == "swiglu" else 2) * n * f_r * B
    masks = 2 * n * h / r * (1 if fused_kernels else B) if cfg.dropout > 0 else 0.0
    return LayerActivations(norm_inputs=norm, linear_inputs=2 * n * h * B, qkv=qkv, attention_out=n * a_r * d * B,
                            softmax_stats=stats, attention_scores=scores, mlp=mlp, dropout_masks=masks)


def block_input_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, dtype_bytes: int) -> float:
    """The residual stream entering a block (what full recompute keeps): n h B / r."""
    return seq_len * micro_batch * cfg.hidden_size * dtype_bytes / (tp if sp else 1)


def activation_bytes_per_layer(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool,
                               recompute: RecomputePolicy | str, dtype_bytes: int, fused_kernels: bool = True,
                               flash_attention: bool = True, layers: int | None = None) -> float:
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
        return terms.total - terms.attention_core - terms.qkv + _kept_qkv(cfg, seq_len, micro_batch, tp, dtype_bytes,
                                                                          terms, flash_attention)
    boundary = block_input_bytes(cfg, seq_len, micro_batch, tp, sp, dtype_bytes)
    if policy.kind == "full":
        return boundary
    if layers is None:
        return boundary / policy.every
    return math.ceil(layers / policy.every) * boundary / layers


def _policy(recompute: RecomputePolicy | str) -> RecomputePolicy:
    return recompute if isinstance(recompute, RecomputePolicy) else RecomputePolicy.parse(recompute)


def _math_path(terms: LayerActivations, flash_attention: bool) -> bool:
    """PyTorch's CPU math attention (dropout > 0 with CPU kernels): scores and fp32 q, k, v copies saved."""
    return bool(terms.attention_scores) and flash_attention


def _kept_qkv(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, dtype_bytes: int,
              terms: LayerActivations, flash_attention: bool) -> float:
    """q, k, v as the attention core's checkpoint keeps them (its inputs, in the activation dtype)."""
    if not _math_path(terms, flash_attention):
        return terms.qkv
    n, d = seq_len * micro_batch, cfg.head_dim
    return n * d * (cfg.n_heads // tp + 2 * kv_heads_per_rank(cfg, tp)) * dtype_bytes


def _norm_saves_block_input(cfg: ModelConfig, dtype_bytes: int, fused_kernels: bool) -> bool:
    """Whether the first norm saves the block input's own storage (then a rebuilt block does not add it again).
    LayerNorm and fused RMSNorm save their input; CPU RMSNorm saves input.float(), the input itself in fp32."""
    return cfg.norm == "layernorm" or fused_kernels or dtype_bytes == 4


def recompute_transient_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool,
                              recompute: RecomputePolicy | str, dtype_bytes: int, fused_kernels: bool = True,
                              flash_attention: bool = True, segment: int | None = None) -> float:
    """Bytes a recomputation rebuilds in backward, beyond the inputs it keeps: one attention core's internals
    (selective), or `segment` blocks' full sets (full: 1; every:K: K unless given) less the kept input."""
    policy = _policy(recompute)
    terms = layer_activation_terms(cfg, seq_len, micro_batch, tp, sp, dtype_bytes, fused_kernels, flash_attention)
    if policy.kind == "none":
        return 0.0
    if policy.kind == "selective":
        if _math_path(terms, flash_attention):
            return terms.qkv + terms.attention_scores
        if not flash_attention:
            return terms.attention_scores
        return terms.softmax_stats + terms.attention_out  # log-sum-exp and a new output
    blocks = segment if segment is not None else (1 if policy.kind == "full" else policy.every)
    overlap = block_input_bytes(cfg, seq_len, micro_batch, tp, sp, dtype_bytes) \
        if _norm_saves_block_input(cfg, dtype_bytes, fused_kernels) else 0.0
    return blocks * terms.total - overlap


def stage_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool,
                           recompute: RecomputePolicy, dtype_bytes: int, layers_per_chunk: int, in_flight: int,
                           fused_kernels: bool = True, flash_attention: bool = True) -> float:
    """Peak activations of the blocks of one pipeline rank: `in_flight` (chunk, micro-batch) pairs of
    `layers_per_chunk` blocks each, held, plus what recomputation rebuilds in one backward at its worst."""
    recompute = _policy(recompute)
    args = (cfg, seq_len, micro_batch, tp, sp)
    kinds = (fused_kernels, flash_attention)
    if recompute.kind == "none":
        return in_flight * layers_per_chunk * activation_bytes_per_layer(*args, recompute, dtype_bytes, *kinds)
    if recompute.kind == "selective":
        terms = layer_activation_terms(*args, dtype_bytes, *kinds)
        per = activation_bytes_per_layer(*args, recompute, dtype_bytes, *kinds)
        # When backward reaches the last block's core, what that block saved after the core is freed.
        before_core = terms.norm_inputs / 2 + terms.linear_inputs / 2 + _kept_qkv(cfg, seq_len, micro_batch, tp,
                                                                                  dtype_bytes, terms, flash_attention)
        transient = recompute_transient_bytes(*args, recompute, dtype_bytes, *kinds)
        return in_flight * layers_per_chunk * per + max(0.0, transient - (per - before_core))
    boundary = block_input_bytes(*args, dtype_bytes)
    size = min(1 if recompute.kind == "full" else recompute.every, layers_per_chunk)
    segments = math.ceil(layers_per_chunk / size)
    one_block = recompute_transient_bytes(*args, recompute, dtype_bytes, *kinds, segment=1)
    block_set = one_block + (boundary if _norm_saves_block_input(cfg, dtype_bytes, fused_kernels) else 0.0)

    def rebuilding(j: int, blocks: int) -> float:
        """Held while segment j (0-based, `blocks` long) is rebuilt: inputs of segments 0..j, its blocks' sets."""
        return (j + 1) * boundary + one_block + (blocks - 1) * block_set

    full_segments = layers_per_chunk // size
    worst = rebuilding(full_segments - 1, size)
    if segments > full_segments:  # a shorter last segment, rebuilt first, while all inputs are held
        worst = max(worst, rebuilding(segments - 1, layers_per_chunk - full_segments * size))
    return (in_flight - 1) * segments * boundary + worst


def head_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool,
                          dtype_bytes: int, fused_kernels: bool = True) -> float:
    """Last stage, one micro-batch: final norm input, head input, logits and the fp32 softmax of the loss."""
    n, h, r = seq_len * micro_batch, cfg.hidden_size, (tp if sp else 1)
    vocab = padded_vocab(cfg.vocab_size, tp) // tp
    norm = (n * h * 8 if cfg.norm == "rmsnorm" and not fused_kernels else n * h * dtype_bytes) / r
    return norm + n * h * dtype_bytes + n * vocab * (dtype_bytes + 4)


def embedding_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool,
                               fused_kernels: bool = True, dtype_bytes: int = 2) -> float:
    """First stage, one micro-batch: the embedding dropout mask (the token ids are negligible)."""
    if cfg.dropout <= 0:
        return 0.0
    return seq_len * micro_batch * cfg.hidden_size / (tp if sp else 1) * (1 if fused_kernels else dtype_bytes)


# ---- model states -------------------------------------------------------------------------------------------


def block_parameters_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Parameters of one block held by one tp rank (norms replicated; kv weights replicated when k < tp)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q = cfg.n_heads // tp
    kv = kv_weight_heads_per_rank(cfg, tp)
    mlp = (3 if cfg.mlp == "swiglu" else 2) * h * cfg.ffn_hidden_size // tp
    norms = 2 * h * (2 if cfg.norm == "layernorm" else 1)
    return h * q * d + 2 * h * kv * d + q * d * h + mlp + norms


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
        if not (cfg.tie_embeddings and first):
            out += vocab_rank
    return out


def state_bytes_per_parameter(precision: str, grad_reduce_fp32: bool = False) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter for our AdamW.

    fp32: 4 + 4 + 8 (Adam m and v). bf16 mixed precision: 2 (bf16 weights) + 2 or 4 (gradient, fp32 when
    reduced in fp32) + 12 (fp32 master weights, m, v).
    """
    if precision == "fp32":
        return 4, 4, 8
    return 2, 4 if grad_reduce_fp32 else 2, 12


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


def model_state_bytes(params: int, precision: str, zero: int, dp: int,
                      grad_reduce_fp32: bool = False) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes of `params` parameters under a ZeRO stage over dp.

    Stage 1 shards the optimizer states over dp, 2 also the gradients, 3 also the parameters.
    """
    p, g, o = state_bytes_per_parameter(precision, grad_reduce_fp32)
    return (params * p / (dp if zero >= 3 else 1), params * g / (dp if zero >= 2 else 1),
            params * o / (dp if zero >= 1 else 1))


def stage_memory(job: Job, layout: Layout, stage: int, layers_per_chunk: int, layers: int, in_flight: int,
                 head_in_flight: int, fused_kernels: bool = True) -> MemoryBreakdown:
    """Memory of one device of pipeline rank `stage`: `layers` blocks in chunks of `layers_per_chunk`,
    `in_flight` (chunk, micro-batch) activations at the peak; `head_in_flight` micro-batches of the head."""
    cfg, t, sp = job.model, layout.tp, layout.sequence_parallel
    s, b = job.seq_len, layout.micro_batch_size
    B = 2 if job.precision == "bf16" else 4
    first, last = stage == 0, stage == layout.pp - 1
    params = stage_parameters(cfg, t, layers, first, last)
    p_bytes, g_bytes, o_bytes = model_state_bytes(params, job.precision, layout.zero, layout.dp, job.grad_reduce_fp32)
    kinds = (fused_kernels, job.flash_attention)
    rebuilding = stage_activation_bytes(cfg, s, b, t, sp, layout.recompute, B, layers_per_chunk, in_flight, *kinds)
    held = in_flight * layers_per_chunk * activation_bytes_per_layer(cfg, s, b, t, sp, layout.recompute, B, *kinds,
                                                                     layers=layers_per_chunk)
    head = head_activation_bytes(cfg, s, b, t, sp, B, fused_kernels) if last else 0.0
    # Two candidate peaks: the end of a forward, every block's saves and the head held; and a recomputation in
    # backward, which starts after that micro-batch's head backward has freed its head (with full recompute the
    # second is the larger by far, and counting the head there too over-predicted by a quarter for `tiny`).
    acts = max(held + head_in_flight * head, rebuilding + max(head_in_flight - 1, 0) * head)
    if first:
        acts += in_flight * embedding_activation_bytes(cfg, s, b, t, sp, fused_kernels, B)
    # Buffers: pipeline send/receive of activations and gradients; two dp buckets in flight; ZeRO-3's gathered
    # weights of the current and the prefetched block and one block's full gradient; error feedback.
    per_param, per_grad, _ = state_bytes_per_parameter(job.precision, job.grad_reduce_fp32)
    buffers = 4 * block_input_bytes(cfg, s, b, t, sp, B) if layout.pp > 1 else 0.0
    if layout.dp > 1:
        buffers += min(2 * DEFAULT_BUCKET_BYTES, params * per_grad)
    if layout.zero == 3 and layout.dp > 1:
        block = block_parameters_per_rank(cfg, t)
        buffers += block * (2 * per_param + per_grad)
    if job.compression.kind != "none" and layout.dp > 1:
        buffers += params * 4  # fp32 error-feedback residual of every gradient element this rank reduces
    if job.compression_target == "update" and layout.dp > 1:
        buffers += params * 4  # every bucket's fp32 AdamW update, in flight together in the engine's step
    return MemoryBreakdown(stage, p_bytes, g_bytes, o_bytes, acts, buffers)


def total_parameters(cfg: ModelConfig) -> int:
    """All parameters of the model (for lower bounds on devices)."""
    return cfg.n_layers * block_parameters(cfg) + stage_parameters(cfg, 1, 0, True, True)


def stage_layer_counts(chunks: list[int], pp: int) -> list[int]:
    """Blocks per pipeline rank (sum over its chunks) from blocks per virtual stage."""
    return [sum(chunks[r::pp]) for r in range(pp)]
