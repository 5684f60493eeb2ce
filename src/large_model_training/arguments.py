"""The command line's shared pieces: the parser that raises instead of exiting, `lmt train`'s flags (also
`lmt estimate`'s, so both read a layout the same way) and the dotted overrides they produce.

Kept apart from `cli.py` so that the planner's subcommands can reuse the flags without importing the main CLI.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import fields
from typing import Any, NoReturn

from large_model_training.config import ALIASES, CHOICE_TYPES, SECTION_TYPES


@functools.cache  # read once per process: every `lmt` call builds its parser
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field (for --help), read from the source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
        ):
            docs[prev.target.id] = str(node.value.value)
    return docs


# Short flags of `lmt train` and the setting each one fills (scripts rely on these names).
TRAIN_FLAGS: dict[str, tuple[str, str]] = {
    "model": ("model.preset", "model preset (tiny, small, llama3-8b, ...)"),
    "tp": ("parallel.tp", "tensor-parallel degree"),
    "cp": ("parallel.cp", "context-parallel degree: each sequence split (zig-zag) over cp ranks"),
    "cp_attention": ("parallel.cp_attention", "attention across cp: ring or allgather"),
    "ep": ("parallel.ep", "expert-parallel degree (MoE): experts split over ep of the dp ranks"),
    "pp": ("parallel.pp", "pipeline-parallel degree"),
    "dp": ("parallel.dp", "data-parallel degree (0: what is left, WORLD_SIZE / (tp x cp x pp) under torchrun, else 1)"),
    "sequence_parallel": ("parallel.sequence_parallel", "shard norms/dropout along the sequence over tp"),
    "schedule": ("parallel.schedule", "pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zbv"),
    "virtual_stages": ("parallel.virtual_stages", "model chunks per pipeline rank (interleaved; zbv implies 2)"),
    "pp_layers": ("parallel.pp_layers", "blocks per stage, e.g. 3,5,5,3 (default: balanced)"),
    "zero": ("parallel.zero", "ZeRO stage 0-3 over dp"),
    "bucket_mb": ("parallel.bucket_mb", "gradient-reduction bucket size in MiB"),
    "precision": ("train.precision", "fp32 or bf16 (mixed, fp32 master weights)"),
    "recompute": ("train.recompute", "none, full, every:K, selective or sac"),
    "offload_activations": ("train.offload_activations", "keep saved activations in host memory"),
    "compile": ("train.compile", "torch.compile each transformer block (--train.compile_backend inductor|aot_eager)"),
    "compression": ("train.compression", "dp gradient compression: int8, topk:0.01, powersgd:4, ..."),
    "compression_warmup": ("train.compression_warmup", "dense dp steps before compression starts"),
    "compression_target": ("train.compression_target", "gradient (default) or update: compress AdamW's update"),
    "sync": (
        "sync.mode",
        "every-step (default), local:H (DiLoCo: outer step every H steps) or streaming:H "
        "(fragments on a staggered schedule); --sync.outer_lr, --sync.compression, ...",
    ),
    "optimizer": (
        "train.optimizer",
        "adamw (default), muon (Newton-Schulz on the blocks' matrices, AdamW on the "
        "rest) or onebit-adam (1-bit Adam after --train.onebit_warmup dense steps; "
        "--train.onebit_compression sign|int8)",
    ),
    "steps": ("train.steps", "optimizer steps"),
    "seq_len": ("train.seq_len", "tokens per sample"),
    "micro_batch_size": ("train.micro_batch_size", "samples per forward/backward on one rank"),
    "global_batch_size": ("train.global_batch_size", "samples per optimizer step over all dp ranks"),
    "lr": ("train.lr", "peak learning rate"),
    "seed": ("train.seed", "seed of weights, data order and dropout"),
    "eval_every": ("train.eval_every", "validate every N steps (0: never)"),
    "data": (
        "data.path",
        "prepared folder (lmt prepare), text file/folder, .jsonl[.gz|.zst], .parquet, or a blend "
        "'0.7:dirA,0.3:dirB' (default: Python stdlib source)",
    ),
    "tokenizer": ("data.tokenizer", "Hugging Face tokenizer.json for raw text (default: bytes)"),
    "out": ("run.out", "run folder (default runs/<timestamp>)"),
    "save_every": ("run.save_every", "checkpoint every N steps (0: only at the end)"),
    "resume": (
        "run.resume",
        "run folder, checkpoint folder, 'latest' (the newest in --out) or 'auto' (the newest "
        "in --out if any, else start fresh) to continue from",
    ),
    "keep": ("run.keep", "keep only the newest N checkpoints"),
    "init_from_hf": (
        "run.init_from_hf",
        "start from a Hugging Face folder's weights (Llama, Qwen3, Mixtral, Qwen3-MoE or GPT-2 safetensors)",
    ),
    "async_save": ("run.async_save", "write checkpoints in the background"),
    "stall_timeout": ("run.stall_timeout", "seconds without progress before a stalled rank ends the job (0: off)"),
    "max_restarts": ("run.max_restarts", "restart after a failure, resuming from the newest checkpoint"),
    "save_local_every": (
        "run.save_local_every",
        "copy each rank's state to host memory and a partner rank every N steps; restarts come back from it (0: off)",
    ),
    "spares": (
        "run.spares",
        "start K idle spare processes; a killed rank is replaced in place, the others keep running (0: off)",
    ),
}


BOOLEAN_FLAGS = {"parallel.sequence_parallel", "train.offload_activations", "train.compile", "run.async_save"}


class UsageError(Exception):
    """Raised by the parser instead of printing usage and exiting, so main() reports it in one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="FILE.toml", help="TOML file with [model] [parallel] [train] [data] [run] [sync]"
    )
    for flag, (key, text) in TRAIN_FLAGS.items():
        if key in BOOLEAN_FLAGS:
            p.add_argument(
                "--" + flag.replace("_", "-"), dest=key, action="store_const", const="true", help=f"{text} ({key})"
            )
        else:
            p.add_argument("--" + flag.replace("_", "-"), dest=key, metavar="V", help=f"{text} ({key})")
    p.add_argument(
        "--no-error-feedback",
        dest="train.error_feedback",
        action="store_const",
        const="false",
        help="send compressed gradients without error feedback (train.error_feedback)",
    )
    for section, cls in SECTION_TYPES.items():
        group = p.add_argument_group(f"every [{section}] setting as a dotted override")
        docs = field_docs(cls)
        for f in fields(cls):
            key = f"{section}.{f.name}"
            if key == "model.preset":
                continue
            default = repr(str(f.default)) if isinstance(f.default, CHOICE_TYPES) else repr(f.default)
            add_dotted(group, key, key, f"{docs.get(f.name, '')} [{default}]")
            for alias in (a for a, target in ALIASES.items() if target == key):
                add_dotted(group, alias, key, f"the same as --{key}")


def add_dotted(group, flag: str, dest: str, text: str) -> None:
    """--section.some_field, and --section.some-field as the same option (hidden from --help): the short flags
    are spelled with hyphens, so users type the dotted ones that way too."""
    group.add_argument(f"--{flag}", dest=dest, metavar="V", help=text)
    if "_" in flag:
        group.add_argument(f"--{flag.replace('_', '-')}", dest=dest, metavar="V", help=argparse.SUPPRESS)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted settings ('parallel.tp': '2', ...) a parsed command line gives, without the unset ones."""
    return {k: v for k, v in vars(args).items() if "." in k and v is not None}
