"""Hugging Face interop: our checkpoints to and from the `transformers` formats, through safetensors only.

Six families map onto our decoder exactly (same logits, not "close enough"):
  Llama (LlamaForCausalLM):   swiglu, rmsnorm, rope; any grouped-query attention; tied or untied head.
  Qwen3 (Qwen3ForCausalLM):   Llama with qk_norm (q_norm, k_norm over each head); models/hf_moe.py maps it.
  Mixtral (MixtralForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM): Llama, Qwen3 with softmax top-k MoE blocks
                              (models/hf_moe.py says which MoE models).
  DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention, group-limited sigmoid routing with its
                              bias, shared experts (models/hf_deepseek.py).
  GPT-2 (GPT2LMHeadModel):    gelu (tanh approximation = HF's "gelu_new"), layernorm, learned positions,
                              plain multi-head attention; tied or untied head.
Any other combination (gelu with rope, GQA under GPT-2, ...) is refused with one line, never approximated.
Llama-like configs carry head_dim (Qwen3's default: 128 at any width; the others': hidden_size / heads), read
into model.attention_head_dim (0 when it is that derived width); export writes the width in effect.

Two conventions differ and are converted here:
  - Rotary pairs. Ours (Meta's original Llama) rotates interleaved pairs (x[2i], x[2i+1]); HF's Llama rotates
    (x[i], x[i + head_dim/2]) ("rotate_half"). Attention scores are unchanged if the rows of wq and wk are
    permuted within each head so that row 2i goes to i and row 2i+1 to i + head_dim/2: the permutation of HF's
    convert_llama_weights_to_hf.py, applied per head (per kv head for wk, so GQA works the same way). Qwen3's
    q_norm and k_norm weights (one per head dim) take the same permutation; RMS of a head is unchanged by it.
  - GPT-2's Conv1D stores weights as (in, out), the transpose of nn.Linear, fuses q, k, v into one c_attn, and
    gives every linear a bias. Ours have none: export writes zero biases; import refuses non-zero ones (a model
    with biases is not one we can run exactly).

Loading never unpickles: only config.json and *.safetensors are read. `import_hf` checks the config and every
tensor's name and shape from the safetensors headers (and GPT-2's biases) before any weight is changed; data is
read when asked for, by our parameter names (HF's separate q/k/v and gate/up fused on the way: models/fused.py),
so each rank reads just the tensors it holds (`load_hf_into_model`) and cuts its shard with `local_shard`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.fused import FusedView, split_state
from large_model_training.models.hf_configs import (
    LLAMA_LIKE,
    hf_config as hf_config,
    hf_family,
    model_config_from_hf as model_config_from_hf,
)
from large_model_training.models.hf_deepseek import (
    MLA_FIELDS,
    add_deepseek_moe,
    add_latent_attention,
)
from large_model_training.models.hf_files import read_config, read_headers, read_tensors, weight_files
from large_model_training.models.hf_moe import (
    EXPORT_LAYOUT,
    MOE_SHAPE_FIELDS,
    add_moe_mlp,
    check_expert_bias,
    detect_layout,
)
from large_model_training.models.init import full_shape, local_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Shape fields: an HF folder decides these; the rest (dropout, preset) stay the run's own choice.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "attention_head_dim",
    "ffn_hidden_size",
    "max_seq_len",
    "mlp",
    "norm",
    "position",
    "tie_embeddings",
    "norm_eps",
    "rope_theta",
    "qk_norm",
    *MOE_SHAPE_FIELDS,
    *MLA_FIELDS,
)
# Non-parameter tensors some transformers versions saved (causal masks, rotary tables): safe to skip.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def to_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of wq/wk from interleaved rotary pairs to HF's halves, per head: row 2i -> i, 2i+1 -> i + d/2."""
    return w.reshape(heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def from_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `to_rotate_half`."""
    return w.reshape(heads, 2, -1, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transposed(t: torch.Tensor) -> torch.Tensor:  # GPT-2's Conv1D (in, out) <-> nn.Linear's (out, in)
    return t.t()


def _import_plan(cfg: ModelConfig, layout: str | None = None) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(our name -> (HF name, HF tensor -> ours), HF name -> expected shape) for a model of shape cfg; stacked
    experts come from a tuple of HF names (their converter takes the tensors in order); `layout`: hf_moe's
    expert naming (None: the one export writes)."""
    h, f, v, nh, nkv, hd = (
        cfg.hidden_size,
        cfg.ffn_hidden_size,
        cfg.vocab_size,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.head_dim,
    )
    plan: dict[str, tuple[str | tuple[str, ...], Callable]] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    def add(ours: str, hf: str | tuple[str, ...], shape: tuple[int, ...], fn: Callable = _same) -> None:
        plan[ours] = (hf, fn)
        shapes.update((name, shape) for name in (hf if isinstance(hf, tuple) else (hf,)))

    if (family := hf_family(cfg)) in LLAMA_LIKE:
        layout = layout or EXPORT_LAYOUT.get(family)
        add("tok_embeddings.weight", "model.embed_tokens.weight", (v, h))
        add("norm.weight", "model.norm.weight", (h,))
        if not cfg.tie_embeddings:
            add("output.weight", "lm_head.weight", (v, h))
        for i in range(cfg.n_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            add(ours + "attn_norm.weight", hf + "input_layernorm.weight", (h,))
            add(ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight", (h,))
            if family == "deepseek_v3":
                add_latent_attention(add, cfg, ours, hf)
                if cfg.is_moe_layer(i):
                    add_deepseek_moe(add, cfg, ours, hf, layout)
                    continue
                _add_dense_mlp(add, ours, hf, h, f)
                continue
            add(
                ours + "attn.wq.weight", hf + "self_attn.q_proj.weight", (nh * hd, h), lambda t: from_rotate_half(t, nh)
            )
            add(
                ours + "attn.wk.weight",
                hf + "self_attn.k_proj.weight",
                (nkv * hd, h),
                lambda t: from_rotate_half(t, nkv),
            )
            add(ours + "attn.wv.weight", hf + "self_attn.v_proj.weight", (nkv * hd, h))
            for norm in ("q_norm", "k_norm") if cfg.qk_norm else ():  # a (head_dim,) weight: as one head's rows
                add(
                    f"{ours}attn.{norm}.weight",
                    f"{hf}self_attn.{norm}.weight",
                    (hd,),
                    lambda t: from_rotate_half(t[:, None], 1)[:, 0],
                )
            add(ours + "attn.wo.weight", hf + "self_attn.o_proj.weight", (h, nh * hd))
            if cfg.is_moe_layer(i):
                add_moe_mlp(add, cfg, ours, hf, layout)
                continue
            _add_dense_mlp(add, ours, hf, h, f)
        return plan, shapes
    add("tok_embeddings.weight", "transformer.wte.weight", (v, h))
    add("pos_embeddings.weight", "transformer.wpe.weight", (cfg.max_seq_len, h))
    add("norm.weight", "transformer.ln_f.weight", (h,))
    add("norm.bias", "transformer.ln_f.bias", (h,))
    if not cfg.tie_embeddings:
        add("output.weight", "lm_head.weight", (v, h))
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            add(f"{ours}{norm}.weight", f"{hf}{ln}.weight", (h,))
            add(f"{ours}{norm}.bias", f"{hf}{ln}.bias", (h,))
        for j, w in enumerate(("wq", "wk", "wv")):  # c_attn is (h, 3h): columns [q | k | v]
            add(
                f"{ours}attn.{w}.weight",
                hf + "attn.c_attn.weight",
                (h, 3 * h),
                lambda t, j=j: t.t()[j * h : (j + 1) * h],
            )
        add(ours + "attn.wo.weight", hf + "attn.c_proj.weight", (h, h), _transposed)
        add(ours + "mlp.w_up.weight", hf + "mlp.c_fc.weight", (h, f), _transposed)
        add(ours + "mlp.w_down.weight", hf + "mlp.c_proj.weight", (f, h), _transposed)
        for bias, size in (("attn.c_attn", 3 * h), ("attn.c_proj", h), ("mlp.c_fc", f), ("mlp.c_proj", h)):
            shapes[f"{hf}{bias}.bias"] = (size,)  # must be zero: checked by import_hf
    return plan, shapes


def _add_dense_mlp(add: Callable, ours: str, hf: str, h: int, f: int) -> None:
    add(ours + "mlp.w_gate.weight", hf + "mlp.gate_proj.weight", (f, h))
    add(ours + "mlp.w_up.weight", hf + "mlp.up_proj.weight", (f, h))
    add(ours + "mlp.w_down.weight", hf + "mlp.down_proj.weight", (h, f))


def to_hf_state(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state dict -> the HF state dict (contiguous; no two entries share memory, as safetensors wants)."""
    plan, shapes = _import_plan(cfg)
    state = split_state(state, cfg)  # the plan's separate q/k/v and gate/up, as HF holds them (models/fused.py)
    out: dict[str, torch.Tensor] = {}
    family = hf_family(cfg)
    if cfg.moe_experts and family != "deepseek_v3":  # DeepSeek-V3's router has the bias (hf_deepseek.py)
        check_expert_bias(state)
    for ours, (hf, _) in plan.items():
        t = state[ours].detach()
        if isinstance(hf, tuple):  # stacked experts -> one tensor per expert
            out.update((name, t[j].contiguous()) for j, name in enumerate(hf))
            continue
        if family in LLAMA_LIKE and ours.endswith(("attn.wq.weight", "attn.wk.weight")):
            t = to_rotate_half(t, cfg.n_heads if ours.endswith("wq.weight") else cfg.kv_heads)
        elif ours.endswith(("attn.q_norm.weight", "attn.k_norm.weight")) and cfg.qk_norm:  # not MLA's latent norm
            t = to_rotate_half(t[:, None], 1)[:, 0]
        elif family == "gpt2" and ours.endswith("attn.wq.weight"):
            prefix = ours[: -len("wq.weight")]
            t = torch.cat([state[prefix + w + ".weight"].detach() for w in ("wq", "wk", "wv")]).t()
        elif family == "gpt2" and ours.endswith(("attn.wk.weight", "attn.wv.weight")):
            continue  # fused into c_attn with wq
        elif family == "gpt2" and hf.endswith((".c_proj.weight", ".c_fc.weight")):
            t = t.t()
        out[hf] = t.contiguous()
    for hf, shape in shapes.items():
        if hf not in out:  # GPT-2's linear biases
            out[hf] = torch.zeros(shape)
    return out


class HFWeights(Mapping):
    """Our parameter name -> full tensor (in the file's dtype), read from the safetensors files on access."""

    def __init__(
        self,
        cfg: ModelConfig,
        where: dict[str, tuple[str, tuple[int, ...]]],
        prefix: dict[str, str],
        layout: str | None = None,
    ):
        self.cfg = cfg
        self._plan, _ = _import_plan(cfg, layout)
        self._where, self._prefix = where, prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        hf, convert = self._plan[name]
        stored = [self._prefix.get(n, n) for n in (hf if isinstance(hf, tuple) else (hf,))]
        # an MoE parameter stacks E experts' tensors: each shard is opened once for all of them, not once per expert
        return convert(*read_tensors([(self._where[n][0], n) for n in stored])).contiguous()

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def import_hf(hf_dir: str, base: ModelConfig | None = None) -> tuple[ModelConfig, FusedView]:
    """(our ModelConfig, our parameter name -> full tensor) for an HF folder; ConfigError naming the bad file.

    Everything is checked here, before any weight is read into a model: the config, every tensor's presence
    and shape, no unknown tensors, and (GPT-2) that the linear biases are zero.
    """
    doc, config_path = read_config(hf_dir)
    cfg = model_config_from_hf(doc, config_path, base)
    where = read_headers(weight_files(hf_dir))
    layout = detect_layout(where, doc["model_type"])
    _, shapes = _import_plan(cfg, layout)
    # Files saved from the base model (GPT2Model, LlamaModel) lack the 'transformer.' / 'model.' prefix.
    prefix: dict[str, str] = {}
    for hf in shapes:
        if hf not in where and "." in hf and hf.split(".", 1)[1] in where:
            prefix[hf] = hf.split(".", 1)[1]
    known = {prefix.get(hf, hf) for hf in shapes} | {"lm_head.weight"}  # a tied head may be saved anyway
    unknown = sorted(n for n in where if n not in known and not n.endswith(IGNORED_SUFFIXES))
    if unknown:
        raise ConfigError(
            f"{where[unknown[0]][0]}: unexpected tensor {unknown[0]} for a {doc['model_type']} "
            f"model ({len(unknown)} in all)"
        )
    for hf, shape in shapes.items():
        stored = prefix.get(hf, hf)
        if stored not in where:
            raise ConfigError(
                f"tensor {hf} missing from {hf_dir} (files: "
                f"{', '.join(sorted({os.path.basename(p) for p, _ in where.values()}))})"
            )
        if where[stored][1] != shape:
            raise ConfigError(
                f"{where[stored][0]}: tensor {stored} has shape {list(where[stored][1])}, "
                f"config.json implies {list(shape)}"
            )
        if hf.endswith("bias") and ("attn.c_" in hf or "mlp.c_" in hf):
            if read_tensors([(where[stored][0], stored)])[0].abs().max() != 0:
                raise ConfigError(
                    f"{where[stored][0]}: {stored} is not zero; lmt's linears have no bias, so "
                    "this GPT-2 cannot be run exactly"
                )
    return cfg, FusedView(HFWeights(cfg, where, prefix, layout), cfg)  # by our (fused) parameter names


def model_config_for_run(hf_dir: str, base: ModelConfig, explicit: tuple[str, ...] = ()) -> ModelConfig:
    """The model of a run that starts from hf_dir: shape from its config.json, the rest (dropout, preset) from
    base. A shape field the user set explicitly (`explicit`: field names such as 'hidden_size') must agree."""
    cfg, _ = import_hf(hf_dir, base)
    clash = [
        k
        for k in explicit
        if k in SHAPE_FIELDS and shape_differences(dataclasses.replace(cfg, **{k: getattr(base, k)}), cfg)
    ]
    if clash:
        k = clash[0]
        raise ConfigError(
            f"--model.{k} {getattr(base, k)!r} contradicts {hf_dir}/config.json ({getattr(cfg, k)!r}); "
            "a run started from Hugging Face weights takes their shape"
        )
    return cfg


def shape_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """The shape fields on which two model configs differ (empty when their weights are interchangeable)."""

    def shape(cfg: ModelConfig) -> dict:  # MoE fields only for MoE models, the dense width only if a block uses it
        moe = {"moe_ffn_hidden_size": cfg.expert_ffn} if cfg.moe_experts else {k: None for k in MOE_SHAPE_FIELDS}
        dense = {"ffn_hidden_size": None} if cfg.moe_experts and cfg.moe_layers == cfg.n_layers else {}
        return {
            **{k: getattr(cfg, k) for k in SHAPE_FIELDS},
            "n_kv_heads": cfg.kv_heads,
            "attention_head_dim": cfg.head_dim,
            **moe,
            **dense,
        }

    sa, sb = shape(a), shape(b)
    return [f"{k}: {sa[k]!r} vs {sb[k]!r}" for k in SHAPE_FIELDS if sa[k] != sb[k]]


@torch.no_grad()
def load_hf_into_model(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors by name into this rank's (tensor-parallel, pipeline, or whole) model, shard by shard.

    Mirrors `init_parameters`: each parameter this rank holds takes the full tensor of its name and keeps
    `local_shard` of it, so any tp x pp layout loads the same weights. A last pipeline stage's copy of a tied
    embedding (`output.weight`) takes `tok_embeddings.weight`.
    """
    cfg = model.cfg
    if isinstance(state, FusedView) and (diff := shape_differences(state.cfg, cfg)):
        raise ConfigError(f"the Hugging Face weights are for a different model ({'; '.join(diff[:3])})")
    state = FusedView(state, cfg)  # separate q/k/v and gate/up (HF's), if any, read and fused per parameter
    todo, seen = [], set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            if cfg.tie_embeddings and name == "output.weight":
                name = "tok_embeddings.weight"
            if name not in state:
                raise ConfigError(f"the Hugging Face weights have no tensor for parameter {name}")
            todo.append((module, param_name, param, name))
    for name, buffer in model.named_buffers():  # the expert bias (DeepSeek-V3's e_score_correction_bias)
        if name in state:
            buffer.copy_(state[name].to(buffer.dtype))
    for module, param_name, param, name in todo:
        full = state[name]
        if tuple(full.shape) != full_shape(module, param_name, param):
            raise ConfigError(
                f"tensor for {name} has shape {list(full.shape)}, the model expects "
                f"{list(full_shape(module, param_name, param))}"
            )
        param.copy_(local_shard(module, param_name, full.to(param.dtype)))
