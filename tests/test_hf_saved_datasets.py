"""Hugging Face `datasets.save_to_disk` folders (written by the real `datasets` package, read without it) and
`--text-field` on JSON Lines, Parquet and Arrow inputs: the documents in order, exact skips, one-line errors,
and a saved dataset prepared by `lmt prepare` and trained on."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from large_model_training.cli import main
from large_model_training.data.prepared import open_prepared
from large_model_training.data.sources import expand_inputs, iter_documents
from tests.helpers import SMALL_MODEL, train
from tests.test_data_sources import _config_error, _parquet
from tests.test_prepare_cli import _one_line_exit_2

# Rows whose text column is `content`; every 9th is null (a missing value, not a document).
CONTENT = [None if i % 9 == 4 else f"def f_{i}(x):\n    return x * {i}\n" * (1 + i % 3) for i in range(120)]


def save_dataset(folder, rows=CONTENT, num_shards=3, **columns) -> list[str]:
    """A Dataset shuffled and cut (save_to_disk writes it in that order), saved in `num_shards` Arrow files by
    the real package; returns the non-null `content` values in the saved order."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"content": rows, "n": list(range(len(rows))), **columns})
    ds = ds.shuffle(seed=3).select(range(len(rows) - 7))
    ds.save_to_disk(str(folder), num_shards=num_shards)
    return [t for t in ds["content"] if t is not None]


def test_a_saved_dataset_reads_in_its_order_and_skips_exactly(tmp_path):
    docs = save_dataset(tmp_path / "corpus" / "saved")
    (tmp_path / "corpus" / "a.txt").write_text("a text file first")
    files = expand_inputs([str(tmp_path / "corpus")])
    # The Arrow files only (not state.json / dataset_info.json), in state.json's order, after a.txt.
    assert [os.path.relpath(f, tmp_path / "corpus") for f in files] == [
        "a.txt",
        *(os.path.join("saved", f"data-0000{i}-of-00003.arrow") for i in range(3)),
    ]
    saved = files[1:]
    assert list(iter_documents(saved, text_field="content")) == docs
    for skip in (0, 1, 36, 37, 38, len(docs) - 1, len(docs), len(docs) + 1):
        assert list(iter_documents(files, skip=skip, text_field="content")) == ["a text file first", *docs][skip:]
    assert expand_inputs([str(tmp_path / "corpus" / "saved")]) == saved


