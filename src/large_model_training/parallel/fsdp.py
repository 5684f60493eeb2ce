"""ZeRO-3 through PyTorch FSDP2 (`fully_shard`): parameters, gradients and optimizer states sharded over dp.

Why FSDP2 here and our own engine for ZeRO 0-2: stage 3 must gather each block's weights just in time,
prefetch the next block's and free them after use, in forward and again in backward. FSDP2 does exactly that
on per-parameter DTensors and composes with what we built: our tensor-parallel layers hold plain local shards,
which FSDP2 shards further over the dp sub-mesh (a 2-D layout like torchtitan's), and a pipeline rank's chunks
are each wrapped on their own (as torchtitan does for pipeline stages). Its reduce-scatter averages over dp,
matching our engine. Under ep the routed experts are sharded over their expert-data-parallel group (edp, x cp)
instead, the rest over dp x cp. Mixed precision is FSDP2's policy: bf16 compute/gathers, fp32 sharded master weights,
reduction in bf16 or fp32.

Its traffic is counted at FSDP2's own collectives (`fsdp_counters.py`), so `comm_bytes_dp` is measured, as for
our engine. Under `--precision fp8` (tensorwise) the block linears' weights are all-gathered in float8, half the
bytes (`fsdp_float8.py`).

This class implements the same `Engine` interface (parallel/engine.py) as `DataParallelEngine`, so the trainer
does not care which runs. ZeRO-3 composes with no compression (the config refuses it): no per-rank state.
"""

from __future__ import annotations

from collections.abc import Callable, Set as AbstractSet

import torch
from torch import nn

