"""`lmt export --hf DIR RUN_OR_CHECKPOINT` and `lmt import HF_DIR`: Hugging Face folders in and out.

Wired into the main CLI by `add_subcommands(subparsers)` and `COMMANDS`; bad input raises ConfigError (one
line on stderr, exit 2). Training from an HF folder is `lmt train --init-from-hf DIR` (see train/hf.py).

    lmt export --hf out/hf runs/my-run                      # newest checkpoint -> config.json + model.safetensors
    lmt export --hf out/hf runs/my-run/checkpoints/step_300 --dtype bfloat16
    lmt import out/hf --write-config model.toml             # check a folder; its [model] as an lmt config
"""

from __future__ import annotations

import argparse
import dataclasses

from large_model_training.train.hf import DTYPES


def add_subcommands(subparsers) -> None:
    """Add `export` and `import` to the main CLI's subparsers."""
    exp = subparsers.add_parser("export", allow_abbrev=False, help="write a checkpoint as a Hugging Face folder",
                                description="Write config.json + model.safetensors that transformers loads as "
                                            "LlamaForCausalLM (swiglu/rmsnorm/rope) or GPT2LMHeadModel "
                                            "(gelu/layernorm/learned).")
    exp.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="run folder (newest checkpoint) or checkpoint")
    exp.add_argument("--hf", required=True, metavar="DIR", help="output folder")
    exp.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the saved weights [float32]")
    imp = subparsers.add_parser("import", allow_abbrev=False, help="check a Hugging Face folder lmt can train from",
                                description="Read config.json and the safetensors headers of a Llama or GPT-2 "
                                            "folder, print the lmt model it is, and optionally write it as a "
                                            "config for `lmt train --config FILE --init-from-hf DIR`.")
    imp.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json and *.safetensors")
    imp.add_argument("--write-config", metavar="FILE.toml", help="write the [model] section as an lmt config")


def cmd_export(args: argparse.Namespace) -> int:
    from large_model_training.train.hf import export_hf

    out = export_hf(args.checkpoint, args.hf, args.dtype)
    print(f"lmt: exported {args.checkpoint} -> {out} (config.json, model.safetensors, {args.dtype})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    import tomli_w

    from large_model_training.config import ConfigError
    from large_model_training.train.hf import hf_family, import_hf

    cfg, weights = import_hf(args.hf_dir)
    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("preset", "dropout")}
    print(f"lmt: {args.hf_dir} is a {hf_family(cfg)} model with {len(weights)} parameter tensors")
    print(tomli_w.dumps({"model": model}), end="")
    if args.write_config:
        try:
            with open(args.write_config, "wb") as f:
                tomli_w.dump({"model": model}, f)
        except OSError as e:
            raise ConfigError(f"cannot write {args.write_config}: {e.strerror}") from None
        print(f"lmt: wrote {args.write_config}; train with --config {args.write_config} --init-from-hf {args.hf_dir}")
    return 0


COMMANDS = {"export": cmd_export, "import": cmd_import}
