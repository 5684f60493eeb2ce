"""Hugging Face interop for DeepSeek-V3 (DeepseekV3ForCausalLM; models/hf.py's third half): in and out, exactly.

DeepSeek-V3 is ours with `attention mla` (LatentAttention), the first `first_k_dense_replace` blocks dense and the
rest MoE with a sigmoid router choosing the top-k of the best `topk_group` of `n_group` expert groups on score +
`e_score_correction_bias` (our expert bias: the auxiliary-loss-free balancing), gates renormalised and scaled by
`routed_scaling_factor`, plus `n_shared_experts` shared experts. The tensors map one to one:
  q_a_proj, q_a_layernorm, q_b_proj        wq_a, q_norm, wq_b (rows per head: [nope | rope], the same order)
  kv_a_proj_with_mqa, kv_a_layernorm       wkv_a ([latent | rotary key]), kv_norm
  kv_b_proj, o_proj                        wkv_b (rows per head: [k nope | v]), wo
  mlp.gate.weight, .e_score_correction_bias  mlp.router.weight, mlp.router.expert_bias
  mlp.experts.{e}.gate_proj|up_proj|down_proj (or transformers 5's fused gate_up_proj, down_proj)  the experts
  mlp.shared_experts.gate_proj|up_proj|down_proj                    mlp.shared's (gate and up fused by us)
No rotary permutation: with `rope_interleave` (DeepSeek's own layout, transformers' default) the rotary dimensions
are interleaved pairs, as ours; transformers de-interleaves q and k alike, which leaves the scores unchanged.

Refused, one line each: rope scaling other than plain rope (the released checkpoint uses YaRN, which lmt's
rotary tables do not have yet), rope_interleave false, q_lora_rank null (lmt's MLA compresses the query),
rms_norm_eps other than 1e-6 (transformers normalises the latents with 1e-6 whatever the config says), biases.
Its multi-token-prediction layer (num_nextn_predict_layers) is not part of DeepseekV3ForCausalLM's weights.
"""

from __future__ import annotations

from collections.abc import Callable

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.hf_moe import add_moe_mlp

MLA_FIELDS = (
    "attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "moe_groups",
    "moe_topk_groups",
    "moe_routed_scale",
)
LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which transformers' attention uses for both latents


def deepseek_problem(cfg: ModelConfig) -> str | None:
    """Why DeepseekV3ForCausalLM cannot run the MLA model `cfg` exactly, or None."""
    if (cfg.mlp, cfg.norm, cfg.position) != ("swiglu", "rmsnorm", "rope"):
        return f"mlp={cfg.mlp}, norm={cfg.norm}, position={cfg.position} (DeepSeek-V3: swiglu/rmsnorm/rope)"
    if cfg.norm_eps != LATENT_NORM_EPS:
        return f"norm_eps {cfg.norm_eps} (transformers normalises MLA's latents with {LATENT_NORM_EPS})"
    if cfg.moe_experts and (cfg.moe_router != "sigmoid" or cfg.moe_every != 1 or not cfg.moe_shared_experts):
        return (
            "its experts are not DeepSeek-V3's (a sigmoid router, every block MoE after the dense ones, shared experts)"
        )
    return None


def deepseek_config(cfg: ModelConfig, llama: dict) -> dict:
    """DeepseekV3Config fields: models/hf.py's Llama config.json plus MLA and the experts."""
    doc = {k: v for k, v in llama.items() if k not in ("head_dim", "mlp_bias")}
    experts = cfg.moe_experts
    doc.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        num_key_value_heads=cfg.n_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        head_dim=cfg.qk_rope_head_dim,
        rope_interleave=True,
        num_nextn_predict_layers=0,
        first_k_dense_replace=cfg.moe_first_dense if experts else cfg.n_layers,
        n_routed_experts=experts or 1,
        num_experts_per_tok=cfg.moe_top_k if experts else 1,
        n_shared_experts=cfg.moe_shared_experts or 1,
        moe_intermediate_size=cfg.expert_ffn,
        n_group=cfg.moe_groups,
        topk_group=cfg.moe_topk_groups,
        norm_topk_prob=True,
        routed_scaling_factor=cfg.moe_routed_scale,
    )
    return doc


