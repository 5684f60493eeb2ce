"""Per-step bookkeeping of the MoE blocks this rank holds: the aux loss's gradient scale, the step's metrics and
DeepSeek-V3's expert-bias update.

Why here and not in models/: the bias must be identical on every data-parallel rank, so it moves from token
counts summed over the dp group (a collective), once per optimizer step whatever the gradient accumulation.
The layers' statistics go into one (n_layers x (E + 2)) tensor indexed by global layer: a sum over pp gives
every stage all layers (each layer lives on one stage), a sum over dp all tokens, a sum over tp (sequence
parallelism: each tp rank routes its own shard) the rest. Under expert parallelism the step's dispatch bytes
(`comm_bytes_ep`) and the straggler factor (`moe_ep_straggler`: the token copies the most loaded rank of an ep
group computed over the group's mean, worst group and MoE layer; 1.0 when balanced) are added.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.config import ModelConfig
from large_model_training.mesh import ParallelMesh
from large_model_training.models.moe import MoE


class MoEBalance:
    def __init__(self, model: nn.Module, cfg: ModelConfig, mesh: ParallelMesh):
        self.cfg, self.mesh = cfg, mesh
        self.layers = [module for module in model.modules() if isinstance(module, MoE)]
        ep = getattr(mesh, "ep", None)
        self.ep = ep if ep is not None and ep.size > 1 else None

    def start_step(self, micro_batches: int) -> None:
        """Each micro-batch's LM loss is scaled by 1 / micro_batches; its aux loss gradient gets the same."""
        for layer in self.layers:
            layer.aux_grad_scale = 1.0 / micro_batches
            layer.reset_stats()  # an evaluation between steps ran in eval mode, but be explicit
        if self.ep is not None:
            self.ep.bytes = 0.0

    def finish_step(self, update_bias: bool) -> dict:
        """The step's MoE metrics (global over dp and pp); moves the expert bias when `update_bias` (a step
        taken). Every rank calls it (collectives over pp and dp)."""
        n, experts = self.cfg.n_layers + self.cfg.mtp_depth, self.cfg.moe_experts  # prediction modules' blocks last
        straggler = self._ep_straggler() if self.ep is not None else None  # before take_stats clears the rows
        stats = torch.zeros(n, experts + 2, dtype=torch.float64, device=self.mesh.device)
        for layer in self.layers:
            counts, aux_sum, dropped, forwards = layer.take_stats()
            if forwards:
                stats[layer.layer, :experts] = counts.to(stats)
                stats[layer.layer, experts] = aux_sum.to(stats) / forwards
                stats[layer.layer, experts + 1] = dropped.to(stats)
        for axis in ("pp", "grad", "tp"):
            if getattr(self.mesh, f"{axis}_size", 1) > 1:
                dist.all_reduce(stats, group=self.mesh.group(axis))
        # aux: summed over the gradient group, where each data replica's cp ranks hold parts of its loss
        counts, aux = stats[:, :experts], stats[:, experts] / self.mesh.dp_size
        rate = self.cfg.moe_bias_update_rate
        if update_bias and rate > 0:
            for layer in self.layers:
                load = counts[layer.layer]
                bias = layer.router.expert_bias
                bias += (rate * torch.sign(load.mean() - load)).to(bias)
        moe = [i for i in range(n) if self.cfg.is_moe_layer(i)]
        imbalance = [float(counts[i].max() / counts[i].mean().clamp(min=1e-12)) for i in moe]
        record = {
            "moe_aux_loss": float(aux[moe].sum()),
            "moe_load_imbalance": max(imbalance),
            "moe_tokens_dropped": int(stats[:, experts + 1].sum()),
            "moe_aux_loss_per_layer": [float(aux[i]) for i in moe],
            "moe_load_imbalance_per_layer": imbalance,
        }
        if straggler is not None:
            record.update(comm_bytes_ep=int(self.ep.bytes), moe_ep_straggler=straggler)
        return record

    def _ep_straggler(self) -> float:
        """max / mean of the copies each rank of an ep group computed this step, worst layer and group (a MAX
        over the ep group's peers on other dp, tp and pp coordinates)."""
        ep = self.ep
        blocks = self.cfg.n_layers + self.cfg.mtp_depth
        rows = torch.zeros(blocks, ep.size, dtype=torch.float64, device=self.mesh.device)
        for layer in self.layers:
            rows[layer.layer, ep.rank] = layer.experts.rows
        dist.all_reduce(rows, group=ep.group)
        worst = (rows.max(1).values / rows.mean(1).clamp(min=1e-12)).max().reshape(1)
        for axis in ("pp", "grad", "tp"):
            if getattr(self.mesh, f"{axis}_size", 1) > 1:
                dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.mesh.group(axis))
        return float(worst)
