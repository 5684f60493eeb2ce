"""What a valid run is, decided once: the job (what is trained), the layout (how it is spread over devices),
and the one layout check that `lmt train`, `lmt plan` (for every candidate it searches) and `lmt estimate` use.

`check_fields` (config_checks.py) looks at each setting alone; `layout_problems` at how they combine: tensor-parallel
divisibility, sequence parallelism, context parallelism's zig-zag split (and what it refuses), the pipeline split
and schedule, micro-batches, ZeRO with compression.
A new parallel axis adds its rules here (and a field to `Layout`), so the three commands cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from large_model_training.choices import (
    CompressionSpec,
    CompressionTarget,
    Precision,
    RecomputePolicy,
    Schedule,
    splits_backward,
)
from large_model_training.config import Config, ModelConfig, SyncConfig
from large_model_training.config_checks import check_fields
from large_model_training.errors import ConfigError
from large_model_training.parallel.pipeline.partition import split_problems


@dataclass(frozen=True)
class Layout:
    """How a job is spread over tp x pp x dp devices: one point of the planner's search, or one run's layout."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    zero: int = 0
    recompute: RecomputePolicy = RecomputePolicy()
    sequence_parallel: bool = False
    pp_layers: str = ""
    """Explicit blocks per virtual stage ('3,5,5,3'); empty: balanced by compute."""
    cp: int = 1
    """Context-parallel degree (the sequence split over cp ranks)."""
    cp_attention: str = "ring"
    """How attention crosses the cp ranks: 'ring' or 'allgather' (parallel/context.py)."""
    ep: int = 1
    """Expert-parallel degree, carved from dp (the experts of each MoE block split over ep ranks)."""

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        sched = f"{self.schedule}" + (f"/v{self.virtual_stages}" if self.schedule == "interleaved" else "")
        cp = f" cp={self.cp}/{self.cp_attention}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (
            f"tp={self.tp}{'+sp' if self.sequence_parallel else ''}{cp} pp={self.pp} dp={self.dp}{ep} "
            f"mb={self.micro_batch_size} {sched} zero={self.zero} recompute={self.recompute}"
        )


@dataclass(frozen=True)
class Job:
    """What is trained, independent of the layout."""

    model: ModelConfig
    seq_len: int
    global_batch_size: int
    precision: Precision = Precision.BF16
    compression: CompressionSpec = CompressionSpec()
    compression_target: CompressionTarget = CompressionTarget.GRADIENT
    """'update': the dp reduction runs after backward, on AdamW's update (no overlap; ZeRO-0 only)."""
    grad_reduce_fp32: bool = False
    """bf16 only: reduce (and keep) gradients in fp32 (4 bytes instead of 2 per parameter)."""
    flash_attention: bool = True
    """Our model runs F.scaled_dot_product_attention (flash kernels). False describes stacks that materialise
    the s x s scores (Megatron before 2023), used to compare with their published runs."""
    document_mask: bool = False
    """Attention and positions restart at each end-of-document token (data.document_mask)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How the dp replicas synchronise: every step, or DiLoCo's outer step every H steps (parallel/diloco.py)."""
    optimizer_states: str = "fp32"
    """'bf16': Adam's moments stored in bf16 (planner/memory.py counts 2 + 2 bytes instead of 4 + 4)."""
    optimizer: str = "adamw"
    """'onebit-adam': the momentum is averaged compressed after a dense warm-up (parallel/onebit_adam.py)."""
    compile: bool = False
    """torch.compile per block (regional_compile.py)."""
    fsdp_sync_per_step: bool = False
    """ZeRO-3: one reduce-scatter per step instead of per micro-batch (parallel.fsdp_sync_per_step)."""
    fused_loss: bool = True
    """The head GEMM and the loss fused chunk by chunk (train.fused_loss): the last stage never holds the logits."""
    fp8_recipe: str = "tensorwise"
    """--precision fp8's scaling (models/float8.py): tensorwise lets ZeRO-3 gather block weights in float8;
    rowwise_with_gw_hp runs the weight gradients' GEMMs in bf16."""
    fp8_bf16_first_last: int = 0
    """--precision fp8: the first and last K blocks stay bf16 (train.fp8_bf16_first_last)."""
    grad_overlap: bool = True
    """ZeRO 0/1: the dp gradient reduction leaves in buckets during the last backward (ours, DDP). False: after it,
    whole: Megatron-LM 2021's local DDP (`allreduce_gradients()` after `forward_backward_func` in `train_step`) and
    DeepSpeed's pipeline engine (`ReduceGrads` after the last micro-batch in `TrainSchedule`)."""
    fused_optimizer: bool = False
    """The framework's AdamW is one fused multi-tensor pass (Apex's FusedAdam in Megatron-LM and DeepSpeed, torchtitan's
    `fused` implementation): the planner prices one pass; False: lmt's own step, pass by pass
    (planner/optimizer_step.py). Set for published runs; lmt's runtime has no fused AdamW."""
    moe_dispatch: str = "nccl"
    """The all-to-all kernel the planner prices (planner/moe.py): 'nccl' (ours), 'deepep' (DeepEP-class) or
    'deepep-dualpipe' (DeepEP under DualPipe: the all-to-alls beside the paired micro-batch's compute)."""

    @property
    def fp8_tensorwise(self) -> bool:
        """fp8 with one scale per tensor: block linears keep their inputs in float8 (models/float8.py) and ZeRO-3
        gathers their weights in float8 (parallel/fsdp_float8.py)."""
        return self.precision == "fp8" and self.fp8_recipe == "tensorwise"

    @property
    def fp8_weight_grad_hp(self) -> bool:
        """fp8 whose weight-gradient GEMMs run in bf16 (torchao's rowwise_with_gw_hp, models/float8.py)."""
        return self.precision == "fp8" and self.fp8_recipe == "rowwise_with_gw_hp"

    def micro_batches(self, layout: Layout) -> int:
        """Micro-batches each dp rank runs per step (the pipeline's m)."""
        return self.global_batch_size // (layout.dp * layout.micro_batch_size)


