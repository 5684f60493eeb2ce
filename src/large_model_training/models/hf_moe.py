"""Hugging Face interop for Mixture-of-Experts models and Qwen3 (models/hf.py's MoE half): Mixtral, Qwen3-MoE and
dense Qwen3, in and out, exactly.

Mixtral (MixtralForCausalLM) is a Llama whose every MLP is a softmax top-k router over E swiglu experts with the
chosen gates renormalised to sum to 1: ours with moe_router=softmax, moe_norm_topk=true, no shared experts, no
dense blocks. Attention, norms, embeddings and the rotary permutation are the Llama mapping of models/hf.py.
Qwen3 (Qwen3ForCausalLM) is a Llama whose attention RMS-normalises each head's queries and keys before rope
(q_norm, k_norm: ours with qk_norm=true) and whose heads are head_dim wide (128 at any width: ours with
attention_head_dim; Qwen3-30B-A3B's 32 heads of 128 make its attention 4096 wide at hidden_size 2048);
Qwen3-MoE (Qwen3MoeForCausalLM) adds Mixtral's router and experts, gates renormalised or not (norm_topk_prob:
moe_norm_topk), and dense blocks where decoder_sparse_step and mlp_only_layers put them (when ours can: the
first ones dense, then every moe_every-th block MoE).

Expert weights, ours stacked (E, f, h) / (E, h, f), come in four namings, all read on import:
  'block_sparse_moe'  Mixtral hub checkpoints' (mistralai/Mixtral-8x7B-v0.1) and what transformers 5's
                      save_pretrained writes: block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1|w3|w2
                      .weight (gate, up, down of expert e). Mixtral export writes this one, which every
                      transformers version loads (transformers 5 fuses it on load).
  'mlp'               the same per-expert tensors under mlp. (transformers 5's module name).
  'qwen'              Qwen3-MoE hub checkpoints' (and its export): mlp.gate.weight, mlp.experts.{e}.gate_proj|
                      up_proj|down_proj.weight.
  'fused'             transformers 5's in-memory parameters: mlp.gate.weight, mlp.experts.gate_up_proj (E, 2f, h),
                      gate rows first, and mlp.experts.down_proj (E, h, f).

Refused, one line each, because the result would not compute the same function:
  - sigmoid routers (DeepSeek-V3), shared experts: neither family has them; without qk_norm (Mixtral) also gates
    not renormalised (moe_norm_topk=false) and dense blocks between MoE ones (moe_first_dense, moe_every);
  - a nonzero expert bias on export: the bias chooses the experts (DeepSeek-V3's auxiliary-loss-free balancing)
    and neither family has such a term, so its routing would differ. Export a checkpoint trained with
    moe_bias_update_rate=0 (the bias stays zero);
  - on import, sliding-window attention; Qwen2-MoE: q/k/v biases and a sigmoid-gated shared expert
    (shared_expert_gate), which ours lacks.
Training choices stay the run's own (like dropout): moe_aux_loss_coef, moe_bias_update_rate and
moe_capacity_factor. The capacity factor only drops tokens past an expert's capacity; transformers runs dropless.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError

# Per-expert namings: the module under a block's prefix, and the gate, up and down projections' names.
PER_EXPERT = {
    "block_sparse_moe": ("block_sparse_moe.", ("w1", "w3", "w2")),
    "mlp": ("mlp.", ("w1", "w3", "w2")),
    "qwen": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
}
EXPORT_LAYOUT = {"mixtral": "block_sparse_moe", "qwen3_moe": "qwen", "deepseek_v3": "qwen"}
# The fields an HF folder decides for an MoE model (models/hf.py's SHAPE_FIELDS adds them).
MOE_SHAPE_FIELDS = (
    "moe_experts",
    "moe_top_k",
    "moe_ffn_hidden_size",
    "moe_shared_experts",
    "moe_first_dense",
    "moe_every",
    "moe_router",
    "moe_norm_topk",
)
# Why a model_type lmt cannot run exactly is refused (besides the generic "not supported").
UNSUPPORTED = {
    "qwen2_moe": "its q/k/v projections have biases and its shared expert is scaled by a sigmoid gate "
    "(shared_expert_gate), which lmt's model has not",
}


def moe_family(cfg: ModelConfig) -> str:
    """'mixtral' or 'qwen3_moe': the transformers architecture that runs the MoE model `cfg` exactly (Qwen3-MoE
    when it normalises queries and keys); ConfigError if none."""
    why = None
    if (cfg.mlp, cfg.norm, cfg.position) != ("swiglu", "rmsnorm", "rope"):
        why = f"mlp={cfg.mlp}, norm={cfg.norm}, position={cfg.position} (Mixtral, Qwen3-MoE: swiglu/rmsnorm/rope)"
    elif cfg.moe_router != "softmax":
        why = f"its router is {cfg.moe_router} (Mixtral's and Qwen3-MoE's are softmax)"
    elif cfg.moe_shared_experts:
        why = f"it has {cfg.moe_shared_experts} shared experts (Mixtral and Qwen3-MoE have none)"
    elif cfg.qk_norm:
        return "qwen3_moe"
    elif not cfg.moe_norm_topk:
        why = (
            "its top-k gates are not renormalised (moe_norm_topk=false; Mixtral always renormalises, and "
            "Qwen3-MoE, which need not, has qk_norm)"
        )
    elif cfg.moe_layers != cfg.n_layers:
        why = (
            f"blocks are dense too (moe_first_dense={cfg.moe_first_dense}, moe_every={cfg.moe_every}; "
            "Mixtral's are all MoE, and Qwen3-MoE, which may have dense ones, has qk_norm)"
        )
    if why:
        raise ConfigError(f"no Hugging Face architecture runs this MoE model exactly: {why}")
    return "mixtral"


def check_expert_bias(state: dict[str, torch.Tensor]) -> None:
    """Refuse to export a nonzero expert bias: it changes which experts are chosen, and the HF routers have none."""
    for name, t in state.items():
        if name.endswith("mlp.router.expert_bias") and torch.count_nonzero(t):
            raise ConfigError(
                f"{name} is not zero: the expert bias chooses experts and Mixtral and Qwen3-MoE have "
                "no such term, so the export would route differently (export a run trained with "
                "moe_bias_update_rate=0)"
            )


def mixtral_config(cfg: ModelConfig, llama: dict) -> dict:
    """MixtralConfig fields: models/hf.py's Llama config.json plus the experts."""
    doc = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    doc.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=cfg.expert_ffn,
        num_local_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_jitter_noise=0.0,
        sliding_window=None,
        output_router_logits=False,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
    )
    return doc