def deepseek_fields(doc: dict, path: str, fields: dict) -> dict:
    """Our fields for a DeepseekV3 config.json, given the Llama ones read from the same doc (`fields`)."""

    def positive(key: str) -> int:
        value = doc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{path}: field '{key}' is missing or not a positive integer (got {value!r})")
        return value

    def refuse(what: str) -> None:
        raise ConfigError(f"{path}: {what}; lmt cannot run this model exactly")

    if doc.get("q_lora_rank") is None:
        refuse("q_lora_rank is null (an uncompressed query)")
    if not doc.get("rope_interleave", True):
        refuse("rope_interleave is false")
    if fields["norm_eps"] != LATENT_NORM_EPS:
        refuse(f"rms_norm_eps {fields['norm_eps']} (transformers normalises the latents with {LATENT_NORM_EPS})")
    n, dense = fields["n_layers"], doc.get("first_k_dense_replace", 0)
    experts = positive("n_routed_experts") if dense < n else 0
    out = dict(
        fields,
        n_kv_heads=0,
        attention_head_dim=0,
        attention="mla",
        q_lora_rank=positive("q_lora_rank"),
        kv_lora_rank=positive("kv_lora_rank"),
        qk_nope_head_dim=positive("qk_nope_head_dim"),
        qk_rope_head_dim=positive("qk_rope_head_dim"),
        v_head_dim=positive("v_head_dim"),
    )
    if not experts:
        return out
    return dict(
        out,
        moe_experts=experts,
        moe_top_k=positive("num_experts_per_tok"),
        moe_ffn_hidden_size=positive("moe_intermediate_size"),
        moe_shared_experts=positive("n_shared_experts"),
        moe_first_dense=dense,
        moe_every=1,
        moe_router="sigmoid",
        moe_norm_topk=True,
        moe_groups=positive("n_group"),
        moe_topk_groups=positive("topk_group"),
        moe_routed_scale=float(doc.get("routed_scaling_factor", 1.0)),
    )


def add_latent_attention(add: Callable, cfg: ModelConfig, ours: str, hf: str) -> None:
    """The plan entries of one block's MLA (ours = 'layers.{i}.', hf = 'model.layers.{i}.')."""
    h, n, rope = cfg.hidden_size, cfg.n_heads, cfg.qk_rope_head_dim
    qk, v, q_rank, kv_rank = cfg.qk_nope_head_dim + rope, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    for mine, theirs, shape in (
        ("wq_a", "q_a_proj", (q_rank, h)),
        ("q_norm", "q_a_layernorm", (q_rank,)),
        ("wq_b", "q_b_proj", (n * qk, q_rank)),
        ("wkv_a", "kv_a_proj_with_mqa", (kv_rank + rope, h)),
        ("kv_norm", "kv_a_layernorm", (kv_rank,)),
        ("wkv_b", "kv_b_proj", (n * (cfg.qk_nope_head_dim + v), kv_rank)),
        ("wo", "o_proj", (h, n * v)),
    ):
        add(f"{ours}attn.{mine}.weight", f"{hf}self_attn.{theirs}.weight", shape)


def add_deepseek_moe(add: Callable, cfg: ModelConfig, ours: str, hf: str, layout: str) -> None:
    """The plan entries of one MoE block: router (and its bias), routed experts, shared experts."""
    e, h, f = cfg.moe_experts, cfg.hidden_size, cfg.expert_ffn * cfg.moe_shared_experts
    add_moe_mlp(add, cfg, ours, hf, layout)
    add(ours + "mlp.router.expert_bias", hf + "mlp.gate.e_score_correction_bias", (e,))
    for mine, theirs, shape in (
        ("w_gate", "gate_proj", (f, h)),
        ("w_up", "up_proj", (f, h)),
        ("w_down", "down_proj", (h, f)),
    ):
        add(f"{ours}mlp.shared.{mine}.weight", f"{hf}mlp.shared_experts.{theirs}.weight", shape)
