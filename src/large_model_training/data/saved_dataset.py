"""Hugging Face `datasets.save_to_disk` folders as inputs, read without the `datasets` package.

A saved `Dataset` is a folder of Arrow IPC stream files (`data-00000-of-00004.arrow`, ...) with `state.json`
(which lists those files, in order) and `dataset_info.json` (features, description). `save_to_disk` writes the
rows in the dataset's own order (a shuffle or select is applied first), so the files in `state.json`'s order are
the documents in order. A saved `DatasetDict` is a folder of such folders, one per split, with
`dataset_dict.json`: it is refused with the splits named, since preparing every split at once would train on
the test split too.
"""

from __future__ import annotations

import json
import os

from large_model_training.errors import ConfigError

STATE, INFO, DICT = "state.json", "dataset_info.json", "dataset_dict.json"


def is_saved_dataset(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, STATE)) and os.path.isfile(os.path.join(folder, INFO))


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not valid JSON") from None


def refuse_dataset_dict(folder: str) -> None:
    """A saved DatasetDict is a one-line error that names its splits."""
    path = os.path.join(folder, DICT)
    if not os.path.isfile(path):
        return
    info = _read_json(path)
    splits = info.get("splits") if isinstance(info, dict) else None
    splits = [str(s) for s in splits] if isinstance(splits, list) and splits else ["SPLIT"]
    raise ConfigError(
        f"{folder} is a saved DatasetDict (splits: {', '.join(splits)}); name one "
        f"split's folder, e.g. {os.path.join(folder, splits[0])}"
    )


def saved_dataset_files(folder: str) -> list[str]:
    """The Arrow files of a saved Dataset, in the order `state.json` lists them."""
    path = os.path.join(folder, STATE)
    state = _read_json(path)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path} lists no data files (_data_files); not a datasets.save_to_disk folder?")
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise ConfigError(f"{path}: bad _data_files entry {entry!r}")
        if not os.path.isfile(os.path.join(folder, name)):
            raise ConfigError(f"saved dataset {folder}: {name}, listed in {STATE}, is missing")
        files.append(os.path.join(folder, name))
    return files
