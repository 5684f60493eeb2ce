"""`lmt prepare`: raw text -> token shards with a document index and a manifest (format: `data/prepared.py`).

Documents are read in one deterministic order (`data/sources.py`) and numbered; every round(1/val_fraction)-th
(numbers 0, k, 2k, ...) is held out for validation. Worker processes tokenize units of about 1 MB of text
(`--workers 1`: this process, with the tokenizer's own threads) and return them in order, so the output does
not depend on the worker count. Each document is followed by the tokenizer's end-of-document id.

Documents are collected into groups: a group closes when the next document arrives and its training tokens
have reached the shard size; it is written as one train and one val shard (`train-00003.bin/.idx`, `val-...`),
each file through a temporary name, and then recorded in `prepare-progress.json` with the number of input
documents it ends at. A prepare that is killed resumes from its last recorded group (its files re-hashed),
skipping the documents before it unread by the tokenizer, and ends with the same files as an uninterrupted
one. `manifest.json` is written last: a folder without it is never taken for finished data.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from large_model_training.data.prepared import FORMAT, MANIFEST, VERSION, file_sha256, token_dtype
from large_model_training.data.sources import expand_inputs, iter_documents, stdlib_files
from large_model_training.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from large_model_training.errors import ConfigError

PROGRESS = "prepare-progress.json"
# Text per tokenizer call. Worker processes: ~1 MB, enough to amortise the hand-off while keeping workers evenly
# loaded. In this process (--workers 1) the tokenizer's own threads share each call, and a 1 MB batch holding
# one 200 KB document leaves a thread idle: 16 MB batches took 12.1 s where 1 MB ones took 17.0 s
# (bench/prepare_throughput.py, 25 MB of Python source, 2 cores).
UNIT_CHARS = {"worker": 1 << 20, "in_process": 16 << 20}
UNIT_DOCS = 4096


@dataclass
class PrepareRequest:
    """What to prepare: the inputs (empty = the Python standard library) and how to cut and tokenize them."""

    inputs: list[str] = field(default_factory=list)
    tokenizer: str = ""
    eod_token: str | None = None
    train_tokenizer: int = 0  # vocabulary of a byte-level BPE to train on the input first (0: none)
    val_fraction: float = 0.02
    shard_mb: float = 256.0
    text_field: str = "text"  # the JSON field / Parquet or Arrow column that holds each document

    def files(self) -> list[str]:
        return expand_inputs(self.inputs) if self.inputs else stdlib_files()

    def check(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.shard_mb <= 0:
            raise ConfigError(f"--shard-mb must be positive, got {self.shard_mb}")
        if not self.text_field:
            raise ConfigError("--text-field must name a field")
        if self.train_tokenizer and self.tokenizer:
            raise ConfigError("pass either --tokenizer or --train-tokenizer, not both")


def _atomic_write(path: str, data: bytes | memoryview) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: str, obj: dict) -> None:
    _atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


# ---- tokenizing workers: the tokenizer is loaded once per worker process --------------------------------
_worker_tokenizer = None


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tokenizer = tokenizer


def _encode_unit(texts: list[str], tokenizer=None) -> tuple[list[np.ndarray], int]:
    """Token ids of each text with the end-of-document id appended, and the unit's size in UTF-8 bytes."""
    tokenizer = tokenizer or _worker_tokenizer
    eod = np.array([tokenizer.eod_id])
    docs = [np.concatenate([ids, eod.astype(ids.dtype)]) for ids in tokenizer.encode_batch(texts)]
    return docs, sum(len(t.encode("utf-8", errors="replace")) for t in texts)


def _units(documents: Iterator[str], max_chars: int) -> Iterator[list[str]]:
    unit, chars = [], 0
    for text in documents:
        unit.append(text)
        chars += len(text)
        if chars >= max_chars or len(unit) >= UNIT_DOCS:
            yield unit
            unit, chars = [], 0
    if unit:
        yield unit


