"""Where the text comes from, turned into one train and one validation token stream.

Sources: the running Python's standard-library source (the default: needs no download, ~12 MB of .py files,
sorted paths, test suites excluded), a text file, a folder of text files, JSON Lines with a `text` field, or
a pre-tokenized `.bin` file of uint16/uint32 ids. Documents are split deterministically: every
round(1/val_fraction)-th document (by sorted order) is held out for validation; a `.bin` file has no
documents, so its last val_fraction of tokens is held out.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

from large_model_training.config import ConfigError, DataConfig
from large_model_training.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEST_DIRS = ("test", "tests", "idle_test")


@dataclass
class TokenStreams:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str


def stdlib_files() -> list[str]:
    """The standard library's .py files in sorted order, without site-packages and test suites."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in TEST_DIRS and d != "site-packages"
                             and not d.startswith("__pycache__"))
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"cannot read data file {path}: {e.strerror}") from None


def _jsonl_documents(path: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError(f"{path}:{line_no}: expected an object with a string field 'text'")
            docs.append(record["text"])
    return docs


def load_documents(path: str) -> tuple[list[str], str]:
    """Documents of a text source, in a deterministic order, and a short description of the source."""
    if not path:
        files = stdlib_files()
        return [_read_text(f) for f in files], f"Python {sysconfig.get_python_version()} standard library"
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if not f.startswith("."))
        if not files:
            raise ConfigError(f"data folder {path} has no files")
        docs = []
        for f in files:
            docs.extend(_jsonl_documents(f) if f.endswith(".jsonl") else [_read_text(f)])
        return docs, path
    if path.endswith(".jsonl"):
        return _jsonl_documents(path), path
    return [_read_text(path)], path


def _tokenize(docs: list[str], tokenizer: ByteTokenizer | HFTokenizer) -> np.ndarray:
    if isinstance(tokenizer, HFTokenizer):
        parts = tokenizer.encode_batch(docs)
    else:
        parts = [tokenizer.encode(d) for d in docs]
    if not parts:
        return np.zeros(0, dtype=np.uint32)
    out = np.concatenate(parts)
    return out.astype(np.uint8 if tokenizer.vocab_size <= 256 else np.uint32, copy=False)


def load_token_streams(cfg: DataConfig) -> TokenStreams:
    """Train and validation token streams for a data config (same result on every rank)."""
    if cfg.path.endswith(".bin"):
        tokens = np.memmap(cfg.path, dtype=np.dtype(cfg.bin_dtype), mode="r")
        cut = len(tokens) - max(1, int(len(tokens) * cfg.val_fraction))
        vocab = int(tokens.max()) + 1 if len(tokens) else 0
        return TokenStreams(np.asarray(tokens[:cut]), np.asarray(tokens[cut:]), vocab, cfg.path)
    tokenizer = load_tokenizer(cfg.tokenizer)
    docs, source = load_documents(cfg.path)
    every = max(2, round(1 / cfg.val_fraction))
    if len(docs) >= every:
        val_docs, train_docs = docs[::every], [d for i, d in enumerate(docs) if i % every]
        return TokenStreams(_tokenize(train_docs, tokenizer), _tokenize(val_docs, tokenizer),
                            tokenizer.vocab_size, source)
    # Too few documents to hold whole ones out: hold out the tail of the stream instead.
    tokens = _tokenize(docs, tokenizer)
    cut = len(tokens) - max(1, int(len(tokens) * cfg.val_fraction))
    return TokenStreams(tokens[:cut], tokens[cut:], tokenizer.vocab_size, source)
