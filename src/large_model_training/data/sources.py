"""Where documents come from: input paths expanded to files, and the files read as documents, in a fixed order.

The order is the contract a resumed `lmt prepare` relies on: the same paths always give the same files in the
same order, and `iter_documents(files, skip=n)` gives exactly what the first call gave after its n-th document.
Everything streams (JSON Lines line by line, Parquet and Arrow by record batches: `data/columnar.py`,
compressed files through a streaming decompressor), so memory does not grow with file size; only a plain text file,
which *is* one document, is read whole. Bad input is a one-line `ConfigError` naming the file (and line), never a
traceback.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Any

from large_model_training.data.columnar import arrow_documents, one_line, parquet_documents
from large_model_training.data.saved_dataset import is_saved_dataset, refuse_dataset_dict, saved_dataset_files
from large_model_training.errors import ConfigError

TEST_DIRS = ("test", "tests", "idle_test")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")


def stdlib_files() -> list[str]:
    """The standard library's .py files in sorted order, without site-packages and test suites."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in TEST_DIRS and d != "site-packages" and not d.startswith("__pycache__")
        )
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def expand_inputs(paths: Sequence[str]) -> list[str]:
    """Files of the given paths in order: a file as is, a folder as its files (recursive, sorted by path).

    Hidden files and folders inside a folder are skipped (.git, editor swap files); a hidden file named
    explicitly is kept, since the user asked for it. A Hugging Face `save_to_disk` folder, named or found inside
    a folder, gives its Arrow files in its own order (`data/saved_dataset.py`), never its JSON files.
    """
    if not paths:
        raise ConfigError("no input paths given")
    files: list[str] = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            found = _folder_files(path)
            if not found:
                raise ConfigError(f"data folder {path} has no files")
            files.extend(found)
        elif os.path.exists(path):
            raise ConfigError(f"data path {path} is neither a file nor a folder")
        else:
            raise ConfigError(f"data path not found: {path}")
    return files


def _folder_files(root: str) -> list[str]:
    found: list[tuple[str, str]] = []  # (sort key, file)
    for dirpath, dirnames, filenames in os.walk(root):
        refuse_dataset_dict(dirpath)
        if is_saved_dataset(dirpath):
            dirnames[:] = []  # the saved dataset is the unit: its files in state.json's order, keyed by position
            found.extend((os.path.join(dirpath, f"{i:08d}"), f) for i, f in enumerate(saved_dataset_files(dirpath)))
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.extend((os.path.join(dirpath, f),) * 2 for f in filenames if not f.startswith("."))
    return [f for _, f in sorted(found)]


def iter_documents(files: Sequence[str], skip: int = 0, text_field: str = "text") -> Iterator[str]:
    """The documents of the files in order, after skipping the first `skip` of them.

    By name: JSON Lines (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`, `.json.gz`, `.json.zst`) give one document per
    non-blank line, the string field `text_field` of a JSON object; `.parquet` and `.arrow` (Arrow IPC, as in a
    `save_to_disk` folder) give the non-null values of the column `text_field`; anything else is a text file and
    the whole file is one document (utf-8, undecodable bytes replaced). Skipped documents are counted, not
    decoded: a skipped text file is not opened, a skipped Parquet row group or Arrow batch is not converted, a
    skipped JSON line is not parsed (it was checked when it was first read).
    """
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    for path in files:
        name = path.lower()
        if name.endswith(JSONL_SUFFIXES):
            docs = _jsonl_documents(path, skip, text_field)
        elif name.endswith(".parquet"):
            docs = parquet_documents(path, skip, text_field)
        elif name.endswith(".arrow"):
            docs = arrow_documents(path, skip, text_field)
        elif skip:
            skip -= 1
            continue
        else:
            yield _read_text(path)
            continue
        # Each reader yields (documents it skipped, document or None) so that skip carries into the next file.
        for skipped, doc in docs:
            skip -= skipped
            if doc is not None:
                yield doc


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"cannot read data file {path}: {e.strerror or one_line(e)}") from None


def _open_binary(path: str) -> tuple[IO[bytes], tuple[type[BaseException], ...]]:
    """The decompressed bytes of a file, and the errors that mean the file itself is bad."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    name = path.lower()
    zstandard: Any = None
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ConfigError(f"reading {path} needs the zstandard package: pip install zstandard") from None
    try:
        if name.endswith(".gz"):
            return gzip.open(path, "rb"), errors  # type: ignore[return-value]
        raw = open(path, "rb")
    except OSError as e:
        raise ConfigError(f"cannot read data file {path}: {e.strerror or one_line(e)}") from None
    if zstandard is not None:
        return io.BufferedReader(_ZstdReader(raw, zstandard)), errors + (zstandard.ZstdError,)
    return raw, errors


def _jsonl_documents(path: str, skip: int, field: str) -> Iterator[tuple[int, str | None]]:
    stream, bad_file_errors = _open_binary(path)
    line_no = 0
    try:
        # newline="\n": JSON Lines records end at \n only (a stray \r is JSON whitespace, not a record break).
        with io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline="\n") as lines:
            for line_no, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                if skip:
                    skip -= 1
                    yield 1, None
                    continue
                yield 0, _text_of_json_line(path, line_no, line, field)
    except bad_file_errors as e:
        where = f" (after line {line_no})" if line_no else ""
        raise ConfigError(f"cannot read data file {path}{where}: {one_line(e)}") from None


def _text_of_json_line(path: str, line_no: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ConfigError(
            f"{path}:{line_no}: expected a JSON object with a string field '{field}', got {type(record).__name__}"
        )
    text = record.get(field)
    if not isinstance(text, str):
        found = (
            f"no field '{field}' (fields: {', '.join(map(str, record))})"
            if field not in record
            else f"'{field}' is {type(text).__name__}"
        )
        raise ConfigError(f"{path}:{line_no}: expected a string field '{field}', found {found}")
    return text


class _ZstdReader(io.RawIOBase):
    """zstd frames decoded as a stream. Unlike `ZstdDecompressor().stream_reader`, which silently stops at the
    end of the input, a file cut inside a frame is an error here (`EOFError`), as it is for gzip."""

    INPUT_CHUNK = 1 << 14  # compressed bytes per call: what one call may expand to is what memory holds

    def __init__(self, raw: IO[bytes], zstandard):
        super().__init__()
        self._raw, self._zstandard = raw, zstandard
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False  # input of the current frame has been seen but its end has not
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._raw.read(self.INPUT_CHUNK)
            if not chunk:
                if self._in_frame:
                    raise EOFError("zstd stream ended before the end of a frame (truncated file?)")
                return 0
            self._pending = memoryview(self._decompress(chunk))
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]  # a view: no copy of what is left
        return size

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # a file may hold several frames back to back
            self._frame = self._zstandard.ZstdDecompressor().decompressobj()
        return b"".join(out)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()
