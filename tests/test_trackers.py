"""Experiment trackers (--run.tracker) with the real packages, offline, and the per-step MFU fields.

Each tracker test trains a short run, then reads the logged run back with the tracker's own reader and finds
every step's loss of metrics.jsonl there, and the resolved config. A tracker whose package is absent skips.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from large_model_training.cli import main
from large_model_training.config import build_config
from large_model_training.models.flops import training_flops_per_token
from large_model_training.train.mfu import Utilization, utilization
from large_model_training.train.trackers import flat_config, scalars
from tests.helpers import SMALL_MODEL, metrics

STEPS = 3


def test_scalars_are_the_rows_numbers_flattened():
    row = {
        "step": 3,
        "loss": 2.5,
        "skipped": False,
        "grad_norm": None,
        "moe_aux_loss_per_layer": [0.1, 0.2],
        "spike": {"threshold": 4.0, "action": "skip"},
    }
    assert scalars(row) == {
        "step": 3.0,
        "loss": 2.5,
        "skipped": 0.0,
        "moe_aux_loss_per_layer/0": 0.1,
        "moe_aux_loss_per_layer/1": 0.2,
        "spike/threshold": 4.0,
    }
    assert flat_config({"model": {"hidden_size": 64}, "run": {"tracker": "wandb"}}) == {
        "model.hidden_size": 64,
        "run.tracker": "wandb",
    }


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "trackio"])
def test_a_missing_tracker_package_is_one_line_naming_pip(tracker, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    assert main(["train", "--run.tracker", tracker, "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"pip install 'large-model-training[{tracker}]'" in err, err


def test_an_unknown_tracker_is_refused(capsys):
    assert main(["train", "--run.tracker", "comet", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.tracker must be one of" in err, err


def test_utilization_is_model_flops_over_devices_time_and_peak():
    u = Utilization(flops_per_step=8e12, devices=4, peak=1e12, peak_source="test")
    assert u.record(0.5) == pytest.approx({"tflops_per_device": 4.0, "mfu": 4.0})
    cfg = build_config(overrides={"train.global_batch_size": 8, "train.seq_len": 64})
    measured = utilization(cfg, torch.device("cpu"), devices=2)
    assert measured.flops_per_step == training_flops_per_token(cfg.model, 64) * 8 * 64
    assert measured.devices == 2 and 1e8 < measured.peak < 1e14 and "measured" in measured.peak_source


# ---- short runs, read back ------------------------------------------------------------------------------------


def _args(out, corpus: str, tracker: str) -> list[str]:
    return [
        "train",
        "--out",
        str(out),
        *SMALL_MODEL,
        "--data",
        corpus,
        "--steps",
        str(STEPS),
        "--eval-every",
        str(STEPS),
        "--train.eval_batches",
        "1",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "4",
        "--run.tracker",
        tracker,
    ]


def _train(out, corpus: str, tracker: str, fresh_process: bool = False) -> list[dict]:
    if fresh_process:  # as a spawned rank: trackio reads its folder from the environment once, at import
        code = "import sys; from large_model_training.cli import main; sys.exit(main(sys.argv[1:]))"
        done = subprocess.run(
            [sys.executable, "-c", code, *_args(out, corpus, tracker)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        assert main(_args(out, corpus, tracker)) == 0
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


def _wandb_records(path: str):
    """The records of a .wandb file (W&B's LevelDB-style log: a 7-byte header, 32 KiB blocks of chunks with a
    7-byte header each: crc32c, length, type FULL/FIRST/MIDDLE/LAST); W&B ships no Python reader any more."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # W&B writes a plain key one way or the other


def _read_wandb(out) -> tuple[dict[int, dict], dict]:
    (path,) = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    steps, config = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_wandb_key(item): json.loads(item.value_json) for item in record.history.item}
            steps[row["_step"]] = row
        elif kind == "run":
            config = {_wandb_key(item): json.loads(item.value_json) for item in record.run.config.update}
    return steps, {
        f"{section}.{k}": v for section, values in config.items() if section != "_wandb" for k, v in values.items()
    }


def _read_mlflow(out) -> tuple[dict[int, dict], dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{os.path.abspath(out)}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("lmt").experiment_id])
    steps: dict[int, dict] = {}
    for key in ("loss", "val_loss", "mfu"):
        for m in client.get_metric_history(run.info.run_id, key):
            steps.setdefault(m.step, {})[key] = m.value
    return steps, run.data.params


def _read_trackio(out) -> tuple[dict[int, dict], dict]:
    code = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
        "print(json.dumps([S.get_logs('lmt', sys.argv[1]), S.get_run_config('lmt', sys.argv[1])]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, os.path.basename(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "TRACKIO_DIR": os.path.join(out, "trackio")},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    logs, config = json.loads(done.stdout.strip().splitlines()[-1])
    return {row["step"]: row for row in logs}, flat_config(
        {k: v for k, v in config.items() if k in ("model", "train", "run")}
    )


def _read_tensorboard(out) -> tuple[dict[int, dict], dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    steps: dict[int, dict] = {}
    for key in ("loss", "val_loss", "mfu"):
        for e in events.Scalars(key):
            steps.setdefault(e.step, {})[key] = e.value
    (text,) = events.Tensors("config/text_summary")
    lines = text.tensor_proto.string_val[0].decode().splitlines()
    return steps, {k.strip(): ast.literal_eval(v.strip()) for k, v in (line.split(" = ", 1) for line in lines)}


READERS = {"tensorboard": _read_tensorboard, "wandb": _read_wandb, "mlflow": _read_mlflow, "trackio": _read_trackio}


@pytest.mark.slow
@pytest.mark.parametrize("tracker", list(READERS))
def test_the_tracker_holds_every_steps_metrics_and_the_config(tracker, tmp_path, small_corpus, monkeypatch):
    pytest.importorskip(tracker)
    for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_DIR"):
        monkeypatch.delenv(var, raising=False)  # the defaults: offline, into the run folder
    out = tmp_path / f"run_{tracker}"
    rows = _train(out, small_corpus, tracker, fresh_process=tracker == "trackio")
    logged, config = READERS[tracker](str(out))
    for row in rows:
        got = logged[row["step"]]
        tol = 1e-6 if tracker == "tensorboard" else 0  # TensorBoard stores float32
        assert got["loss"] == pytest.approx(row["loss"], rel=tol), (tracker, row["step"])
        assert got["mfu"] == pytest.approx(row["mfu"], rel=tol)
    assert logged[STEPS]["val_loss"] == pytest.approx(rows[-1]["val_loss"], rel=1e-6)
    assert str(config["model.hidden_size"]) == "64" and config["run.tracker"] == tracker


@pytest.mark.slow
def test_every_step_records_mfu(tmp_path, small_corpus, capsys):
    rows = _train(tmp_path / "run", small_corpus, "none")
    assert "MFU" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "run" / "tensorboard")  # tracker none: metrics.jsonl alone
    cfg = build_config(
        overrides={
            "train.global_batch_size": 4,
            "train.seq_len": 64,
            "model.hidden_size": 64,
            "model.n_layers": 2,
            "model.n_heads": 4,
            "model.ffn_hidden_size": 128,
        }
    )
    flops = training_flops_per_token(cfg.model, 64) * 4 * 64
    for row in rows:
        assert 0 < row["mfu"] < 1.5, row  # against the matmul peak measured at startup on this CPU
        assert row["tflops_per_device"] == pytest.approx(flops / row["step_time_s"] / 1e12, rel=1e-9)