def qwen3_config(cfg: ModelConfig, llama: dict) -> dict:
    """Qwen3Config or Qwen3MoeConfig fields: the Llama config.json plus the experts; every block's MoE-or-dense
    choice is spelled out in mlp_only_layers (decoder_sparse_step 1), which every pattern of ours fits."""
    doc = {k: v for k, v in llama.items() if k != "mlp_bias"}
    doc.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if not cfg.moe_experts:
        return dict(doc, architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    return dict(
        doc,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        moe_intermediate_size=cfg.expert_ffn,
        num_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        norm_topk_prob=cfg.moe_norm_topk,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)],
        output_router_logits=False,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
    )


def _positive(doc: dict, path: str, key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{path}: field '{key}' is missing or not a positive integer (got {value!r})")
    return value


def _experts_and_top_k(doc: dict, path: str, experts_key: str) -> tuple[int, int]:
    experts, top_k = _positive(doc, path, experts_key), _positive(doc, path, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"{path}: num_experts_per_tok {top_k} exceeds {experts_key} {experts}")
    return experts, top_k


def _refuse_window(window: int | None, path: str, fields: dict) -> None:
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
        raise ConfigError(f"{path}: field 'sliding_window' is not an integer (got {window!r})")
    if window is not None and window < fields["max_seq_len"]:
        raise ConfigError(
            f"{path}: sliding_window {window} < max_position_embeddings; lmt's attention is full "
            "causal, so it cannot run this model exactly"
        )


def mixtral_fields(doc: dict, path: str, fields: dict) -> dict:
    """Our MoE fields for a Mixtral config.json, given the Llama ones (`fields`, from the same doc)."""
    experts, top_k = _experts_and_top_k(doc, path, "num_local_experts")
    _refuse_window(doc.get("sliding_window"), path, fields)
    out = dict(
        fields,
        moe_experts=experts,
        moe_top_k=top_k,
        moe_ffn_hidden_size=fields["ffn_hidden_size"],
        moe_shared_experts=0,
        moe_first_dense=0,
        moe_every=1,
        moe_router="softmax",
        moe_norm_topk=True,
    )
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if "rope_theta" not in rope and "rope_theta" not in doc:
        out["rope_theta"] = 1e6  # MixtralConfig's defaults, not Llama's
    if "rms_norm_eps" not in doc:
        out["norm_eps"] = 1e-5
    return out


def qwen3_fields(doc: dict, path: str, fields: dict) -> dict:
    """Our fields for a Qwen3 or Qwen3-MoE config.json, given the Llama ones (`fields`, from the same doc)."""
    n = fields["n_layers"]
    types = doc.get("layer_types")  # Qwen3 slides from block max_window_layers on, Qwen3-MoE in every block
    if types is not None:
        slides = "sliding_attention" in types
    else:
        first_window = doc.get("max_window_layers", 28)
        if not isinstance(first_window, int) or isinstance(first_window, bool):
            raise ConfigError(f"{path}: field 'max_window_layers' is not an integer (got {first_window!r})")
        slides = doc.get("use_sliding_window", False) and (doc["model_type"] == "qwen3_moe" or first_window < n)
    _refuse_window(doc.get("sliding_window") if slides else None, path, fields)
    out = dict(fields, qk_norm=True)
    if doc["model_type"] == "qwen3":
        return out
    experts, top_k = _experts_and_top_k(doc, path, "num_experts" if "num_experts" in doc else "num_local_experts")
    step = _positive(doc, path, "decoder_sparse_step") if "decoder_sparse_step" in doc else 1
    dense = doc.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"{path}: field 'mlp_only_layers' is not a list of block indices (got {dense!r})")
    dense = set(dense)
    moe = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if not moe:
        raise ConfigError(
            f"{path}: no block has experts (decoder_sparse_step {step}, mlp_only_layers "
            f"{sorted(dense)}); import it as a dense model"
        )
    every = moe[1] - moe[0] if len(moe) > 1 else n - moe[0]
    if moe != list(range(moe[0], n, every)):
        raise ConfigError(
            f"{path}: its MoE blocks {moe} are not every k-th block after the first dense ones; lmt "
            "cannot run this model exactly"
        )
    width = _positive(doc, path, "moe_intermediate_size")
    return dict(
        out,
        moe_experts=experts,
        moe_top_k=top_k,
        moe_ffn_hidden_size=width,
        moe_shared_experts=0,
        moe_first_dense=moe[0],
        moe_every=every,
        moe_router="softmax",
        moe_norm_topk=bool(doc.get("norm_topk_prob", False)),
    )


def detect_layout(names: Iterable[str], model_type: str) -> str:
    """Which expert naming ('block_sparse_moe', 'mlp', 'qwen' or 'fused': the module docstring) a folder's tensor
    names use (the family's export naming when none: its names are then missing)."""
    names = list(names)
    if any(n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) for n in names):
        return "fused"
    if model_type in ("qwen3_moe", "deepseek_v3"):
        return "qwen"
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
    module, hf_names = PER_EXPERT[layout]
    block = hf + module
    add(ours + "mlp.router.weight", block + "gate.weight", (e, h))
    for w, hf_w, shape in zip(("w_gate", "w_up", "w_down"), hf_names, ((f, h), (f, h), (h, f))):
        add(f"{ours}mlp.experts.{w}", tuple(f"{block}experts.{j}.{hf_w}.weight" for j in range(e)), shape, _stack)
