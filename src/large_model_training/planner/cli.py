"""`lmt plan`, `lmt estimate`, `lmt calibrate`: parse, check, call the planner, print.

Wired into the main CLI by `add_subcommands(subparsers)` and `COMMANDS`; bad input raises ConfigError (one
line on stderr, exit 2).

    lmt plan --model megatron-1t --devices 8192 --hardware a100-80gb --global-batch-size 3072 --top 5
    lmt estimate --model small --tp 2 --zero 1 --recompute selective --json
    lmt calibrate
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import fields

from large_model_training.arguments import add_dotted, add_train_arguments, field_docs, overrides
from large_model_training.choices import CompressionTarget, Precision, RecomputePolicy, Schedule
from large_model_training.config import ALIASES, ModelConfig, build_config, load_toml
from large_model_training.config_checks import check_fields
from large_model_training.errors import ConfigError
from large_model_training.layout import Job, Layout, layout_problems
from large_model_training.planner.context import ATTENTIONS
from large_model_training.planner.error_band import band_note
from large_model_training.planner.estimate import checked_job_and_layout, memory_by_stage, without_data_files
from large_model_training.planner.hardware import CATALOGUE, OVERRIDES, GiB, get_hardware, with_overrides
from large_model_training.planner.search import Axes, Plan, Planner, plan_layouts


def _bool(text: str) -> bool:
    if str(text).lower() in ("1", "true", "yes", "on"):
        return True
    if str(text).lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def add_subcommands(subparsers) -> None:
    """Add `plan`, `estimate` and `calibrate` to the main CLI's subparsers."""
    plan = subparsers.add_parser(
        "plan",
        allow_abbrev=False,
        help="rank parallel layouts by predicted tokens/s",
        description="Search tp x cp x pp x dp x micro-batch x schedule x ZeRO x recompute x "
        "sequence parallel for a model on a cluster; any axis flag fixes it.",
    )
    plan.add_argument("--config", metavar="FILE.toml", help="TOML file ([model] and [train] are read)")
    plan.add_argument("--model", dest="model.preset", metavar="PRESET", help="model preset")
    docs = field_docs(ModelConfig)
    group = plan.add_argument_group("model overrides")
    for f in fields(ModelConfig):
        if f.name != "preset":
            add_dotted(group, f"model.{f.name}", f"model.{f.name}", docs.get(f.name, ""))
    for alias, key in ALIASES.items():  # --model.head_dim
        add_dotted(group, alias, key, f"the same as --{key}")
    plan.add_argument("--devices", type=int, required=True, metavar="N", help="devices in the cluster")
    plan.add_argument("--devices-per-node", type=int, metavar="K", help="devices per node (default: hardware's)")
    plan.add_argument(
        "--hardware",
        default="a100-80gb",
        metavar="NAME",
        help=f"one of {', '.join(CATALOGUE)}, or cpu after `lmt calibrate` [a100-80gb]",
    )
    _add_hardware_overrides(plan)
    plan.add_argument(
        "--flash-attention",
        type=_bool,
        default=True,
        metavar="BOOL",
        help="false: the attention scores are materialised (stacks before 2023) [true]",
    )
    plan.add_argument(
        "--fsdp-sync-per-step",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="ZeRO-3: one reduce-scatter per step, not per micro-batch [false]",
    )
    plan.add_argument("--global-batch-size", type=int, metavar="N", help="samples per step [config's, else devices]")
    plan.add_argument("--seq-len", type=int, metavar="N", help="tokens per sample [config's, else max_seq_len]")
    plan.add_argument(
        "--precision", choices=[p.value for p in Precision], help="bf16 mixed precision [bf16; fp32 on cpu]"
    )
    plan.add_argument("--compression", default="none", metavar="KIND", help="dp gradient compression [none]")
    plan.add_argument(
        "--sync",
        dest="sync.mode",
        metavar="MODE",
        help="every-step | local:H | streaming:H (DiLoCo: dp volume / H) [every-step]",
    )
    plan.add_argument(
        "--compression-target",
        choices=[t.value for t in CompressionTarget],
        default="gradient",
        help="compress the gradient, or AdamW's update (ZeRO 0 only, not overlapped) [gradient]",
    )
    axes = plan.add_argument_group("fixed axes (searched when not given)")
    for flag in ("tp", "pp", "dp", "micro-batch-size", "virtual-stages", "zero"):
        axes.add_argument(f"--{flag}", type=int, metavar="N")
    axes.add_argument("--cp", type=int, metavar="N", help="context-parallel degree (the sequence split over N ranks)")
    axes.add_argument("--cp-attention", choices=list(ATTENTIONS), help="how attention crosses the cp ranks")
    axes.add_argument("--ep", type=int, metavar="N", help="expert-parallel degree (MoE): experts split over N dp ranks")
    axes.add_argument("--schedule", choices=[k.value for k in Schedule])
    axes.add_argument("--recompute", metavar="POLICY", help="none | selective | full | every:K")
    axes.add_argument("--sequence-parallel", type=_bool, metavar="BOOL")
    plan.add_argument("--top", type=int, default=5, metavar="K", help="layouts to show [5]")
    plan.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    plan.add_argument("--write-config", metavar="FILE.toml", help="write the best layout as an lmt train config")
    plan.add_argument("--timeline", metavar="FILE.png", help="Gantt chart of the best layout's pipeline step")

    est = subparsers.add_parser(
        "estimate",
        allow_abbrev=False,
        help="memory per rank of one layout",
        description="Memory per rank (parameters, gradients, optimizer states, "
        "activations, buffers) of the layout lmt train's flags describe.",
    )
    add_train_arguments(est)
    est.add_argument("--hardware", metavar="NAME", help="device whose kernels and memory to assume [this machine]")
    _add_hardware_overrides(est)
    est.add_argument("--json", action="store_true", help="print JSON")
    cal = subparsers.add_parser("calibrate", allow_abbrev=False, help="measure this machine as hardware 'cpu'")
    cal.add_argument("--name", help="name of the stored entry [cpu; with --from: the base entry's]")
    cal.add_argument(
        "--from",
        dest="from_suite",
        metavar="GPU_SUITE.json",
        help="update a catalogue entry from bench/gpu_suite.py's measurements instead of measuring",
    )
    cal.add_argument("--base", metavar="NAME", help="with --from: the entry to update [the suite's device's]")


