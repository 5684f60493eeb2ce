"""Reading a TOML config file into dotted overrides, and merging them with the command line's (config.py's
file half)."""

from __future__ import annotations

import os
import tomllib
from typing import Any

from large_model_training.errors import ConfigError


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
