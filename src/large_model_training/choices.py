"""The config's choice fields as typed values, parsed once from the string a user writes.

`--schedule`, `--precision`, `--recompute`, `--compression` and `--compression-target` arrive as strings
(flags, TOML). `config.py` turns each into one of the types below when it fills the config, so a typo is a
`ConfigError` before any rank starts, and the trainer, the recompute module, the engine and the planner read
`cfg.train.recompute.kind` instead of splitting strings again. `str(value)` gives back the spelling that
parses to an equal value, which is how the resolved config is written to TOML.

Checks that need other settings (K of every:K against n_layers, interleaving against pp) are in the one
layout check, `layout.py`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from large_model_training.errors import ConfigError


class _Choice(str, enum.Enum):
    """A closed set of spellings; a str, so it compares equal to its spelling and TOML writes it as one."""

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return str.__hash__(self)  # equal to its spelling, so hashed as it: a dict keyed by spellings finds it

    @classmethod
    def parse(cls, text: object, key: str):
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise ConfigError(f"{key} must be one of {', '.join(c.value for c in cls)}, got '{text}'") from None


class Schedule(_Choice):
    """Pipeline schedule (parallel/pipeline/schedules.py builds each as data)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"


SPLIT_BACKWARD = (Schedule.ZB_H1.value, Schedule.ZBV.value)
"""Kinds whose backward is two actions: B (input gradient, sent upstream at once) and a later W (weight
gradient) that fills the bubble. In the other kinds B is the whole backward and there is no W."""


def splits_backward(kind: object) -> bool:
    """Whether `kind` (a Schedule or its spelling) runs separate W actions."""
    return str(kind) in SPLIT_BACKWARD


