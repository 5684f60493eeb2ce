"""The engine of an expert-parallel model (ep > 1): two data-parallel engines behind the one Engine interface.

Why two: the routed experts' weights of one ep rank exist only on the ranks with the same ep index (the
expert-data-parallel group, dp / ep ranks), everything else (attention, dense MLPs, routers, shared experts,
embeddings) on every dp rank. So the expert parameters get their own `DataParallelEngine` over
`mesh.expert_view()` (gradients averaged, and under ZeRO 1/2 optimizer states sharded, over edp), and the rest
the usual one over dp x cp. Averaging over edp is right because the expert weights' gradients were scaled by
1 / ep in backward (models/moe.py `ScaleGrad`): each already sums ep data shards.

Clipping uses one global norm: the dense engine's squared norm (summed over the axes that split it) plus the
experts' (also summed over ep, whose ranks hold different experts), one square root.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.mesh import ParallelMesh
from large_model_training.models.moe import Experts
from large_model_training.parallel.dp_engine import DataParallelEngine
from large_model_training.parallel.grad_sync import GradSync
from large_model_training.parallel.local_state import PersistentBuffers


def expert_parameter_names(model: nn.Module) -> set[str]:
    """The routed experts' stacked weights (`...mlp.experts.w_gate`, `w_up`, `w_down`)."""
    return {
        f"{name}.{p}"
        for name, module in model.named_modules()
        if isinstance(module, Experts)
        for p, _ in module.named_parameters(recurse=False)
    }


class ExpertParallelEngine:
    """Delegates every Engine call to the dense and the expert engine (dense first, the same order on every
    rank, so their collectives pair up)."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, sync: GradSync, **engine_args):
        self.model, self.mesh = model, mesh
        experts = expert_parameter_names(model)
        dense = {n for n, p in model.named_parameters() if p.requires_grad} - experts
        dense_sync = GradSync(mesh, set(sync.partial) - experts, set(sync.tied))
        expert_sync = GradSync(mesh, set(sync.partial) & experts)
        self.dense = DataParallelEngine(model, mesh, sync=dense_sync, params=dense, **engine_args)
        self.expert = DataParallelEngine(model, mesh.expert_view(), sync=expert_sync, params=experts, **engine_args)
        self._experts = experts
        self.engines = (self.dense, self.expert)
        self.buffers = PersistentBuffers(model)  # the in-memory copies' (local_state_dict)

    def grad_of(self, name: str) -> torch.Tensor:
        return (self.expert if name in self._experts else self.dense).grad_of(name)

    def prepare_step(self, micro_batches: int) -> None:
        for engine in self.engines:
            engine.prepare_step(micro_batches)

    def before_backward(self, stage: int, last: bool) -> None:
        for engine in self.engines:
            engine.before_backward(stage, last)

    def finish_grad_sync(self) -> int:
        return sum(engine.finish_grad_sync() for engine in self.engines)

    def grad_norm(self) -> torch.Tensor:
        experts = self.expert.norm_sq()
        dist.all_reduce(experts, group=self.mesh.ep.group)
        return (self.dense.norm_sq() + experts).sqrt()

    def step(self, lr: float, grad_scale: torch.Tensor | float = 1.0) -> None:
        for engine in self.engines:
            engine.step(lr, grad_scale)

    def end_step(self, stepped: bool) -> None:
        for engine in self.engines:
            engine.end_step(stepped)

    def comm_bytes(self) -> int:
        """dp and edp reductions and all-gathers (the dispatch's bytes are comm_bytes_ep)."""
        return sum(engine.comm_bytes() for engine in self.engines)

    def model_state_bytes(self) -> int:
        return sum(engine.model_state_bytes() for engine in self.engines)

    def memory_by_kind(self) -> dict[str, int]:
        kinds = [engine.memory_by_kind() for engine in self.engines]
        return {k: sum(kind[k] for kind in kinds) for k in kinds[0]}

    compressed_from: int | None = None

    def step_record(self) -> dict:
        return {}

    def compression_note(self, sent: int) -> str:
        return ""

    def model_state_dict(self) -> dict:
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def reload_parameters(self) -> None:
        for engine in self.engines:
            engine.reload_parameters()

    def state_dict(self) -> dict:
        """One optimizer state by parameter name (the experts' at this rank's E / ep experts: checkpoints
        store them as shards of the full (E, ...) tensors)."""
        dense, expert = self.dense.state_dict(), self.expert.state_dict()
        return {key: {**value, **expert[key]} if isinstance(value, dict) else value for key, value in dense.items()}

    def load_state_dict(self, state: dict) -> None:
        for engine in self.engines:
            engine.load_state_dict(state)

    def rank_state_dict(self) -> dict:
        return {}

    def local_state_dict(self) -> dict:
        """Each engine's tensors as they lie, and the model's persistent buffers (the router's expert bias)."""
        return {
            "dense": self.dense.local_state_dict(buffers=False),
            "expert": self.expert.local_state_dict(buffers=False),
            "buffers": self.buffers.tensors(),
        }

    @torch.no_grad()
    def load_local_state_dict(self, state: dict) -> None:
        self.dense.load_local_state_dict(state["dense"])
        self.expert.load_local_state_dict(state["expert"])
        self.buffers.load(state["buffers"])

    def load_rank_state_dict(self, saved: dict | None) -> None:
        return None
