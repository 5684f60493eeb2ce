"""Tokenizers: byte-level by default (no file needed, 256 ids), or a Hugging Face `tokenizer.json`.

Every tokenizer has an end-of-document id `eod_id`, which prepared data puts between documents, and an
`identity()` that a manifest records so that data tokenized with one tokenizer is never read with another.
Text never encodes to the EOD id (the byte tokenizer drops NUL; a Hugging Face tokenizer encodes the literal
text of special tokens as ordinary text), so a document cannot fake a document boundary.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np

from large_model_training.errors import ConfigError

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
TRAINED_EOD_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes are the tokens: any text round-trips; vocabulary of 256.

    The end-of-document id is 0, the NUL byte: text never needs it, so the vocabulary stays 256 and ids still
    fit in uint8. `encode` drops NUL characters from the text to keep that promise; `decode` turns an EOD id
    into a newline, so that generated text that crosses a document boundary stays readable.
    """

    vocab_size = 256
    eod_id = 0
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        # errors="replace": JSON may carry lone surrogates ("\ud800"), which UTF-8 cannot encode
        return np.frombuffer(text.replace("\0", "").encode("utf-8", errors="replace"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(10 if i == self.eod_id else i for i in map(int, ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def identity(self) -> dict:
        return {
            "kind": "bytes",
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "sha256": hashlib.sha256(b"lmt-bytes-v1").hexdigest(),
        }


class HFTokenizer:
    """A `tokenizers` BPE/WordPiece/Unigram tokenizer read from a tokenizer.json file (no hub access).

    The EOD token is `eod_token` if given, else the first of EOD_CANDIDATES among the tokenizer's added tokens.
    A tokenizer without one still encodes and decodes (raw-text training and old checkpoints need no EOD);
    asking for `eod_id` or `identity()` then raises the ConfigError, so `lmt prepare` fails before it writes.
    """

    def __init__(self, path: str, eod_token: str | None = None):
        from tokenizers import Tokenizer

        try:
            with open(path, "rb") as f:
                data = f.read()
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except OSError as e:
            raise ConfigError(f"cannot read tokenizer {path}: {e.strerror}") from None
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"cannot read tokenizer {path}: {first_line}") from None
        # Literal "<|endoftext|>" in a document is text, not a boundary (like tiktoken's encode_ordinary).
        self._tok.encode_special_tokens = True
        self.path = path
        self.name = os.path.basename(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.eod_token, self._eod_id, self._eod_problem = self._find_eod(eod_token)

    def __setstate__(self, state: dict) -> None:
        """Unpickled (a spawned `prepare` worker): the library's pickle drops encode_special_tokens; restore it."""
        self.__dict__.update(state)
        self._tok.encode_special_tokens = True

    def _find_eod(self, wanted: str | None) -> tuple[str | None, int | None, str]:
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        if wanted is not None:
            if wanted in added:
                return wanted, added[wanted], ""
            known = ", ".join(sorted(added)[:8]) or "none"
            return None, None, (f"tokenizer {self.path} has no special token {wanted!r} (its special tokens: {known})")
        for candidate in EOD_CANDIDATES:
            if candidate in added:
                return candidate, added[candidate], ""
        return (
            None,
            None,
            (
                f"tokenizer {self.path} has no end-of-document token "
                f"(looked for {' '.join(EOD_CANDIDATES)}); pass --eod-token"
            ),
        )

    @property
    def eod_id(self) -> int:
        if self._eod_id is None:
            raise ConfigError(self._eod_problem)
        return self._eod_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One call into the library, which tokenizes the batch on all cores (no offsets computed)."""
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch_fast(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; an EOD id becomes a newline (as for bytes), other special tokens are dropped."""
        ids = [int(i) for i in ids]
        if self._eod_id is None:
            return self._tok.decode(ids)
        parts, start = [], 0
        for at, i in enumerate(ids + [self._eod_id]):
            if i == self._eod_id:
                parts.append(self._tok.decode(ids[start:at]))
                start = at + 1
        return "\n".join(parts)

    def identity(self) -> dict:
        return {
            "kind": "hf",
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "eod_token": self.eod_token,
            "sha256": self.sha256,
        }


def load_tokenizer(path: str = "", eod_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer for an empty path, else the tokenizer.json at path."""
    if not path:
        if eod_token is not None:
            raise ConfigError("--eod-token needs a tokenizer file; the byte tokenizer's EOD is always id 0")
        return ByteTokenizer()
    return HFTokenizer(path, eod_token)


def train_bpe_tokenizer(documents: Iterable[str], vocab_size: int, out_path: str) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) on the documents, write it to out_path, load it.

    Byte-level with the full byte alphabet: any text encodes, with no unknown token. Its one special token,
    "<|endoftext|>", is the EOD (id 0). Training is deterministic: the same documents and vocab_size give a
    byte-identical tokenizer.json, across processes and thread counts. The file appears atomically.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(alphabet) + 2  # the bytes, the EOD token and at least one merge
    if vocab_size < smallest:
        raise ConfigError(
            f"tokenizer vocab_size must be at least {smallest} (256 bytes + EOD + one merge), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[TRAINED_EOD_TOKEN], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(documents, trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"  # same folder, so os.replace is atomic; a reader never sees half
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(tokenizer.to_str(pretty=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return HFTokenizer(out_path, TRAINED_EOD_TOKEN)
