"""The training loop. It orchestrates; the parallel machinery lives in `parallel/`, state in the objects it holds.

One optimizer step: take this rank's micro-batches of the global batch, forward/backward each (loss scaled by
1/micro_batches so the accumulated gradient is the mean), reduce gradients over dp, clip by the global norm,
step (or skip the step if the loss or norm is not finite), log, and now and then evaluate and save.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from large_model_training.config import Config
from large_model_training.data.corpus import load_token_streams
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.models.build import build_model
from large_model_training.parallel.collectives import TPGroup
from large_model_training.parallel.data import allreduce_gradients
from large_model_training.parallel.tensor import sync_partial_gradients
from large_model_training.train import checkpoint
from large_model_training.train.metrics import MetricsLogger
from large_model_training.train.optim import (build_optimizer, clip_gradients, global_grad_norm, learning_rate,
                                              norm_parameters)


class TrainingError(RuntimeError):
    """The run cannot usefully continue (e.g. repeated non-finite losses); the message says why."""


@dataclass
class TrainResult:
    """What a rank returns: the per-step losses (global means) and validation losses by step."""

    losses: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    last_step: int = 0
    checkpoint: str = ""


class Trainer:
    """Holds the model, optimizer and loaders of one rank and runs the loop."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, run_dir: str):
        self.cfg = cfg
        self.mesh = mesh
        self.run_dir = run_dir
        t = cfg.train
        torch.manual_seed(t.seed + 1000 * mesh.rank)  # dropout streams: distinct per rank, fixed per seed
        self.tp = TPGroup(mesh.tp_group if mesh.tp_size > 1 else None, mesh.tp_size, mesh.tp_rank)
        self.model = build_model(cfg.model, mesh, t.seed, sequence_parallel=cfg.parallel.sequence_parallel, tp=self.tp)
        self.optimizer = build_optimizer(self.model, t)
        self.norm_params = norm_parameters(self.model, mesh)
        streams = load_token_streams(cfg.data)
        shard = Shard(mesh.dp_rank, mesh.dp_size, t.global_batch_size, t.micro_batch_size)
        self.micro_batches = shard.micro_batches
        self.start_step = 0
        loop_state = {}
        if cfg.run.resume:
            loop_state = checkpoint.load_checkpoint(cfg.run.resume, self.model, self.optimizer, mesh)
            self.start_step = checkpoint.read_meta(cfg.run.resume)["step"]
            if "rng" in loop_state:
                checkpoint.set_rng_state(loop_state["rng"], mesh.device)
        self.loader = BatchLoader(streams.train, t.seq_len, shard, t.seed, mesh.device, start_step=self.start_step)
        val_shard = Shard(mesh.dp_rank, mesh.dp_size, t.micro_batch_size * mesh.dp_size * t.eval_batches,
                          t.micro_batch_size)
        self.val_batches = BatchLoader(streams.val, t.seq_len, val_shard, t.seed, mesh.device, shuffle=False,
                                       prefetch=False).next()
        self.tokens_per_step = t.global_batch_size * t.seq_len

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        if self.mesh.dp_size > 1:
            dist.all_reduce(value, group=self.mesh.dp_group)
            value = value / self.mesh.dp_size
        return float(value)

    def train_step(self, step: int, micro_batches: list) -> dict:
        """One optimizer step (0-based `step` for the schedule). Returns the metrics record."""
        lr = learning_rate(step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss_sum = torch.zeros((), device=self.mesh.device)
        self.tp.bytes = 0.0
        for inputs, targets in micro_batches:
            loss = self.model.loss_fn(self.model(inputs), targets) / self.micro_batches
            loss.backward()
            loss_sum += loss.detach()
        sync_partial_gradients(self.model, self.tp)
        comm_bytes_dp = allreduce_gradients(self.model, self.mesh.dp_group, self.mesh.dp_size)
        grad_norm = global_grad_norm(self.norm_params, self.mesh)
        loss_value = self._mean_over_dp(loss_sum)
        finite = math.isfinite(loss_value) and bool(torch.isfinite(grad_norm))
        if finite:
            clip_gradients(self.model, grad_norm, self.cfg.train.grad_clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                "comm_bytes_dp": comm_bytes_dp, "comm_bytes_tp": int(self.tp.bytes), "skipped": not finite}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.mesh.device)
        for inputs, targets in self.val_batches:
            total += self.model.loss_fn(self.model(inputs), targets)
        return self._mean_over_dp(total / len(self.val_batches))

    def save(self, step: int) -> str:
        return checkpoint.save_checkpoint(self.cfg, self.run_dir, step, self.model, self.optimizer,
                                          {"loader": self.loader.state_dict()}, self.mesh)

    def fit(self) -> TrainResult:
        t, r = self.cfg.train, self.cfg.run
        is_logger = self.mesh.rank == 0
        logger = MetricsLogger(self.run_dir, t.steps, self.start_step, r.log_every) if is_logger else None
        result = TrainResult(last_step=self.start_step)
        bad_streak = 0
        try:
            for step in range(self.start_step, t.steps):
                started = time.perf_counter()
                record = self.train_step(step, self.loader.next())
                synchronize(self.mesh.device)
                elapsed = time.perf_counter() - started
                record.update(step_time_s=elapsed, tokens_per_s=self.tokens_per_step / elapsed)
                done = step + 1
                if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
                    record["val_loss"] = self.evaluate()
                    result.val_losses[done] = record["val_loss"]
                result.losses.append(record["loss"])
                result.last_step = done
                if logger:
                    logger.log(record)
                bad_streak = bad_streak + 1 if record["skipped"] else 0
                if bad_streak >= t.max_bad_steps:
                    raise TrainingError(f"loss or gradient norm not finite for {bad_streak} consecutive steps "
                                        f"(last at step {done}); lower --lr or check the data")
                if (r.save_every and done % r.save_every == 0) or done == t.steps:
                    result.checkpoint = self.save(done)
                    if logger:
                        logger.message(f"saved checkpoint {result.checkpoint}")
        finally:
            if logger:
                logger.close()
        return result


def train_rank(cfg: Config, run_dir: str) -> TrainResult:
    """Entry point of one rank (torch.distributed already initialised): build the mesh, train, return losses."""
    mesh = ParallelMesh.for_this_rank(cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp)
    return Trainer(cfg, mesh, run_dir).fit()
