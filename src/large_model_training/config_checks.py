"""Each configuration setting checked alone (ranges, choices, files): `check_fields`. What depends on several
settings together (the layout) is `layout.layout_problems`. Apart from config.py so that the dataclasses and
their loading stay one readable file."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from large_model_training.config import CHOICE_TYPES, SECTION_TYPES, Config, _field_types
from large_model_training.config_toml import coerce
from large_model_training.errors import ConfigError


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def _non_negative(section: str, obj: Any, keys: tuple[str, ...]) -> None:
    for key in keys:
        if getattr(obj, key) < 0:
            raise ConfigError(f"{section}.{key} must be >= 0, got {getattr(obj, key)}")


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def parse_choices(cfg: Config) -> None:
    """Parse choice fields that were assigned as strings in code (flags and TOML arrive parsed already)."""
    for section, cls in SECTION_TYPES.items():
        types = _field_types(cls)
        for name, typ in types.items():
            if typ in CHOICE_TYPES:
                obj = getattr(cfg, section)
                setattr(obj, name, coerce(f"{section}.{name}", getattr(obj, name), typ))


def check_fields(cfg: Config) -> None:
    """Every setting on its own (ranges, choices, files); what depends on the layout is `layout.validate`'s."""
    parse_choices(cfg)
    m, p, t, d, r = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.run
    for key in ("vocab_size", "hidden_size", "n_layers", "n_heads", "ffn_hidden_size", "max_seq_len"):
        _positive(f"model.{key}", getattr(m, key))
    _non_negative("model", m, ("n_kv_heads", "attention_head_dim"))
    if not m.attention_head_dim and m.hidden_size % m.n_heads:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) must be divisible by model.n_heads ({m.n_heads}), "
            "or model.attention_head_dim set"
        )
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.kv_heads})")
    if m.position == "rope" and m.head_dim % 2:
        where = "model.attention_head_dim" if m.attention_head_dim else "hidden_size / n_heads"
        raise ConfigError(f"rope needs an even head_dim, got {m.head_dim} ({where})")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout}")
    _non_negative(
        "model",
        m,
        (
            "moe_experts",
            "moe_ffn_hidden_size",
            "moe_shared_experts",
            "moe_first_dense",
            "moe_aux_loss_coef",
            "moe_bias_update_rate",
            "moe_capacity_factor",
        ),
    )
    _positive("model.moe_every", m.moe_every)
    if m.moe_experts and not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k must be in [1, moe_experts = {m.moe_experts}], got {m.moe_top_k}")
    _non_negative("model", m, ("mtp_depth",))
    if m.attention == "mla":
        _mla_problems(m)
    _positive("model.moe_groups", m.moe_groups)
    _positive("model.moe_routed_scale", m.moe_routed_scale)
    if m.moe_experts and m.moe_groups > 1:
        per_group = m.moe_experts // m.moe_groups
        if m.moe_experts % m.moe_groups or per_group < 2:
            raise ConfigError(
                f"model.moe_groups ({m.moe_groups}) must divide moe_experts ({m.moe_experts}) into "
                "groups of 2 or more (a group is scored by its two best experts)"
            )
        if not 1 <= m.moe_topk_groups <= m.moe_groups or m.moe_top_k > m.moe_topk_groups * per_group:
            raise ConfigError(
                f"model.moe_topk_groups must be in [1, moe_groups = {m.moe_groups}] with room for "
                f"moe_top_k = {m.moe_top_k} experts in its groups of {per_group}, got "
                f"{m.moe_topk_groups}"
            )
    if m.moe_experts and m.mlp != "swiglu":
        raise ConfigError(f"MoE experts are swiglu: model.mlp must be 'swiglu' with moe_experts > 0, got {m.mlp!r}")

    for key in ("tp", "pp", "virtual_stages"):
        _positive(f"parallel.{key}", getattr(p, key))
    _non_negative("parallel", p, ("dp",))
    _one_of("parallel.zero", p.zero, (0, 1, 2, 3))
    _positive("parallel.bucket_mb", p.bucket_mb)

    for key in ("steps", "seq_len", "micro_batch_size", "lr", "eval_batches", "max_bad_steps"):
        _positive(f"train.{key}", getattr(t, key))
    _non_negative(
        "train",
        t,
        ("global_batch_size", "warmup_steps", "weight_decay", "grad_clip", "eval_every", "seed", "compression_warmup"),
    )
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(t, key)}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")

    if d.tokenizer and not os.path.isfile(d.tokenizer):
        raise ConfigError(f"tokenizer file not found: {d.tokenizer}")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {d.val_fraction}")

    if t.spike_factor != 0 and t.spike_factor <= 1:
        raise ConfigError(f"train.spike_factor must be above 1 (or 0: off), got {t.spike_factor}")
    if t.spike_window < 3:
        raise ConfigError(f"train.spike_window must be at least 3, got {t.spike_window}")
    _positive("train.onebit_warmup", t.onebit_warmup)  # v must have seen gradients before it freezes
    _non_negative("train", t, ("onebit_variance_refresh", "fp8_bf16_first_last"))
    _one_of("train.compile_backend", t.compile_backend, ("inductor", "aot_eager"))

    _sync_checks(cfg)
    _positive("run.timeout", r.timeout)
    _non_negative(
        "run", r, ("stall_timeout", "save_every", "log_every", "keep", "max_restarts", "save_local_every", "spares")
    )
    if r.spares and not r.save_local_every:
        raise ConfigError("run.spares needs run.save_local_every (a replacement rank loads from the in-memory copies)")
    if r.tracker not in ("tensorboard", "none") and importlib.util.find_spec(str(r.tracker)) is None:
        raise ConfigError(
            f"run.tracker {r.tracker} needs the {r.tracker} package: pip install "
            f"'large-model-training[{r.tracker}]' (or pip install {r.tracker})"
        )


def _sync_checks(cfg: Config) -> None:
    """The [sync] section (parallel/diloco.py): outer optimizer, exchange format, streaming fragments."""
    s = cfg.sync
    _positive("sync.outer_lr", s.outer_lr)
    if not 0.0 <= s.outer_momentum < 1.0:
        raise ConfigError(f"sync.outer_momentum must be in [0, 1), got {s.outer_momentum}")
    _positive("sync.fragments", s.fragments)
    _non_negative("sync", s, ("overlap", "warmup"))
    if s.mode.infrequent and cfg.train.optimizer != "adamw":
        raise ConfigError(
            f"sync.mode {s.mode} runs AdamW inner steps: it does not compose with --optimizer "
            f"{cfg.train.optimizer} (which compresses every step's exchange instead)"
        )
    if s.mode.kind == "streaming":
        h = s.mode.every
        if s.fragments > h:
            raise ConfigError(
                f"sync.mode streaming:{h} needs H >= sync.fragments ({s.fragments}): the fragments "
                f"sync H / fragments steps apart"
            )
        if s.overlap >= h:
            raise ConfigError(
                f"sync.overlap ({s.overlap}) must be below H ({h}) of streaming:{h}: a fragment's "
                f"exchange must land before its next one starts"
            )


def _mla_problems(m: Any) -> None:
    dims = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for name in dims:
        _positive(f"model.{name} (with model.attention mla)", getattr(m, name))
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim must be even (rotary pairs), got {m.qk_rope_head_dim}")
    if m.position != "rope":
        raise ConfigError(
            f"model.attention mla needs model.position rope (its decoupled rotary key), got {m.position!r}"
        )
    if m.qk_norm:
        raise ConfigError("model.qk_norm does not apply to model.attention mla (its latents are normalised instead)")
