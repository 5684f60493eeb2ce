"""Running `lmt` in-process from tests and reading what a run wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

from large_model_training.cli import main
from large_model_training.config import ModelConfig

# The tests' two small models, each defined once: a test names only what it changes (`model_flags(n_layers=8)`).
# RUN_MODEL: `lmt train` runs, small enough that a few-step run takes well under a second per step on one core.
# UNIT_MODEL: models built in-process, 32 wide over a 64-token vocabulary and 16 positions.
RUN_MODEL = dict(hidden_size=64, n_layers=2, n_heads=4, ffn_hidden_size=128)
UNIT_MODEL = dict(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, ffn_hidden_size=64, max_seq_len=16)


def model_flags(**changes: object) -> list[str]:
    """`--model.*` flags of RUN_MODEL with `changes` (field=value) on top."""
    fields = {**RUN_MODEL, **changes}
    return [a for k, v in fields.items() for a in (f"--model.{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def model_config(**changes: object) -> ModelConfig:
    """UNIT_MODEL with `changes` on top."""
    return ModelConfig(**{**UNIT_MODEL, **changes})


SMALL_MODEL = [*model_flags(), "--seq-len", "64"]
# A 5-step fp32 run of 8 sequences in micro-batches of 2, no evaluation: the layout tests' reference shape.
RUN_FLAGS = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--steps",
    "5",
    "--eval-every",
    "0",
    "--precision",
    "fp32",
]


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
        return {
            other
            for other in self.args
            if other != name
            and any(
                arg == str(self.root / other) or arg.startswith(str(self.root / other) + os.sep)
                for arg in self.args[name]
            )
        }

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


def tp2_dp2_replica_divergence(run_dir: str, corpus: str, steps: int, overrides: dict) -> float:
    """On each of 4 ranks (`tests.dist.run_ranks`): train a small model at tp = 2 x dp = 2 for `steps` steps with
    `overrides` on top, then return `tp_replica_divergence` of the trained model."""
    from large_model_training.config import build_config
    from large_model_training.layout import validate
    from large_model_training.mesh import ParallelMesh
    from large_model_training.train.trainer import Trainer

    common = {
        "model.hidden_size": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.ffn_hidden_size": 128,
        "train.seq_len": 32,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "train.steps": steps,
        "train.eval_every": 0,
        "parallel.tp": 2,
        "parallel.dp": 2,
        "parallel.bucket_mb": 0.1,
        "data.path": corpus,
    }
    cfg = validate(build_config(overrides={**common, **overrides}))
    mesh = ParallelMesh.for_this_rank(1, 2, 2)
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, mesh, run_dir)
    trainer.fit()
    return tp_replica_divergence(trainer.model, mesh)


def perturb_norms(model) -> None:
    """Norm weights start at one: move them (q_norm and k_norm too) so that a misplaced or unpermuted one shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))


def save_hf_folder(path, tensors: dict, doc: dict) -> str:
    """A Hugging Face checkpoint folder: `tensors` as model.safetensors and `doc` as config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(doc, f)
    return str(path)


def imported_logits(path: str, tokens):
    """Our model imported from the Hugging Face folder at `path`: its logits on `tokens`."""
    import torch

    from large_model_training.assembly import build_model
    from large_model_training.models.hf import import_hf, load_hf_into_model

    cfg, weights = import_hf(path)
    model = build_model(cfg, None, seed=1).eval()
    load_hf_into_model(model, weights)
    with torch.no_grad():
        return model(tokens)


def export_load_and_back(path, transformers, cfg, cls_name: str, tokens) -> dict:
    """Ours -> Hugging Face folder at `path` -> transformers' `cls_name` (same logits on `tokens`) -> ours again
    (same config, same tensors). Returns the exported config.json."""
    import torch

    from large_model_training.assembly import build_model
    from large_model_training.models.hf import hf_config, import_hf, to_hf_state

    model = build_model(cfg, None, seed=3).eval()
    perturb_norms(model)
    with torch.no_grad():
        want = model(tokens)
    state = model.state_dict()
    doc = hf_config(cfg)
    out = save_hf_folder(path, to_hf_state(cfg, state), doc)
    theirs, info = getattr(transformers, cls_name).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        got = theirs.eval()(tokens).logits
    assert (got - want).abs().max() < 1e-5
    assert want.std() > 0.3  # not a near-uniform output: the comparison means something
    back, weights = import_hf(out)
    assert back == cfg
    assert sorted(weights) == sorted(n for n, _ in model.named_parameters())
    assert all(torch.equal(weights[name], state[name]) for name in weights)
    return doc
