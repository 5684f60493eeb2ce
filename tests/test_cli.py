"""The CLI contract: documented flags, and bad input ending in one line on stderr with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from large_model_training.cli import main
from tests.helpers import SMALL_MODEL, train

CONTRACT_FLAGS = [
    "--config",
    "--model",
    "--tp",
    "--pp",
    "--dp",
    "--steps",
    "--seq-len",
    "--micro-batch-size",
    "--global-batch-size",
    "--lr",
    "--seed",
    "--data",
    "--out",
    "--save-every",
    "--resume",
    "--eval-every",
    "--model.hidden_size",
    "--model.n_layers",
    "--model.n_heads",
    "--model.n_kv_heads",
    "--model.ffn_hidden_size",
    "--model.vocab_size",
    "--model.max_seq_len",
    "--model.mlp",
    "--model.norm",
    "--model.position",
]


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
    "global batch not a multiple of micro-batch x dp": lambda p: ["--dp", "3", "--global-batch-size", "8"],
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
    "kv heads not divisible by tp": lambda p: [
        "--tp",
        "4",
        "--model.n_heads",
        "12",
        "--model.hidden_size",
        "96",
        "--model.n_kv_heads",
        "6",
    ],
    "ffn not divisible by tp": lambda p: ["--tp", "4", "--model.ffn_hidden_size", "390"],
    "sp seq not divisible by tp": lambda p: ["--tp", "4", "--sequence-parallel", "--seq-len", "30"],
    "pp above the layer count": lambda p: ["--pp", "8"],
    "interleaved with too few micro-batches": lambda p: [
        "--pp",
        "2",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "2",
    ],
    "inner chunk without a layer": lambda p: [
        "--pp",
        "2",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "2",
        "--global-batch-size",
        "32",
        "--pp-layers",
        "3,0,2,1",
    ],
    "zbv with three chunks": lambda p: ["--pp", "2", "--schedule", "zbv", "--virtual-stages", "3"],
    "zbv with an explicit single chunk": lambda p: ["--pp", "2", "--schedule", "zbv", "--virtual-stages", "1"],
    "hyphenated unknown dotted setting": lambda p: ["--train.warmup-stepz", "5"],
    "hyphenated dotted setting, bad value": lambda p: ["--train.warmup-steps", "-1"],
    "zero bubble under ZeRO-3": lambda p: ["--pp", "2", "--dp", "2", "--schedule", "zb-h1", "--zero", "3"],
    "pp-layers not adding up": lambda p: ["--pp", "2", "--pp-layers", "1,2"],
    "unknown schedule": lambda p: ["--pp", "2", "--schedule", "zigzag"],
    "cp zero": lambda p: ["--cp", "0"],
    "cp not a number": lambda p: ["--cp", "two"],
    "cp not dividing the zig-zag": lambda p: ["--cp", "4", "--cp-attention", "allgather", "--seq-len", "36"],
    "unknown cp attention": lambda p: ["--cp", "2", "--cp-attention", "star"],
    "cp with SP, seq / cp not divisible by tp": lambda p: [
        "--tp",
        "4",
        "--sequence-parallel",
        "--cp",
        "2",
        "--cp-attention",
        "allgather",
        "--seq-len",
        "12",
    ],
    "cp with dropout": lambda p: ["--cp", "2", "--cp-attention", "allgather", "--model.dropout", "0.1"],
    "cp with document masking": lambda p: ["--cp", "2", "--cp-attention", "allgather", "--data.document_mask", "true"],
    "negative save-local-every": lambda p: ["--save-local-every", "-1"],
    "spares without local copies": lambda p: ["--dp", "2", "--spares", "1"],
    "spares on one rank": lambda p: ["--spares", "1", "--save-local-every", "1"],
}

# What each case must say (a case that fails for another reason than its name would pass on exit code alone).
BAD_INPUT_ERRORS = {
    "unknown preset": "unknown model preset 'gpt-9'",
    "unknown flag": "unrecognized arguments: --bogus 1",
    "unknown dotted setting": "unrecognized arguments: --model.hiden_size 64",
    "global batch not a multiple of micro-batch x dp": "global_batch_size (8) must be a multiple of micro_batch_size",
    "heads not dividing hidden": "model.hidden_size (100) must be divisible by model.n_heads (3)",
    "kv heads not dividing heads": "model.n_heads (4) must be divisible by model.n_kv_heads (3)",
    "seq-len above the maximum": "train.seq_len (100000) exceeds model.max_seq_len",
    "zero size": "model.hidden_size must be positive, got 0",
    "negative steps": "train.steps must be positive, got -5",
    "negative save-local-every": "run.save_local_every must be >= 0, got -1",
    "spares without local copies": "run.spares needs run.save_local_every",
    "spares on one rank": "run.spares needs lmt's own launcher and more than one rank",
    "not a number": "train.lr must be a number, got 'fast'",
    "bad choice": "model.mlp must be one of swiglu, gelu, got 'relu'",
    "missing data path": "data path not found: ",
    "unreadable resume folder": "resume path not found or not a folder: ",
    "foreign resume folder": "not an lmt checkpoint (foreign meta.json)",
    "malformed TOML": "malformed TOML in ",
    "missing TOML": "config file not found: ",
    "tp larger than heads": "tp (8) is larger than the number of heads (4)",
    "heads not divisible by tp": "model.n_heads must be divisible by tp (tp=3",
    "kv heads not divisible by tp": "model.n_kv_heads must be divisible by tp (tp=4, n_heads=12, n_kv_heads=6",
    "ffn not divisible by tp": "model.ffn_hidden_size must be divisible by tp (tp=4",
    "sp seq not divisible by tp": "--sequence-parallel needs seq_len (30) divisible by tp (4)",
    "pp above the layer count": "pp x virtual_stages = 8 stages is more than the 4 layers",
    "interleaved with too few micro-batches": "interleaved schedule needs at least pp = 2 micro-batches per step",
    "inner chunk without a layer": "--pp-layers gives stage 1 no layer",
    "zbv with three chunks": "--virtual-stages must be 2, got 3",
    "zbv with an explicit single chunk": "--virtual-stages must be 2, got 1",
    "hyphenated unknown dotted setting": "unrecognized arguments: --train.warmup-stepz 5",
    "hyphenated dotted setting, bad value": "train.warmup_steps must be >= 0, got -1",
    "zero bubble under ZeRO-3": "the zb-h1 schedule composes with --zero 0, 1 or 2",
    "pp-layers not adding up": "--pp-layers adds up to 3 layers but the model has 4",
    "unknown schedule": "parallel.schedule must be one of gpipe, 1f1b, interleaved, zb-h1, zbv, got 'zigzag'",
    "cp zero": "parallel.cp must be positive, got 0",
    "cp not a number": "parallel.cp must be an integer, got 'two'",
    "cp not dividing the zig-zag": "--cp 4 needs seq_len (36) divisible by 2 x cp = 8",
    "unknown cp attention": "--cp-attention must be ring or allgather, got 'star'",
    "cp with SP, seq / cp not divisible by tp": "with --cp 2 needs seq_len / cp (6) divisible by tp (4)",
    "cp with dropout": "--cp > 1 needs model.dropout = 0 (got 0.1)",
    "cp with document masking": "--cp > 1 does not compose with data.document_mask yet",
}
assert set(BAD_INPUT_ERRORS) == set(BAD_INPUTS)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    code = main(["train", "--out", str(tmp_path / "run"), *BAD_INPUTS[case](tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("lmt: error: "), err
    assert BAD_INPUT_ERRORS[case] in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_resume_of_a_different_model_is_refused(tmp_path, small_corpus, capsys):
    train(str(tmp_path / "a"), *SMALL_MODEL, "--data", small_corpus, "--steps", "2")
    code = main(
        [
            "train",
            "--out",
            str(tmp_path / "b"),
            *SMALL_MODEL,
            "--data",
            small_corpus,
            "--model.n_layers",
            "3",
            "--resume",
            str(tmp_path / "a"),
        ]
    )
    assert code == 2 and "different model" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_reports_bad_input_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "large_model_training.cli", "train", "--model.n_heads", "7"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "n_heads" in proc.stderr
    assert not os.path.exists(tmp_path / "runs")


def _config(*argv: str, toml: str | None = None):
    """The checked config `lmt train ARGV` would run (no data read, no rank started)."""
    from large_model_training.arguments import overrides
    from large_model_training.cli import build_parser
    from large_model_training.config import build_config
    from large_model_training.layout import validate

    args = build_parser().parse_args(["train", *argv])
    return validate(build_config(toml or args.config, overrides(args)))


def test_zbv_implies_two_virtual_stages(tmp_path):
    assert _config("--pp", "2", "--schedule", "zbv").parallel.virtual_stages == 2
    assert _config("--pp", "2", "--schedule", "zbv", "--virtual-stages", "2").parallel.virtual_stages == 2
    # a run folder's config.toml from a 1f1b run holds virtual_stages = 1: not a contradiction of --schedule zbv
    old = tmp_path / "config.toml"
    old.write_text('[parallel]\npp = 2\nschedule = "1f1b"\nvirtual_stages = 1\n')
    assert _config("--config", str(old), "--schedule", "zbv").parallel.virtual_stages == 2
    (tmp_path / "zbv.toml").write_text('[parallel]\npp = 2\nschedule = "zbv"\n')
    assert _config("--config", str(tmp_path / "zbv.toml")).parallel.virtual_stages == 2
    assert _config("--pp", "2", "--schedule", "1f1b").parallel.virtual_stages == 1


def test_dotted_overrides_take_hyphens_and_underscores():
    assert _config("--train.warmup-steps", "5").train.warmup_steps == 5
    assert _config("--train.warmup_steps", "6").train.warmup_steps == 6
    cfg = _config("--model.n-kv-heads", "2", "--model.head-dim", "64", "--run.stall-timeout", "0")
    assert (cfg.model.n_kv_heads, cfg.model.attention_head_dim, cfg.run.stall_timeout) == (2, 64, 0.0)


def test_a_second_train_into_a_held_run_folder_is_one_line_naming_the_holder(tmp_path, small_corpus, capsys):
    from large_model_training.train.run_folder import run_folder_lock

    run = tmp_path / "run"
    with run_folder_lock(str(run)):  # another open file: flock refuses it as it would another process
        code = main(["train", "--out", str(run), *SMALL_MODEL, "--data", small_corpus, "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("lmt: error: ") and f"pid {os.getpid()} on " in err and str(run) in err
    assert not (run / "metrics.jsonl").exists() and not (run / "config.toml").exists()


def test_the_lock_file_a_dead_run_leaves_blocks_nothing(tmp_path):
    from large_model_training.train.run_folder import LOCK_FILE, run_folder_lock

    (tmp_path / LOCK_FILE).write_text("pid 999999 on a-crashed-host\n")  # left behind, its flock gone with it
    with run_folder_lock(str(tmp_path)):
        assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()} on {__import__('socket').gethostname()}\n"
    with run_folder_lock(str(tmp_path)):  # released on leaving: the next run of this process takes it again
        pass


HOLD = """import sys
from large_model_training.train.run_folder import run_folder_lock
with run_folder_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.slow
def test_run_folder_lock_against_another_process_and_after_its_kill(tmp_path, small_corpus, capsys):
    """A live holder in another process refuses a second run (naming its pid); once SIGKILLed (no cleanup runs,
    the lock file still names it), --resume auto continues the finished run."""
    run = tmp_path / "run"
    args = [
        *SMALL_MODEL,
        "--data",
        small_corpus,
        "--eval-every",
        "0",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--save-every",
        "1",
    ]
    train(str(run), *args, "--steps", "2")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        assert main(["train", "--out", str(run), *args, "--steps", "3", "--resume", "auto"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"(pid {holder.pid} on " in err, err
    finally:
        holder.kill()
        holder.wait()
    rows = train(str(run), *args, "--steps", "3", "--resume", "auto")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1].get("restart", {}).get("resumed_from") == 2
