"""Parameter and FLOP counts of our architecture: the one place these formulas live.

Notation as in Narayanan et al. 2021: h hidden size, L layers, a heads, s sequence length, V vocabulary,
f MLP inner width, k key/value heads, d head dim (h / a unless model.attention_head_dim sets it: Qwen3's
a*d differs from h, so the attention terms below use a*d, never h).

Parameters per block: attention h*(a*d) + 2*h*(k*d) + (a*d)*h; MLP 3*h*f (swiglu) or 2*h*f (gelu);
two norms of h (plus h of bias each for layernorm; with qk_norm two more of d). Outside the blocks: embedding
V*h, learned positions max_seq*h, final norm, and the head V*h unless tied. An MoE block's MLP
(`cfg.is_moe_layer`) holds E experts of 3*h*f_e, the shared experts and the router E*h; a token runs k experts
and the shared ones: total parameters count all E, active ones (and the FLOPs, hence MFU) only k.

Training FLOPs per token: 6 per parameter touched by a matmul (2 forward, 4 backward), plus attention's two
s x s matmuls (QK^T and AV): 2 * 2 * s * (a*d) forward per layer per token, halved for causal masking only
when the kernel skips masked blocks; we count the full square, as Megatron's MFU does, so our MFU figures
compare with theirs. Recomputation adds forward FLOPs on top (counted by the planner, not here).
"""

from __future__ import annotations

from large_model_training.config import ModelConfig


def attention_parameters(cfg: ModelConfig) -> int:
    """The attention's projection weights (norms apart: `attention_norm_parameters`)."""
    h, d, a = cfg.hidden_size, cfg.head_dim, cfg.n_heads
    if cfg.attention == "mla":
        qk, r, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = h * cfg.q_lora_rank + cfg.q_lora_rank * a * qk
        kv = h * (cfg.kv_lora_rank + r) + cfg.kv_lora_rank * a * (cfg.qk_nope_head_dim + v)
        return q + kv + a * v * h
    return h * a * d + 2 * h * cfg.kv_heads * d + a * d * h


def attention_norm_parameters(cfg: ModelConfig) -> int:
    """Norm weights inside the attention: qk_norm's two head_dim weights, or MLA's two latent norms."""
    if cfg.attention == "mla":
        return cfg.q_lora_rank + cfg.kv_lora_rank
    return 2 * cfg.head_dim if cfg.qk_norm else 0


def attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(query/key width, value width) of one head: head_dim twice, or MLA's nope + rope and v_head_dim."""
    if cfg.attention == "mla":
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


def mlp_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Parameters of block `layer`'s MLP: all of them, or (`active`) those one token runs through."""
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return (3 if cfg.mlp == "swiglu" else 2) * h * cfg.ffn_hidden_size
    experts = cfg.moe_top_k if active else cfg.moe_experts
    return 3 * h * cfg.expert_ffn * (experts + cfg.moe_shared_experts) + cfg.moe_experts * h


def mean_mlp_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """Per-block mean over the layers (exact for a dense model), for per-block planner terms."""
    if not cfg.moe_experts:  # the planner asks per candidate layout: no loop over layers for dense models
        return mlp_parameters(cfg, 0, active)
    return sum(mlp_parameters(cfg, i, active) for i in range(cfg.n_layers)) // cfg.n_layers


def block_parameters(cfg: ModelConfig) -> int:
    """One block's parameters (MLP: the mean over layers of all parameters, experts included)."""
    norms = 2 * cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1) + attention_norm_parameters(cfg)
    return attention_parameters(cfg) + mean_mlp_parameters(cfg) + norms


def embedding_parameters(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size + (cfg.max_seq_len * cfg.hidden_size if cfg.position == "learned" else 0)


def head_parameters(cfg: ModelConfig) -> int:
    final_norm = cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1)
    return final_norm + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)


def parameter_count(cfg: ModelConfig, active: bool = False) -> int:
    """All parameters, or (`active`) those one token uses: only its k experts of each MoE block."""
    norms = 2 * cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1) + attention_norm_parameters(cfg)
    layers = cfg.n_layers + cfg.mtp_depth  # a prediction module's block is one more block (models/transformer.py)
    blocks = layers * (attention_parameters(cfg) + norms)
    blocks += sum(mlp_parameters(cfg, i, active) for i in range(layers))
    return embedding_parameters(cfg) + blocks + head_parameters(cfg) + cfg.mtp_depth * mtp_extra_parameters(cfg)


