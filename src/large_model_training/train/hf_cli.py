"""`lmt export --hf DIR RUN_OR_CHECKPOINT` and `lmt import HF_DIR`: Hugging Face folders in and out.

Wired into the main CLI by `add_subcommands(subparsers)` and `COMMANDS`; bad input raises ConfigError (one
line on stderr, exit 2). Training from an HF folder is `lmt train --init-from-hf DIR` (see models/hf.py).

    lmt export --hf out/hf runs/my-run                      # newest checkpoint -> config.json + model.safetensors
    lmt export --hf out/hf runs/my-run/checkpoints/step_300 --dtype bfloat16
    lmt import out/hf --write-config model.toml             # check a folder; its [model] as an lmt config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings

import torch

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.hf import DTYPES, hf_config, hf_family, import_hf, to_hf_state


def add_subcommands(subparsers) -> None:
    """Add `export` and `import` to the main CLI's subparsers."""
    exp = subparsers.add_parser(
        "export",
        allow_abbrev=False,
        help="write a checkpoint as a Hugging Face folder",
        description="Write config.json + model.safetensors that transformers loads as "
        "LlamaForCausalLM (swiglu/rmsnorm/rope), Qwen3ForCausalLM (the same "
        "with qk_norm), MixtralForCausalLM or Qwen3MoeForCausalLM (those with "
        "softmax top-k MoE blocks) or GPT2LMHeadModel (gelu/layernorm/learned).",
    )
    exp.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="run folder (newest checkpoint) or checkpoint")
    exp.add_argument("--hf", required=True, metavar="DIR", help="output folder")
    exp.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the saved weights [float32]")
    imp = subparsers.add_parser(
        "import",
        allow_abbrev=False,
        help="check a Hugging Face folder lmt can train from",
        description="Read config.json and the safetensors headers of a Llama, Qwen3, Mixtral, "
        "Qwen3-MoE or GPT-2 folder, print the lmt model it is, and optionally "
        "write it as a config for `lmt train --config FILE --init-from-hf DIR`.",
    )
    imp.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json and *.safetensors")
    imp.add_argument("--write-config", metavar="FILE.toml", help="write the [model] section as an lmt config")


def cmd_export(args: argparse.Namespace) -> int:

    out = export_hf(args.checkpoint, args.hf, args.dtype)
    print(f"lmt: exported {args.checkpoint} -> {out} (config.json, model.safetensors, {args.dtype})")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    import tomli_w

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


def export_hf(checkpoint_or_run_dir: str, out_dir: str, dtype: str = "float32") -> str:
    """Write config.json + model.safetensors for an lmt checkpoint (or a run's newest). Returns out_dir."""
    from safetensors.torch import save_file

    from large_model_training.models.transformer import Transformer
    from large_model_training.train import checkpoint

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    ckpt = checkpoint.resolve_checkpoint(checkpoint_or_run_dir)
    cfg = ModelConfig(**checkpoint.read_meta(ckpt)["model"])
    doc = hf_config(cfg, dtype)  # refuses a model no HF architecture runs, before loading anything
    with torch.device("meta"):  # no initialisation: every value comes from the checkpoint
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    with warnings.catch_warnings():  # DCP notes that it loads without a process group: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        checkpoint.load_checkpoint(ckpt, model)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in to_hf_state(cfg, model.state_dict()).items()}
    try:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(doc, f, indent=2)
    except OSError as e:
        raise ConfigError(f"cannot write to {out_dir}: {e.strerror or e}") from None
    return out_dir


COMMANDS = {"export": cmd_export, "import": cmd_import}
