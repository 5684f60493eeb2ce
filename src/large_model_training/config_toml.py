"""Reading a TOML config file into dotted overrides (config.py's file half)."""

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
