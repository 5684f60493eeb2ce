"""The CLI contract: documented flags, and bad input ending in one line on stderr with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from large_model_training.cli import main
from tests.helpers import SMALL_MODEL, train

CONTRACT_FLAGS = ["--config", "--model", "--tp", "--pp", "--dp", "--steps", "--seq-len", "--micro-batch-size",
                  "--global-batch-size", "--lr", "--seed", "--data", "--out", "--save-every", "--resume",
                  "--eval-every", "--model.hidden_size", "--model.n_layers", "--model.n_heads", "--model.n_kv_heads",
                  "--model.ffn_hidden_size", "--model.vocab_size", "--model.max_seq_len", "--model.mlp",
                  "--model.norm", "--model.position"]


def test_help_documents_every_contract_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in CONTRACT_FLAGS:
        assert flag in text, flag
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "train" in capsys.readouterr().out


def _bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train\nsteps = 3\n")
    return str(path)


def _foreign_folder(tmp_path):
    path = tmp_path / "foreign"
    (path / "checkpoints" / "step_3").mkdir(parents=True)
    (path / "checkpoints" / "step_3" / "meta.json").write_text(json.dumps({"format": "something-else"}))
    return str(path)


BAD_INPUTS = {
    "unknown preset": lambda p: ["--model", "gpt-9"],
    "unknown flag": lambda p: ["--bogus", "1"],
    "unknown dotted setting": lambda p: ["--model.hiden_size", "64"],
    "world size not tp*pp*dp": lambda p: ["--dp", "3", "--global-batch-size", "8"],
    "heads not dividing hidden": lambda p: ["--model.hidden_size", "100", "--model.n_heads", "3"],
    "kv heads not dividing heads": lambda p: ["--model.n_kv_heads", "3"],
    "seq-len above the maximum": lambda p: ["--seq-len", "100000"],
    "zero size": lambda p: ["--model.hidden_size", "0"],
    "negative steps": lambda p: ["--steps", "-5"],
    "not a number": lambda p: ["--lr", "fast"],
    "bad choice": lambda p: ["--model.mlp", "relu"],
    "missing data path": lambda p: ["--data", str(p / "nowhere")],
    "unreadable resume folder": lambda p: ["--resume", str(p / "no-run")],
    "foreign resume folder": lambda p: ["--resume", _foreign_folder(p)],
    "malformed TOML": lambda p: ["--config", _bad_toml(p)],
    "missing TOML": lambda p: ["--config", str(p / "none.toml")],
    "tp larger than heads": lambda p: ["--tp", "8", "--model.n_heads", "4"],
    "heads not divisible by tp": lambda p: ["--tp", "3"],
    "kv heads not divisible by tp": lambda p: ["--tp", "4", "--model.n_heads", "8", "--model.hidden_size", "128",
                                              "--model.n_kv_heads", "6"],
    "ffn not divisible by tp": lambda p: ["--tp", "4", "--model.ffn_hidden_size", "390"],
    "sp seq not divisible by tp": lambda p: ["--tp", "4", "--sequence-parallel", "--seq-len", "30"],
    "pp above the layer count": lambda p: ["--pp", "8"],
    "interleaved with too few micro-batches": lambda p: ["--pp", "2", "--schedule", "interleaved",
                                                         "--virtual-stages", "2"],
    "inner chunk without a layer": lambda p: ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                                              "--global-batch-size", "32", "--pp-layers", "3,0,2,1"],
    "zbv with three chunks": lambda p: ["--pp", "2", "--schedule", "zbv", "--virtual-stages", "3"],
    "zero bubble under ZeRO-3": lambda p: ["--pp", "2", "--dp", "2", "--schedule", "zb-h1", "--zero", "3"],
    "pp-layers not adding up": lambda p: ["--pp", "2", "--pp-layers", "1,2"],
    "unknown schedule": lambda p: ["--pp", "2", "--schedule", "zigzag"],
    "cp zero": lambda p: ["--cp", "0"],
    "cp not a number": lambda p: ["--cp", "two"],
    "cp not dividing the zig-zag": lambda p: ["--cp", "4", "--cp-attention", "allgather", "--seq-len", "36"],
    "unknown cp attention": lambda p: ["--cp", "2", "--cp-attention", "star"],
    "cp with SP, seq / cp not divisible by tp": lambda p: ["--tp", "4", "--sequence-parallel", "--cp", "2",
                                                          "--cp-attention", "allgather", "--seq-len", "12"],
    "cp with dropout": lambda p: ["--cp", "2", "--cp-attention", "allgather", "--model.dropout", "0.1"],
    "cp with document masking": lambda p: ["--cp", "2", "--cp-attention", "allgather",
                                           "--data.document_mask", "true"],
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    code = main(["train", "--out", str(tmp_path / "run"), *BAD_INPUTS[case](tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("lmt: error: "), err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_resume_of_a_different_model_is_refused(tmp_path, small_corpus, capsys):
    train(str(tmp_path / "a"), *SMALL_MODEL, "--data", small_corpus, "--steps", "2")
    code = main(["train", "--out", str(tmp_path / "b"), *SMALL_MODEL, "--data", small_corpus,
                 "--model.n_layers", "3", "--resume", str(tmp_path / "a")])
    assert code == 2 and "different model" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_reports_bad_input_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "large_model_training.cli", "train", "--model.n_heads", "7"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "n_heads" in proc.stderr
    assert not os.path.exists(tmp_path / "runs")
