"""The training loop. It orchestrates; the parallel machinery lives in `parallel/`, state in the objects it holds.

The rank's model, engine and executor come from `assembly.assemble` (the one place that orders their
construction). One optimizer step: take this rank's micro-batches of the global batch; the executor (the
pipeline schedule over this rank's chunks, pp = 1 included) runs forward/backward of each, loss scaled by
1/micro_batches so the accumulated gradient is the mean, while the data-parallel engine reduces finished gradient
buckets; then clip by the global norm, step (or skip the step if the loss or norm is not finite), log, and now and then
evaluate and save.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from large_model_training.assembly import assemble
from large_model_training.config import Config
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.memory.accounting import ActivationCounter
from large_model_training.memory.offload import activation_context, offload_note
from large_model_training.mesh import ParallelMesh, synchronize
from large_model_training.models.float8 import float8_note
from large_model_training.parallel.context import shard_micro_batches
from large_model_training.parallel.engine import apply_step, backward_step
from large_model_training.parallel.fsdp_float8 import float8_gather_note
from large_model_training.parallel.pipeline.runtime import measured_bubble
from large_model_training.parallel.pipeline.trace import write_chrome_trace, write_gantt
from large_model_training.regional_compile import compile_seconds, report as compile_report
from large_model_training.reliability.guards import SpikeGuard, StragglerReport
from large_model_training.reliability.heartbeat import NoHeartbeat
from large_model_training.train import checkpoint
from large_model_training.train.metrics import MetricsLogger
from large_model_training.train.mfu import utilization
from large_model_training.train.moe_balance import MoEBalance
from large_model_training.train.mtp_metrics import take_mtp_losses
from large_model_training.train.optim import clip_scale, learning_rate, peak_memory
from large_model_training.train.recovery import LocalRecovery, RecoveryClock


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

    def __init__(
        self,
        cfg: Config,
        mesh: ParallelMesh,
        run_dir: str,
        restart: dict | None = None,
        heartbeat=None,
        clock: RecoveryClock | None = None,
    ):
        self.cfg = cfg
        self.clock = clock or RecoveryClock(None)  # a recovery's phases (recovery.py): marked as the rank rebuilds
        self.restart = restart  # set on a restarted attempt: logged with its first step (attempt, from, why)
        self.heartbeat = heartbeat or NoHeartbeat()  # phases for stall reports; reliability/heartbeat.py
        self.heartbeat.watch(
            {
                "world": dist.group.WORLD,
                "pp": mesh.pp_group,
                "dp": mesh.grad_group,
                "tp": mesh.tp_group,
                "embedding": mesh.embedding_group,
            }
            | ({"cp": mesh.group("cp")} if mesh.cp_size > 1 else {})
        )
        self.heartbeat.phase("build")
        self.spikes = SpikeGuard(cfg.train.spike_factor, cfg.train.spike_window)
        self.straggler = StragglerReport(mesh) if cfg.run.straggler_report else None
        self.mesh = mesh
        self.run_dir = run_dir
        t = cfg.train
        torch.manual_seed(t.seed + 1000 * mesh.rank)  # dropout streams: distinct per rank, fixed per seed
        # The batch is cut by the dp coordinate only: every cp rank of a share reads the same micro-batches and
        # keeps its zig-zag part (`shard_micro_batches`). Each rank's loss is the mean over its seq_len / cp
        # tokens; as every rank of the dp x cp gradient group holds as many tokens, the group's average of
        # those means (and of their gradients) is the global mean over all tokens, as at cp = 1.
        shard = Shard(mesh.dp_rank, mesh.dp_size, t.global_batch_size, t.micro_batch_size)
        self.micro_batches = shard.micro_batches
        # Prepared before ranks start by `lmt train`; a caller of train_rank (the API, tests) may leave it to the
        # ranks: the first prepares under a lock, the others wait and open the same folder by memory map.
        self.data = load_training_data(cfg.data, prepare_missing=True)
        self.clock.mark("data")
        parts = assemble(cfg, mesh, self.micro_batches, self.data.eod_id if cfg.data.document_mask else None)
        self.model, self.engine, self.executor = parts.model, parts.engine, parts.executor
        self.clock.mark("model")
        self.activations = ActivationCounter().exclude_parameters(self.model)
        self.moe = MoEBalance(self.model, cfg.model, mesh) if cfg.model.moe_experts else None
        if self.executor.weight_grads is not None:  # zero-bubble: what B leaves held for W counts too
            self.executor.weight_grads.counters.append(self.activations)
        self.start_step = 0
        self.last_checkpoint = cfg.run.resume  # what a spike rollback returns to
        loop_state: dict = {}
        # --save-local-every: a restart comes back from the ranks' in-memory copies when they are newer (recovery.py)
        self.local = LocalRecovery.for_run(cfg.run, mesh, run_dir, self.clock)
        restored = self.local.restore(self.engine, cfg.run.resume, restart) if self.local else None
        if restored is not None:  # the model and optimizer are loaded; the per-rank state and RNG here
            loop_state, self.start_step, recovery = restored
            self.restart = {**(restart or {}), "resumed_from": self.start_step, "recovery": recovery}
            self.engine.load_rank_state_dict(checkpoint.engine_rank_state(loop_state))
            if "rng" in loop_state:
                checkpoint.set_rng_state(loop_state["rng"], mesh.device)
        elif cfg.run.resume:
            loop_state = self.restore(cfg.run.resume)
            self.start_step = checkpoint.read_meta(cfg.run.resume)["step"]
        # The loader's position is the step, unless a spike rollback skipped batches (then the checkpoint says).
        self.shard = shard
        self.loader = self._loader(loop_state.get("loader", {}).get("next_step", self.start_step))
        # The validation set is eval_batches global batches: the same samples whatever the layout.
        val_shard = Shard(mesh.dp_rank, mesh.dp_size, t.global_batch_size * t.eval_batches, t.micro_batch_size)
        self.val_batches = shard_micro_batches(
            BatchLoader(
                self.data.val,
                t.seq_len,
                val_shard,
                t.seed,
                mesh.device,
                shuffle=False,
                prefetch=False,
                weights=self.data.weights,
            ).next(),
            mesh.cp,
        )
        self.clock.mark("loaders")
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.writer = checkpoint.CheckpointWriter(cfg, run_dir, mesh, cfg.run.async_save, cfg.run.keep)
        self.utilization = utilization(cfg, mesh.device, mesh.world_size)  # a CPU peak: every rank times it at once
        self.clock.mark("setup")

    def _loader(self, next_step: int) -> BatchLoader:
        t = self.cfg.train
        return BatchLoader(
            self.data.train,
            t.seq_len,
            self.shard,
            t.seed,
            self.mesh.device,
            start_step=next_step,
            weights=self.data.weights,
        )

    def tokens_per_source(self, steps: int) -> dict[str, int]:
        """Training tokens each source has given the first `steps` optimizer steps (metrics: tokens_<label>)."""
        counts = self.loader.samples_per_source(steps)
        return {f"tokens_{p.label}": n * self.cfg.train.seq_len for p, n in zip(self.data.parts, counts)}

    def _sum_over_pp(self, value: torch.Tensor) -> torch.Tensor:
        """The loss lives on the last stage (zeros elsewhere): summing over pp gives it to every rank."""
        if self.mesh.pp_size > 1:
            dist.all_reduce(value, group=self.mesh.pp_group)
        return value

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        if self.mesh.grad_size > 1:
            dist.all_reduce(value, group=self.mesh.grad_group)
            value = value / self.mesh.grad_size
        return float(value)

    def train_step(self, step: int, micro_batches: list) -> dict:
        """One optimizer step (0-based `step` for the schedule). Returns the metrics record."""
        started = time.perf_counter()
        lr = learning_rate(step, self.cfg.train)
        self.heartbeat.phase("forward_backward", step + 1)
        self.model.train()
        self.mesh.tp.bytes = self.mesh.cp.bytes = 0.0
        self.activations.reset_peak()
        if self.moe is not None:
            self.moe.start_step(self.micro_batches)
        busy = 0.0

        def backward_done() -> None:
            nonlocal busy
            busy = time.perf_counter() - started  # this rank's own work, before it waits on the others' gradients
            self.heartbeat.phase("grad_sync")

        loss_sum, grad_norm = backward_step(
            self.engine,
            self.executor,
            micro_batches,
            self.micro_batches,
            backward_done=backward_done,
            context=activation_context(self.mesh.device, self.cfg.train.offload_activations, self.activations),
        )
        loss_value = self._mean_over_dp(self._sum_over_pp(loss_sum))
        finite = math.isfinite(loss_value) and bool(torch.isfinite(grad_norm))
        spike = finite and self.spikes.is_spike(loss_value)  # the global loss: every rank decides the same
        self.heartbeat.phase("optimizer")
        # A Python float: the norm was read to the host above anyway, and engines skip a scale of 1.0.
        engine_record = apply_step(
            self.engine, lr, float(clip_scale(grad_norm, self.cfg.train.grad_clip)), finite and not spike
        )
        if finite and not spike:
            self.spikes.accept(loss_value)
        moe_record = self.moe.finish_step(finite and not spike) if self.moe is not None else {}
        record: dict[str, Any] = {
            "step": step + 1,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "comm_bytes_dp": int(self.engine.comm_bytes()),
            "comm_bytes_tp": int(self.mesh.tp.bytes),
            "activation_bytes": self.activations.peak,
            "model_state_bytes": self.engine.model_state_bytes(),
            "peak_mem_bytes": peak_memory(self.mesh.device),
            "skipped": not finite or spike,
        }
        record.update(moe_record)
        if (
            self.cfg.model.mtp_depth
        ):  # multi-token prediction: each depth's loss (summed over the stages: train/mtp_metrics.py)
            record.update(take_mtp_losses(self.model, self.micro_batches, self.mesh))
        record.update(engine_record)  # e.g. --sync local/streaming: sync_outer (parallel/diloco.py)
        if self.mesh.cp_size > 1:
            record["comm_bytes_cp"] = int(self.mesh.cp.bytes)
        if spike:
            record["spike"] = {"threshold": self.spikes.threshold(), "action": self.cfg.train.spike_action}
        if self.straggler is not None:
            record.update(self.straggler(busy))
        if self.mesh.pp_size > 1:
            record.update(
                comm_bytes_pp=self.executor.bytes,
                bubble_fraction=measured_bubble(self.executor, self.mesh),
                activation_bytes_per_stage=self._per_pipeline_rank(self.activations.peak),
                in_flight_per_stage=self._per_pipeline_rank(self.executor.peak_in_flight),
            )
        return record

    def timed_step(self, step: int) -> dict:
        """`train_step` on the loader's next batches, timed until the device is done, with the throughput fields
        (what `fit` logs per step; bench/trainer_overhead.py times the same call)."""
        started = time.perf_counter()
        record = self.train_step(step, shard_micro_batches(self.loader.next(), self.mesh.cp))
        synchronize(self.mesh.device)
        elapsed = time.perf_counter() - started
        record.update(
            step_time_s=elapsed,
            tokens_per_s=self.tokens_per_step / elapsed,
            **self.utilization.record(elapsed),
            **self.tokens_per_source(self.loader.next_step),
        )
        return record

    def _per_pipeline_rank(self, value: int) -> list[int]:
        """A number from every pipeline rank of this (dp, tp) position, in pipeline order."""
        out = [torch.zeros(1, dtype=torch.int64, device=self.mesh.device) for _ in range(self.mesh.pp_size)]
        mine = torch.tensor([value], dtype=torch.int64, device=self.mesh.device)
        dist.all_gather(out, mine, group=self.mesh.pp_group)
        return [int(t) for t in out]

    def write_timeline(self, step: int) -> None:
        """Collective: rank 0 writes this step's measured pipeline timeline (Chrome trace + Gantt PNG)."""
        events = self.executor.events
        gathered: list[Any] | None = [None] * self.mesh.world_size if self.mesh.rank == 0 else None
        dist.gather_object(events, gathered, dst=0)
        if self.mesh.rank == 0:
            by_rank = dict(enumerate(gathered))
            write_chrome_trace(by_rank, os.path.join(self.run_dir, "timeline.json"))
            pipeline = [by_rank[self.mesh.grid.rank(pp, 0, 0)] for pp in range(self.mesh.pp_size)]
            p = self.cfg.parallel
            write_gantt(
                pipeline,
                os.path.join(self.run_dir, "timeline.png"),
                f"step {step}: {p.schedule}, pp={p.pp}, v={p.virtual_stages}, m={self.micro_batches}",
            )
        dist.barrier()  # every rank starts the next step's clock together, or its bubble counts the drawing

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = self._sum_over_pp(self.executor.forward_only(self.val_batches))
        return self._mean_over_dp(total / len(self.val_batches))

    def save(self, step: int) -> str:
        loop_state: dict = {"loader": self.loader.state_dict()}
        rank_state = self.engine.rank_state_dict()  # compression residuals, DiLoCo replicas: each rank's own
        if rank_state:
            loop_state[checkpoint.ENGINE_RANK_STATE] = rank_state
        return self.writer.save(step, self.model, self.engine, loop_state)

    def restore(self, ckpt: str) -> dict:
        """Everything a checkpoint holds back into this rank (collective): model, optimizer, the engine's
        per-rank state, RNG; returns the loop state (the loader's position). Resume and rollback alike."""
        loop_state = checkpoint.load_checkpoint(ckpt, self.model, self.engine, self.mesh)
        self.engine.load_rank_state_dict(checkpoint.engine_rank_state(loop_state))
        if "rng" in loop_state:
            checkpoint.set_rng_state(loop_state["rng"], self.mesh.device)
        return loop_state

    def rollback(self, spike_step: int) -> dict:
        """Reload the newest checkpoint and continue past the batches that led to the spike (collective).

        The loader resumes at the batch after the spike, so the steps from the checkpoint on see new data;
        the loop then continues from the checkpoint's step. Returns the note logged with the next step.
        """
        self.heartbeat.phase("rollback")
        self.writer.wait()
        ckpt = self.last_checkpoint
        loop_state = self.restore(ckpt)
        step = checkpoint.read_meta(ckpt)["step"]
        # Past the batch that spiked: where the loader is now (not `spike_step`, which an earlier rollback's
        # skipped batches have moved away from the batch index); the checkpoint says where it stood.
        next_batch, resumed_batch = self.loader.next_step, loop_state.get("loader", {}).get("next_step", step)
        self.loader.close()
        self.loader = self._loader(next_batch)
        return {
            "spike_step": spike_step,
            "checkpoint": ckpt,
            "resumed_from": step,
            "skipped_batches": next_batch - resumed_batch,
        }

    def fit(self) -> TrainResult:
        t, r = self.cfg.train, self.cfg.run
        is_logger = self.mesh.rank == 0
        logger = (
            MetricsLogger(
                self.run_dir, t.steps, self.start_step, r.log_every, tracker=r.tracker, config=self.cfg.to_dict()
            )
            if is_logger
            else None
        )
        result = TrainResult(last_step=self.start_step)
        if logger and self.local is not None:  # rows past the step restored are redone (run_folder left them)
            logger.truncate(self.start_step)
        note = offload_note(self.mesh.device, t.offload_activations)
        if logger:
            logger.message(self.utilization.note())
        if logger and note:
            logger.message(note)
        if logger and t.precision == "fp8":
            logger.message(float8_note(self.model, t.fp8_recipe, t.fp8_bf16_first_last))
            if self.cfg.parallel.zero == 3:
                logger.message(float8_gather_note(self.model))
        bad_streak, rollbacks, pending_note = 0, 0, None
        compiled_s = compile_seconds() if t.compile else 0.0  # --compile: each step that compiled says how long
        step = self.start_step
        try:
            while step < t.steps:
                record = self.timed_step(step)
                if step == self.start_step and self.restart and "recovery" in self.restart:
                    self.clock.mark("first_step")
                    self.local.report_phases(self.restart["recovery"])
                if self.mesh.pp_size > 1 and step == min(self.start_step + 1, t.steps - 1):
                    self.write_timeline(step + 1)  # the second step: the first one warms up
                if self.restart and step == self.start_step:
                    record["restart"] = self.restart
                if pending_note:
                    record["rollback"], pending_note = pending_note, None
                done = step + 1
                if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
                    self.heartbeat.phase("eval")
                    record["val_loss"] = self.evaluate()
                    result.val_losses[done] = record["val_loss"]
                result.losses.append(record["loss"])
                result.last_step = done
                if t.compile and compile_seconds() > compiled_s + 0.05:  # the first step and eval compile (no_grad)
                    record["compile_s"], compiled_s = round(compile_seconds() - compiled_s, 3), compile_seconds()
                    if logger:
                        logger.message(f"step {done}: {compile_report()}")
                if logger:
                    logger.log(record)
                    first = self.engine.compressed_from  # the first compressed step, said once
                    if first is not None and step == max(self.start_step, first):
                        logger.message(self.engine.compression_note(record["comm_bytes_dp"]))
                bad_streak = bad_streak + 1 if record["skipped"] else 0
                if bad_streak >= t.max_bad_steps:
                    what = "loss spikes" if "spike" in record else "loss or gradient norm not finite"
                    raise TrainingError(
                        f"{what} for {bad_streak} consecutive steps (last at step {done}); lower --lr or check the data"
                    )
                if "spike" in record and t.spike_action == "rollback" and self.last_checkpoint:
                    rollbacks += 1
                    if rollbacks > t.max_bad_steps:
                        raise TrainingError(
                            f"loss spikes came back after {t.max_bad_steps} rollbacks (last at "
                            f"step {done}); lower --lr or check the data"
                        )
                    pending_note = self.rollback(done)
                    step = pending_note["resumed_from"]
                    result.losses = result.losses[: step - self.start_step]
                    if logger:
                        logger.truncate(step)
                        logger.message(
                            f"loss spike at step {done} ({record['loss']:.4f} > "
                            f"{record['spike']['threshold']:.4f}): rolled back to "
                            f"{pending_note['checkpoint']}, skipping {pending_note['skipped_batches']} "
                            f"batches"
                        )
                    continue
                if (r.save_every and done % r.save_every == 0) or done == t.steps:
                    self.heartbeat.phase("save")
                    result.checkpoint = self.last_checkpoint = self.save(done)
                    if logger:
                        logger.message(
                            f"{'saving' if self.cfg.run.async_save else 'saved'} checkpoint {result.checkpoint}"
                        )
                if self.local is not None:
                    self.local.save(done, self.engine, self.loader)
                step = done
            self.writer.wait()
        finally:
            if self.local is not None:
                self.local.close(finished=step >= t.steps)
            self.loader.close()
            if logger:
                logger.close()
        self.heartbeat.phase("done")
        return result


