"""A prepared token folder (what `lmt prepare` writes), opened by memory map.

Layout (format "lmt-tokens", version 1):

    DIR/manifest.json          tokenizer identity, dtype, counts, per-shard files and sha256, sources
    DIR/tokenizer.json         the tokenizer (Hugging Face tokenizers only; the byte tokenizer needs no file)
    DIR/train-00000.bin        token ids of whole documents, each followed by the end-of-document id (EOD)
    DIR/train-00000.idx        int64 end offset of every document in the shard (Megatron's .idx, reduced)
    DIR/val-00000.bin, .idx    the held-out documents of the same group of input documents

The manifest is written last, so a folder without one is an unfinished prepare, never a short data set.
Opening costs O(shards): the manifest's sizes are checked against the files (a truncated shard is refused),
nothing is read whole; checksums are verified by `lmt prepare --verify` and by a resumed prepare.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass

import numpy as np

from large_model_training.errors import ConfigError

FORMAT, VERSION = "lmt-tokens", 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id: uint8 for bytes, uint16 up to 65,536 ids, else uint32."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ConfigError(f"a vocabulary of {vocab_size} ids does not fit uint32")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not valid JSON (damaged? run lmt prepare again)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not an lmt prepared-data manifest")
    if manifest.get("version") != VERSION:
        raise ConfigError(f"{path} has format version {manifest.get('version')}; this lmt reads version {VERSION}")
    return manifest


class Split:
    """One split's token stream: its shards end to end, read by memory map (an in-memory array for tests)."""

    def __init__(
        self,
        parts: list[np.ndarray],
        doc_ends: list[np.ndarray] | None = None,
        maps: list[mmap.mmap | None] | None = None,
    ):
        self.parts = parts
        self.doc_ends = doc_ends
        self.maps = maps or [None] * len(parts)
        self.starts = np.cumsum([0] + [len(p) for p in parts])  # one entry per shard: O(shards) memory
        self.num_tokens = int(self.starts[-1])
        self._touched: set[int] = set()

    @classmethod
    def from_array(cls, tokens: np.ndarray) -> Split:
        return cls([tokens])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split, across shard ends where the window spans two."""
        if length <= 0:
            return self.parts[0][:0] if self.parts else np.zeros(0, dtype=np.int64)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = start - int(self.starts[shard])
        part = self.parts[shard][offset : offset + length]
        self._touched.add(shard)
        if len(part) == length:
            return part
        pieces = [part]
        got = len(part)
        while got < length:
            shard += 1
            pieces.append(self.parts[shard][: length - got])
            self._touched.add(shard)
            got += len(pieces[-1])
        return np.concatenate(pieces)

    def release(self) -> None:
        """Unmap the pages the reads since the last release touched (the loader calls it once per batch,
        after copying its windows). Why: the kernel maps whole page-cache folios on a fault (up to 2 MB for
        a window of 4 KB: measured 1.4 MB per window drawn), so without this a rank's resident memory grows
        with every window it has read, up to the corpus. The pages stay in the page cache for other ranks."""
        for shard in self._touched:
            if self.maps[shard] is not None and hasattr(self.maps[shard], "madvise"):
                self.maps[shard].madvise(mmap.MADV_DONTNEED)
        self._touched.clear()

    def documents(self) -> int:
        return sum(len(d) for d in self.doc_ends or ())


@dataclass
class PreparedData:
    """An opened prepared folder: both splits by memory map, and what the manifest says about them."""

    folder: str
    manifest: dict
    train: Split
    val: Split

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    @property
    def eod_id(self) -> int:
        return int(self.tokenizer["eod_id"])

    def tokenizer_file(self) -> str:
        """The tokenizer.json to decode with (generation), or "" for the byte tokenizer."""
        return os.path.join(self.folder, "tokenizer.json") if self.tokenizer["kind"] == "hf" else ""


def _open_shard(folder: str, shard: dict, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, mmap.mmap | None]:
    """Memory-map one shard and its document index after checking their sizes against the manifest."""
    arrays: list[np.ndarray] = []
    maps: list[mmap.mmap | None] = [None, None]
    for key, kind, count in (("bin", dtype, shard["tokens"]), ("idx", np.dtype(np.int64), shard["documents"])):
        path = os.path.join(folder, shard[key])
        try:
            size = os.path.getsize(path)
        except OSError:
            raise ConfigError(f"prepared data {folder} is missing {shard[key]} (run lmt prepare again)") from None
        if size != count * kind.itemsize:
            raise ConfigError(
                f"{path} is {size} bytes but the manifest says {count * kind.itemsize} "
                f"(truncated or replaced; run lmt prepare again)"
            )
        if not count:  # mmap refuses empty files
            arrays.append(np.zeros(0, dtype=kind))
            continue
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mapped, "madvise"):  # POSIX. Why random: samples are windows at random offsets, and the
            mapped.madvise(mmap.MADV_RANDOM)  # default read-ahead (8 MB here) made each draw 7x slower
        maps[len(arrays)] = mapped
        arrays.append(np.frombuffer(mapped, dtype=kind))
    return arrays[0], arrays[1], maps[0]


def open_prepared(folder: str) -> PreparedData:
    """Open a prepared folder in O(shards): manifest, sizes, memory maps. Bad or partial folders: ConfigError."""
    manifest = read_manifest(folder)
    try:
        dtype = np.dtype(manifest["dtype"])
        splits = {}
        for name in SPLITS:
            opened = [_open_shard(folder, s, dtype) for s in manifest["splits"][name]["shards"]]
            splits[name] = Split([t for t, _, _ in opened], [d for _, d, _ in opened], [m for _, _, m in opened])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{os.path.join(folder, MANIFEST)} is incomplete or damaged ({e!r})") from None
    return PreparedData(folder, manifest, splits["train"], splits["val"])


def verify_prepared(folder: str) -> dict:
    """Re-hash every shard file against the manifest (reads everything). Returns the manifest; ConfigError on the
    first mismatch, naming the file."""
    manifest = read_manifest(folder)
    open_prepared(folder)  # sizes first: cheaper, and a clearer message for a truncated file
    for name in SPLITS:
        for shard in manifest["splits"][name]["shards"]:
            for key in ("bin", "idx"):
                path = os.path.join(folder, shard[key])
                if file_sha256(path) != shard[f"{key}_sha256"]:
                    raise ConfigError(
                        f"{path} does not match its checksum in the manifest (damaged; run lmt prepare again)"
                    )
    tokenizer = manifest["tokenizer"]
    if tokenizer["kind"] == "hf" and file_sha256(os.path.join(folder, "tokenizer.json")) != tokenizer["sha256"]:
        raise ConfigError(f"{folder}/tokenizer.json does not match the tokenizer the data was prepared with")
    return manifest
