"""A training layout (the planner's search point) and a job (what is trained), read from or written to a Config.

Why separate from `Config`: the planner enumerates many layouts for one job, and the axes it searches
(schedule, ZeRO stage, recompute policy, ...) are being added to `Config` by other issues. The planner reads
them with the names they get there (`parallel.schedule`, `parallel.virtual_stages`, `parallel.zero`,
`parallel.sequence_parallel`, `train.recompute`, `train.precision`, `train.compression`) and falls back to
the defaults below while a field does not exist yet, so `lmt estimate` works before and after they land.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from large_model_training.config import Config, ConfigError, ModelConfig

SCHEDULES = ("1f1b", "gpipe", "interleaved")
RECOMPUTE_KINDS = ("none", "selective", "full", "every:K")
PRECISIONS = ("bf16", "fp32")
COMPRESSORS = ("none", "int8", "int4", "topk:R", "randomk:R", "threshold:T", "powersgd:R")


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation policy: 'none', 'selective', 'full' or 'every:K' (K = layers per segment)."""

    kind: str = "none"
    every: int = 0

    @staticmethod
    def parse(text: str) -> "Recompute":
        text = str(text).strip().lower()
        if text in ("none", "selective", "full"):
            return Recompute(text)
        if text.startswith("every:"):
            try:
                k = int(text.split(":", 1)[1])
            except ValueError:
                k = 0
            if k <= 0:
                raise ConfigError(f"recompute 'every:K' needs an integer K >= 1, got '{text}'")
            return Recompute("every", k)
        raise ConfigError(f"unknown recompute policy '{text}'; choose one of {', '.join(RECOMPUTE_KINDS)}")

    def __str__(self) -> str:
        return f"every:{self.every}" if self.kind == "every" else self.kind


@dataclass(frozen=True)
class Compression:
    """Gradient compression of the dp reduction: kind and its parameter (ratio R, rank R or threshold T)."""

    kind: str = "none"
    value: float = 0.0

    @staticmethod
    def parse(text: str) -> "Compression":
        text = str(text).strip().lower()
        if text in ("none", "", "int8", "int4"):
            return Compression(text or "none")
        kind, _, arg = text.partition(":")
        if kind not in ("topk", "randomk", "threshold", "powersgd") or not arg:
            raise ConfigError(f"unknown compression '{text}'; choose one of {', '.join(COMPRESSORS)}")
        try:
            value = float(arg)
        except ValueError:
            raise ConfigError(f"compression '{text}': '{arg}' is not a number") from None
        if kind in ("topk", "randomk") and not 0.0 < value <= 1.0:
            raise ConfigError(f"compression '{text}': ratio must be in (0, 1]")
        if kind == "powersgd" and (value < 1 or not value.is_integer()):
            raise ConfigError(f"compression '{text}': rank must be an integer >= 1")
        if kind == "threshold":
            raise ConfigError(f"compression '{text}': the volume of threshold sparsification depends on the "
                              "gradients and cannot be predicted; plan with topk:R at the density you expect")
        return Compression(kind, value)

    def __str__(self) -> str:
        if self.kind in ("topk", "randomk"):
            return f"{self.kind}:{self.value:g}"
        if self.kind == "powersgd":
            return f"powersgd:{int(self.value)}"
        return self.kind


