"""Reading a TOML config file into dotted overrides, merging them with the command line's, and turning each value
into its field's type (config.py's file half)."""

from __future__ import annotations

import math
import os
import tomllib
from typing import Any

from large_model_training.choices import (
    AttentionKind,
    CompressionSpec,
    CompressionTarget,
    CpAttention,
    Fp8Recipe,
    Mlp,
    MoeAuxScope,
    MoeRouter,
    Norm,
    OnebitCompression,
    Optimizer,
    Position,
    Precision,
    RecomputePolicy,
    Schedule,
    SpikeAction,
    StateDtype,
    SyncCompression,
    SyncMode,
    Tracker,
)
from large_model_training.errors import ConfigError

CHOICE_TYPES = (
    Schedule,
    Precision,
    CompressionTarget,
    RecomputePolicy,
    CompressionSpec,
    SyncMode,
    Optimizer,
    StateDtype,
    OnebitCompression,
    SpikeAction,
    CpAttention,
    Fp8Recipe,
    Mlp,
    MoeAuxScope,
    MoeRouter,
    Norm,
    Tracker,
    SyncCompression,
    Position,
    AttentionKind,
)
"""The typed choice fields (choices.py): parsed from their spelling, written back as it."""


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file into dotted overrides."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"malformed TOML in {path}: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    flat: dict[str, Any] = {}
    for section, values in doc.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
        for name, value in values.items():
            flat[f"{section}.{name}"] = value
    return flat


def merge_sources(from_file: dict[str, Any], from_flags: dict[str, Any]) -> dict[str, Any]:
    """The file's dotted settings under the command line's, plus what they imply. zbv always runs two chunks per
    rank, so parallel.virtual_stages becomes 2 unless the source that chose zbv (or a later one) set it: a
    virtual_stages left in a file by an earlier 1f1b run does not contradict --schedule zbv on the command line,
    and a value set alongside is kept for the layout check to refuse if it is not 2."""
    flat = {**from_file, **from_flags}
    if str(flat.get("parallel.schedule", "")).lower() == "zbv":
        given = from_flags if "parallel.schedule" in from_flags else flat
        if "parallel.virtual_stages" not in given:
            flat["parallel.virtual_stages"] = 2
    return flat


def coerce(key: str, value: Any, typ: type) -> Any:
    """Turn a TOML or CLI value into the type of the field `key` names, or raise ConfigError naming it."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be an integer, got {value!r}") from None
    if typ in CHOICE_TYPES:
        return value if isinstance(value, typ) else typ.parse(value, key)
    if typ is float:
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ConfigError(f"{key} must be finite, got {value!r}")
        return out
    return str(value)
