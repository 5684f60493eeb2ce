"""The update rule: what the ZeRO 0-2 engine does with the reduced gradients, one small class per optimizer.

The engine (parallel/dp_engine.py) is a gradient reducer (parallel/grad_reducer.py: buckets, overlap with
backward, compression hooks, the norm) and one update rule over the same flat pieces (parallel/pieces.py). A rule
sees this rank's pieces and a gradient per piece, changes the pieces' masters, and keeps its own state; the engine
publishes the masters into the parameters and re-gathers them under ZeRO-1/2. Why this split: AdamW, 1-bit Adam,
Muon and DiLoCo's outer step each differ only here, so each is one class and none reaches into another's
internals; a rule that needs an exchange of its own (1-bit Adam's compressed momentum, update compression's
average, Muon's owner ranks) is given the reducer and the mesh in its `RuleContext`.

A new optimizer is one module of parallel/ defining `make_rule(ctx) -> UpdateRule` and its name in
`choices.Optimizer` (the spelling names the module); `rule_factory` finds it from there.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch

from large_model_training.choices import Optimizer
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.pieces import FlatShards, ShardPiece


@dataclasses.dataclass
class RuleContext:
    """What a rule is built from: the pieces it updates, the reducer (for rules with an exchange of their own),
    the mesh of this parameter group, and the hyperparameters."""

    shards: FlatShards
    reducer: Any  # GradReducer (parallel/grad_reducer.py)
    mesh: ParallelMesh
    weight_decay: float
    betas: tuple[float, float]
    state_dtype: torch.dtype = torch.float32
    compress_update: bool = False  # --compression-target update: the rule averages its update by the hook
    train: Any = None  # TrainConfig, for a rule's own settings (None in unit tests: the defaults)
    model: Any = None  # the rank's model, for rules that choose parameters by name or tp layout


class UpdateRule(abc.ABC):
    """The base every rule extends: `step` is the update; the rest default to a rule without exchange, per-rank
    state or metrics."""

    local_grads = False
    """Whether this step's gradients stay local (not reduced over dp): the rule averages something itself, and
    the norm is the ranks' root-mean-square. `step` then gets each piece's whole bucket gradient."""

    compressed_from: int | None = None
    """The first compressed step, when the rule compresses its own exchange (None: the reducer's, if any)."""

    def prepare_step(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Before backward of a step (a rule whose `local_grads` changes decides it here)."""

    @abc.abstractmethod
    def step(
        self, pieces: list[ShardPiece], grads: list[torch.Tensor], lr: float, grad_scale: torch.Tensor | float
    ) -> None:
        """Update `pieces`' masters from one gradient per piece (scaled by `grad_scale`: the clip factor)."""

    def end_step(self, stepped: bool) -> None:  # noqa: B027 - an optional hook
        """After every step on every rank, whether or not `step` ran."""

    def comm_bytes(self) -> int:
        """dp bytes this rule passed to its own collectives this step."""
        return 0

    def record(self) -> dict:
        """This step's metrics particular to the rule (read after `end_step`)."""
        return {}

    def compression_note(self, sent: int) -> str:
        return ""

    def tensors(self) -> list[torch.Tensor]:
        """The optimizer-state storage the rule holds (for the state-bytes count)."""
        return []

    def state_dict(self) -> dict:
        """State by parameter name, the same on every layout (collective under ZeRO)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

    def local_state_dict(self) -> dict:
        """The state as this rank holds it, for the in-memory copies (restored onto the same layout, so nothing
        is gathered or renamed). The default is `state_dict`; a rule whose state is its pieces' tensors returns
        those as they are."""
        return self.state_dict()

    def load_local_state_dict(self, state: dict) -> None:
        self.load_state_dict(state)

    def rank_state_dict(self) -> dict:
        """State only this rank holds ({} if none)."""
        return {}

    def load_rank_state_dict(self, saved: dict, same_layout: bool) -> None:
        """`saved` is this rank's file ({} if none); `same_layout`: saved in this run's rank layout."""
        return None


RuleFactory = Callable[[RuleContext], UpdateRule]


def rule_factory(optimizer: object) -> RuleFactory:
    """`make_rule` of the module `optimizer` (a choices.Optimizer or its spelling) names."""
    name = Optimizer.parse(optimizer, "train.optimizer").module
    module = importlib.import_module(f"large_model_training.parallel.{name}")
    return module.make_rule
