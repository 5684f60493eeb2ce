"""Gradient sums over tensor- and pipeline-parallel peers that must happen before the dp reduction.

Two kinds of parameter get gradients that are only part of the true gradient on each rank. tp-partial ones
(held whole on every tp rank, each rank's gradient a partial sum: the norms under sequence parallelism,
key/value weights replicated over tp) are summed over tp; a tied embedding split between the first and last
pipeline stage is summed over the two (Megatron's embedding group; locally when one rank holds both, as zbv's V
does). Both sums commute with the dp average, so
the engine runs them on the full (or, under ZeRO-3, the dp-sharded) gradients just before their buckets
reduce; their parameters form the engine's late buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Set as AbstractSet

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.collectives import all_reduce_
from large_model_training.parallel.tensor import tp_layouts

TIED = ("tok_embeddings.weight", "output.weight")


class GradSync:
    """The tp-partial and tied-embedding gradient sums of one rank's model; call it with the engine's grad_of."""

    def __init__(
        self, mesh: ParallelMesh, partial: AbstractSet[str] = frozenset(), tied: AbstractSet[str] = frozenset()
    ):
        self.mesh = mesh
        self.partial, self.tied = sorted(partial), sorted(tied)  # the same order on every rank, sorted once

    @classmethod
    def for_model(cls, model: nn.Module, mesh: ParallelMesh, tie_embeddings: bool) -> GradSync:
        """Read the partial parameters from the model's tp layouts; tied ones only where pp splits the tie, or
        where multi-token prediction keeps a copy of the embedding on the last stage (models/transformer.py)."""
        partial = {n for n, lay in tp_layouts(model).items() if lay.partial_grad}
        tied = set()
        names = dict(model.named_parameters())
        if mesh.pp_size > 1 and tie_embeddings:
            tied = {n for n in TIED if n in names}
        elif mesh.pp_size > 1 and getattr(model, "cfg", None) is not None and model.cfg.mtp_depth:
            tied = {n for n in TIED[:1] if n in names}
        return cls(mesh, partial, tied)

    @property
    def names(self) -> set[str]:
        """The parameters whose gradients this sums (the engine reduces them last)."""
        return set(self.partial) | set(self.tied)

    def __call__(self, grad_of: Callable[[str], torch.Tensor]) -> None:
        for name in self.partial:
            all_reduce_(grad_of(name), self.mesh.tp)  # counted in comm_bytes_tp
        if len(self.tied) == 2:  # both on this rank (zbv's V): the same sum, without the embedding group
            embedding, head = grad_of(TIED[0]), grad_of(TIED[1])
            embedding.add_(head)
            head.copy_(embedding)
            return
        for name in self.tied:
            dist.all_reduce(grad_of(name), group=self.mesh.embedding_group)
