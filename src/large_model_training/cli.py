"""`lmt` command line: parse, validate, call. Bad input ends with one line on stderr and exit code 2.

lmt train [--config FILE.toml] [--model PRESET] [--tp N] [--cp N] [--pp N] [--dp N] ... [--model.FIELD V]
lmt generate RUN_OR_CHECKPOINT --prompt "def "
lmt prepare INPUT... --out DIR [--tokenizer tokenizer.json | --train-tokenizer VOCAB]   (then --data DIR)
lmt rehearse --model llama-100b --world-size 512 --tp 8 --pp 8 ...     (one rank per kind, fake devices)
lmt doctor                                                           (torch, devices, backends, extras)
torchrun --nproc-per-node 8 -m large_model_training.cli train ...    (joins torchrun's ranks)
torchrun --max-restarts 3 ... train --out RUN --save-every 100 --resume auto   (restarts resume by themselves)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from large_model_training.arguments import Parser, UsageError, add_train_arguments, overrides
from large_model_training.choices import bf16_compute
from large_model_training.config import build_config
from large_model_training.data import cli as data_cli
from large_model_training.doctor import cmd_doctor
from large_model_training.errors import ConfigError
from large_model_training.layout import validate
from large_model_training.planner import cli as planner_cli
from large_model_training.train import hf_cli
from large_model_training.train.run_folder import (
    last_checkpoint_note,
    left_behind,
    previous_attempt,
    restart_record,
    restartable,
    run_folder_lock,
    write_quietly,
    write_run_folder,
)

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def build_parser() -> Parser:
    parser = Parser(
        prog="lmt",
        description="Train large transformers with tensor, pipeline and data parallelism.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    train = sub.add_parser(
        "train",
        help="train a model (spawns tp x cp x pp x dp local ranks, or joins torchrun's)",
        allow_abbrev=False,
        description="Train a model. Any setting can come from --config FILE.toml and be overridden by flags.",
    )
    add_train_arguments(train)
    gen = sub.add_parser("generate", help="sample a continuation from a trained model", allow_abbrev=False)
    gen.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="run folder (newest checkpoint) or checkpoint")
    gen.add_argument("--prompt", default="def ", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample")
    gen.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0: greedy)")
    gen.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    rehearse = sub.add_parser(
        "rehearse",
        allow_abbrev=False,
        help="run one rank of each kind of a huge layout on fake devices: memory, bytes, ops",
        description="lmt train's flags plus --world-size: every kind of rank (first, middle, "
        "last stage; ZeRO shard ends) is assembled and trained for two steps "
        "on PyTorch's fake backend with fake tensors, and measured against "
        "lmt estimate. Nothing is read or saved (docs/rehearsal.md).",
    )
    add_train_arguments(rehearse)
    rehearse.add_argument("--world-size", type=int, required=True, metavar="N", help="devices to simulate")
    rehearse.add_argument("--json", action="store_true", help="print a JSON list, one object per rank kind")
    sub.add_parser(
        "doctor",
        allow_abbrev=False,
        help="what this install can use: torch, devices, backends, extras",
        description="torch and its build, CUDA / NPU devices, NCCL / HCCL / gloo, the device and backend "
        "lmt train would pick, optional packages, the planner's hardware entry.",
    )
    data_cli.add_subcommands(sub)
    planner_cli.add_subcommands(sub)
    hf_cli.add_subcommands(sub)
    return parser


def _run_dir(cfg) -> str:
    if cfg.run.out:
        return cfg.run.out
    if cfg.run.resume:  # continue in the run folder the checkpoint belongs to
        return os.path.dirname(os.path.dirname(cfg.run.resume))
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def prepare_train(args: argparse.Namespace):
    """Everything that can fail on user input, done before any rank starts. Returns (cfg, run_dir, auto): auto
    when --resume auto was given (cfg.run.resume is then the checkpoint found, or "" for a fresh start)."""
    from large_model_training.data.dataset import open_data, resolve_data
    from large_model_training.launch import under_torchrun
    from large_model_training.mesh import fp8_gemm_problem, select_device, supports_bf16
    from large_model_training.train import checkpoint

    cfg = build_config(args.config, overrides(args))
    if cfg.run.init_from_hf:  # the folder's config.json sets the model: before validation checks it
        from large_model_training.models.hf import model_config_for_run

        explicit = tuple(k.split(".", 1)[1] for k in overrides(args) if k.startswith("model."))
        cfg.model = model_config_for_run(cfg.run.init_from_hf, cfg.model, explicit)
    validate(cfg, int(os.environ["WORLD_SIZE"]) if under_torchrun() else None)
    if bf16_compute(cfg.train.precision) and not supports_bf16(select_device(int(os.environ.get("LOCAL_RANK", "0")))):
        raise ConfigError(
            f"--precision {cfg.train.precision} needs a device with bf16 support; this one has none (use fp32)"
        )
    if cfg.train.precision == "fp8":
        problem = fp8_gemm_problem(select_device(int(os.environ.get("LOCAL_RANK", "0"))))
        if problem:
            raise ConfigError(f"--precision fp8: {problem}")
    auto = cfg.run.resume == "auto"
    if auto:  # for restart loops: the first launch has no checkpoint yet and starts fresh
        if not cfg.run.out:
            raise ConfigError("--resume auto needs --out RUN_FOLDER (the run to continue if it has a checkpoint)")
        cfg.run.resume = checkpoint.newest_checkpoint(cfg.run.out)
    if cfg.run.resume:
        if cfg.run.resume == "latest":
            if not cfg.run.out:
                raise ConfigError("--resume latest needs --out RUN_FOLDER (the run whose newest checkpoint to use)")
            cfg.run.resume = cfg.run.out
        cfg.run.resume = checkpoint.resolve_checkpoint(cfg.run.resume)
        checkpoint.verify_checkpoint(cfg.run.resume)
    # The data last of the cheap checks (raw input is prepared here), and before the model is compared with the
    # checkpoint's: a prepared subword tokenizer sets the model's vocabulary.
    vocab_given = "model.vocab_size" in overrides(args) or bool(cfg.run.init_from_hf)
    check_data(cfg, open_data(resolve_data(cfg.data), cfg.data.tokenizer), vocab_given)
    if cfg.run.resume:
        checkpoint.check_compatible(cfg.run.resume, cfg.model)
    return cfg, _run_dir(cfg), auto


def check_data(cfg, data, vocab_given: bool) -> None:
    """Sizes and vocabulary from the manifests (nothing read whole). A subword tokenizer sets the model's
    vocabulary unless --model.vocab_size was given; the byte tokenizer's 256 ids fit any preset."""
    need = cfg.train.seq_len + 1
    for part, source in zip(data.parts, data.sources):
        if source.train.num_tokens < need or source.val.num_tokens < need:
            raise ConfigError(
                f"data too small: {part.folder} has {source.train.num_tokens} train / "
                f"{source.val.num_tokens} validation tokens, each split needs at least seq_len + 1 "
                f"= {need}"
            )
    if data.tokenizer_file():
        cfg.data.tokenizer = cfg.data.tokenizer or data.tokenizer_file()  # recorded for `lmt generate`
        if not vocab_given:
            cfg.model.vocab_size = data.vocab_size
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {data.vocab_size} ids but model.vocab_size is {cfg.model.vocab_size};"
            f" pass --model.vocab_size {data.vocab_size} or more"
        )


