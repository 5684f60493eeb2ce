"""Hugging Face interop for Mixture-of-Experts models (models/hf.py's MoE half): Mixtral in and out, exactly.

Mixtral (MixtralForCausalLM) is a Llama whose every MLP is a softmax top-k router over E swiglu experts with the
chosen gates renormalised to sum to 1: ours with moe_router=softmax, moe_norm_topk=true, no shared experts, no
dense blocks. Attention, norms, embeddings and the rotary permutation are the Llama mapping of models/hf.py.

Expert weights, ours stacked (E, f, h) / (E, h, f), come in three namings, all read on import:
  'block_sparse_moe'  the hub checkpoints' (mistralai/Mixtral-8x7B-v0.1) and what transformers 5's
                      save_pretrained writes: block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1|w3|w2
                      .weight (gate, up, down of expert e). Export writes this one, which every transformers
                      version loads (transformers 5 fuses it on load).
  'mlp'               the same per-expert tensors under mlp. (transformers 5's module name).
  'fused'             transformers 5's in-memory parameters: mlp.gate.weight, mlp.experts.gate_up_proj (E, 2f, h),
                      gate rows first, and mlp.experts.down_proj (E, h, f).

Refused, one line each, because the result would not compute the same function:
  - sigmoid routers (DeepSeek-V3), gates not renormalised (moe_norm_topk=false), shared experts, dense blocks
    between MoE ones (moe_first_dense, moe_every): Mixtral has none of these;
  - a nonzero expert bias on export: the bias chooses the experts (DeepSeek-V3's auxiliary-loss-free balancing)
    and Mixtral has no such term, so its routing would differ. Export a checkpoint trained with
    moe_bias_update_rate=0 (the bias stays zero);
  - Qwen3-MoE: its attention RMS-normalises each head's queries and keys (q_norm, k_norm), which ours lacks;
    Qwen2-MoE: q/k/v biases and a sigmoid-gated shared expert (shared_expert_gate), which ours lacks.
Training choices stay the run's own (like dropout): moe_aux_loss_coef, moe_bias_update_rate and
moe_capacity_factor. The capacity factor only drops tokens past an expert's capacity; transformers runs dropless.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError

LAYOUTS = ("block_sparse_moe", "mlp", "fused")
# The fields an HF folder decides for an MoE model (models/hf.py's SHAPE_FIELDS adds them).
MOE_SHAPE_FIELDS = ("moe_experts", "moe_top_k", "moe_ffn_hidden_size", "moe_shared_experts", "moe_first_dense",
                    "moe_every", "moe_router", "moe_norm_topk")
# Why a model_type lmt cannot run exactly is refused (besides the generic "not supported").
UNSUPPORTED = {
    "qwen3_moe": "its attention RMS-normalises each head's queries and keys (q_norm, k_norm), which lmt's does not",
    "qwen2_moe": "its q/k/v projections have biases and its shared expert is scaled by a sigmoid gate "
                 "(shared_expert_gate), which lmt's model has not",
}


def check_mixtral(cfg: ModelConfig) -> None:
    """ConfigError unless MixtralForCausalLM runs the MoE model `cfg` exactly."""
    why = None
    if (cfg.mlp, cfg.norm, cfg.position) != ("swiglu", "rmsnorm", "rope"):
        why = f"mlp={cfg.mlp}, norm={cfg.norm}, position={cfg.position} (Mixtral: swiglu/rmsnorm/rope)"
    elif cfg.moe_router != "softmax":
        why = f"its router is {cfg.moe_router} (Mixtral's is softmax)"
    elif not cfg.moe_norm_topk:
        why = "its top-k gates are not renormalised (moe_norm_topk=false; Mixtral always renormalises)"
    elif cfg.moe_shared_experts:
        why = f"it has {cfg.moe_shared_experts} shared experts (Mixtral has none)"
    elif cfg.moe_layers != cfg.n_layers:
        why = (f"blocks are dense too (moe_first_dense={cfg.moe_first_dense}, moe_every={cfg.moe_every}; "
               "Mixtral's are all MoE)")
    if why:
        raise ConfigError(f"no Hugging Face architecture runs this MoE model exactly: {why}")


def check_expert_bias(state: dict[str, torch.Tensor]) -> None:
    """Refuse to export a nonzero expert bias: it changes which experts are chosen, and Mixtral has none."""
    for name, t in state.items():
        if name.endswith("mlp.router.expert_bias") and torch.count_nonzero(t):
            raise ConfigError(f"{name} is not zero: the expert bias chooses experts and Mixtral has no such term, so "
                              "the export would route differently (export a run trained with moe_bias_update_rate=0)")


def mixtral_config(cfg: ModelConfig, llama: dict) -> dict:
    """MixtralConfig fields: models/hf.py's Llama config.json plus the experts."""
    doc = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    doc.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=cfg.expert_ffn,
               num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k, router_jitter_noise=0.0,
               sliding_window=None, output_router_logits=False, router_aux_loss_coef=cfg.moe_aux_loss_coef)
    return doc