def train_rank(cfg: Config, run_dir: str, restart: dict | None = None, watched: bool = False) -> TrainResult:
    """Entry point of one rank (torch.distributed already initialised): build the mesh, train, return losses.

    `restart` (attempt number, step resumed from, reason) marks a restarted attempt; it is logged with the
    attempt's first step in metrics.jsonl. `watched`: the built-in launcher reads this job's heartbeats from
    the run folder; otherwise (torchrun, any other launcher) they go to the job's store and every rank watches.
    """
    from large_model_training.reliability.watch import start_heartbeat

    clock = RecoveryClock(restart)  # --spares brings the marks of the way back so far (reliability/in_place.py)
    clock.mark("enter")
    restart = {k: v for k, v in restart.items() if k != "marks"} if restart else None
    if restart and restart.get("in_place"):  # --spares: the newest durable checkpoint is the copies' fallback
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=checkpoint.newest_checkpoint(run_dir)))
    heartbeat = start_heartbeat(run_dir, cfg.run.stall_timeout, watched)
    try:
        mesh = ParallelMesh.for_this_rank(
            cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.ep
        )
        clock.mark("mesh")
        result = Trainer(cfg, mesh, run_dir, restart, heartbeat, clock).fit()
    except BaseException:
        heartbeat.stop("failed")  # a failed rank is not 'done': the others' stall verdict still stands
        raise
    heartbeat.stop("done")
    return result