from large_model_training.choices import bf16_compute
from large_model_training.mesh import ParallelMesh
from large_model_training.models.moe import Experts
from large_model_training.parallel.fsdp_counters import CommBytes, count_collectives
from large_model_training.parallel.fsdp_float8 import Float8GatherScales, float8_gather_problem, wrap_for_float8_gather
from large_model_training.parallel.grad_norm import reduce_norm_sq
from large_model_training.parallel.grad_sync import GradSync
from large_model_training.parallel.local_state import PersistentBuffers


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPEngine:
    def __init__(
        self,
        model: nn.Module,
        mesh: ParallelMesh,
        *,
        precision: str,
        grad_reduce_fp32: bool,
        weight_decay: float,
        betas: tuple[float, float],
        norm_excluded: AbstractSet[str] = frozenset(),
        sync: GradSync | None = None,
        sync_per_step: bool = False,
        materialise: Callable[[], None] | None = None,
    ):
        """`materialise`: when the model is still on meta, allocates and initialises it (assembly.py); called
        once FSDP2 has sharded it, so that each rank allocates only its shards, as torchtitan does."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.model, self.mesh, self.sync = model, mesh, sync
        self.zero, self.bytes = 3, 0
        dp_mesh = mesh.grad_mesh  # the gradient group: dp x cp
        policy = None
        if bf16_compute(precision):
            policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if grad_reduce_fp32 else torch.bfloat16
            )
        kw = {"mesh": dp_mesh} | ({"mp_policy": policy} if policy else {})
        self._chunks = dict(model.chunks) if hasattr(model, "chunks") else {0: model}
        self.sync_per_step = sync_per_step
        gather_float8 = float8_gather_problem(model) is None
        if gather_float8:  # --precision fp8, tensorwise: block weights gathered in float8 (fsdp_float8.py)
            if materialise is not None:  # torchao's float8 weight wraps a materialised tensor: whole first
                materialise()
                materialise = None
            wrap_for_float8_gather(model)
        self.counts = CommBytes()
        # Under ep the routed experts (this ep rank's E / ep of each block) are their own FSDP2 group over the
        # expert gradient group (edp, x cp), before their block takes the rest over dp x cp, as torchtitan does.
        expert_kw = {**kw, "mesh": mesh.expert_dp_mesh} if getattr(mesh, "expert_dp_mesh", None) is not None else None
        for chunk in self._chunks.values():
            for block in chunk.layers.values():
                for module in block.modules() if expert_kw else ():
                    if isinstance(module, Experts):
                        fully_shard(module, **expert_kw)
                        count_collectives(module, self.counts)
                fully_shard(block, **kw)
                count_collectives(block, self.counts)
            fully_shard(chunk, **kw)  # embedding, final norm and head: the chunk's own group
            count_collectives(chunk, self.counts)
        if materialise is not None:
            materialise()
        self.float8_scales = Float8GatherScales(model if gather_float8 else nn.Module(), mesh)
        self.float8_scales.refresh()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decay = [p for _, p in named if p.ndim >= 2]
        no_decay = [p for _, p in named if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=0.0,
            betas=betas,
            eps=1e-8,
            foreach=False,
        )
        self.counted = [p for n, p in named if n not in norm_excluded]
        self.params = dict(named)
        self.buffers = PersistentBuffers(model)  # the in-memory copies' (local_state_dict)
        self._numel = sum(_local(p).numel() for _, p in named)

    def grad_of(self, name: str) -> torch.Tensor:
        """This rank's (dp-sharded, already averaged) gradient of a parameter: syncs over tp or the embedding
        group commute with the dp average, and their shards line up across those groups."""
        return _local(self.params[name].grad)

    def prepare_step(self, micro_batches: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def before_backward(self, stage: int, last: bool) -> None:
        """With sync_per_step, a chunk's non-last backwards accumulate unsharded gradients; its last one
        reduce-scatters their sum (one reduce-scatter per step instead of per micro-batch)."""
        if self.sync_per_step and stage in self._chunks:
            self._chunks[stage].set_requires_gradient_sync(last)

    def finish_grad_sync(self) -> int:
        if self.sync is not None:
            self.sync(self.grad_of)
        # Bytes FSDP2's gathers and reduce-scatters moved this step, counted (fsdp_counters.py), and the float8
        # scales' amax all-reduces (after the last optimizer step).
        gathered, scattered = self.counts.take()
        self.bytes = int(gathered + scattered + self.float8_scales.bytes)
        self.float8_scales.bytes = 0.0
        return self.bytes

    def comm_bytes(self) -> int:
        return self.bytes

    def grad_norm(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        for p in self.counted:
            if p.grad is not None:
                total += _local(p.grad).float().pow(2).sum()
        # dp x cp = edp x ep x cp: the sum over it also completes the experts' shards (edp x cp) and adds the
        # other ep ranks' experts
        return reduce_norm_sq(total, self.mesh, ("grad", "tp", "pp")).sqrt()

    @torch.no_grad()
    def step(self, lr: float, grad_scale: torch.Tensor | float = 1.0) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if not (isinstance(grad_scale, float) and grad_scale == 1.0):  # x * 1.0 == x: skip the pass
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        self.optimizer.step()
        self.float8_scales.refresh()  # the weights changed: so do the float8 gathers' scales

    def end_step(self, stepped: bool) -> None:
        pass  # no compression state to advance

    compressed_from: int | None = None

    def step_record(self) -> dict:
        return {}

    def compression_note(self, sent: int) -> str:
        return ""

    def model_state_bytes(self) -> int:
        """Sharded fp32 parameters, their gradients and AdamW states (gathered weights are freed after use)."""
        return sum(self.memory_by_kind().values())

    def memory_by_kind(self) -> dict[str, int]:
        """model_state_bytes by kind: parameter shards, gradient shards, AdamW states."""

        def size(t: torch.Tensor) -> int:
            return _local(t).numel() * _local(t).element_size()

        out = {"parameters": 0, "gradients": 0, "optimizer_states": 0}
        for p in self.params.values():
            out["parameters"] += size(p)
            out["gradients"] += size(p.grad) if p.grad is not None else 0
            out["optimizer_states"] += sum(
                size(v) for v in self.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.ndim > 0
            )
        return out

    # Checkpoints hold full (dp-gathered) tensors under parameter names, in the same format as
    # DataParallelEngine's, so a checkpoint moves between ZeRO stages and dp sizes.
    def model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))

    def load_model_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
        self.float8_scales.refresh()

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        per_param = full.get("state", {})
        step = next((float(s["step"]) for s in per_param.values() if "step" in s), 0.0)
        out = {"step": torch.tensor(int(step)), "exp_avg": {}, "exp_avg_sq": {}}
        for name, p in self.params.items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = per_param.get(name, {}).get(key)
                out[key][name] = (
                    value if value is not None else torch.zeros(p.shape, dtype=torch.float32, device=self.mesh.device)
                )
        return out

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        step = float(state["step"])
        if step == 0:
            return
        per_param = {
            name: {
                "step": torch.tensor(step),
                "exp_avg": state["exp_avg"][name],
                "exp_avg_sq": state["exp_avg_sq"][name],
            }
            for name in self.params
        }
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [n for n, p in self.params.items() if any(p is q for q in g["params"])],
            }
            for g in self.optimizer.param_groups
        ]
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            {"state": per_param, "param_groups": groups},
            options=StateDictOptions(full_state_dict=True),
        )

    def reload_parameters(self) -> None:
        pass

    def rank_state_dict(self) -> dict:
        return {}

    def local_state_dict(self) -> dict:
        """This rank's shards as they lie: each parameter's local shard, its AdamW state's, and the model's
        persistent buffers (replicated, e.g. the router's expert bias). Nothing is gathered (the by-name
        `model_state_dict` and `state_dict` gather every tensor whole over dp)."""
        state = self.optimizer.state
        return {
            "parameters": {name: _local(p) for name, p in self.params.items()},
            "adamw": {
                name: {k: _local(v) for k, v in state[p].items()} for name, p in self.params.items() if p in state
            },
            "buffers": self.buffers.tensors(),
        }

    @torch.no_grad()
    def load_local_state_dict(self, saved: dict) -> None:
        from torch.distributed.tensor import DTensor

        for name, p in self.params.items():
            _local(p).copy_(saved["parameters"][name])
        for name, values in saved["adamw"].items():
            p = self.params[name]
            state = self.optimizer.state[p]
            for key, value in values.items():
                if key in state:
                    _local(state[key]).copy_(value)
                elif isinstance(p, DTensor) and value.dim() > 0:  # a fresh optimizer: shaped as the parameter
                    state[key] = DTensor.from_local(
                        value.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                else:
                    state[key] = value.clone()
        self.buffers.load(saved["buffers"])
        self.float8_scales.refresh()

    def load_rank_state_dict(self, saved: dict | None) -> None:
        pass
