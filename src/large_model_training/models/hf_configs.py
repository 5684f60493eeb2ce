"""Hugging Face config.json <-> our ModelConfig (models/hf.py's config half): which transformers architecture
runs a model exactly (`hf_family`), its config.json (`hf_config`), and ours from theirs (`model_config_from_hf`),
refusing in one line what lmt cannot run exactly."""

from __future__ import annotations

import dataclasses
from typing import Any

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.hf_deepseek import deepseek_config, deepseek_fields, deepseek_problem
from large_model_training.models.hf_moe import (
    UNSUPPORTED,
    mixtral_config,
    mixtral_fields,
    moe_family,
    qwen3_config,
    qwen3_fields,
)

LLAMA_LIKE = ("llama", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3")  # Llama's names (and rotary permutation)


def hf_family(cfg: ModelConfig) -> str:
    """'llama', 'qwen3', 'gpt2', 'mixtral' or 'qwen3_moe': the transformers architecture that runs `cfg`
    exactly; ConfigError if none."""
    if cfg.attention == "mla":  # models/hf_deepseek.py
        if why := deepseek_problem(cfg):
            raise ConfigError(f"no Hugging Face architecture runs this model exactly: {why}")
        return "deepseek_v3"
    if cfg.moe_experts:
        return moe_family(cfg)
    kind = (cfg.mlp, cfg.norm, cfg.position)
    if kind == ("swiglu", "rmsnorm", "rope"):
        return "qwen3" if cfg.qk_norm else "llama"
    if cfg.qk_norm:
        raise ConfigError(
            f"qk_norm runs in Hugging Face's Qwen3 only, which is swiglu/rmsnorm/rope, not "
            f"mlp={cfg.mlp}, norm={cfg.norm}, position={cfg.position}"
        )
    if kind == ("gelu", "layernorm", "learned"):
        if cfg.kv_heads != cfg.n_heads:
            raise ConfigError(
                f"GPT-2 has no grouped-query attention: cannot export n_kv_heads={cfg.kv_heads} "
                f"with n_heads={cfg.n_heads}"
            )
        if cfg.n_heads * cfg.head_dim != cfg.hidden_size:
            raise ConfigError(
                f"GPT-2's heads are hidden_size / n_heads wide: cannot export head_dim {cfg.head_dim} "
                f"with hidden_size {cfg.hidden_size} and {cfg.n_heads} heads"
            )
        return "gpt2"
    raise ConfigError(
        f"no Hugging Face architecture runs mlp={cfg.mlp}, norm={cfg.norm}, position={cfg.position} "
        "exactly (Llama: swiglu/rmsnorm/rope; GPT-2: gelu/layernorm/learned)"
    )


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """config.json for `cfg` (LlamaConfig, Qwen3Config, MixtralConfig, Qwen3MoeConfig or GPT2Config fields)."""
    # Special token ids belong to the tokenizer, which this folder does not carry: none rather than HF's defaults.
    common = {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if (family := hf_family(cfg)) in LLAMA_LIKE:
        doc = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
        }
        if family == "mixtral":
            return mixtral_config(cfg, doc)
        if family == "deepseek_v3":
            return deepseek_config(cfg, doc)
        return doc if family == "llama" else qwen3_config(cfg, doc)
    # GPT-2 drops out exactly where we do: embeddings, attention probabilities, both residual branches.
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **common,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_hidden_size,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
    }


def _require(path: str, doc: dict, key: str) -> int:
    """A positive integer field of config.json."""
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{path}: field '{key}' is missing or not a positive integer (got {value!r})")
    return value