def _tensor_parallel_problems(m: ModelConfig, t: int, sp: bool, seq_len: int) -> list[str]:
    if sp and t == 1:
        return ["--sequence-parallel needs --tp > 1 (it shards along the sequence over the tp ranks)"]
    if t == 1:
        return []
    shape = f"tp={t}, n_heads={m.n_heads}, n_kv_heads={m.kv_heads}, ffn_hidden_size={m.ffn_hidden_size}"
    if t > m.n_heads:
        return [f"tp ({t}) is larger than the number of heads ({m.n_heads})"]
    out = []
    if m.n_heads % t:
        out.append(f"model.n_heads must be divisible by tp ({shape})")
    if m.kv_heads >= t and m.kv_heads % t:
        out.append(f"model.n_kv_heads must be divisible by tp ({shape})")
    if m.kv_heads < t:
        out.append(
            f"tp ({t}) exceeds model.n_kv_heads ({m.kv_heads}): the fused q/k/v projection keeps each "
            f"rank's key/value heads whole, as Megatron-LM and torchtitan require; use tp <= {m.kv_heads}"
        )
    if m.ffn_hidden_size % t:
        out.append(f"model.ffn_hidden_size must be divisible by tp ({shape})")
    if sp and seq_len % t:
        out.append(f"--sequence-parallel needs seq_len ({seq_len}) divisible by tp ({t})")
    return out


