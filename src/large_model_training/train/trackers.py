"""Experiment trackers beside metrics.jsonl (`--run.tracker`): TensorBoard (the default), Weights & Biases, MLflow,
trackio, or none. Rank 0's MetricsLogger hands each one every step's numeric fields and, once, the resolved config.

Each writes into the run folder and needs no network unless the user asks for one through the library's own
environment variables, so a run on an air-gapped cluster logs the same way as one on a laptop:
  - tensorboard: RUN/tensorboard (event files; skipped quietly when the package is absent, as it is optional);
  - wandb: offline mode (WANDB_MODE=online or another mode set by the user wins), RUN/wandb/offline-run-*;
    `wandb sync` uploads it later. Project: $WANDB_PROJECT, else 'lmt';
  - mlflow: a local SQLite store RUN/mlflow.db, artifacts in RUN/mlflow-artifacts, unless $MLFLOW_TRACKING_URI
    names another (a server). MLflow 3 refuses its plain file store (./mlruns) unless told to, and names SQLite
    as the local store: `mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db`. Experiment:
    $MLFLOW_EXPERIMENT_NAME, else 'lmt';
  - trackio: its local SQLite store in RUN/trackio (unless $TRACKIO_DIR is set: trackio reads it once, at import;
    `trackio show` with TRACKIO_DIR=RUN/trackio shows it). Project 'lmt'.
The run is named after the run folder; each attempt (a resume, a restart) opens a new tracker run, whose steps
continue where the checkpoint was. A missing package is refused before any rank starts
(`config_checks`, with the pip command); this module only imports what the chosen tracker needs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from large_model_training.choices import TRACKERS


@contextlib.contextmanager
def _quiet(logger: str):
    """The library logger `logger` at WARNING for the block, then as it was."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


class Tracker(Protocol):
    where: str
    """Where it writes, for the run log's first lines."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A metrics row's numbers, as trackers take them: booleans as 0/1, lists and dicts flattened to key/i and
    key/name (per-layer MoE lists, the spike note); null (a non-finite value) and text left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, (bool, int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            out.update(scalars({str(i): v for i, v in enumerate(value)}, name + "/"))
    return out


def flat_config(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'model': {'hidden_size': 64}} -> {'model.hidden_size': 64}: the dotted names of the flags."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoard:
    def __init__(self, run_dir: str, config: dict[str, Any], name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.where = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(log_dir=self.where)
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in flat_config(config).items()), 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, run_dir: str, config: dict[str, Any], name: str):
        import wandb

        mode: Any = os.environ.get("WANDB_MODE") or "offline"  # wandb checks the value
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "lmt",
            name=name,
            dir=run_dir,
            mode=mode,
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.where = f"wandb {mode} run {self.run.dir.removesuffix(os.sep + 'files')}"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)  # W&B drops steps below its last one (a spike rollback's redone steps)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    KEY = re.compile(r"[^\w\-. /]")  # what MLflow accepts in metric and parameter names
    PARAMS_PER_CALL = 100  # MLflow's limit on parameters in one log_batch

    def __init__(self, run_dir: str, config: dict[str, Any], name: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(run_dir)}/mlflow.db"
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lmt"
        with _quiet("mlflow.store.db.utils"):  # the new store's table creation, told at INFO
            self.client = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(experiment)
        artifacts = (
            None
            if os.environ.get("MLFLOW_TRACKING_URI")
            else "file://" + os.path.abspath(os.path.join(run_dir, "mlflow-artifacts"))
        )
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment, artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(self.KEY.sub("_", k), str(v)[:6000]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + self.PARAMS_PER_CALL])
        self.where = f"mlflow run {self.run_id} in {uri}"

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(self.KEY.sub("_", k), v, now, step) for k, v in values.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio:
    def __init__(self, run_dir: str, config: dict[str, Any], name: str):
        wanted = os.path.join(run_dir, "trackio")
        user_dir = os.environ.get("TRACKIO_DIR")
        if "trackio" not in sys.modules and not user_dir:  # trackio reads TRACKIO_DIR once, when imported
            os.environ["TRACKIO_DIR"] = wanted
            try:
                import trackio
            finally:
                del os.environ["TRACKIO_DIR"]
        import trackio
        from trackio import utils

        with contextlib.redirect_stdout(io.StringIO()):  # its banner (dashboard hints) would cut the step lines
            self.run = trackio.init(project="lmt", name=name, config=config)
        self.where = f"trackio project lmt, run {name}, in {utils.TRACKIO_DIR}"
        if not user_dir and os.path.abspath(utils.TRACKIO_DIR) != os.path.abspath(wanted):
            self.where += " (trackio was imported earlier in this process: its folder stays)"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):
            trackio.finish()  # the current run, ours; run.finish() alone would leave it to be finished again at exit


ADAPTERS: dict[str, Callable[[str, dict[str, Any], str], Tracker]] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
    "mlflow": MLflow,
    "trackio": Trackio,
}
assert set(ADAPTERS) | {"none"} == set(TRACKERS)


def open_tracker(name: str, run_dir: str, config: dict[str, Any]) -> Tracker | None:
    """The tracker `name` (choices.TRACKERS) for this run folder, or None ('none', or TensorBoard not installed)."""
    if name == "none":
        return None
    if name == "tensorboard":
        try:
            import tensorboard  # noqa: F401  (optional: the default must work with torch alone)
        except ImportError:
            return None
    return ADAPTERS[name](run_dir, config, os.path.basename(os.path.abspath(run_dir)))
