"""Tokenizers: byte-level by default (no file needed, 256 ids), or a Hugging Face `tokenizer.json`."""

from __future__ import annotations

import numpy as np

from large_model_training.config import ConfigError


class ByteTokenizer:
    """UTF-8 bytes are the tokens. Any text round-trips; vocabulary of 256."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` BPE/WordPiece/Unigram tokenizer read from a tokenizer.json file (no hub access)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise ConfigError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.name = path

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(path: str) -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(path) if path else ByteTokenizer()