def _context_parallel_problems(job: Job, lay: Layout) -> list[str]:
    """cp splits each sequence into 2 x cp zig-zag chunks (parallel/context.py)."""
    if lay.cp_attention not in ("ring", "allgather"):
        return [f"--cp-attention must be ring or allgather, got '{lay.cp_attention}'"]
    if lay.cp == 1:
        return []
    out = []
    if job.seq_len % (2 * lay.cp):
        out.append(
            f"--cp {lay.cp} needs seq_len ({job.seq_len}) divisible by 2 x cp = {2 * lay.cp} (the zig-zag "
            f"split that balances causal work cuts each sequence into 2 x cp chunks)"
        )
    elif lay.sequence_parallel and (job.seq_len // lay.cp) % lay.tp:
        out.append(
            f"--sequence-parallel with --cp {lay.cp} needs seq_len / cp ({job.seq_len // lay.cp}) divisible "
            f"by tp ({lay.tp})"
        )
    if job.document_mask:
        out.append(
            "--cp > 1 does not compose with data.document_mask yet: its per-document mask and positions "
            "are built from the whole sequence, which no cp rank holds"
        )
    if job.model.dropout > 0:
        out.append(
            f"--cp > 1 needs model.dropout = 0 (got {job.model.dropout}): attention across the cp ranks "
            f"has no dropout, so the run would silently differ from the same model at cp = 1"
        )
    return out


def _pipeline_problems(job: Job, lay: Layout) -> list[str]:
    p, v, kind = lay.pp, lay.virtual_stages, lay.schedule
    if kind == "interleaved":
        if v < 2:
            return ["the interleaved schedule needs --virtual-stages >= 2"]
        if p < 2:
            return ["the interleaved schedule needs --pp >= 2"]
    elif kind == "zbv":
        # Two chunks per rank in a V. One rank has no bubble to fill, and pp = 1 runs 1f1b's one-chunk order.
        if v != 2:
            return [
                f"the zbv schedule runs two chunks per rank in a V (implied when --virtual-stages is left "
                f"out): --virtual-stages must be 2, got {v}"
            ]
        if p < 2:
            return ["the zbv schedule needs --pp >= 2"]
    elif v != 1:
        return [f"--virtual-stages {v} needs --schedule interleaved (any v >= 2) or zbv (v = 2)"]
    out = split_problems(job.model.n_layers, p, v, kind, lay.pp_layers) if p > 1 or lay.pp_layers else []
    if kind == "interleaved" and job.global_batch_size % (lay.dp * lay.micro_batch_size) == 0:
        m = job.micro_batches(lay)
        if m < p:
            out.append(
                f"the interleaved schedule needs at least pp = {p} micro-batches per step, got {m} (global "
                f"batch {job.global_batch_size} / micro-batch {lay.micro_batch_size} / dp {lay.dp})"
            )
    if splits_backward(kind) and lay.zero == 3:
        out.append(
            f"the {kind} schedule composes with --zero 0, 1 or 2: ZeRO-3 reduce-scatters a module's gradients "
            "in its post-backward hook, before the deferred W actions have produced the weight gradients"
        )
    return out


def _moe_problems(job: Job, lay: Layout) -> list[str]:
    """Expert parallelism's rules, and layouts MoE blocks do not run in yet."""
    if not job.model.moe_experts:
        return [f"--ep {lay.ep} needs an MoE model (model.moe_experts > 0)"] if lay.ep > 1 else []
    if lay.dp % lay.ep:
        return [f"--ep {lay.ep} must divide dp ({lay.dp}): the expert groups are carved from the data-parallel ranks"]
    if job.model.moe_experts % lay.ep:
        return [
            f"--ep {lay.ep} must divide model.moe_experts ({job.model.moe_experts}): each ep rank holds an equal "
            "share of every MoE block's experts"
        ]
    out = []
    if lay.tp > 1 and not lay.sequence_parallel:
        out.append(
            f"MoE blocks with --tp {lay.tp} need --sequence-parallel: each tp rank routes its own "
            "sequence shard (the experts are replicated over tp, not split)"
        )
    if lay.ep > 1:
        if job.compression.enabled or job.compression_target == "update":
            out.append(f"--ep {lay.ep} does not compose with gradient or update compression yet")
    return out


def _sync_problems(job: Job, lay: Layout) -> list[str]:
    """--sync local:H / streaming:H (DiLoCo): whole inner optimizer per replica, its own exchange format."""
    mode = job.sync.mode
    if not mode.infrequent:
        return []
    if lay.zero != 0:
        return [
            f"--sync {mode} composes with --zero 0 only: each replica keeps AdamW's whole state for its inner steps"
        ]
    if job.compression.enabled or job.compression_target == "update":
        return [
            f"--sync {mode} sends no per-step gradients to compress: drop --compression/--compression-target "
            "and use --sync.compression (bf16, int8, int4 or sign) for the outer exchange"
        ]
    if lay.ep > 1 or lay.cp > 1:
        return [
            f"--sync {mode} needs ep = 1 and cp = 1 for now (their gradients reduce over groups the outer "
            "step does not cover)"
        ]
    return []


def _onebit_problems(job: Job, lay: Layout) -> list[str]:
    """--optimizer onebit-adam (parallel/onebit_adam.py): our ZeRO 0-2 engine, its own compressed exchange."""
    if job.optimizer != "onebit-adam":
        return []
    if lay.zero == 3:
        return ["--optimizer onebit-adam composes with --zero 0, 1 or 2, not 3 (FSDP2 owns ZeRO-3's optimizer)"]
    if job.compression.enabled or job.compression_target == "update":
        return [
            "--optimizer onebit-adam compresses the momentum itself: drop --compression/--compression-target "
            "and choose --train.onebit_compression (sign or int8)"
        ]
    if lay.ep > 1 or job.sync.mode.infrequent:
        return ["--optimizer onebit-adam needs ep = 1 and --sync every-step for now"]
    return []


def _muon_problems(job: Job, lay: Layout) -> list[str]:
    """--optimizer muon (parallel/muon.py): an update rule of our ZeRO 0-2 engine on dp-averaged gradients; bf16
    optimizer states, too, are our engine's."""
    if job.optimizer_states != "fp32" and lay.zero == 3:
        return ["--train.optimizer_states bf16 is our AdamW's (ZeRO 0-2): FSDP2's torch AdamW keeps fp32 moments"]
    if job.optimizer_states == "bf16_sr" and (
        job.precision != "bf16"
        or job.optimizer != "adamw"
        or job.compression_target == "update"
        or job.sync.mode.infrequent
    ):
        return [
            "--train.optimizer_states bf16_sr rounds AdamW's update into bf16 masters: it needs --precision "
            "bf16 and --optimizer adamw, without --compression-target update or --sync local/streaming"
        ]
    if job.optimizer != "muon":
        return []
    if lay.zero == 3:
        return ["--optimizer muon composes with --zero 0, 1 or 2, not 3 (FSDP2 owns ZeRO-3's optimizer)"]
    if job.compression_target == "update":
        return [
            "--optimizer muon orthogonalises the averaged gradient: --compression-target update (AdamW's "
            "compressed update) does not apply"
        ]
    return []


def layout_problems(job: Job, lay: Layout) -> list[str]:
    """Every reason why `lay` cannot run `job` (empty when it can), in the order a user should fix them."""
    for name in ("tp", "cp", "ep", "pp", "dp", "micro_batch_size", "virtual_stages"):
        if getattr(lay, name) < 1:
            return [f"parallel.{name} must be positive, got {getattr(lay, name)}"]
    if lay.zero not in (0, 1, 2, 3):
        return [f"parallel.zero must be 0, 1, 2 or 3, got {lay.zero}"]
    out = _tensor_parallel_problems(job.model, lay.tp, lay.sequence_parallel, job.seq_len)
    out += _context_parallel_problems(job, lay)
    per_step = lay.micro_batch_size * lay.dp
    if job.global_batch_size % per_step:
        out.append(
            f"train.global_batch_size ({job.global_batch_size}) must be a multiple of micro_batch_size x "
            f"dp = {lay.micro_batch_size} x {lay.dp}"
        )
    out += _pipeline_problems(job, lay)
    out += _moe_problems(job, lay)
    if job.model.mtp_depth and job.seq_len // (2 * lay.cp) <= job.model.mtp_depth:
        out.append(
            f"model.mtp_depth {job.model.mtp_depth} needs sequences longer than it in every zig-zag chunk: seq_len / "
            f"(2 x cp) = {job.seq_len // (2 * lay.cp)} (each rank keeps labelled positions in each chunk)"
        )
    if job.model.mtp_depth and lay.schedule == "zbv":
        out.append(
            "model.mtp_depth does not compose with the zbv schedule yet: its V puts the last stage, with its "
            "copy of the embedding for the prediction modules, on the first stage's rank"
        )
    if lay.recompute.problem(job.model.n_layers):
        out.append(lay.recompute.problem(job.model.n_layers))
    if job.compression_target == "update" and lay.zero != 0:
        out.append(
            "--compression-target update composes with --zero 0 only: every rank keeps AdamW's moments of "
            "its own gradients for the whole model"
        )
    out += _sync_problems(job, lay)
    out += _compile_problems(job, lay)
    out += _fp8_problems(job, lay)
    out += _onebit_problems(job, lay)
    out += _muon_problems(job, lay)
    if job.compression.enabled and lay.zero >= 2:
        out.append(
            "gradient compression composes with --zero 0 or 1: ZeRO-2/3 reduce-scatter gradient shards, "
            "and a compressed full-bucket exchange with per-rank residuals would undo their "
            "gradient-memory saving"
        )
    return out


def _compile_problems(job: Job, lay: Layout) -> list[str]:
    """--compile with full / every:K recompute traces each checkpointed segment whole (regional_compile.py): a
    segment holding an eager part (tp's collectives, FSDP2's gathers, the cp ring, the MoE layer) cannot be
    traced, and an eager checkpoint around compiled blocks fails in its recomputation (pytorch#166926)."""
    if job.compile and lay.recompute.kind == "sac":  # its per-op policy is wired for eager blocks only
        return ["--recompute sac runs eagerly: use it without --compile (or full / every:K with it)"]
    if not job.compile or lay.recompute.kind not in ("full", "every"):
        return []
    eager = [
        what
        for what, there in (
            ("tp > 1", lay.tp > 1),
            ("cp > 1", lay.cp > 1),
            ("zero 3", lay.zero == 3),
            ("MoE blocks", job.model.moe_experts > 0),
        )
        if there
    ]
    if not eager:
        return []
    return [
        f"--compile with --recompute {lay.recompute} needs blocks that compile whole, not {', '.join(eager)}: "
        f"the checkpointed segment would run eagerly; use --recompute selective (or none) with --compile"
    ]


def _fp8_problems(job: Job, lay: Layout) -> list[str]:
    """Float8 GEMMs (`torch._scaled_mm`) need every dimension a multiple of 16: each block linear's local (per tp
    rank) input and output widths, and the tokens of a micro-batch on one rank (the weight gradient's reduction)."""
    if job.precision != "fp8":
        return []
    m, t = job.model, lay.tp
    q_width, kv_width = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    mlp = (
        [("w_gate_up", m.hidden_size, 2 * m.ffn_hidden_size // t)]
        if m.mlp == "swiglu"
        else [("w_up", m.hidden_size, m.ffn_hidden_size // t)]
    )
    layers = [
        ("wqkv", m.hidden_size, (q_width + 2 * kv_width) // t),
        ("wo", q_width // t, m.hidden_size),
        *mlp,
        ("w_down", m.ffn_hidden_size // t, m.hidden_size),
    ]
    out = [
        f"--precision fp8: {name} is {n_in} x {n_out} per tp rank; float8 GEMMs need multiples of 16"
        for name, n_in, n_out in layers
        if n_in % 16 or n_out % 16
    ]
    if 2 * job.fp8_bf16_first_last >= m.n_layers:
        out.append(
            f"--train.fp8_bf16_first_last {job.fp8_bf16_first_last} keeps all {m.n_layers} blocks in bf16: "
            "fp8 would run nothing; lower it or use --precision bf16"
        )
    tokens = lay.micro_batch_size * job.seq_len // lay.cp
    if tokens % 16:
        out.append(
            f"--precision fp8: a micro-batch holds {tokens} tokens per rank (micro-batch x seq-len / cp); "
            "float8 GEMMs need a multiple of 16"
        )
    return out


def job_and_layout(cfg: Config) -> tuple[Job, Layout]:
    """The job and layout a Config describes (dp 0 read as 1, global batch 0 as micro-batch x dp)."""
    par, tr = cfg.parallel, cfg.train
    dp = par.dp or 1
    job = Job(
        model=cfg.model,
        seq_len=tr.seq_len,
        global_batch_size=tr.global_batch_size or tr.micro_batch_size * dp,
        precision=tr.precision,
        compression=tr.compression,
        compression_target=tr.compression_target,
        grad_reduce_fp32=tr.grad_reduce_fp32,
        document_mask=cfg.data.document_mask,
        sync=cfg.sync,
        optimizer=tr.optimizer,
        compile=tr.compile,
        fused_loss=tr.fused_loss,
        fp8_recipe=tr.fp8_recipe,
        fp8_bf16_first_last=tr.fp8_bf16_first_last,
        fsdp_sync_per_step=par.fsdp_sync_per_step,
        optimizer_states=tr.optimizer_states,
    )
    layout = Layout(
        tp=par.tp,
        pp=par.pp,
        dp=dp,
        micro_batch_size=tr.micro_batch_size,
        schedule=par.schedule,
        virtual_stages=par.virtual_stages,
        zero=par.zero,
        recompute=tr.recompute,
        sequence_parallel=par.sequence_parallel,
        pp_layers=par.pp_layers,
        cp=par.cp,
        cp_attention=par.cp_attention,
        ep=par.ep,
    )
    return job, layout


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check every setting and the layout they make; fill derived defaults (dp, global batch). Returns cfg.

    world_size is given when ranks are already started by torchrun; then dp defaults to what is left.
    """
    check_fields(cfg)
    p, t = cfg.parallel, cfg.train
    if world_size is not None:
        cp = max(p.cp, 1)  # a bad cp is reported by layout_problems, not as a division by zero here
        if p.dp == 0:
            if world_size % (p.tp * cp * p.pp):
                raise ConfigError(f"world size {world_size} is not divisible by tp x cp x pp = {p.tp} x {cp} x {p.pp}")
            p.dp = world_size // (p.tp * cp * p.pp)
        if p.tp * cp * p.pp * p.dp != world_size:
            raise ConfigError(f"world size {world_size} != tp x cp x pp x dp = {p.tp} x {cp} x {p.pp} x {p.dp}")
    elif p.dp == 0:
        p.dp = 1
    if t.global_batch_size == 0:
        t.global_batch_size = t.micro_batch_size * p.dp
    problems = layout_problems(*job_and_layout(cfg))
    if problems:
        raise ConfigError(problems[0])
    return cfg
