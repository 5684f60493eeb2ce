"""`lmt prepare` and `lmt train --data` on prepared folders and blends: the CLI contract and whole runs."""

from __future__ import annotations

import json
import os

import pytest

from large_model_training.cli import main
from large_model_training.data.prepared import read_manifest
from tests.helpers import SMALL_MODEL, Runs, assert_close_curves, losses


def _corpus(folder, n=80, word="alpha") -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "docs.jsonl"), "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"def {word}_{i}(x):\n    return x * {i} + {word!r}\n" * (1 + i % 5)}) + "\n")
    return str(folder)


def _prepare(*args: str) -> None:
    assert main(["prepare", *args]) == 0


def _one_line_exit_2(capsys, argv: list[str], message: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("lmt: error: ") and "Traceback" not in err, err
    assert message in err, err


def _parquet_without_text(p) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), str(p / "bad.parquet"))
    return str(p / "bad.parquet")


PREPARE_BAD = {
    "missing input": (lambda p: [str(p / "nowhere"), "--out", str(p / "o")], "nowhere"),
    "no --out": (lambda p: [_corpus(p / "c")], "--out"),
    "parquet without a text column": (lambda p: [_parquet_without_text(p), "--out", str(p / "o")], "bad.parquet"),
    "bad JSON line": (lambda p: [_bad_jsonl(p), "--out", str(p / "o")], "bad.jsonl:2"),
    "missing tokenizer": (
        lambda p: [_corpus(p / "c"), "--out", str(p / "o"), "--tokenizer", str(p / "t.json")],
        "t.json",
    ),
    "no workers": (lambda p: [_corpus(p / "c"), "--out", str(p / "o"), "--workers", "0"], "--workers"),
    "two tokenizers": (
        lambda p: [_corpus(p / "c"), "--out", str(p / "o"), "--train-tokenizer", "300", "--tokenizer", __file__],
        "either",
    ),
    "verify a folder that is not prepared": (lambda p: ["--verify", _corpus(p / "c")], "manifest.json"),
}


def _bad_jsonl(p) -> str:
    (p / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    return str(p / "bad.jsonl")


@pytest.mark.parametrize("case", list(PREPARE_BAD))
def test_bad_prepare_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    argv, message = PREPARE_BAD[case]
    _one_line_exit_2(capsys, ["prepare", *argv(tmp_path)], message)
    assert not (tmp_path / "o" / "manifest.json").exists()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, str]:
    """Two byte-level folders and one with a BPE tokenizer trained on the input."""
    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for name, word in (("alpha", "alpha"), ("beta", "beta")):
        out[name] = str(root / name)
        _prepare(
            _corpus(root / f"raw_{name}", word=word), "--out", out[name], "--workers", "1", "--val-fraction", "0.1"
        )
    out["bpe"] = str(root / "bpe")
    _prepare(
        _corpus(root / "raw_alpha"),
        "--out",
        out["bpe"],
        "--train-tokenizer",
        "300",
        "--workers",
        "1",
        "--val-fraction",
        "0.1",
    )
    return out


def test_train_tokenizer_writes_a_tokenizer_the_data_is_tokenized_with(prepared, capsys):
    manifest = read_manifest(prepared["bpe"])
    assert manifest["tokenizer"]["kind"] == "hf" and manifest["tokenizer"]["vocab_size"] == 300
    assert manifest["dtype"] == "uint16" and os.path.isfile(os.path.join(prepared["bpe"], "tokenizer.json"))
    assert main(["prepare", "--verify", prepared["bpe"]]) == 0
    assert "every shard matches its checksum" in capsys.readouterr().out


def _truncated(prepared, p) -> str:
    import shutil

    copy = shutil.copytree(prepared["alpha"], p / "truncated")
    with open(copy / "train-00000.bin", "r+b") as f:
        f.truncate(100)
    return str(copy)


def _unfinished(p) -> str:
    (p / "half").mkdir()
    (p / "half" / "prepare-progress.json").write_text("{}")
    return str(p / "half")