def mtp_extra_parameters(cfg: ModelConfig) -> int:
    """A prediction module beside its block: the 2h -> h projection and three norms (embedding and head shared)."""
    norm = cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1)
    return 2 * cfg.hidden_size * cfg.hidden_size + 3 * norm


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup and norms do not; of an MoE
    block's experts only the k a token is routed to)."""
    layers = cfg.n_layers + cfg.mtp_depth  # each prediction module: a block, its projection and the head again
    mlp = sum(mlp_parameters(cfg, i, active=True) for i in range(layers))
    mtp = cfg.mtp_depth * (2 * cfg.hidden_size * cfg.hidden_size + cfg.vocab_size * cfg.hidden_size)
    return layers * attention_parameters(cfg) + mlp + cfg.vocab_size * cfg.hidden_size + mtp


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token (no recomputation)."""
    layers = cfg.n_layers + cfg.mtp_depth
    attention = 2 * seq_len * cfg.n_heads * sum(attention_widths(cfg)) * layers  # QK^T and AV, forward
    return 6.0 * matmul_parameters(cfg) + 3.0 * attention


# ---- per-rank shapes and executed FLOPs, for the planner's time model ------------------------------------------
# The functions above count model FLOPs (what MFU divides by). The ones below describe the work one tensor-
# parallel rank actually executes: the GEMM shapes of one block, and attention cores as flash kernels run them.


def block_gemm_shapes(cfg: ModelConfig, tokens: int, tp: int, kv_heads_rank: int) -> list[tuple[int, int, int]]:
    """(M, N, K) of the forward GEMMs of one block on one tp rank: M tokens x K inputs -> N outputs.

    q, k and v are one GEMM (the fused wqkv, models/fused.py); swiglu's gate and up likewise (w_gate_up): 4 per
    dense block. The backward runs each GEMM twice more (input gradient and weight gradient) with the same three
    sizes permuted.
    """
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size // tp
    if cfg.moe_experts:  # a token's k routed and shared experts, as one wide MLP (no ep term yet)
        f = cfg.expert_ffn * (cfg.moe_top_k + cfg.moe_shared_experts) // tp
    q_heads = cfg.n_heads // tp
    if cfg.attention == "mla":  # down-projections replicated, up-projections by heads, then wo
        qk, v = attention_widths(cfg)
        r, q_rank, kv_rank = cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        shapes = [
            (tokens, q_rank, h),
            (tokens, q_heads * qk, q_rank),
            (tokens, kv_rank + r, h),
            (tokens, q_heads * (cfg.qk_nope_head_dim + v), kv_rank),
            (tokens, h, q_heads * v),
        ]
    else:
        shapes = [(tokens, (q_heads + 2 * kv_heads_rank) * d, h), (tokens, h, q_heads * d)]
    shapes.append((tokens, 2 * f if cfg.mlp == "swiglu" else f, h))
    shapes.append((tokens, h, f))
    return shapes


def attention_core_flops(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int) -> float:
    """Forward FLOPs one tp rank executes in QK^T and AV with a causal flash kernel (masked blocks skipped).

    The model-FLOP count (`training_flops_per_token`) keeps the full square for comparability with
    Megatron's MFU; a causal flash kernel computes about half of it, which is what takes time.
    """
    return 0.5 * 2 * seq_len * seq_len * (cfg.n_heads // tp) * sum(attention_widths(cfg)) * micro_batch


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, policy: str) -> float:
    """Forward FLOPs per token run again in backward by a recompute policy (model-FLOP convention).

    full and every:K re-run every block's forward (2 per matmul parameter of the blocks plus the attention
    square); selective re-runs only the attention core. Adding this to `training_flops_per_token` gives the
    hardware FLOPs that Megatron's "achieved TFLOP/s" of 2021 counts (their 96 B s l h^2 formula).
    """
    attention = 2 * 2 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers
    if policy == "none":
        return 0.0
    if policy == "selective":
        return float(attention)
    if policy == "sac":  # the output projections run again (memory/op_checkpoint.py keeps the other matmuls)
        return 2.0 * cfg.n_heads * cfg.head_dim * cfg.hidden_size * cfg.n_layers
    blocks = matmul_parameters(cfg) - cfg.vocab_size * cfg.hidden_size
    return 2.0 * blocks + attention