def mixtral_fields(doc: dict, path: str, fields: dict) -> dict:
    """Our MoE fields for a Mixtral config.json, given the Llama ones (`fields`, from the same doc)."""
    def positive(key: str) -> int:
        value = doc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{path}: field '{key}' is missing or not a positive integer (got {value!r})")
        return value

    experts, top_k = positive("num_local_experts"), positive("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"{path}: num_experts_per_tok {top_k} exceeds num_local_experts {experts}")
    window = doc.get("sliding_window")
    if window is not None and window < fields["max_seq_len"]:
        raise ConfigError(f"{path}: sliding_window {window} < max_position_embeddings; lmt's attention is full "
                          "causal, so it cannot run this model exactly")
    out = dict(fields, moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=fields["ffn_hidden_size"],
               moe_shared_experts=0, moe_first_dense=0, moe_every=1, moe_router="softmax", moe_norm_topk=True)
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if "rope_theta" not in rope and "rope_theta" not in doc:
        out["rope_theta"] = 1e6  # MixtralConfig's defaults, not Llama's
    if "rms_norm_eps" not in doc:
        out["norm_eps"] = 1e-5
    return out


def detect_layout(names: Iterable[str]) -> str:
    """Which of LAYOUTS a folder's tensor names use ('block_sparse_moe' when none: its names are then missing)."""
    names = list(names)
    if any(n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) for n in names):
        return "fused"
    return "mlp" if any(".mlp.experts." in n for n in names) else "block_sparse_moe"


def _stack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.stack(tensors)


def add_moe_mlp(add: Callable, cfg: ModelConfig, ours: str, hf: str, layout: str) -> None:
    """The plan entries of one MoE block: `add(our name, HF name or per-expert names, HF shape, HF -> ours)`;
    ours = 'layers.{i}.', hf = 'model.layers.{i}.'."""
    e, f, h = cfg.moe_experts, cfg.expert_ffn, cfg.hidden_size
    if layout == "fused":
        add(ours + "mlp.router.weight", hf + "mlp.gate.weight", (e, h))
        add(ours + "mlp.experts.w_gate", hf + "mlp.experts.gate_up_proj", (e, 2 * f, h), lambda t: t[:, :f])
        add(ours + "mlp.experts.w_up", hf + "mlp.experts.gate_up_proj", (e, 2 * f, h), lambda t: t[:, f:])
        add(ours + "mlp.experts.w_down", hf + "mlp.experts.down_proj", (e, h, f))
        return
    block = hf + ("block_sparse_moe." if layout == "block_sparse_moe" else "mlp.")
    add(ours + "mlp.router.weight", block + "gate.weight", (e, h))
    for w, hf_w, shape in (("w_gate", "w1", (f, h)), ("w_up", "w3", (f, h)), ("w_down", "w2", (h, f))):
        add(f"{ours}mlp.experts.{w}", tuple(f"{block}experts.{j}.{hf_w}.weight" for j in range(e)), shape, _stack)