def cmd_train(args: argparse.Namespace) -> int:
    from large_model_training.launch import under_torchrun

    cfg, run_dir, auto = prepare_train(args)
    torchrun = under_torchrun()
    if cfg.run.spares and (torchrun or cfg.parallel.world_size == 1):
        raise ConfigError("run.spares needs lmt's own launcher and more than one rank (not torchrun, not one rank)")
    is_rank0 = not torchrun or os.environ["RANK"] == "0"
    with run_folder_lock(run_dir) if is_rank0 else contextlib.nullcontext():
        return _train_attempts(cfg, run_dir, auto, torchrun, is_rank0)


def _train_attempts(cfg, run_dir: str, auto: bool, torchrun: bool, is_rank0: bool) -> int:
    """The attempts of one run (a failure restarts from the newest checkpoint, up to --max-restarts)."""
    import traceback

    import torch.distributed as dist

    from large_model_training.launch import RankFailure, join_torchrun, run_in_process, run_on_ranks
    from large_model_training.reliability.in_place import Spares
    from large_model_training.train import checkpoint
    from large_model_training.train.metrics import plot_loss_curve
    from large_model_training.train.recovery import warm_spare
    from large_model_training.train.trainer import TrainingError, train_rank

    world = cfg.parallel.world_size
    # Restarted by torchrun's agent (--max-restarts, or a node joined) or relaunched with --resume auto onto a
    # checkpoint: this attempt continues an earlier one in the run folder, whose marker holds its number (each
    # agent counts TORCHELASTIC_RESTART_COUNT for itself, and not at all when it restarts for a joining node).
    attempt, restart, restarts = 0, None, 0
    restarted = torchrun and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if is_rank0 and (restarted or (auto and cfg.run.resume)):
        attempt = previous_attempt(run_dir) + 1
        restart = restart_record(cfg, attempt, left_behind(run_dir))
    if is_rank0:
        cp = f" cp={cfg.parallel.cp}" if cfg.parallel.cp > 1 else ""
        ep = f" ep={cfg.parallel.ep}" if cfg.parallel.ep > 1 else ""
        print(
            f"lmt: training {cfg.model.preset} (tp={cfg.parallel.tp}{cp} pp={cfg.parallel.pp} "
            f"dp={cfg.parallel.dp}{ep}, "
            f"global batch {cfg.train.global_batch_size} x {cfg.train.seq_len} tokens) -> {run_dir}",
            flush=True,
        )
    while True:
        if is_rank0:
            write_run_folder(cfg, run_dir, attempt)
        try:
            if torchrun:
                join_torchrun(cfg.run.timeout)
                try:
                    result = train_rank(cfg, run_dir, restart)
                except Exception as e:  # what this rank saw, for the log and the next attempt's restart record
                    if not isinstance(e, TrainingError):
                        write_quietly(
                            os.path.join(run_dir, f"error_rank{os.environ['RANK']}.log"), traceback.format_exc()
                        )
                    raise
                finally:  # before interpreter shutdown, while gloo/NCCL threads can still be joined cleanly
                    dist.destroy_process_group()
            elif world == 1:
                result = run_in_process(train_rank, (cfg, run_dir, restart), timeout_s=cfg.run.timeout)
            else:
                result = run_on_ranks(
                    train_rank,
                    world,
                    (cfg, run_dir, restart, True),
                    timeout_s=cfg.run.timeout,
                    monitor=_stall_watcher(cfg, run_dir, world),
                    spares=Spares(cfg.run.spares, 2, cfg.run.timeout, warm_spare) if cfg.run.spares else None,
                )[0]
            break
        except (RankFailure, TrainingError) as e:
            rank = getattr(e, "rank", 0)
            log = os.path.join(run_dir, "stall.log" if rank < 0 or getattr(e, "kind", "") else f"error_rank{rank}.log")
            details = write_quietly(log, getattr(e, "traceback", "") or f"{e}\n")
            if torchrun or restarts >= cfg.run.max_restarts or not restartable(e):
                print(f"lmt: {e} ({details}); {last_checkpoint_note(run_dir)}", file=sys.stderr)
                return EXIT_FAILED
            attempt, restarts = attempt + 1, restarts + 1
            cfg.run.resume = checkpoint.newest_checkpoint(run_dir)
            if cfg.run.resume:
                checkpoint.verify_checkpoint(cfg.run.resume)
            restart = {**restart_record(cfg, attempt, str(e)), "detected_at": time.time()}  # recovery phases
            print(
                f"lmt: {e} ({details}); restart {restarts} of {cfg.run.max_restarts} from "
                f"{cfg.run.resume or 'the start (no checkpoint yet)'}",
                file=sys.stderr,
                flush=True,
            )
    if is_rank0:
        plot_loss_curve(run_dir)
        val = result.val_losses.get(result.last_step)
        summary = f"final loss {result.losses[-1]:.4f}" if result.losses else "no steps run"
        if val is not None:
            summary += f", validation loss {val:.4f}"
        print(f"lmt: done at step {result.last_step}: {summary}; loss curve {run_dir}/loss.png", flush=True)
    return 0


