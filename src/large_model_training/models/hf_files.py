"""Reading a Hugging Face folder's files (models/hf.py's file half): config.json, then the safetensors files;
never unpickles; headers first (names and shapes), tensor data only when asked for."""

from __future__ import annotations

import glob
import json
import os

import torch

from large_model_training.errors import ConfigError


def read_config(hf_dir: str) -> tuple[dict, str]:
    """(config.json as a dict, its path); ConfigError when the folder or a readable JSON object is missing."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"Hugging Face folder not found: {hf_dir}")
    try:
        with open(config_path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"not a Hugging Face model folder (no config.json): {hf_dir}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"unreadable {config_path}: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{config_path} is not a JSON object")
    return doc, config_path


def weight_files(hf_dir: str) -> list[str]:
    """The folder's *.safetensors files; ConfigError (naming the file) when it holds only pickles."""
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if files:
        return files
    pickles = [
        os.path.basename(p)
        for p in glob.glob(os.path.join(hf_dir, "*.bin"))
        + glob.glob(os.path.join(hf_dir, "*.pt"))
        + glob.glob(os.path.join(hf_dir, "*.pth"))
    ]
    if pickles:
        raise ConfigError(
            f"{os.path.join(hf_dir, sorted(pickles)[0])}: only safetensors weights are accepted "
            "(pickle files can run code); re-save with save_pretrained(safe_serialization=True)"
        )
    raise ConfigError(f"no *.safetensors weights in {hf_dir}")


def read_headers(files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (file, shape), from the headers only."""
    from safetensors import SafetensorError, safe_open

    where: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in where:
                        raise ConfigError(f"tensor {name} is in both {where[name][0]} and {path}")
                    where[name] = (path, tuple(f.get_slice(name).get_shape()))
        except SafetensorError as e:
            raise ConfigError(f"unreadable safetensors file {path}: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    return where


def read_tensors(places: list[tuple[str, str]]) -> list[torch.Tensor]:
    """The data of (file, tensor name) pairs, in order, each file opened once (an MoE block's experts share one)."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[str, list[str]] = {}
    for path, name in places:
        by_file.setdefault(path, []).append(name)
    read: dict[tuple[str, str], torch.Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for name in names:
                    read[path, name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            missing = next(n for n in names if (path, n) not in read)
            raise ConfigError(f"cannot read tensor {missing} from {path}: {e}") from None
    return [read[place] for place in places]