def test_an_arrow_ipc_file_in_the_random_access_format_reads_too(tmp_path):
    import pyarrow as pa

    table = pa.table({"body": ["one", None, "two", "three"]})
    with pa.ipc.new_file(str(tmp_path / "t.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    assert list(iter_documents([str(tmp_path / "t.arrow")], text_field="body")) == ["one", "two", "three"]
    assert list(iter_documents([str(tmp_path / "t.arrow")], skip=2, text_field="body")) == ["three"]


def test_text_field_picks_the_column_of_jsonl_and_parquet(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": f"j{i}", "text": 0}) + "\n" for i in range(3)))
    _parquet(tmp_path / "b.parquet", None, body=["p0", None, "p1"], text=[1, 2, 3])
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")]
    assert list(iter_documents(files, text_field="body")) == ["j0", "j1", "j2", "p0", "p1"]
    assert list(iter_documents(files, skip=4, text_field="body")) == ["p1"]


def test_bad_saved_datasets_and_fields_are_one_line_errors(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"content": ["a", "b"]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    _config_error(
        lambda: expand_inputs([str(tmp_path / "dict")]),
        "DatasetDict",
        "train, test",
        os.path.join(str(tmp_path / "dict"), "train"),
    )
    saved = expand_inputs([str(tmp_path / "dict" / "train")])
    _config_error(lambda: list(iter_documents(saved)), "no column 'text'", "columns: content")
    os.remove(saved[0])
    _config_error(lambda: expand_inputs([str(tmp_path / "dict" / "train")]), "data-00000-of-00001.arrow", "missing")
    (tmp_path / "fake.arrow").write_text("not arrow")
    _config_error(lambda: list(iter_documents([str(tmp_path / "fake.arrow")])), "fake.arrow")
    (tmp_path / "a.jsonl").write_text('{"text": "t", "id": 1}\n')
    _config_error(
        lambda: list(iter_documents([str(tmp_path / "a.jsonl")], text_field="body")),
        "a.jsonl:1",
        "no field 'body'",
        "fields: text, id",
    )


def _parquet_file(p) -> str:
    _parquet(p / "a.parquet", ["x", "y"])
    return str(p / "a.parquet")


def _jsonl_file(p) -> str:
    (p / "a.jsonl").write_text('{"text": "x"}\n')
    return str(p / "a.jsonl")


BAD_FIELD = {
    "jsonl": (_jsonl_file, "a.jsonl:1: expected a string field 'body', found no field 'body'"),
    "parquet": (_parquet_file, "has no column 'body' (columns: text)"),
    "saved dataset": (
        lambda p: (save_dataset(p / "saved", num_shards=1), str(p / "saved"))[1],
        "has no column 'body' (columns: content, n)",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_FIELD))
def test_prepare_with_a_missing_text_field_is_one_line_and_exit_2(kind, tmp_path, capsys):
    make, message = BAD_FIELD[kind]
    _one_line_exit_2(
        capsys,
        ["prepare", make(tmp_path), "--text-field", "body", "--out", str(tmp_path / "o"), "--workers", "1"],
        message,
    )
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_lmt_prepare_reads_a_saved_dataset_back_document_for_document(tmp_path, capsys):
    docs = save_dataset(tmp_path / "saved")
    assert (
        main(
            [
                "prepare",
                str(tmp_path / "saved"),
                "--text-field",
                "content",
                "--out",
                str(tmp_path / "out"),
                "--workers",
                "1",
                "--val-fraction",
                "0.1",
            ]
        )
        == 0
    )
    n_val = len(docs[::10])
    assert f"{len(docs) - n_val:,} train / {n_val:,} validation documents" in capsys.readouterr().out
    data = open_prepared(str(tmp_path / "out"))
    assert data.manifest["text_field"] == "content" and data.eod_id == 0

    def documents(split) -> list[str]:  # the byte tokenizer: tokens are the UTF-8 bytes, EOD (0) ends each
        tokens = np.concatenate(split.parts).tobytes()
        return [d.decode() for d in tokens.split(b"\0")[:-1]]

    assert documents(data.train) == [d for i, d in enumerate(docs) if i % 10]
    assert documents(data.val) == docs[::10]


@pytest.mark.slow
def test_a_saved_dataset_trains_through_prepare_and_through_raw_data(tmp_path, small_corpus):
    """`lmt prepare --text-field` then `lmt train --data` on it; and a saved dataset whose column is `text`
    given to `lmt train --data` directly (prepared into the cache on the way)."""
    texts = [open(os.path.join(small_corpus, f)).read() for f in sorted(os.listdir(small_corpus))]
    chunks = [t[i : i + 2000] for t in texts for i in range(0, len(t), 2000)]
    save_dataset(tmp_path / "saved", rows=chunks, num_shards=2)
    assert (
        main(
            [
                "prepare",
                str(tmp_path / "saved"),
                "--text-field",
                "content",
                "--out",
                str(tmp_path / "data"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    args = [*SMALL_MODEL, "--steps", "3", "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-every", "3"]
    rows = train(str(tmp_path / "run"), *args, "--data", str(tmp_path / "data"))
    assert [r["step"] for r in rows] == [1, 2, 3] and "val_loss" in rows[-1] and rows[-1]["loss"] < rows[0]["loss"]
    save_dataset(tmp_path / "text", rows=chunks, num_shards=2, text=chunks)
    rows = train(str(tmp_path / "run2"), *args, "--data", str(tmp_path / "text"))
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["tokens_text"] == 3 * 4 * 64
