"""What a run reports, written by rank 0: metrics.jsonl, progress, the experiment tracker (TensorBoard by default;
train/trackers.py), the loss-curve PNG.

Contract: one JSON object per optimizer step in `metrics.jsonl`, with at least step, loss, lr, grad_norm,
tokens_per_s, step_time_s (and val_loss on eval steps). Fields are added over time, never renamed. MoE models
add moe_aux_loss, moe_load_imbalance (max / mean tokens per expert, worst layer), their per-layer lists
(moe_aux_loss_per_layer, moe_load_imbalance_per_layer, over the MoE blocks in order) and moe_tokens_dropped;
under expert parallelism also comm_bytes_ep (this rank's all-to-all bytes) and moe_ep_straggler (the most loaded
ep rank's token copies over its ep group's mean, worst group and layer; 1.0 = balanced). Every step also has
tflops_per_device and mfu (train/mfu.py: model FLOPs, the convention of models/flops.py, over the device's peak).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, TextIO

from large_model_training.train.trackers import open_tracker, scalars


class MetricsLogger:
    """Appends step records and shows progress: a rich bar in a terminal, plain lines otherwise."""

    def __init__(
        self,
        run_dir: str,
        total_steps: int,
        start_step: int = 0,
        log_every: int = 10,
        stream: TextIO | None = None,
        tracker: str = "tensorboard",
        config: dict[str, Any] | None = None,
    ):
        """`tracker`: one of choices.TRACKERS, handed every row's numbers and, once, `config` (the resolved config
        as Config.to_dict gives it)."""
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.stream = stream or sys.stdout
        self._file = open(self.path, "a")
        self._tracker = open_tracker(tracker, run_dir, config or {})
        self._progress = None
        if self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()
        if self._tracker is not None and tracker != "tensorboard":
            self.message(f"tracker: {self._tracker.where}")

    def log(self, record: dict[str, Any]) -> None:
        # NaN and inf are not JSON: a skipped step records null for its non-finite values.
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        if self._tracker is not None:
            self._tracker.log(step, {k: v for k, v in scalars(record).items() if k != "step"})
        line = format_record(record)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=line)
            if "val_loss" in record:
                self._progress.console.print(line)
        elif step % self.log_every == 0 or step == self.total_steps or "val_loss" in record or record.get("skipped"):
            print(line, file=self.stream, flush=True)

    def truncate(self, step: int) -> None:
        """Drop the rows after `step` (a rollback redoes them): one row per step stays true."""
        self._file.close()
        with open(self.path) as f:
            rows = [line for line in f if line.strip().endswith("}") and json.loads(line)["step"] <= step]  # a
            # line cut short (its writer killed mid-write) is dropped
        with open(self.path, "w") as f:
            f.writelines(rows)
        self._file = open(self.path, "a")

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tracker is not None:
            self._tracker.close()
        self._file.close()


def _num(value: Any, fmt: str) -> str:
    return "nan" if value is None else format(value, fmt)


def format_record(r: dict[str, Any]) -> str:
    parts = [f"step {r['step']}", f"loss {_num(r['loss'], '.4f')}"]
    if "val_loss" in r:
        parts.append(f"val_loss {_num(r['val_loss'], '.4f')}")
    parts += [f"lr {r['lr']:.2e}", f"grad_norm {_num(r['grad_norm'], '.3f')}", f"{r['tokens_per_s']:.0f} tok/s"]
    if "mfu" in r:
        parts.append(f"{r['tflops_per_device']:.3g} TFLOP/s/device MFU {r['mfu']:.1%}")
    if "moe_aux_loss" in r:  # MoE models: the balance at a glance (per-layer values in metrics.jsonl)
        parts.append(
            f"moe aux {r['moe_aux_loss']:.3f} imbalance {r['moe_load_imbalance']:.2f}"
            + (f" ep straggler {r['moe_ep_straggler']:.2f}" if "moe_ep_straggler" in r else "")
        )
    if r.get("spike"):
        parts.append(f"SKIPPED (loss spike above {r['spike']['threshold']:.4f})")
    elif r.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(run_dir: str) -> str:
    """Write loss.png (train and validation loss against step) from metrics.jsonl; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train", lw=1)
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(run_dir, "loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path
