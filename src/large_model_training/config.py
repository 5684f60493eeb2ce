"""Typed configuration: dataclasses with a docstring per field, filled from presets, TOML and CLI overrides.

Choice fields (schedule, precision, recompute, compression, ...) hold typed values from `choices.py`, parsed once
when the config is filled. `config_checks.check_fields` checks each setting alone, `layout.validate` several together
(the planner's search too), in the launching process before any rank starts. A bad value raises `ConfigError`: one
line on stderr, exit code 2. Ranks never re-check a `Config`.
Resolution order (later wins): model preset -> TOML file -> command-line flags (`--tp`, `--model.hidden_size`, ...).
The resolved config is written back as TOML into the run folder, and that file is accepted by `--config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from large_model_training.choices import (
    AttentionKind,
    CompressionSpec,
    CompressionTarget,
    CpAttention,
    Fp8Recipe,
    Mlp,
    MoeAuxScope,
    MoeRouter,
    Norm,
    OnebitCompression,
    Optimizer,
    Position,
    Precision,
    RecomputePolicy,
    Schedule,
    SpikeAction,
    StateDtype,
    Tracker,
)
from large_model_training.config_sync import SyncConfig
from large_model_training.config_toml import CHOICE_TYPES, coerce, load_toml, merge_sources
from large_model_training.errors import ConfigError
from large_model_training.models.presets import PRESETS

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "SyncConfig",
    "TrainConfig",
    "SECTION_TYPES",
    "build_config",
    "load_toml",
    "model_from_preset",
    "to_toml",
]


@dataclass
class ModelConfig:
    """Shape of a Llama/GPT-family decoder."""

    preset: str = "tiny"
    """Name of the preset the other fields started from (see `lmt.models.presets.PRESETS`)."""
    vocab_size: int = 256
    """Tokens in the vocabulary (256 for the byte-level tokenizer)."""
    hidden_size: int = 128
    """Model width h."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads a; each is attention_head_dim wide (hidden_size / n_heads unless set)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means n_heads (plain multi-head attention)."""
    attention_head_dim: int = 0
    """Width of one attention head (Hugging Face's head_dim; also --model.head_dim); 0 means hidden_size / n_heads.
    q projects hidden_size -> n_heads x head_dim, k and v -> kv heads x head_dim, o back to hidden_size (Qwen3:
    128 at any width)."""
    ffn_hidden_size: int = 512
    """Inner width of the MLP (for swiglu: width of each of the gate and up projections)."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (size of the learned position table; rope has no table)."""
    mlp: Mlp = Mlp.SWIGLU
    """MLP kind: 'swiglu' (Llama) or 'gelu' (GPT)."""
    norm: Norm = Norm.RMSNORM
    """Normalisation: 'rmsnorm' (Llama) or 'layernorm' (GPT)."""
    position: Position = Position.ROPE
    """Position encoding: 'rope' (rotary, Llama) or 'learned' (absolute table, GPT)."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output head."""
    dropout: float = 0.0
    """Dropout probability after attention and MLP (0 keeps runs bit-comparable across layouts)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation (output projections scaled by 1/sqrt(2L))."""
    qk_norm: bool = False
    """RMS-normalise each head's queries and keys over head_dim before rope, one weight per q and k (Qwen3)."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3): D sequential modules after the last block, module k predicting the
    token k + 1 ahead from module k-1's states and token k's embedding, sharing the embedding and head; 0 = off."""
    attention: AttentionKind = AttentionKind.GQA
    """'gqa' (grouped-query heads) or 'mla' (DeepSeek-V2/V3 multi-head latent attention: models/mla.py)."""
    q_lora_rank: int = 0
    """mla: width of the compressed query (DeepSeek-V3: 1536)."""
    kv_lora_rank: int = 0
    """mla: width of the compressed keys and values shared by all heads (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int = 0
    """mla: per-head query/key width without rotary positions (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int = 0
    """mla: per-head query width with rotary positions; the key's rotary part is one head shared by all (64)."""
    v_head_dim: int = 0
    """mla: per-head value width (DeepSeek-V3: 128)."""
    moe_experts: int = 0
    """Routed experts per Mixture-of-Experts block; 0 = dense model (every block a plain MLP)."""
    moe_top_k: int = 2
    """Experts each token is sent to."""
    moe_ffn_hidden_size: int = 0
    """Inner width of one expert (swiglu); 0 means ffn_hidden_size."""
    moe_shared_experts: int = 0
    """Shared experts (DeepSeek, Qwen-MoE): one dense swiglu of this many experts' width that every token runs."""
    moe_first_dense: int = 0
    """The first k blocks stay dense (DeepSeek-V3: 3), as early layers gain little from experts."""
    moe_every: int = 1
    """Every k-th block (after the dense ones) is MoE, the others dense (1: all of them)."""
    moe_router: MoeRouter = MoeRouter.SOFTMAX
    """Router scores: 'softmax' (Switch, Mixtral) or 'sigmoid' (DeepSeek-V3; the top-k gates renormalised)."""
    moe_norm_topk: bool = False
    """Renormalise softmax gates to sum to 1 over the chosen k (Mixtral, Qwen3-MoE: norm_topk_prob); sigmoid
    gates always are."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss E * sum_e f_e P_e per MoE block; 0 turns it off."""
    moe_aux_loss_scope: MoeAuxScope = MoeAuxScope.BATCH
    """Over what tokens f_e and P_e are taken: 'batch' (the micro-batch's, Switch) or 'sequence' (each sequence's,
    averaged: DeepSeek-V3's sequence-wise balance loss)."""
    moe_groups: int = 1
    """Expert groups (DeepSeek-V3's n_group: 8, one per node): a token's experts come from its moe_topk_groups
    groups whose two best (biased) scores sum highest. 1: no group limit."""
    moe_topk_groups: int = 1
    """Groups a token may route to (DeepSeek-V3's topk_group: 4), when moe_groups > 1."""
    moe_routed_scale: float = 1.0
    """Routed experts' gates times this (DeepSeek-V3's routed_scaling_factor: 2.5)."""
    moe_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: per-expert bias that only chooses experts, moved by this rate
    once per optimizer step towards equal loads; 0 turns it off."""
    moe_capacity_factor: float = 0.0
    """Tokens an expert takes per micro-batch, as a multiple of its fair share T k / E (the rest dropped); 0 =
    dropless."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rope_dim(self) -> int:
        """The width rotary positions apply to: a head's (gqa), the decoupled rotary part's (mla)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def head_dim(self) -> int:
        """The width of one attention head in effect: attention_head_dim, or hidden_size / n_heads when 0."""
        return self.attention_head_dim or self.hidden_size // self.n_heads

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` holds experts: after the first dense ones, every moe_every-th."""
        first = self.moe_first_dense
        return self.moe_experts > 0 and layer >= first and (layer - first) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))