def _encoded(
    request: PrepareRequest, files: list[str], skip: int, tokenizer, workers: int
) -> Iterator[tuple[list[np.ndarray], int]]:
    documents = iter_documents(files, skip=skip, text_field=request.text_field)
    if workers <= 1:
        for unit in _units(documents, UNIT_CHARS["in_process"]):
            yield _encode_unit(unit, tokenizer)
        return
    units = _units(documents, UNIT_CHARS["worker"])
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _init_worker, (tokenizer,)) as pool:
        yield from pool.imap(_encode_unit, units)


# ---- groups of documents, written as one train and one val shard ------------------------------------------
class _Shard:
    """The documents of one shard being collected, already in the shard's dtype."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.parts: list[np.ndarray] = []
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        self.parts.append(ids.astype(self.dtype, copy=False))
        self.tokens += len(ids)

    def write(self, folder: str, name: str) -> dict:
        dtype = self.dtype
        tokens = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype)
        ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)
        record: dict[str, Any] = {
            "bin": f"{name}.bin",
            "idx": f"{name}.idx",
            "tokens": int(len(tokens)),
            "documents": len(ends),
        }
        for key, array in (("bin", tokens), ("idx", ends)):
            data = np.ascontiguousarray(array).data.cast("B")
            _atomic_write(os.path.join(folder, record[key]), data)
            record[f"{key}_sha256"] = hashlib.sha256(data).hexdigest()
        return record


def _hold_out_tail(train: _Shard, val: _Shard, fraction: float) -> None:
    """Move the last `fraction` of the training tokens (at least one, at most half) into validation."""
    tokens = np.concatenate(train.parts)
    cut = len(tokens) - max(1, min(int(len(tokens) * fraction), len(tokens) // 2))
    ends = np.cumsum([len(p) for p in train.parts])
    kept = [p for p, end in zip(train.parts, ends) if end <= cut]
    head = tokens[sum(len(p) for p in kept) : cut]
    train.parts, train.tokens = kept + ([head] if len(head) else []), cut
    val.add(tokens[cut:])


class _Progress:
    """Documents, tokens and MB/s: a rich progress bar on a terminal (pulsing: a stream's length is not known
    ahead), a plain line every 10 s otherwise."""

    def __init__(self, enabled: bool):
        self.docs = self.tokens = self.bytes = 0
        self.started = self.printed = time.perf_counter()
        self.enabled = enabled
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("lmt prepare"),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._bar.add_task("starting", total=None)
            self._bar.start()

    def line(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        return (
            f"{self.docs:,} documents, {self.tokens:,} tokens, {self.bytes / 1e6:,.1f} MB of text at "
            f"{self.bytes / 1e6 / seconds:,.1f} MB/s"
        )

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        if self._bar is not None:
            self._bar.update(self._task, description=self.line())
        elif self.enabled and time.perf_counter() - self.printed > 10:
            self.printed = time.perf_counter()
            print("lmt prepare: " + self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# ---- the whole preparation ---------------------------------------------------------------------------------
def _tokenizer_for(request: PrepareRequest, files: list[str], out: str, every: int):
    """Load the given tokenizer, or train one on the training documents (kept in OUT, reused on resume)."""
    path = os.path.join(out, "tokenizer.json")
    if request.train_tokenizer:
        if not os.path.isfile(path):
            train_docs = (d for i, d in enumerate(iter_documents(files, text_field=request.text_field)) if i % every)
            train_bpe_tokenizer(train_docs, request.train_tokenizer, path)
        return load_tokenizer(path, request.eod_token)
    tokenizer = load_tokenizer(request.tokenizer, request.eod_token)
    if request.tokenizer and (not os.path.isfile(path) or file_sha256(path) != tokenizer.identity()["sha256"]):
        shutil.copyfile(request.tokenizer, path + ".tmp")
        os.replace(path + ".tmp", path)
    return tokenizer


def _fingerprint(request: PrepareRequest, files: list[str], identity: dict) -> str:
    """What the output depends on (not the worker count): a resumed prepare must have been asked the same."""
    sizes = [(f, os.path.getsize(f)) for f in files]
    what = {
        "format": VERSION,
        "files": sizes,
        "tokenizer": identity["sha256"],
        "eod": identity["eod_id"],
        "val_fraction": request.val_fraction,
        "shard_mb": request.shard_mb,
        "text_field": request.text_field,
    }
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def _resume_groups(out: str, fingerprint: str) -> list[dict]:
    """The groups an earlier, killed prepare of the same request finished, verified by their checksums; any
    group after the first damaged one is done again."""
    path = os.path.join(out, PROGRESS)
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            progress = json.load(f)
        recorded, recorded_for = list(progress["groups"]), progress["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"{path} is damaged; delete {out} and prepare again") from None
    if recorded_for != fingerprint:
        raise ConfigError(
            f"{out} holds an unfinished prepare of different inputs or settings; use another --out or delete it"
        )
    groups = []
    for group in recorded:
        if any(
            file_sha256(os.path.join(out, g[k])) != g[f"{k}_sha256"]
            for g in (group["train"], group["val"])
            for k in ("bin", "idx")
        ):
            break
        groups.append(group)
    return groups


def prepare(
    request: PrepareRequest,
    out: str,
    workers: int = 1,
    progress: bool = True,
    on_group: Callable[[int], None] | None = None,
) -> dict:
    """Prepare `request` into `out` (resuming an unfinished run there); returns the manifest.

    on_group(k) runs after group k is durably recorded (tests stop a prepare there to resume it)."""
    request.check()
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    files = request.files()
    if os.path.isfile(os.path.join(out, MANIFEST)):
        raise ConfigError(f"{out} already holds prepared data (manifest.json); use another --out or delete it")
    os.makedirs(out, exist_ok=True)
    every = max(2, round(1 / request.val_fraction))
    tokenizer = _tokenizer_for(request, files, out, every)
    identity = tokenizer.identity()
    dtype = token_dtype(identity["vocab_size"])
    shard_tokens = max(1, int(request.shard_mb * 2**20 / dtype.itemsize))
    fingerprint = _fingerprint(request, files, identity)
    groups = _resume_groups(out, fingerprint)
    doc_number = groups[-1]["documents_end"] if groups else 0

    def commit(train: _Shard, val: _Shard) -> None:
        k = len(groups)
        groups.append(
            {
                "documents_end": doc_number,
                "train": train.write(out, f"train-{k:05d}"),
                "val": val.write(out, f"val-{k:05d}"),
            }
        )
        _write_json(os.path.join(out, PROGRESS), {"fingerprint": fingerprint, "groups": groups})
        if on_group is not None:
            on_group(k)

    meter = _Progress(progress)
    train, val = _Shard(dtype), _Shard(dtype)
    try:
        for docs, nbytes in _encoded(request, files, doc_number, tokenizer, workers):
            for ids in docs:
                if train.tokens >= shard_tokens:  # the group is full and another document follows: close it
                    commit(train, val)
                    train, val = _Shard(dtype), _Shard(dtype)
                (val if doc_number % every == 0 else train).add(ids)
                doc_number += 1
            meter.update(len(docs), sum(len(d) for d in docs), nbytes)
        if not groups and doc_number < every:  # too few documents to hold whole ones out: cut the tail off
            train.parts, train.tokens, val = val.parts + train.parts, val.tokens + train.tokens, _Shard(dtype)
            if train.tokens > 1:
                _hold_out_tail(train, val, request.val_fraction)
        if train.tokens or val.tokens or not groups:
            commit(train, val)
    finally:
        meter.close()
    manifest = _manifest(request, files, identity, dtype, groups)
    _write_json(os.path.join(out, MANIFEST), manifest)
    os.remove(os.path.join(out, PROGRESS))
    return manifest


def _manifest(request: PrepareRequest, files: list[str], identity: dict, dtype: np.dtype, groups: list) -> dict:
    splits = {}
    for name in ("train", "val"):
        shards = [g[name] for g in groups]
        splits[name] = {
            "tokens": sum(s["tokens"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "shards": shards,
        }
    shown = [{"path": f, "bytes": os.path.getsize(f)} for f in files[:1000]]
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": identity,
        "dtype": dtype.name,
        "val_fraction": request.val_fraction,
        "documents": sum(s["documents"] for s in splits.values()),
        "tokens": sum(s["tokens"] for s in splits.values()),
        "splits": splits,
        "inputs": request.inputs or ["<python standard library>"],
        "text_field": request.text_field,
        "files": len(files),
        "sources": shown,
    }