TRAIN_BAD = {
    "blend weight zero": (lambda d, p: ["--data", f"0:{d['alpha']},1:{d['beta']}"], "positive"),
    "blend item without weight": (lambda d, p: ["--data", f"{d['alpha']},{d['beta']}"], "WEIGHT:PATH"),
    "blend of different tokenizers": (
        lambda d, p: ["--data", f"0.5:{d['alpha']},0.5:{d['bpe']}"],
        "different tokenizers",
    ),
    "tokenizer above the model's vocabulary": (
        lambda d, p: ["--data", d["bpe"], "--model.vocab_size", "256"],
        "300 ids but model.vocab_size is 256",
    ),
    "truncated shard": (lambda d, p: ["--data", _truncated(d, p)], "truncated or replaced"),
    "unfinished prepare": (lambda d, p: ["--data", _unfinished(p)], "unfinished lmt prepare"),
    "data smaller than a sample": (
        lambda d, p: ["--data", d["alpha"], "--seq-len", "1000", "--model.max_seq_len", "1024"],
        "data too small",
    ),
}


@pytest.mark.parametrize("case", list(TRAIN_BAD))
def test_bad_data_for_train_is_one_line_and_exit_2(case, prepared, tmp_path, capsys):
    argv, message = TRAIN_BAD[case]
    _one_line_exit_2(
        capsys, ["train", "--out", str(tmp_path / "run"), *SMALL_MODEL, *argv(prepared, tmp_path)], message
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_prepared_tokenizer_sets_the_model_vocabulary(prepared):
    from large_model_training.cli import build_parser, prepare_train

    cfg, _, _ = prepare_train(build_parser().parse_args(["train", *SMALL_MODEL, "--data", prepared["bpe"]]))
    assert cfg.model.vocab_size == 300 and cfg.data.tokenizer == os.path.join(prepared["bpe"], "tokenizer.json")
    cfg, _, _ = prepare_train(build_parser().parse_args(["train", *SMALL_MODEL, "--data", prepared["alpha"]]))
    assert cfg.model.vocab_size == 256  # bytes: the preset's own


# ---- whole runs (slow) -----------------------------------------------------------------------------------------
COMMON = [*SMALL_MODEL, "--steps", "4", "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-every", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared) -> Runs:
    blend = ["--data", f"0.7:{prepared['alpha']},0.3:{prepared['beta']}", "--data.document_mask", "true"]
    return Runs(
        tmp_path_factory.mktemp("runs"),
        {
            "one": [*COMMON, *blend],
            "tp2pp2": [*COMMON, *blend, "--tp", "2", "--pp", "2", "--sequence-parallel"],
            "dp2": [*COMMON, *blend, "--dp", "2"],
            "bpe": [*COMMON, "--data", prepared["bpe"]],
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2pp2", "dp2"])
def test_a_blend_with_document_masking_trains_the_same_curve_in_any_layout(runs, layout):
    assert_close_curves(losses(runs[layout]), losses(runs["one"]), 1e-5, layout)
    last = runs[layout][-1]
    assert last["tokens_alpha"] + last["tokens_beta"] == 4 * 8 * 64
    assert abs(last["tokens_alpha"] / (4 * 8 * 64) - 0.7) < 0.05


@pytest.mark.slow
def test_raw_text_to_prepare_to_train_to_generate_with_a_trained_tokenizer(runs, capsys):
    rows = runs["bpe"]
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    capsys.readouterr()  # the run's own output
    assert main(["generate", str(runs.folder("bpe")), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.slow
def test_lmt_prepare_killed_by_sigkill_resumes_to_the_same_files(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from large_model_training.data.prepare import PROGRESS
    from tests.test_data import _documents, _files

    _documents(tmp_path / "in", n=20_000)  # several tokenizer units, several groups: a kill lands midway
    argv = [
        sys.executable,
        "-m",
        "large_model_training.cli",
        "prepare",
        str(tmp_path / "in"),
        "--workers",
        "2",
        "--shard-mb",
        "0.05",
    ]
    subprocess.run([*argv, "--out", str(tmp_path / "whole")], check=True, capture_output=True, timeout=120)
    proc = subprocess.Popen(
        [*argv, "--out", str(tmp_path / "killed")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    progress = tmp_path / "killed" / PROGRESS
    deadline = time.time() + 60
    while not (progress.exists() and json.loads(progress.read_text())["groups"]) and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "manifest.json").exists(), "finished before it could be killed"
    done = len(json.loads(progress.read_text())["groups"])
    subprocess.run([*argv, "--out", str(tmp_path / "killed")], check=True, capture_output=True, timeout=120)
    whole, resumed = _files(tmp_path / "whole"), _files(tmp_path / "killed")
    assert whole == resumed and done >= 1
