"""Running `lmt` in-process from tests and reading what a run wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

from large_model_training.cli import main

# A model small enough that a few-step run takes well under a second per step on one core.
SMALL_MODEL = ["--model.hidden_size", "64", "--model.n_layers", "2", "--model.n_heads", "4",
               "--model.ffn_hidden_size", "128", "--seq-len", "64"]


def train(out: str, *args: str) -> list[dict]:
    """Run `lmt train ... --out out` and return its metrics rows; fails the test on a non-zero exit."""
    code = main(["train", "--out", out, *args])
    assert code == 0, f"lmt train exited {code}"
    return metrics(out)


def metrics(out: str | Path) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def val_losses(rows: list[dict]) -> list[float]:
    return [r["val_loss"] for r in rows if "val_loss" in r]


def assert_close_curves(a: list[float], b: list[float], rtol: float, what: str = "") -> None:
    assert len(a) == len(b), (what, len(a), len(b))
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= rtol * abs(y), f"{what} step {step}: {x} vs {y} (rtol {rtol})"


class Runs:
    """A module's `lmt train` runs by name, each trained once, on first use, and shared by the tests that read it
    (a one-process reference several layouts are compared with, a run that another resumes).

    A one-process run trains in this process; a multi-rank one on the pooled ranks of its world size
    (`tests.dist.train_together`). A run whose arguments name another run's folder (a checkpoint to resume) is
    trained after that run.
    """

    def __init__(self, root: Path, runs: dict[str, list[str]]):
        self.root, self.args = Path(root), runs
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}  # a run that failed fails every test that reads it, without a retry

    def folder(self, name: str) -> Path:
        if name in self._failed:
            raise AssertionError(f"run {name!r} failed earlier in this module:\n{self._failed[name]}")
        if name not in self._done:
            for earlier in self._needs(name):
                self.folder(earlier)
            self._train(name)
        return self.root / name

    def __getitem__(self, name: str) -> list[dict]:
        return metrics(self.folder(name))

    def _needs(self, name: str) -> set[str]:
        return {other for other in self.args if other != name and any(
            arg == str(self.root / other) or arg.startswith(str(self.root / other) + os.sep)
            for arg in self.args[name])}

    def _train(self, name: str) -> None:
        from tests.dist import train_together, world_size

        out, args = str(self.root / name), self.args[name]
        try:
            if world_size(args) == 1:
                train(out, *args)
            else:
                train_together(world_size(args), {out: args})
        except BaseException as e:
            self._failed[name] = f"{type(e).__name__}: {e}"
            raise
        self._done.add(name)


def tp_replica_divergence(model, mesh) -> float:
    """Largest difference between the two tp peers' copies of the tp-replicated parameters (tp = 2)."""
    import torch
    import torch.distributed as dist
    from large_model_training.parallel.tensor import tp_layouts

    worst = 0.0
    params = dict(model.named_parameters())
    for name, layout in sorted(tp_layouts(model).items()):
        if layout.replicated:
            mine = params[name].detach().clone()
            peers = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(peers, mine, group=mesh.tp_group)
            worst = max(worst, float((peers[0] - peers[1]).abs().max()))
    return worst
