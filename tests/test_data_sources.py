"""Document sources (every format, order, skip, every bad input) and the tokenizers' EOD and identity."""

from __future__ import annotations

import gzip
import json
import os
import pickle

import numpy as np
import pytest

from large_model_training.data.sources import expand_inputs, iter_documents
from large_model_training.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe_tokenizer
from large_model_training.errors import ConfigError


def _jsonl(texts) -> bytes:
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _parquet(path, texts, row_group_size=None, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": texts, **columns} if texts is not None else columns)
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture
def every_format(tmp_path):
    """One file of each format in a folder (plus hidden entries that must be skipped) and the docs in order."""
    import zstandard

    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / ".hidden.txt").write_text("no")
    (root / "a.txt").write_bytes(b"plain \xff text\r\n")
    (root / "b.jsonl").write_bytes(_jsonl(["j0", "j1"]) + b"\n  \n" + _jsonl(["j2"]))
    (root / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl(["g0", "g1"])))
    # Two zstd frames back to back (as pzstd writes them) are one stream.
    zstd = zstandard.ZstdCompressor()
    (root / "sub" / "d.jsonl.zst").write_bytes(zstd.compress(_jsonl(["z0"])) + zstd.compress(_jsonl(["z1"])))
    _parquet(root / "sub" / "e.parquet", ["p0", None, "p1", "p2", "p3"], row_group_size=2)
    docs = ["plain \ufffd text\r\n", "j0", "j1", "j2", "g0", "g1", "z0", "z1", "p0", "p1", "p2", "p3"]
    return root, docs


def _config_error(call, *names):
    with pytest.raises(ConfigError) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message and all(n in message for n in names), message
    return message


def test_folder_expands_sorted_without_hidden_and_every_format_reads(every_format):
    root, docs = every_format
    files = expand_inputs([str(root)])
    assert [os.path.relpath(f, root) for f in files] == [
        "a.txt",
        "b.jsonl",
        "c.jsonl.gz",
        os.path.join("sub", "d.jsonl.zst"),
        os.path.join("sub", "e.parquet"),
    ]
    assert list(iter_documents(files)) == docs
    # Files and folders mix, in the order given.
    assert expand_inputs([files[1], str(root / "sub")]) == [files[1], *files[3:]]


def test_skip_resumes_exactly_where_a_reader_stopped(every_format, tmp_path):
    root, docs = every_format
    files = expand_inputs([str(root)])
    for skip in range(len(docs) + 2):
        assert list(iter_documents(files, skip=skip)) == docs[skip:], skip
    # Many row groups: whole groups and whole batches are skipped from metadata, rows inside the rest.
    texts = [f"r{i}" if i % 7 else None for i in range(3000)]
    _parquet(tmp_path / "big.parquet", texts, row_group_size=500)
    present = [t for t in texts if t is not None]
    for skip in (0, 1, 428, 429, 1500, 2571, 3000):
        assert list(iter_documents([str(tmp_path / "big.parquet")], skip=skip)) == present[skip:]


def test_bad_inputs_are_one_line_config_errors_naming_the_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "x",\n')
    _config_error(lambda: list(iter_documents([str(tmp_path / "bad.jsonl")])), "bad.jsonl:2", "not valid JSON")
    (tmp_path / "field.jsonl").write_text('\n{"text": "ok"}\n{"txt": "no"}\n')
    _config_error(lambda: list(iter_documents([str(tmp_path / "field.jsonl")])), "field.jsonl:3", "'text'")
    (tmp_path / "type.jsonl").write_text('{"text": 3}\n')
    _config_error(lambda: list(iter_documents([str(tmp_path / "type.jsonl")])), "type.jsonl:1", "int")
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    _config_error(lambda: list(iter_documents([str(tmp_path / "list.jsonl")])), "list.jsonl:1", "object")
    _parquet(tmp_path / "cols.parquet", None, body=["a"])
    _config_error(lambda: list(iter_documents([str(tmp_path / "cols.parquet")])), "cols.parquet", "body")
    _parquet(tmp_path / "ints.parquet", [1, 2])
    _config_error(lambda: list(iter_documents([str(tmp_path / "ints.parquet")])), "ints.parquet", "int64")
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    _config_error(lambda: list(iter_documents([str(tmp_path / "fake.parquet")])), "fake.parquet")
    whole = gzip.compress(_jsonl([f"doc {i}" for i in range(200)]))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    _config_error(lambda: list(iter_documents([str(tmp_path / "cut.jsonl.gz")])), "cut.jsonl.gz")
    (tmp_path / "plain.jsonl.gz").write_bytes(_jsonl(["not gzip"]))
    _config_error(lambda: list(iter_documents([str(tmp_path / "plain.jsonl.gz")])), "plain.jsonl.gz")
    _config_error(lambda: list(iter_documents([str(tmp_path / "gone.txt")])), "gone.txt")
    _config_error(lambda: expand_inputs([str(tmp_path / "missing")]), "missing", "not found")
    (tmp_path / "empty" / ".git").mkdir(parents=True)
    _config_error(lambda: expand_inputs([str(tmp_path / "empty")]), "empty", "no files")


