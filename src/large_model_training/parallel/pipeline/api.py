"""`lmt.PipelineParallelism`: the seed's split_model / forward / backward flow, on real stages and ranks.

    pipe = lmt.PipelineParallelism(mesh)                 # mesh.pp_size stages, one per pipeline rank
    pipe.split_model(model_cfg, seed)                    # this rank's stage: the whole model's weights
    loss = pipe.forward(micro_batches)                   # GPipe's forward phase over every micro-batch
    pipe.backward()                                      # GPipe's backward phase: this stage's gradients
    loss = pipe.train_step(micro_batches)                # or one step of any schedule (1f1b, interleaved)

forward/backward are the two phases of the GPipe schedule (all forwards, then all backwards), which is the
only schedule where the seed's separate calls make sense; 1F1B and interleaving mix the phases, so they run
through `train_step`. The returned loss is the mean over the micro-batches, on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from large_model_training.config import ModelConfig
from large_model_training.mesh import ParallelMesh
from large_model_training.models.build import build_pipeline_model
from large_model_training.parallel.pipeline.partition import stage_layers, stage_specs
from large_model_training.parallel.pipeline.runtime import PipelineExecutor
from large_model_training.parallel.pipeline.schedules import Op, build_schedule, rank_stages


class PipelineParallelism:
    def __init__(self, mesh: ParallelMesh, schedule: str = "1f1b", virtual_stages: int = 1):
        self.mesh = mesh
        self.num_stages = mesh.pp_size
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.model = None
        self._pending: list = []
        self._executors: dict[tuple[str, int], PipelineExecutor] = {}

    def split_model(self, model_cfg: ModelConfig, seed: int, seq_len: int = 0, layers: str = "") -> torch.nn.Module:
        """Build this rank's stage(s) of the model (balanced split unless `layers` like '2,3' is given)."""
        counts = stage_layers(model_cfg, self.num_stages, self.virtual_stages, self.schedule,
                              seq_len or model_cfg.max_seq_len, layers)
        specs = stage_specs(counts)
        mine = {j: specs[j] for j in rank_stages(self.mesh.pp_rank, self.num_stages, self.virtual_stages)}
        self.model = build_pipeline_model(model_cfg, self.mesh, seed, mine)
        self._executors = {}
        return self.model

    def _executor(self, kind: str, m: int) -> PipelineExecutor:
        """One executor per (schedule, micro-batch count), built once: the schedule is computed at build."""
        key = (kind, m)
        if key not in self._executors:
            v = self.virtual_stages if kind == "interleaved" else 1
            self._executors[key] = PipelineExecutor(self.model, self.mesh, kind, m, v)
        return self._executors[key]

    def _mean_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        if self.num_stages > 1:
            dist.all_reduce(loss_sum, group=self.mesh.pp_group)  # only the last stage holds it
        return loss_sum

    def forward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every micro-batch through every stage, keeping what backward needs (GPipe's first phase)."""
        self._gpipe = self._executor("gpipe", len(micro_batches))
        actions = self._gpipe.actions
        # The backward phase starts at the first backward, or at the receive of its gradient before it.
        first_backward = next(i for i, a in enumerate(actions) if a.op in (Op.BACKWARD, Op.RECV_GRAD))
        self._gpipe.start_step()
        self._gpipe.run(actions[:first_backward], micro_batches, 1.0 / len(micro_batches))
        self._pending = (actions[first_backward:], micro_batches)
        return self._mean_loss(self._gpipe.loss_sum.clone())

    def backward(self) -> None:
        """Gradients of this rank's stage(s), accumulated into .grad (GPipe's second phase)."""
        actions, micro_batches = self._pending
        self._gpipe.run(actions, micro_batches, 1.0 / len(micro_batches))
        self._gpipe.finish_step()

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch in the order of the configured schedule."""
        executor = self._executor(self.schedule, len(micro_batches))
        return self._mean_loss(executor.forward_backward(micro_batches, 1.0 / len(micro_batches)))

    @staticmethod
    def grid(kind: str, p: int, m: int, v: int = 1) -> list[list[str]]:
        """The schedule's compute actions per rank, as strings like '0F1' (for printing)."""
        return [[str(a) for a in rank if a.op in (Op.FORWARD, Op.BACKWARD)] for rank in build_schedule(kind, p, m, v)]
