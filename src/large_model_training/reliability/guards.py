"""Per-step checks that run on every rank and decide the same way everywhere: the straggler report and the
loss-spike guard.

The straggler report gathers each rank's busy time of the step (from the step's start until its own
forward/backward work ended, before it waits in the gradient reduction) and names the rank furthest above
the median of the ranks on the same pipeline stage (stages differ by schedule, not by health). Durations,
not clock times, so hosts need not agree on the time. One all-gather of one float per rank per step. On an
accelerator the host's busy time includes the kernel launches it waited for; it is the host's view.

The spike guard compares the step's loss (already the global mean, identical on every rank) with the median of
the last `window` accepted losses; a loss above `factor` x that median is a spike.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.collectives import all_gather_single


class StragglerReport:
    """Collective over all ranks each step: {'straggler_rank', 'straggler_lag_s'} (empty when dp = 1)."""

    def __init__(self, mesh: ParallelMesh):
        self.mesh = mesh
        self.stages = [
            [r for r in range(mesh.world_size) if mesh.grid.coordinate(r)["pp"] == stage]
            for stage in range(mesh.pp_size)
        ]  # ranks that run the same stage, found once

    def __call__(self, busy_s: float) -> dict[str, float | int]:
        mesh = self.mesh
        if mesh.grad_size == 1:
            return {}
        mine = torch.tensor([busy_s], dtype=torch.float32, device=mesh.device)
        every = torch.empty(mesh.world_size, dtype=torch.float32, device=mesh.device)
        all_gather_single(every, mine)
        busy = every.tolist()
        worst_rank, worst_lag = 0, float("-inf")
        for ranks in self.stages:
            median = statistics.median(busy[r] for r in ranks)
            for r in ranks:
                if busy[r] - median > worst_lag:
                    worst_rank, worst_lag = r, busy[r] - median
        return {"straggler_rank": worst_rank, "straggler_lag_s": round(worst_lag, 6)}


class SpikeGuard:
    """Running median of accepted losses; `is_spike(loss)` once the window is full."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def is_spike(self, loss: float) -> bool:
        if not self.enabled or len(self.recent) < self.recent.maxlen:
            return False
        return loss > self.factor * statistics.median(self.recent)

    def accept(self, loss: float) -> None:
        self.recent.append(loss)

    def threshold(self) -> float:
        return self.factor * statistics.median(self.recent)