def test_truncated_zstd_is_an_error_not_a_short_read(tmp_path):
    import zstandard

    data = _jsonl([f"document {i} " * 20 for i in range(2000)])
    packed = zstandard.ZstdCompressor().compress(data)
    (tmp_path / "cut.jsonl.zst").write_bytes(packed[:-4])
    _config_error(lambda: list(iter_documents([str(tmp_path / "cut.jsonl.zst")])), "cut.jsonl.zst", "truncated")
    (tmp_path / "junk.jsonl.zst").write_bytes(b"definitely not zstd")
    _config_error(lambda: list(iter_documents([str(tmp_path / "junk.jsonl.zst")])), "junk.jsonl.zst")


def test_missing_optional_package_names_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name.split(".")[0] in ("pyarrow", "zstandard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "a.jsonl.zst").write_bytes(b"")
    _config_error(lambda: list(iter_documents([str(tmp_path / "a.parquet")])), "a.parquet", "pip install pyarrow")
    _config_error(lambda: list(iter_documents([str(tmp_path / "a.jsonl.zst")])), "pip install zstandard")


def test_byte_tokenizer_eod_is_nul_and_text_never_makes_it():
    tok = load_tokenizer()
    assert isinstance(tok, ByteTokenizer) and tok.eod_id == 0 and tok.vocab_size == 256
    ids = tok.encode("a\0b é")
    assert ids.dtype == np.uint8 and 0 not in ids and tok.decode(ids) == "ab é"
    docs = tok.encode_batch(["one", "two"])
    assert tok.decode(np.concatenate([docs[0], [tok.eod_id], docs[1]])) == "one\ntwo"
    identity = tok.identity()
    assert identity["kind"] == "bytes" and identity["eod_id"] == 0 and len(identity["sha256"]) == 64
    assert identity == ByteTokenizer().identity()


def test_trained_bpe_round_trips_is_deterministic_and_has_an_eod(tmp_path):
    docs = [f"def f{i}(x):\n    return x * {i} + 'caf\u00e9'\n" for i in range(60)]
    first = train_bpe_tokenizer(iter(docs), 400, str(tmp_path / "a" / "tokenizer.json"))
    second = train_bpe_tokenizer(docs, 400, str(tmp_path / "b.json"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert os.listdir(tmp_path / "a") == ["tokenizer.json"]  # no temporary file left behind
    assert first.identity() == {**second.identity(), "name": "tokenizer.json"}
    assert first.eod_token == "<|endoftext|>" and 300 < first.vocab_size <= 400  # fewer if merges run out
    text = "def g(y):\n    return y * 2 + 'ünïcode 🙂' <|endoftext|>\n"
    ids = first.encode(text)
    assert ids.dtype == np.uint32 and first.eod_id not in ids  # literal special text stays text
    assert np.array_equal(pickle.loads(pickle.dumps(first)).encode(text), ids)  # as in a spawned worker
    assert first.decode(ids) == text and len(ids) < len(text.encode())
    batch = first.encode_batch(["x = 1", text])
    assert np.array_equal(batch[1], ids)
    assert first.decode(np.concatenate([batch[0], [first.eod_id], batch[1]])) == "x = 1\n" + text
    _config_error(lambda: train_bpe_tokenizer(docs, 257, str(tmp_path / "small.json")), "257")


def test_hf_eod_lookup_and_the_missing_eod_error(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def make(name, specials):
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train_from_iterator(["some text here"] * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
        tok.save(str(tmp_path / name))
        return str(tmp_path / name)

    llama_like = make("llama.json", ["[UNK]", "<s>", "</s>", "[SEP]"])
    tok = HFTokenizer(llama_like)
    assert (tok.eod_token, tok.eod_id) == ("</s>", 2)  # the first candidate present, not list order
    assert HFTokenizer(llama_like, eod_token="[SEP]").eod_id == 3
    assert tok.identity()["sha256"] == HFTokenizer(llama_like, "[SEP]").identity()["sha256"]
    _config_error(lambda: HFTokenizer(llama_like, eod_token="<nope>").eod_id, "llama.json", "<nope>")
    bare = HFTokenizer(make("bare.json", ["[UNK]"]))
    assert bare.decode(bare.encode("some text")) == "some text"  # still usable for raw-text training
    _config_error(lambda: bare.eod_id, "bare.json", "--eod-token", "<|endoftext|>")
    _config_error(bare.identity, "bare.json", "--eod-token")
    (tmp_path / "broken.json").write_text("{")
    _config_error(lambda: load_tokenizer(str(tmp_path / "broken.json")), "broken.json")
    _config_error(lambda: load_tokenizer("", eod_token="</s>"), "--eod-token")
