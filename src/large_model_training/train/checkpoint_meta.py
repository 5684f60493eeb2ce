"""What a checkpoint folder holds and how one is found: its meta.json and file manifest, read and checked before
anything is loaded (resume, `lmt generate`, `lmt export`, recovery), apart from the writer and loader in
checkpoint.py."""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import asdict
from typing import Any

from large_model_training.config import ConfigError, ModelConfig

FORMAT = "lmt-checkpoint"
VERSION = 1
STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"


def manifest(folder: str) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of every file of a checkpoint, so damage is found before any weight is loaded."""
    files = {}
    for name in sorted(os.listdir(folder)):
        if name == "meta.json":
            continue
        crc, size = 0, 0
        with open(os.path.join(folder, name), "rb") as f:
            while chunk := f.read(1 << 22):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        files[name] = {"size": size, "crc32": crc}
    return files


def read_meta(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"not an lmt checkpoint (no meta.json): {ckpt}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"unreadable checkpoint metadata {path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"not an lmt checkpoint (foreign meta.json): {path}")
    if meta.get("version") != VERSION:
        raise ConfigError(f"checkpoint {ckpt} has format version {meta.get('version')}, this lmt reads {VERSION}")
    if not os.path.isfile(os.path.join(ckpt, ".metadata")):
        raise ConfigError(f"checkpoint {ckpt} is incomplete: its .metadata file is missing")
    return meta


def verify_checkpoint(ckpt: str) -> None:
    """Every file the checkpoint's manifest lists is there, whole and unchanged (sizes, CRC-32)."""
    meta = read_meta(ckpt)
    for name, expected in meta.get("files", {}).items():
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            raise ConfigError(f"checkpoint file missing: {path}")
        size = os.path.getsize(path)
        if size != expected["size"]:
            raise ConfigError(
                f"checkpoint file truncated or resized: {path} ({size} bytes, expected {expected['size']})"
            )
    actual = manifest(ckpt)
    for name, expected in meta.get("files", {}).items():
        if actual[name]["crc32"] != expected["crc32"]:
            raise ConfigError(f"checkpoint file corrupted (checksum mismatch): {os.path.join(ckpt, name)}")


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder, or a run folder (-> its newest complete checkpoint). ConfigError otherwise."""
    if not os.path.isdir(path):
        raise ConfigError(f"resume path not found or not a folder: {path}")
    if os.path.exists(os.path.join(path, "meta.json")):
        read_meta(path)
        return path
    ckpt = newest_checkpoint(path)
    if not ckpt:
        raise ConfigError(
            f"no checkpoint found in {path} (expected a run folder with checkpoints/step_<N>/ "
            "or a checkpoint folder with meta.json)"
        )
    return ckpt


def newest_checkpoint(run_dir: str) -> str:
    """The run folder's newest complete checkpoint, or "" when it has none (`--resume auto`: start fresh); one
    whose metadata cannot be read is an error (ConfigError), not a reason to start over."""
    root = os.path.join(run_dir, "checkpoints")
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):  # written last by a save: names a complete checkpoint
        named = os.path.join(root, open(pointer).read().strip())
        if os.path.isfile(os.path.join(named, "meta.json")):
            read_meta(named)
            return named
    steps = []
    if os.path.isdir(root):
        steps = sorted(
            (int(m.group(1)), name)
            for name in os.listdir(root)
            if (m := STEP_DIR.match(name)) and os.path.exists(os.path.join(root, name, "meta.json"))
        )
    if not steps:
        return ""
    ckpt = os.path.join(root, steps[-1][1])
    read_meta(ckpt)
    return ckpt


def check_compatible(ckpt: str, model_cfg: ModelConfig) -> dict[str, Any]:
    """The checkpoint's metadata, after checking it holds the same model shape as model_cfg."""
    meta = read_meta(ckpt)
    # a setting newer than the checkpoint (attention_head_dim, qk_norm) had its default when the checkpoint was saved
    saved = {k: v for k, v in {**asdict(ModelConfig()), **meta["model"]}.items() if k != "preset"}
    wanted = {k: v for k, v in asdict(model_cfg).items() if k != "preset"}
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}" for k, v in wanted.items() if saved.get(k) != v]
    if diff:
        raise ConfigError(f"checkpoint {ckpt} holds a different model ({'; '.join(diff[:3])})")
    return meta