class Precision(_Choice):
    """fp32; bf16 mixed precision (bf16 compute and communication, fp32 master weights and optimizer); or fp8:
    bf16 mixed precision whose linear layers' GEMMs run in float8 (`train.fp8_recipe`, models/float8.py)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP8 = "fp8"

    @property
    def bytes(self) -> int:
        """Bytes of one value in the compute dtype (fp8's parameters, activations and communication are bf16)."""
        return 4 if self is Precision.FP32 else 2


class Fp8Recipe(_Choice):
    """`train.fp8_recipe`: torchao's float8 training recipes (models/float8.py)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"


FP8_RECIPES = tuple(r.value for r in Fp8Recipe)


def bf16_compute(precision: object) -> bool:
    """Whether a precision (a Precision or its spelling) computes, stores and communicates in bf16: bf16, and fp8,
    whose only float8 parts are the linear layers' GEMM operands."""
    return str(precision) in ("bf16", "fp8")


class CompressionTarget(_Choice):
    """What the dp reduction compresses: the gradient (during backward) or AdamW's update (after it)."""

    GRADIENT = "gradient"
    UPDATE = "update"


def _count(arg: str, text: object, form: str, name: str, hint: str = "") -> int:
    """The integer >= 1 `arg` of spec `text`, e.g. K of 'every:K'; one-line ConfigErrors name `form` and `name`."""
    try:
        value = int(arg)
    except ValueError:
        raise ConfigError(f"{form} needs an integer {name}{hint}, got '{text}'") from None
    if value < 1:
        raise ConfigError(f"{form} needs {name} >= 1, got {name}={value}")
    return value


@dataclass(frozen=True)
class RecomputePolicy:
    """Activation recomputation: 'none', 'selective', 'sac' (per-op), 'full' or 'every:K' (K blocks per checkpoint)."""

    kind: str = "none"
    every: int = 1
    """K of every:K (1 for the other kinds)."""

    @staticmethod
    def parse(text: object, key: str = "train.recompute") -> RecomputePolicy:
        spec = str(text).strip().lower()
        if spec in ("none", "full", "selective", "sac"):
            return RecomputePolicy(spec)
        kind, _, k = spec.partition(":")
        if kind == "every":
            return RecomputePolicy("every", _count(k, text, f"{key} every:K", "K"))
        raise ConfigError(f"{key} must be none, full, selective, sac or every:K, got '{text}'")

    def problem(self, n_layers: int) -> str | None:
        """Why this policy cannot apply to a model of n_layers blocks (None when it can)."""
        if self.kind == "every" and self.every > n_layers:
            return f"train.recompute every:K needs 1 <= K <= n_layers ({n_layers}), got K={self.every}"
        return None

    def __str__(self) -> str:
        return f"every:{self.every}" if self.kind == "every" else self.kind


QUANT_CHUNK = 256
"""Elements per quantisation scale. 256 keeps an outlier's damage local (it coarsens 255 neighbours, not a whole
bucket) while the fp32 scale costs 4/256 = 1.6% of an int8 payload (3.1% of int4); 1024 would quarter that
overhead at four times the reach of each outlier."""

COMPRESSION_GRAMMAR = (
    "none, topk:R, randomk:R, threshold:T, int8[:stochastic|:two-stage], int4[:stochastic|:two-stage], powersgd:R"
)
COMPRESSION_KINDS = ("none", "topk", "randomk", "threshold", "int8", "int4", "powersgd")


@dataclass(frozen=True)
class CompressionSpec:
    """dp gradient compression (compression/ implements each kind):

    none                 dense all-reduce (the reference)
    topk:R               the largest-|g| fraction R of each bucket, R in (0, 1]
    randomk:R            a seeded random fraction R, the same coordinates on every dp rank
    threshold:T          every coordinate with |g| >= T, T > 0 (the seed's 'sparsification')
    int8 | int4          symmetric per-chunk absmax quantisation, every rank's message all-gathered;
                         ':stochastic' for stochastic rounding, ':two-stage' for the two-stage average
                         (compression/two_stage.py: bytes per rank that do not grow with dp, a second
                         rounding on each shard's owner)
    powersgd:R           rank-R PowerSGD (Vogels et al. 2019) on each matrix of a bucket, R >= 1
    """

    kind: str = "none"
    """One of COMPRESSION_KINDS."""
    ratio: float = 1.0
    """topk / randomk: fraction of each bucket's coordinates sent, in (0, 1]."""
    threshold: float = 0.0
    """threshold: send coordinates with |g| >= threshold."""
    rank: int = 0
    """powersgd: rank of the approximation of each matrix."""
    stochastic: bool = False
    """int8 / int4: stochastic rounding (unbiased) instead of round-to-nearest."""
    two_stage: bool = False
    """int8 / int4: shards exchanged by all-to-all, averaged and re-quantised by their owner, then all-gathered."""
    chunk: int = QUANT_CHUNK
    """int8 / int4: elements sharing one fp32 scale."""

    @property
    def bits(self) -> int:
        """Bits per quantised value (0 for non-quantising kinds)."""
        return {"int8": 8, "int4": 4}.get(self.kind, 0)

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def __str__(self) -> str:
        if self.kind in ("topk", "randomk"):
            return f"{self.kind}:{self.ratio!r}"
        if self.kind == "threshold":
            return f"threshold:{self.threshold!r}"
        if self.kind == "powersgd":
            return f"powersgd:{self.rank}"
        return self.kind + (":stochastic" if self.stochastic else ":two-stage" if self.two_stage else "")

    @staticmethod
    def parse(spec: object, key: str = "train.compression") -> CompressionSpec:
        """Parse a spec string (grammar above); bad input raises ConfigError with a one-line message."""
        if isinstance(spec, CompressionSpec):
            return spec
        kind, sep, arg = _split_spec(
            spec,
            COMPRESSION_KINDS,
            f"unknown compressor '{spec}' for {key}; choose one of: {COMPRESSION_GRAMMAR}",
            bare="none",
            what="compression",
        )
        if kind == "none":
            return CompressionSpec()
        if kind in ("int8", "int4"):
            if sep and arg not in ("stochastic", "two-stage"):
                raise ConfigError(f"compression '{spec}': the options of {kind} are ':stochastic' and ':two-stage'")
            return CompressionSpec(kind, stochastic=arg == "stochastic", two_stage=arg == "two-stage")
        if not arg:
            example = {
                "topk": "topk:0.01",
                "randomk": "randomk:0.01",
                "threshold": "threshold:1e-3",
                "powersgd": "powersgd:4",
            }[kind]
            raise ConfigError(f"compression '{kind}' needs a value, e.g. {example}")
        if kind in ("topk", "randomk"):
            ratio = _number(kind, arg)
            if not 0.0 < ratio <= 1.0:
                raise ConfigError(f"compression '{spec}': the ratio must be in (0, 1], got {ratio}")
            return CompressionSpec(kind, ratio=ratio)
        if kind == "threshold":
            threshold = _number(kind, arg)
            if threshold <= 0.0:
                raise ConfigError(f"compression '{spec}': the threshold must be > 0, got {threshold}")
            return CompressionSpec(kind, threshold=threshold)
        try:
            rank = int(arg)
        except ValueError:
            raise ConfigError(f"compression '{spec}': the rank must be an integer, got '{arg}'") from None
        if rank <= 0:
            raise ConfigError(f"compression '{spec}': the rank must be >= 1, got {rank}")
        return CompressionSpec(kind, rank=rank)


def _split_spec(value: object, kinds: tuple[str, ...], unknown: str, bare: str, what: str) -> tuple[str, bool, str]:
    """(kind, whether a ':' followed, argument) of a 'kind[:argument]' spec, case and outer spaces ignored.
    Raises ConfigError(`unknown`) for a kind not in `kinds`, and a one-line ConfigError when the kind `bare`,
    which takes no argument, has one (`what` names the setting in that message)."""
    kind, sep, arg = str(value).strip().lower().partition(":")
    if kind not in kinds:
        raise ConfigError(unknown)
    if kind == bare and sep:
        raise ConfigError(f"{what} '{bare}' takes no argument, got '{value}'")
    return kind, bool(sep), arg


def _number(kind: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"compression '{kind}:{text}': '{text}' is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"compression '{kind}:{text}': the value must be finite")
    return value


def parse_compression(spec: object) -> CompressionSpec:
    """`CompressionSpec.parse` under the name the compression API has always used."""
    return CompressionSpec.parse(spec)


class Mlp(_Choice):  # model.mlp: Llama's or GPT's
    SWIGLU = "swiglu"
    GELU = "gelu"


class Norm(_Choice):  # model.norm: Llama's or GPT's
    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"


class Position(_Choice):  # model.position: rotary (Llama) or an absolute table (GPT)
    ROPE = "rope"
    LEARNED = "learned"


class AttentionKind(_Choice):
    """model.attention: grouped-query heads, or DeepSeek's multi-head latent attention (models/mla.py)."""

    GQA = "gqa"
    MLA = "mla"


class MoeRouter(_Choice):  # model.moe_router: the router's scores (models/moe.py)
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class MoeAuxScope(_Choice):  # model.moe_aux_loss_scope: the load-balancing loss's tokens (models/moe.py)
    BATCH = "batch"
    SEQUENCE = "sequence"


class Optimizer(_Choice):
    """train.optimizer: each names the module of parallel/ whose `make_rule` builds its update rule
    (parallel/update_rule.py). A new optimizer is that module and its line here."""

    ADAMW = "adamw"
    ONEBIT_ADAM = "onebit-adam"
    MUON = "muon"

    @property
    def module(self) -> str:
        return self.value.replace("-", "_")


class StateDtype(_Choice):
    """train.optimizer_states: the dtype of Adam's moments (bf16: 4 bytes per parameter instead of 8, updated in
    fp32, stored by stochastic rounding: parallel/adamw.RoundingNoise); bf16_sr also drops the fp32 master copy
    under --precision bf16 (the bf16 parameters updated in fp32 and stochastically rounded: 12 -> 4 bytes)."""

    FP32 = "fp32"
    BF16 = "bf16"
    BF16_SR = "bf16_sr"


class OnebitCompression(_Choice):  # train.onebit_compression: 1-bit Adam's exchange (compression/sign.py)
    SIGN = "sign"
    INT8 = "int8"
    NONE = "none"


class SpikeAction(_Choice):  # train.spike_action: what the loss-spike guard does (reliability/guards.py)
    SKIP = "skip"
    ROLLBACK = "rollback"


class CpAttention(_Choice):
    """parallel.cp_attention: attention across the cp ranks (parallel/context.py)."""

    RING = "ring"
    ALLGATHER = "allgather"

    @classmethod
    def parse(cls, text: object, key: str):
        try:
            return cls(str(text).strip().lower())
        except ValueError:  # the flag's own words (layout.py says the same of a Layout built directly)
            raise ConfigError(f"--cp-attention must be ring or allgather, got '{text}'") from None


class Tracker(_Choice):
    """Experiment trackers (run.tracker; train/trackers.py); each but 'none' is the pip package of its name."""

    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    TRACKIO = "trackio"
    NONE = "none"


TRACKERS = tuple(t.value for t in Tracker)
SYNC_KINDS = ("every-step", "local", "streaming")


class SyncCompression(_Choice):  # sync.compression: what DiLoCo's outer exchange sends (parallel/diloco.py)
    NONE = "none"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    SIGN = "sign"


SYNC_CODED = ("int8", "int4", "sign")
"""The exchange formats that cannot be summed in place: sent through the two-stage compressed average
(compression/two_stage.py), with a worker and a server error."""


@dataclass(frozen=True)
class SyncMode:
    """How often the data-parallel replicas synchronise (parallel/diloco.py):

    every-step           gradients averaged every step (ordinary data parallelism)
    local:H              DiLoCo: H inner AdamW steps per replica, then an outer Nesterov step on the
                         averaged parameter change, H >= 1
    streaming:H          Streaming DiLoCo: the model in fragments, each synchronised every H steps at
                         staggered offsets, its exchange overlapped with the next inner step
    """

    kind: str = "every-step"
    every: int = 1
    """H: inner steps between two synchronisations of a parameter (1 for every-step)."""

    @property
    def infrequent(self) -> bool:
        return self.kind != "every-step"

    def __str__(self) -> str:
        return self.kind if self.kind == "every-step" else f"{self.kind}:{self.every}"

    @staticmethod
    def parse(text: object, key: str = "sync.mode") -> SyncMode:
        if isinstance(text, SyncMode):
            return text
        kind, _, arg = _split_spec(
            text,
            SYNC_KINDS,
            f"{key} must be every-step, local:H or streaming:H, got '{text}'",
            bare="every-step",
            what=key,
        )
        if kind == "every-step":
            return SyncMode()
        return SyncMode(kind, _count(arg, text, f"{key} {kind}:H", "H", " (inner steps between syncs)"))