@dataclass(frozen=True)
class Layout:
    """One point of the search: how the job is spread over tp x pp x dp devices."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    recompute: Recompute = Recompute()
    sequence_parallel: bool = False

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        sched = self.schedule + (f"/v{self.virtual_stages}" if self.schedule == "interleaved" else "")
        return (f"tp={self.tp}{'+sp' if self.sequence_parallel else ''} pp={self.pp} dp={self.dp} "
                f"mb={self.micro_batch_size} {sched} zero={self.zero} recompute={self.recompute}")


@dataclass(frozen=True)
class Job:
    """What is trained, independent of the layout."""

    model: ModelConfig
    seq_len: int
    global_batch_size: int
    precision: str = "bf16"
    compression: Compression = Compression()
    compression_target: str = "gradient"
    """'update': the dp reduction runs after backward, on AdamW's update (no overlap; ZeRO-0 only)."""
    grad_reduce_fp32: bool = False
    """bf16 only: reduce (and keep) gradients in fp32 (4 bytes instead of 2 per parameter)."""
    flash_attention: bool = True
    """Our model runs F.scaled_dot_product_attention (flash kernels). False describes stacks that materialise
    the s x s scores (Megatron before 2023), used to compare with their published runs."""

    def micro_batches(self, layout: Layout) -> int:
        """Micro-batches each dp rank runs per step (the pipeline's m)."""
        return self.global_batch_size // (layout.dp * layout.micro_batch_size)


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Key/value heads computed on one tp rank: split when n_kv_heads >= tp, else the one its queries read."""
    return cfg.kv_heads // tp if cfg.kv_heads >= tp else 1


def kv_weight_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Key/value heads whose weights a tp rank holds: when n_kv_heads < tp every rank keeps all of them
    (parallel/tensor.py: ReplicatedHeadsLinear), and their gradients are summed over tp."""
    return cfg.kv_heads // tp if cfg.kv_heads >= tp else cfg.kv_heads


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp (the same rule as parallel/tensor.py)."""
    return math.ceil(vocab_size / tp) * tp


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per (virtual) stage, as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def virtual_stage_layers(job: Job, layout: Layout) -> list[int]:
    """Blocks per virtual stage, from the pipeline partitioner the runtime uses (balanced by compute, the
    embedding and head counted); the even split when the partitioner refuses the layout."""
    from large_model_training.parallel.pipeline.partition import stage_layers

    try:
        return stage_layers(job.model, layout.pp, layout.virtual_stages, layout.schedule, job.seq_len, "")
    except (ConfigError, ValueError):
        return split_layers(job.model.n_layers, layout.pp * layout.virtual_stages)


def layout_problems(job: Job, layout: Layout) -> list[str]:
    """Why `layout` cannot run `job` (divisibility, sizes); empty when it can."""
    m, out = job.model, []
    t, p, v = layout.tp, layout.pp, layout.virtual_stages
    for name in ("tp", "pp", "dp", "micro_batch_size", "virtual_stages"):
        if getattr(layout, name) < 1:
            out.append(f"{name} must be >= 1, got {getattr(layout, name)}")
    if out:
        return out
    if m.n_heads % t:
        out.append(f"n_heads ({m.n_heads}) not divisible by tp ({t})")
    if m.kv_heads >= t and m.kv_heads % t:
        out.append(f"n_kv_heads ({m.kv_heads}) not divisible by tp ({t})")
    if m.kv_heads < t and t % m.kv_heads:
        out.append(f"tp ({t}) not a multiple of n_kv_heads ({m.kv_heads})")
    if m.ffn_hidden_size % t:
        out.append(f"ffn_hidden_size ({m.ffn_hidden_size}) not divisible by tp ({t})")
    if layout.sequence_parallel and (t == 1 or job.seq_len % t):
        out.append(f"sequence parallelism needs tp > 1 dividing seq_len ({job.seq_len}), tp={t}")
    if layout.schedule not in SCHEDULES:
        out.append(f"unknown schedule '{layout.schedule}' (choose {', '.join(SCHEDULES)})")
    if layout.schedule == "interleaved":
        if v < 2 or p < 2:
            out.append(f"interleaved needs pp >= 2 and virtual_stages >= 2 (pp={p}, v={v})")
        elif m.n_layers % (p * v):
            out.append(f"n_layers ({m.n_layers}) not divisible by pp x virtual_stages ({p} x {v})")
    elif v != 1:
        out.append(f"virtual_stages={v} needs schedule 'interleaved'")
    if p > m.n_layers:
        out.append(f"pp ({p}) exceeds n_layers ({m.n_layers})")
    if layout.zero not in (0, 1, 2, 3):
        out.append(f"zero must be 0-3, got {layout.zero}")
    per_step = layout.dp * layout.micro_batch_size
    if job.global_batch_size % per_step:
        out.append(f"global batch {job.global_batch_size} not a multiple of dp x micro_batch_size "
                   f"({layout.dp} x {layout.micro_batch_size})")
    elif layout.schedule == "interleaved" and job.micro_batches(layout) < p:
        out.append(f"interleaved needs at least pp={p} micro-batches, got {job.micro_batches(layout)}")
    if layout.recompute.kind == "every" and layout.recompute.every > m.n_layers:
        out.append(f"recompute every:{layout.recompute.every} exceeds n_layers ({m.n_layers})")
    if job.compression.kind != "none" and layout.zero >= 2:
        out.append(f"compression {job.compression} composes with ZeRO 0/1 only (zero={layout.zero})")
    if job.compression_target == "update" and layout.zero != 0:
        out.append(f"compressing the update composes with ZeRO 0 only (zero={layout.zero})")
    return out


def _get(obj: object, name: str, default):
    return getattr(obj, name, default)


def layout_from_config(cfg: Config, extra: dict | None = None) -> tuple[Job, Layout]:
    """The job and layout a Config describes. `extra` holds dotted settings Config does not have yet."""
    extra = extra or {}
    par, tr = cfg.parallel, cfg.train

    def setting(key: str, default):
        section, name = key.split(".")
        return extra.get(key, _get(par if section == "parallel" else tr, name, default))

    dp = par.dp or 1
    gbs = tr.global_batch_size or tr.micro_batch_size * dp
    job = Job(model=cfg.model, seq_len=tr.seq_len, global_batch_size=gbs,
              precision=str(setting("train.precision", "fp32")),
              compression=Compression.parse(setting("train.compression", "none")),
              compression_target=str(setting("train.compression_target", "gradient")),
              grad_reduce_fp32=bool(setting("train.grad_reduce_fp32", False)))
    if job.precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got '{job.precision}'")
    layout = Layout(tp=par.tp, pp=par.pp, dp=dp, micro_batch_size=tr.micro_batch_size,
                    schedule=str(setting("parallel.schedule", "1f1b")),
                    virtual_stages=int(setting("parallel.virtual_stages", 1)),
                    zero=int(setting("parallel.zero", 0)),
                    recompute=Recompute.parse(setting("train.recompute", "none")),
                    sequence_parallel=bool(setting("parallel.sequence_parallel", False)))
    return job, layout