def _refuse_unless(ok: bool, path: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {what}; lmt cannot run this model exactly")


def model_config_from_hf(doc: dict, path: str, base: ModelConfig | None = None) -> ModelConfig:
    """Our ModelConfig for an HF config.json `doc`: shape fields from it, the rest (dropout, preset) from base."""
    base = base or ModelConfig()
    kind = doc.get("model_type")
    if kind in LLAMA_LIKE:
        heads = _require(path, doc, "num_attention_heads")
        hidden = _require(path, doc, "hidden_size")
        kv = doc.get("num_key_value_heads") or heads
        rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
        theta = rope.get("rope_theta", doc.get("rope_theta", 10000.0))
        _refuse_unless(doc.get("hidden_act", "silu") == "silu", path, f"hidden_act is {doc.get('hidden_act')!r}")
        _refuse_unless(not doc.get("attention_bias") and not doc.get("mlp_bias"), path, "it has linear biases")
        _refuse_unless(
            rope.get("rope_type", rope.get("type", "default")) == "default",
            path,
            f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not plain rope",
        )
        _refuse_unless(rope.get("partial_rotary_factor", 1.0) == 1.0, path, "rope covers part of each head")
        if doc.get("head_dim") is None:  # Qwen3Config's default is 128 at any width; the others derive it
            doc = dict(doc, head_dim=128 if kind == "qwen3" else hidden // heads)
        head_dim = _require(path, doc, "head_dim")
        _refuse_unless(head_dim % 2 == 0, path, f"head_dim {head_dim} is odd (rope rotates pairs)")
        fields: dict[str, Any] = dict(
            vocab_size=_require(path, doc, "vocab_size"),
            hidden_size=hidden,
            n_layers=_require(path, doc, "num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=0 if kv == heads else kv,
            attention_head_dim=0 if heads * head_dim == hidden else head_dim,
            ffn_hidden_size=_require(path, doc, "intermediate_size"),
            max_seq_len=int(doc.get("max_position_embeddings", 2048)),
            mlp="swiglu",
            norm="rmsnorm",
            position="rope",
            tie_embeddings=bool(doc.get("tie_word_embeddings", False)),
            norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            moe_experts=0,
            qk_norm=False,
        )
        if kind == "mixtral":
            fields = mixtral_fields(doc, path, fields)
        elif kind == "deepseek_v3":
            fields = deepseek_fields(doc, path, fields)
        elif kind != "llama":
            fields = qwen3_fields(doc, path, fields)
    elif kind == "gpt2":
        hidden = _require(path, doc, "n_embd")
        _refuse_unless(
            doc.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
            path,
            f"activation_function is {doc.get('activation_function')!r} (lmt's gelu is tanh)",
        )
        _refuse_unless(
            doc.get("scale_attn_weights", True) and not doc.get("scale_attn_by_inverse_layer_idx"),
            path,
            "attention scores are not scaled by 1/sqrt(head_dim)",
        )
        _refuse_unless(not doc.get("add_cross_attention"), path, "it has cross-attention")
        fields = dict(
            vocab_size=_require(path, doc, "vocab_size"),
            hidden_size=hidden,
            n_layers=_require(path, doc, "n_layer"),
            n_heads=_require(path, doc, "n_head"),
            n_kv_heads=0,
            attention_head_dim=0,
            ffn_hidden_size=doc.get("n_inner") or 4 * hidden,
            max_seq_len=int(doc.get("n_positions", 1024)),
            mlp="gelu",
            norm="layernorm",
            position="learned",
            tie_embeddings=bool(doc.get("tie_word_embeddings", True)),
            norm_eps=float(doc.get("layer_norm_epsilon", 1e-5)),
            rope_theta=base.rope_theta,
            moe_experts=0,
            qk_norm=False,
        )
    else:
        why = f": {UNSUPPORTED[kind]}" if kind in UNSUPPORTED else ""
        known = ", ".join(repr(k) for k in (*LLAMA_LIKE, "gpt2"))
        raise ConfigError(f"{path}: model_type {kind!r} is not supported{why} (lmt reads {known})")
    if isinstance(doc.get("initializer_range"), (int, float)):
        fields["init_std"] = float(doc["initializer_range"])
    cfg = dataclasses.replace(base, **fields)
    divisible = bool(cfg.attention_head_dim or cfg.hidden_size % cfg.n_heads == 0)
    _refuse_unless(
        divisible and cfg.n_heads % cfg.kv_heads == 0, path, "its heads do not divide hidden_size / each other"
    )
    return cfg
