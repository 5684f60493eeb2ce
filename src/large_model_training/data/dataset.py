"""What `--data` names, as prepared folders: the one data path of `lmt train`.

`--data` is a prepared folder, raw input (a text file or folder, JSON Lines, Parquet; empty: the Python
standard library's source), or a weighted blend of any of these ("0.7:dirA,0.3:dirB"). Raw input is prepared
once, before any rank starts, into a cache folder keyed by its content (every file's sha256), the tokenizer and
the validation fraction, so the embedded default, a text file and a 100 GB prepared corpus all train through the
same memory-mapped reader. The cache is $LMT_DATA_CACHE, else $XDG_CACHE_HOME/lmt/data (~/.cache/lmt/data); a
file lock lets one process prepare while the others (other torchrun ranks on the node) wait, and an interrupted
cached prepare resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass

from large_model_training.config import DataConfig
from large_model_training.data.blend import parse_blend
from large_model_training.data.prepare import PROGRESS, PrepareRequest, prepare
from large_model_training.data.prepared import (
    MANIFEST,
    VERSION,
    PreparedData,
    Split,
    file_sha256,
    is_prepared,
    open_prepared,
)
from large_model_training.data.tokenizer import load_tokenizer
from large_model_training.errors import ConfigError

LARGE_INPUT = 64 << 20  # raw input above this is tokenized by worker processes, below it in this one


@dataclass
class DataPart:
    """One source of a blend: its weight, its prepared folder and a label for metrics (`tokens_<label>`)."""

    weight: float
    folder: str
    label: str


def cache_root() -> str:
    if os.environ.get("LMT_DATA_CACHE"):
        return os.environ["LMT_DATA_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lmt", "data")


def _label(path: str, taken: set[str]) -> str:
    base = os.path.basename(os.path.normpath(path)) if path else "stdlib"
    label = "".join(c if c.isalnum() or c in "-_." else "_" for c in base) or "data"
    while label in taken:
        label += "_"
    taken.add(label)
    return label


def _cache_key(request: PrepareRequest, files: list[str]) -> str:
    tokenizer = load_tokenizer(request.tokenizer).identity()
    digest = hashlib.sha256(
        json.dumps({"format": VERSION, "tokenizer": tokenizer["sha256"], "val_fraction": request.val_fraction}).encode()
    )
    root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
    for f in files:
        digest.update(f"{os.path.relpath(f, root)}\0{file_sha256(f)}\0".encode())
    return digest.hexdigest()[:24]


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on `path` (POSIX flock; where there is none, no lock: one process prepares)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_prepare(request: PrepareRequest, prepare_missing: bool = True) -> str:
    """The cache folder of raw input, prepared now if it is not there yet (and `prepare_missing`)."""
    files = request.files()
    folder = os.path.join(cache_root(), _cache_key(request, files))
    if is_prepared(folder):
        return folder
    if not prepare_missing:
        raise ConfigError(
            f"the data is not prepared yet (expected {folder}); lmt train prepares it before starting ranks"
        )
    os.makedirs(cache_root(), exist_ok=True)
    with _locked(folder + ".lock"):
        if not is_prepared(folder):  # another process may have finished it while this one waited
            size = sum(os.path.getsize(f) for f in files)
            what = ", ".join(request.inputs) or "the Python standard library"
            print(f"lmt: preparing {what} ({size / 1e6:.1f} MB) once into {folder}", flush=True)
            workers = min(8, os.cpu_count() or 1) if size > LARGE_INPUT else 1
            prepare(request, folder, workers=workers, progress=size > LARGE_INPUT)
    return folder


def resolve_data(cfg: DataConfig, prepare_missing: bool = True) -> list[DataPart]:
    """The prepared folders `--data` stands for, preparing raw input into the cache where needed."""
    parts: list[DataPart] = []
    labels: set[str] = set()
    for weight, path in parse_blend(cfg.path):
        if path and not os.path.exists(path):
            raise ConfigError(f"data path not found: {path}")
        if path and os.path.isdir(path) and is_prepared(path):
            folder = path
        elif path and os.path.isfile(os.path.join(path, PROGRESS)):
            raise ConfigError(
                f"{path} is an unfinished lmt prepare (no {MANIFEST}); run lmt prepare again to finish it"
            )
        else:
            request = PrepareRequest(
                inputs=[path] if path else [], tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction
            )
            folder = cached_prepare(request, prepare_missing)
        parts.append(DataPart(weight, folder, _label(path, labels)))
    return parts


@dataclass
class TrainingData:
    """The opened sources of a run: token splits by memory map, their weights, and the shared tokenizer."""

    parts: list[DataPart]
    sources: list[PreparedData]

    @property
    def weights(self) -> list[float]:
        return [p.weight for p in self.parts]

    @property
    def train(self) -> list[Split]:
        return [s.train for s in self.sources]

    @property
    def val(self) -> list[Split]:
        return [s.val for s in self.sources]

    @property
    def vocab_size(self) -> int:
        return self.sources[0].vocab_size

    @property
    def eod_id(self) -> int:
        return self.sources[0].eod_id

    def tokenizer_file(self) -> str:
        return self.sources[0].tokenizer_file()


def open_data(parts: list[DataPart], tokenizer: str = "") -> TrainingData:
    """Open every part (O(shards) each) and check that they share one tokenizer (and the one asked for)."""
    sources = [open_prepared(p.folder) for p in parts]
    first = sources[0].tokenizer
    for part, source in zip(parts, sources):
        if source.tokenizer["sha256"] != first["sha256"]:
            raise ConfigError(
                f"the blend's sources use different tokenizers: {parts[0].folder} "
                f"({first['name']}) and {part.folder} ({source.tokenizer['name']})"
            )
    if tokenizer and load_tokenizer(tokenizer).identity()["sha256"] != first["sha256"]:
        raise ConfigError(
            f"--tokenizer {tokenizer} is not the tokenizer {parts[0].folder} was prepared with "
            f"({first['name']}); drop --tokenizer to use the folder's"
        )
    return TrainingData(parts, sources)


def load_training_data(cfg: DataConfig, prepare_missing: bool = False) -> TrainingData:
    return open_data(resolve_data(cfg, prepare_missing), cfg.tokenizer)