def _add_hardware_overrides(parser: argparse.ArgumentParser) -> None:
    for flag, (_, _unit, text) in OVERRIDES.items():
        parser.add_argument(f"--hardware.{flag}", dest=f"hw_{flag}", type=float, metavar="X", help=text)


def _hardware(args: argparse.Namespace, name: str):
    """The entry `name` with this run's --hardware.* overrides."""
    return with_overrides(get_hardware(name), {flag: getattr(args, f"hw_{flag}") for flag in OVERRIDES})


def _positive(name: str, value: int | None, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(f"--{name} must be {'>= 0' if allow_zero else 'positive'}, got {value}")


def _prepare_plan(args: argparse.Namespace) -> tuple[Planner, Axes]:
    for name in (
        "devices",
        "devices_per_node",
        "global_batch_size",
        "seq_len",
        "tp",
        "cp",
        "pp",
        "dp",
        "ep",
        "micro_batch_size",
        "virtual_stages",
        "top",
    ):
        _positive(name.replace("_", "-"), getattr(args, name))
    _positive("zero", args.zero, allow_zero=True)
    if args.zero is not None and args.zero > 3:
        raise ConfigError(f"--zero must be 0-3, got {args.zero}")
    hw = _hardware(args, args.hardware)
    cfg = build_config(
        args.config,
        {**overrides(args), "train.compression": args.compression, "train.compression_target": args.compression_target},
    )
    from_file = load_toml(args.config) if args.config else {}
    seq = args.seq_len or (cfg.train.seq_len if "train.seq_len" in from_file else cfg.model.max_seq_len)
    cfg.train.seq_len = seq
    if seq > cfg.model.max_seq_len and cfg.model.position == "rope":
        # Planning a long-context stage (Llama 3's 128K) of a rope model: no table bounds its positions, so the
        # context window follows --seq-len, as the long-context stage raised it.
        cfg.model.max_seq_len = seq
    check_fields(without_data_files(cfg))  # each setting as lmt train checks it; the layout, per candidate
    fixed = (args.tp or 1) * (args.cp or 1) * (args.pp or 1) * (args.dp or 1)
    if args.devices % fixed:
        raise ConfigError(
            f"--devices {args.devices} is not divisible by the fixed tp x cp x pp x dp = "
            f"{args.tp or 1} x {args.cp or 1} x {args.pp or 1} x {args.dp or 1}"
        )
    if args.tp and args.cp and args.pp and args.dp and fixed != args.devices:
        raise ConfigError(f"tp x cp x pp x dp = {fixed} != --devices {args.devices}")
    if args.cp and args.cp > 1 and seq % (2 * args.cp):
        raise ConfigError(
            f"--cp {args.cp} needs --seq-len ({seq}) divisible by 2 x cp = {2 * args.cp} (zig-zag chunks)"
        )
    gbs = args.global_batch_size or cfg.train.global_batch_size or args.devices
    precision = Precision.parse(args.precision or ("bf16" if hw.fused_kernels else "fp32"), "--precision")
    if precision == "fp8" and not hw.peak_flops_fp8 and hw.fused_kernels:
        raise ConfigError(f"--precision fp8: {hw.name} has no float8 GEMMs (they need Ada or Hopper and later)")
    job = Job(
        cfg.model,
        seq,
        gbs,
        precision,
        cfg.train.compression,
        compression_target=cfg.train.compression_target,
        sync=cfg.sync,
        optimizer=cfg.train.optimizer,
        fp8_recipe=cfg.train.fp8_recipe,
        flash_attention=args.flash_attention,
        optimizer_states=cfg.train.optimizer_states,
        fsdp_sync_per_step=args.fsdp_sync_per_step or cfg.parallel.fsdp_sync_per_step,
    )
    if args.ep:
        _check_ep(job, args, fixed)
    per_node = args.devices_per_node or hw.devices_per_node
    schedule = Schedule.parse(args.schedule, "--schedule") if args.schedule else None
    recompute = RecomputePolicy.parse(args.recompute, "--recompute") if args.recompute else None
    axes = Axes(
        args.tp,
        args.pp,
        args.dp,
        args.micro_batch_size,
        schedule,
        args.virtual_stages,
        args.zero,
        recompute,
        args.sequence_parallel,
        args.cp,
        args.cp_attention,
        args.ep,
    )
    return Planner(job, hw, args.devices, per_node), axes


def _check_ep(job: Job, args: argparse.Namespace, fixed: int) -> None:
    """A fixed --ep against the layout check's ep rules (on the smallest layout holding it), then against the
    devices left for dp: one clear line instead of an empty search."""
    probe = Layout(tp=1, pp=1, dp=args.ep, micro_batch_size=1, ep=args.ep)
    problems = [p for p in layout_problems(Job(job.model, job.seq_len, args.ep), probe) if "--ep" in p]
    if problems:
        raise ConfigError(problems[0])
    if args.devices % (fixed * args.ep):
        raise ConfigError(
            f"--ep {args.ep} must divide dp, but --devices {args.devices} / (tp x cp x pp x dp fixed: "
            f"{fixed}) has no dp that is a multiple of {args.ep}"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    planner, axes = _prepare_plan(args)
    best, misses = plan_layouts(planner, axes, args.top)
    if args.write_config:
        write_config(planner.job, best[0], args.write_config)
    if args.timeline:
        lay = best[0].layout
        times = planner.stage_times(lay)
        planner.pipelines.draw(
            lay.schedule,
            lay.pp,
            planner.job.micro_batches(lay),
            lay.virtual_stages,
            times.forward,
            times.backward,
            times.p2p,
            args.timeline,
            lay.describe(),
            times.weight,
        )
    if args.json:
        print(json.dumps([plan.to_json() for plan in best], indent=2))
        return 0
    print_table(planner, best, misses, args.top)
    print(f"train the best layout: {train_command(planner.job, best[0].layout, args.config)}")
    if args.write_config:
        print(f"or: lmt train --config {shlex.quote(args.write_config)}")
    return 0


def train_command(job: Job, lay: Layout, config: str | None = None) -> str:
    """The `lmt train` command line that runs `lay` for `job`: the model as its preset plus the fields that
    differ from it (after --config when the plan read one), then every layout and batch setting explicitly."""
    given = build_config(config, {"model.preset": job.model.preset})  # what the command gets before its flags
    base = given.model
    cmd: list[object] = ["lmt", "train"]
    cmd += (["--config", config] if config else []) + ["--model", job.model.preset]
    for f in fields(ModelConfig):
        value = getattr(job.model, f.name)
        if f.name != "preset" and value != getattr(base, f.name):
            cmd += [f"--model.{f.name}", str(value).lower() if isinstance(value, bool) else str(value)]
    cmd += ["--tp", lay.tp, "--cp", lay.cp, "--pp", lay.pp, "--dp", lay.dp, "--schedule", lay.schedule]
    cmd += ["--virtual-stages", lay.virtual_stages] if lay.schedule == "interleaved" else []
    cmd += [
        "--zero",
        lay.zero,
        "--recompute",
        lay.recompute,
        "--micro-batch-size",
        lay.micro_batch_size,
        "--global-batch-size",
        job.global_batch_size,
        "--seq-len",
        job.seq_len,
        "--precision",
        job.precision,
    ]
    if lay.sequence_parallel:
        cmd.append("--sequence-parallel")
    elif given.parallel.sequence_parallel:
        cmd += ["--parallel.sequence_parallel", "false"]
    cmd += ["--parallel.pp_layers", ""] if given.parallel.pp_layers else []  # the planner balances the stages
    cmd += ["--cp-attention", lay.cp_attention] if lay.cp > 1 else []
    cmd += ["--ep", lay.ep] if lay.ep > 1 else []
    cmd += ["--compression", job.compression] if job.compression.enabled else []
    cmd += ["--compression-target", job.compression_target] if job.compression_target != "gradient" else []
    cmd += ["--sync", job.sync.mode] if job.sync.mode.infrequent else []
    cmd += ["--optimizer", job.optimizer] if job.optimizer != "adamw" else []
    cmd += ["--parallel.fsdp_sync_per_step", "true"] if job.fsdp_sync_per_step and lay.zero == 3 else []
    return shlex.join(str(part) for part in cmd)


def print_table(planner: Planner, best: list[Plan], misses: list[Plan], top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from large_model_training.models.flops import parameter_count

    job, hw = planner.job, planner.hardware
    count = f"{parameter_count(job.model) / 1e9:,.1f}B parameters"
    if job.model.moe_experts:
        count += f", {parameter_count(job.model, active=True) / 1e9:,.1f}B active"
    title = (
        f"{job.model.preset} ({count}) on {planner.devices} x "
        f"{hw.name}, global batch {job.global_batch_size} x {job.seq_len} tokens, {job.precision}"
    )
    table = Table(title=title)
    for col in ("#", "layout", "GiB/dev", "step s", "tokens/s", "TFLOP/s/dev", "MFU", "bubble"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, plan in enumerate(best, 1):
        t = plan.time
        table.add_row(
            str(i),
            plan.layout.describe(),
            f"{plan.memory.total / GiB:.1f}",
            f"{t.step_time_s:.3g}",
            f"{t.tokens_per_s:,.0f}",
            f"{t.tflops_per_device:.1f}",
            f"{t.mfu:.1%}",
            f"{t.bubble_fraction:.1%}" + ("" if plan.simulated else "*"),
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print(
        f"memory: the most loaded device, of {hw.usable_memory_bytes / GiB:.1f} GiB usable; "
        "bubble: simulated on the real schedule (* closed form)"
    )
    console.print(band_note(job, best[0].layout if best else None))
    if len(best) < top:
        for plan in misses[:3]:
            console.print(
                f"does not fit: {plan.layout.describe()} needs {plan.memory.total / GiB:.1f} GiB "
                f"({plan.shortfall_bytes / GiB:.1f} GiB too much)"
            )


def write_config(job: Job, plan: Plan, path: str) -> None:
    """The best layout as a TOML file `lmt train --config` accepts."""
    import dataclasses

    import tomli_w

    lay = plan.layout
    doc = {
        "model": dataclasses.asdict(job.model),
        "parallel": {
            "tp": lay.tp,
            "cp": lay.cp,
            "cp_attention": lay.cp_attention,
            "pp": lay.pp,
            "dp": lay.dp,
            "ep": lay.ep,
            "schedule": str(lay.schedule),
            "virtual_stages": lay.virtual_stages,
            "zero": lay.zero,
            "sequence_parallel": lay.sequence_parallel,
        },
        "train": {
            "seq_len": job.seq_len,
            "micro_batch_size": lay.micro_batch_size,
            "global_batch_size": job.global_batch_size,
            "recompute": str(lay.recompute),
            "precision": str(job.precision),
            "compression": str(job.compression),
            "compression_target": str(job.compression_target),
        },
    }
    try:
        with open(path, "wb") as f:
            tomli_w.dump(doc, f)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror}") from None


def cmd_estimate(args: argparse.Namespace) -> int:
    cfg = build_config(args.config, overrides(args))
    if args.hardware is None and any(getattr(args, f"hw_{flag}") is not None for flag in OVERRIDES):
        raise ConfigError("--hardware.* overrides need --hardware NAME")
    hw = _hardware(args, args.hardware) if args.hardware else None
    job, layout = checked_job_and_layout(cfg)
    stages = memory_by_stage(cfg, hw)
    if args.json:
        print(
            json.dumps(
                {
                    "layout": {
                        "tp": layout.tp,
                        "cp": layout.cp,
                        "cp_attention": layout.cp_attention,
                        "pp": layout.pp,
                        "dp": layout.dp,
                        "ep": layout.ep,
                        "micro_batch_size": layout.micro_batch_size,
                        "schedule": layout.schedule,
                        "virtual_stages": layout.virtual_stages,
                        "zero": layout.zero,
                        "recompute": str(layout.recompute),
                        "sequence_parallel": layout.sequence_parallel,
                        "precision": job.precision,
                    },
                    "stages": [m.to_dict() for m in stages],
                    "max_bytes_per_rank": max(m.total for m in stages),
                },
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{cfg.model.preset}: memory per rank, {layout.describe()}, {job.precision}")
    for col in ("stage", "parameters", "gradients", "optimizer", "activations", "buffers", "total"):
        table.add_column(col, justify="right")
    for m in stages:
        table.add_row(
            str(m.stage),
            *(_size(x) for x in (m.parameters, m.gradients, m.optimizer_states, m.activations, m.buffers, m.total)),
        )
    Console(width=max(Console().width, 120)).print(table)
    return 0


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.from_suite:
        from large_model_training.planner.hardware import save_measured
        from large_model_training.planner.suite_calibration import entry_from_suite

        entry, taken = entry_from_suite(args.from_suite, args.base, args.name)
        path = save_measured(entry)
        print(f"lmt: {entry.name}: " + "; ".join(taken) + f" -> {path}")
        return 0
    if args.base:
        raise ConfigError("--base needs --from GPU_SUITE.json")
    from large_model_training.planner.calibrate import calibrate

    entry, path = calibrate(args.name or "cpu")
    print(
        f"lmt: {entry.name}: matmul {entry.peak_flops_fp32 / 1e9:.1f} GFLOP/s fp32, {entry.peak_flops / 1e9:.1f} "
        f"GFLOP/s bf16 ({entry.devices_per_node} cores); a real step reaches {entry.gemm_efficiency:.2f} of them, "
        f"attention {entry.attention_fraction:.2f}; memory {entry.memory_bandwidth / 1e9:.1f} GB/s; gloo "
        f"all-reduce {entry.intra_node_bandwidth / 1e9:.2f} GB/s, {entry.intra_node_latency * 1e6:.0f} us/step "
        f"-> {path}"
    )
    return 0


COMMANDS = {"plan": cmd_plan, "estimate": cmd_estimate, "calibrate": cmd_calibrate}