@dataclass
class ParallelConfig:
    """Degrees of each parallel axis; world size = tp x cp x pp x dp."""

    tp: int = 1
    """Tensor-parallel degree (innermost axis: neighbouring ranks, one node on a cluster)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (zig-zag), attention as a ring or all-gather."""
    cp_attention: CpAttention = CpAttention.RING
    """How attention crosses the cp ranks: 'ring' (key/value blocks passed around) or 'allgather' (Llama 3's)."""
    ep: int = 1
    """Expert-parallel degree: each MoE block's experts split over ep ranks carved from the dp ranks (ep divides dp);
    tokens travel to their experts by all-to-all."""
    ep_overlap: bool = False
    """ep > 1: each MoE layer's copies in two parts, one part's all-to-alls in flight while the other's experts
    compute, forward and backward (parallel/expert.py, dispatch_overlapped)."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    dp: int = 0
    """Data-parallel degree; 0 means 'what is left': 1 on a local launch, WORLD_SIZE / (tp x pp) under torchrun."""
    sequence_parallel: bool = False
    """Shard norm and dropout regions along the sequence over tp (all-gather/reduce-scatter instead of all-reduce)."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved' (virtual_stages >= 2), 'zb-h1' or 'zbv' (zero bubble,
    backward split into input and weight gradients; zbv: two chunks in a V, virtual_stages = 2 implied)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule): each rank holds v non-adjacent chunks."""
    pp_layers: str = ""
    """Blocks per (virtual) stage, e.g. '3,5,5,3'; empty = balanced by compute (uneven chunks found too)."""
    zero: int = 0
    """ZeRO stage over dp: 0 replicated, 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    fsdp_sync_per_step: bool = False  # ZeRO-3: one reduce-scatter per step, not per micro-batch (parallel/fsdp.py)
    bucket_mb: float = 25.0
    """Size of a gradient-reduction bucket in MiB (reductions start per bucket, overlapping backward)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass
class TrainConfig:
    """Optimisation and batching."""

    steps: int = 300
    """Optimizer steps to run."""
    seq_len: int = 256
    """Tokens per sample."""
    micro_batch_size: int = 16
    """Samples per forward/backward on one rank."""
    global_batch_size: int = 0
    """Samples per optimizer step over all dp ranks; 0 means micro_batch_size x dp (no accumulation)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr x min_lr_ratio."""
    warmup_steps: int = 30
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm (over all ranks); 0 disables clipping."""
    seed: int = 1234
    """Seed of weights, data order and dropout; runs with the same seed and global batch are comparable."""
    eval_every: int = 100
    """Run validation every this many steps (and at the last step); 0 disables."""
    eval_batches: int = 8
    """Global batches of held-out samples in one validation (the same samples in every layout)."""
    max_bad_steps: int = 5
    """Stop the run after this many consecutive steps with a non-finite loss or gradient norm."""
    precision: Precision = Precision.FP32
    """'fp32'; 'bf16' (bf16 compute and communication, fp32 masters); 'fp8': bf16, the blocks' linears in float8."""
    mtp_loss_weight: float = 0.3
    """model.mtp_depth > 0: the weight lambda of the mean of the D prediction losses (DeepSeek-V3: 0.3, then 0.1)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.TENSORWISE
    """--precision fp8: torchao's tensorwise (e5m2 gradients), rowwise or rowwise_with_gw_hp (dW in bf16)."""
    fp8_bf16_first_last: int = 0
    """--precision fp8: the first and the last K blocks keep bf16 GEMMs (Megatron's --first-last-layers-bf16)."""
    grad_reduce_fp32: bool = False
    """Under bf16, reduce gradients over dp in fp32 (twice the bytes, no rounding in the sum)."""
    recompute: RecomputePolicy = RecomputePolicy()
    """Activation recomputation: 'none', 'full', 'every:K' (checkpoint every K-th block), 'selective' or 'sac'."""
    offload_activations: bool = False
    """Move activations saved for backward to host memory (accelerators only; a no-op on the CPU)."""
    compile: bool = False
    """torch.compile each transformer block (regional compilation: one graph shared by all blocks)."""
    compile_backend: str = "inductor"
    """torch.compile backend with --compile: 'inductor' (generated fused kernels) or 'aot_eager' (no codegen)."""
    compression: CompressionSpec = CompressionSpec()
    """dp gradient compression: none, topk:R, randomk:R, threshold:T, int8, int4 (':stochastic'), powersgd:R."""
    error_feedback: bool = True
    """Add what compression did not send to the next step's gradient (error feedback)."""
    compression_warmup: int = 0
    """With compression: all-reduce this many first steps densely, then compress (start_powerSGD_iter)."""
    spike_factor: float = 0.0
    """Loss-spike guard: a loss above this x the median of the last spike_window accepted ones; 0 = off."""
    spike_window: int = 32
    """Accepted losses in the spike guard's running median (it acts once the window is full)."""
    spike_action: SpikeAction = SpikeAction.SKIP
    """On a spike: 'skip' (drop the update) or 'rollback' (reload the last checkpoint, skip the batches since)."""
    compression_target: CompressionTarget = CompressionTarget.GRADIENT
    """What dp compresses: 'gradient', or 'update' (AdamW's update per rank, averaged; ZeRO-0 only)."""
    optimizer_states: StateDtype = StateDtype.FP32
    """'fp32' or 'bf16': the dtype Adam's moments are stored in (choices.StateDtype; ZeRO 0-2)."""
    optimizer: Optimizer = Optimizer.ADAMW
    """'adamw', 'muon' (parallel/muon.py) or 'onebit-adam' (1-bit Adam after onebit_warmup AdamW steps; ZeRO 0-2)."""
    onebit_warmup: int = 100
    """onebit-adam: dense AdamW steps before the variance freezes and compression starts (DeepSpeed's freeze_step)."""
    onebit_compression: OnebitCompression = OnebitCompression.SIGN
    """onebit-adam: 'sign' (1 bit + a scale per 1024, error feedback), 'int8' (error feedback) or 'none'."""
    onebit_variance_refresh: int = 0
    """onebit-adam: update v from the averaged momentum increment every this many steps (0/1 Adam); 0 = frozen."""
    fused_loss: bool = True
    """The head GEMM and the cross-entropy fused chunk by chunk, never holding the logits (models/fused_loss.py);
    false: logits, then the loss on them (more memory; the same loss and gradients to float rounding)."""


