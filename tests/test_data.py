"""Data: sources, the deterministic split, tokenizers, and disjoint, complete dp sharding of every batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from large_model_training.config import DataConfig
from large_model_training.errors import ConfigError
from large_model_training.data.corpus import load_token_streams, stdlib_files
from large_model_training.data.loader import BatchLoader, Shard


def _loader(tokens, dp_rank, dp_size, global_batch=12, micro=2, start_step=0, prefetch=False):
    return BatchLoader(tokens, seq_len=8, shard=Shard(dp_rank, dp_size, global_batch, micro), seed=7,
                       device=torch.device("cpu"), start_step=start_step, prefetch=prefetch)


def test_dp_shards_are_disjoint_and_cover_the_global_batch():
    tokens = np.arange(10_000, dtype=np.int64)  # token value = position: samples are identifiable
    single = _loader(tokens, 0, 1)
    for step in range(3):
        whole = torch.cat([x for x, _ in single.next()])
        for dp in (2, 3):
            parts = [torch.cat([x for x, _ in _loader(tokens, r, dp, start_step=step).next()]) for r in range(dp)]
            firsts = [set(p[:, 0].tolist()) for p in parts]
            assert all(a.isdisjoint(b) for i, a in enumerate(firsts) for b in firsts[i + 1:])
            assert torch.equal(torch.cat(parts), whole)  # same samples, same order as one process


def test_targets_are_inputs_shifted_and_prefetch_changes_nothing():
    tokens = np.arange(5_000, dtype=np.int64)
    plain, prefetched = _loader(tokens, 0, 1), _loader(tokens, 0, 1, prefetch=True)
    for _ in range(4):
        a, b = plain.next(), prefetched.next()
        for (x, y), (x2, y2) in zip(a, b):
            assert torch.equal(x, x2) and torch.equal(y, y2)
            assert torch.equal(x[:, 1:], y[:, :-1])
    assert prefetched.state_dict() == {"next_step": 4}


def test_default_corpus_is_the_stdlib_split_deterministically():
    files = stdlib_files()
    assert files == sorted(files) and not any("/test/" in f or "site-packages" in f for f in files)
    a, b = load_token_streams(DataConfig()), load_token_streams(DataConfig())
    # Byte tokens of whole files, whatever Python is installed: every round(1 / val_fraction)-th file held out.
    texts = [open(f, "rb").read().decode("utf-8", errors="replace").encode() for f in files]
    every = round(1 / DataConfig().val_fraction)
    assert a.vocab_size == 256 and len(files) > 2 * every
    assert a.val.tobytes() == b"".join(texts[::every])
    assert a.train.tobytes() == b"".join(t for i, t in enumerate(texts) if i % every)
    assert np.array_equal(a.val, b.val) and np.array_equal(a.train, b.train)


def test_text_jsonl_and_bin_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    text = load_token_streams(DataConfig(path=str(tmp_path / "a.txt")))
    assert bytes(np.concatenate([text.train, text.val])) == b"hello world\n" * 50
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(100):
            f.write(json.dumps({"text": f"doc {i}\n"}) + "\n")
    docs = load_token_streams(DataConfig(path=str(tmp_path / "d.jsonl"), val_fraction=0.1))
    assert bytes(docs.val).startswith(b"doc 0\ndoc 10\n")
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    binary = load_token_streams(DataConfig(path=str(tmp_path / "t.bin"), val_fraction=0.1))
    assert binary.train.tolist() == list(range(900)) and binary.vocab_size == 1000
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        load_token_streams(DataConfig(path=str(tmp_path / "bad.jsonl")))


def test_hugging_face_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "code.txt").write_text("def g(y):\n    return y * 2\n" * 40)
    streams = load_token_streams(DataConfig(path=str(tmp_path / "code.txt"),
                                            tokenizer=str(tmp_path / "tokenizer.json")))
    assert streams.vocab_size == tok.get_vocab_size()
    assert int(streams.train.max()) < streams.vocab_size
    assert len(streams.train) < len("def g(y):\n    return y * 2\n" * 40)  # merges happened