def _stall_watcher(cfg, run_dir: str, world: int):
    """The launcher's reader of the ranks' heartbeats (RUN/heartbeat), or None when heartbeats are off."""
    from large_model_training.reliability.watch import BoardWatcher, clear_board

    if cfg.run.stall_timeout <= 0:
        return None
    return BoardWatcher(clear_board(run_dir), world, cfg.run.stall_timeout)


def cmd_generate(args: argparse.Namespace) -> int:
    from large_model_training.train.generate import generate_from_checkpoint

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens, --temperature and --top-k must be >= 0")
    text = generate_from_checkpoint(
        args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
    )
    print(text)
    return 0


def cmd_rehearse(args: argparse.Namespace) -> int:
    import json

    from large_model_training.train.rehearse import KERNELS, RESERVED, STAND_INS, rehearse

    if args.world_size < 1:
        raise ConfigError(f"--world-size must be positive, got {args.world_size}")
    cfg = validate(build_config(args.config, overrides(args)), args.world_size)
    reports = rehearse(cfg)
    if args.json:
        print(json.dumps(reports, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    p = cfg.parallel
    table = Table(
        title=f"{cfg.model.preset} rehearsed: rank kinds of tp={p.tp} pp={p.pp} dp={p.dp} "
        f"zero={p.zero} ({p.world_size} devices), per rank"
    )
    columns = ["kind", "rank", "params", "grads", "optimizer", "buffers", "peak", "reserved", "expandable"]
    columns += ["estimate", "tp bytes", "pp bytes", "dp bytes", "ops/step", "flags"]
    sizes = ["param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "peak_bytes", "reserved_peak_bytes"]
    sizes += ["reserved_peak_expandable_bytes", "estimate_peak_bytes", "comm_bytes_tp", "comm_bytes_pp"]
    sizes += ["comm_bytes_dp"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("kind", "flags") else "right")
    for r in reports:
        table.add_row(
            r["kind"],
            str(r["rank"]),
            *(_gib(r[k]) for k in sizes),
            f"{r['ops_per_step']:,}",
            "; ".join(r["flags"]),
        )
    console = Console(width=max(Console().width, 160))
    console.print(table)
    console.print(f"kernels: {KERNELS}\nstood in for: {'; '.join(STAND_INS)}\nreserved: {RESERVED}")
    return 0


def _gib(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.2f} GiB" if nbytes >= 1024**3 else f"{nbytes / 1024**2:.1f} MiB"


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "rehearse": cmd_rehearse, "doctor": cmd_doctor}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_BAD_INPUT
        return {**COMMANDS, **data_cli.COMMANDS, **planner_cli.COMMANDS, **hf_cli.COMMANDS}[args.command](args)
    except (UsageError, ConfigError) as e:
        print(f"lmt: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("lmt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