@dataclass
class DataConfig:
    """Where tokens come from (see docs/data.md)."""

    path: str = ""
    """Prepared folder, text file/folder, JSONL or Parquet, or a blend 'W:PATH,W:PATH'; empty = Python stdlib source."""
    tokenizer: str = ""
    """Hugging Face tokenizer.json for raw text (a prepared folder has its own); empty = byte-level (256 ids)."""
    val_fraction: float = 0.02
    """Fraction of documents (every 1/fraction-th) held out for validation when raw text is prepared."""
    document_mask: bool = False
    """Attention stays inside each document of a packed sequence, positions restart per document (as Llama 3)."""


@dataclass
class RunConfig:
    """Run folder, checkpoints and logging."""

    out: str = ""
    """Run folder; empty = runs/<timestamp>."""
    save_every: int = 0
    """Save a checkpoint every this many steps (and at the end); 0 saves only at the end."""
    resume: str = ""
    """Run or checkpoint folder, 'latest' (newest in --out) or 'auto' (newest in --out if any, else fresh)."""
    log_every: int = 10
    """Plain log line every this many steps when stdout is not a terminal."""
    tracker: Tracker = Tracker.TENSORBOARD
    """Experiment tracker beside metrics.jsonl, offline into the run folder: 'tensorboard', 'wandb', 'mlflow',
    'trackio' or 'none' (each an optional package: pip install 'large-model-training[wandb]')."""
    keep: int = 0
    """Keep only the newest this many checkpoints (0 keeps all)."""
    init_from_hf: str = ""
    """Hugging Face folder (Llama, Qwen3, Mixtral, Qwen3-MoE, GPT-2 safetensors): weights and shape (not on resume)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues (the next save waits for the previous)."""
    timeout: float = 300.0
    """Seconds a collective may wait for a peer before the rank gives up (a dead rank ends the job)."""
    stall_timeout: float = 60.0
    """Seconds without progress (or heartbeat) before a stalled job ends, naming the cause; 0 = off."""
    straggler_report: bool = True
    """Record each step's slowest rank and its lag behind the median (straggler_rank, straggler_lag_s)."""
    max_restarts: int = 0
    """Restart the ranks this many times after a failure or stall, from the newest checkpoint (as torchrun's)."""
    save_local_every: int = 0
    """Copy each rank's state to host memory and a partner every N steps (0: off); restarts restore from it."""
    spares: int = 0
    """Idle processes that replace a killed rank while the others keep running (needs save_local_every)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    @property
    def micro_batches(self) -> int:
        """Micro-batches each dp rank accumulates per optimizer step."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain values by section (choice fields as their spelling): for TOML, JSON and checkpoints."""
        return {
            name: {f.name: _plain(getattr(getattr(self, name), f.name)) for f in fields(SECTION_TYPES[name])}
            for name in SECTION_TYPES
        }


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, CHOICE_TYPES) else value


# Other spellings of a setting, accepted in TOML files and on the command line (Hugging Face's name first).
ALIASES = {"model.head_dim": "model.attention_head_dim"}

SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "run": RunConfig,
    "sync": SyncConfig,
}


def _field_types(cls: type) -> dict[str, type]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> None:
    """Set dotted keys ('model.hidden_size') on cfg, type-checked; unknown keys are errors."""
    for key, value in overrides.items():
        key = ALIASES.get(key, key)
        section, _, name = key.partition(".")
        if section not in SECTION_TYPES or not name:
            raise ConfigError(f"unknown setting '{key}' (sections: {', '.join(SECTION_TYPES)})")
        types = _field_types(SECTION_TYPES[section])
        if name not in types:
            raise ConfigError(f"unknown setting '{key}'; {section} has: {', '.join(types)}")
        setattr(getattr(cfg, section), name, coerce(key, value, types[name]))


def model_from_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return ModelConfig(preset=name, **PRESETS[name])


def build_config(toml_path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Preset -> TOML -> overrides (and what they imply: config_toml.merge_sources). Does not validate."""
    flat = merge_sources(load_toml(toml_path) if toml_path else {}, overrides or {})
    preset = flat.pop("model.preset", None) or "tiny"
    cfg = Config(model=model_from_preset(str(preset)))
    apply_overrides(cfg, flat)
    return cfg


def to_toml(cfg: Config) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.to_dict())
