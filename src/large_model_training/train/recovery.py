"""The trainer's side of in-memory recovery: what a rank's local copy holds, and a restart restored from it.

A restarted attempt (`--max-restarts` with `--resume auto`, or torchrun's restart) first asks every rank's
holders (`reliability/local_checkpoint.py`) for the newest step whose every shard survives somewhere; when that
step is at least the newest durable checkpoint's, the ranks load from the copies (their own, or the partner's
sent over the network) and the durable checkpoint is not read. The recovery record (which rank failed and
why, which copy, seconds per phase, steps redone) joins the attempt's restart record in metrics.jsonl, and one
line goes to the run log.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from large_model_training.mesh import ParallelMesh
from large_model_training.reliability.local_checkpoint import LocalCheckpoints
from large_model_training.train import checkpoint


def ranks_per_node() -> int:
    """Under torchrun, the ranks of one agent (LOCAL_WORLD_SIZE); the built-in launcher runs on one machine, where
    each rank stands for a node of its own (so a copy always goes to another rank's holder)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return 1


def last_logged_step(run_dir: str) -> int:
    """The newest step metrics.jsonl has (the failed attempt's progress: what a recovery redoes)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    last = 0
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    last = max(last, int(json.loads(line).get("step", 0)))
    except (OSError, ValueError):
        pass
    return last


def warm_spare(cfg, run_dir: str, restart: dict | None = None, watched: bool = False) -> None:
    """An idle spare's head start (`--spares`, train_rank's arguments): what a replacement would otherwise do
    after the verdict while the survivors wait for it, and that does not depend on the rank it gets: the device's
    measured peak for the MFU figure (cached per process; the spares started with the job measure it while the
    ranks measure theirs), the training data opened and one batch read (imports, the loader's first use), one
    forward and backward of a small layer (autograd's first use)."""
    from large_model_training.data.dataset import load_training_data
    from large_model_training.data.loader import BatchLoader, Shard
    from large_model_training.mesh import select_device
    from large_model_training.train.mfu import utilization

    device = select_device(int(os.environ.get("LOCAL_RANK", "0")))
    utilization(cfg, device, cfg.parallel.world_size)
    t = cfg.train
    data = load_training_data(cfg.data, prepare_missing=True)
    shard = Shard(0, 1, t.micro_batch_size, t.micro_batch_size)
    BatchLoader(data.train, t.seq_len, shard, t.seed, device, prefetch=False, weights=data.weights).next()
    layer = torch.nn.Linear(8, 8, device=device)
    layer(torch.ones(2, 8, device=device)).sum().backward()


class RecoveryClock:
    """Wall-clock marks of one rank's way back after a failure, from the launcher's verdict (`detected_at` in the
    restart record) to the first step completed again: each mark names the phase that ends there. Wall clock, as
    the launcher and the ranks are different processes. `phases()` gives seconds per phase and their `total`
    (a phase that began before the previous mark, e.g. a survivor that saw the lost peer before the launcher did,
    counts from that mark, so the phases always add up to the total). Idle (no marks) on a fresh start."""

    def __init__(self, restart: dict | None):
        self.start: float | None = (restart or {}).get("detected_at")
        self.marks = [(str(name), float(at)) for name, at in (restart or {}).get("marks", [])]

    def mark(self, phase: str) -> None:
        if self.start is not None:
            self.marks.append((phase, time.time()))

    def phases(self) -> dict[str, float]:
        assert self.start is not None
        out: dict[str, float] = {}
        previous = self.start
        for phase, at in self.marks:
            out[phase] = round(out.get(phase, 0.0) + max(0.0, at - previous), 3)
            previous = max(previous, at)
        out["total"] = round(previous - self.start, 3)
        return out


def slowest_phases(by_rank: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per phase, the most any rank spent in it (the ranks wait for each other at every collective)."""
    out: dict[str, float] = {}
    for phases in by_rank.values():
        for phase, s in phases.items():
            out[phase] = max(out.get(phase, 0.0), s)
    return out


class LocalRecovery:
    """Built by every rank of a run with --save-local-every (collective: it creates the copies' group)."""

    def __init__(
        self, every: int, mesh: ParallelMesh, run_dir: str, clock: RecoveryClock | None = None, timeout_s: float = 300.0
    ):
        self.started = time.time()
        self.every, self.mesh, self.run_dir = every, mesh, run_dir
        self.clock = clock or RecoveryClock(None)
        self.copies = LocalCheckpoints(run_dir, every, ranks_per_node(), timeout_s)
        self.clock.mark("copies_group")

    @classmethod
    def for_run(cls, run, mesh: ParallelMesh, run_dir: str, clock: RecoveryClock) -> LocalRecovery | None:
        """Collective; None without --save-local-every. The copies' stream times out as the run's groups do."""
        return cls(run.save_local_every, mesh, run_dir, clock, run.timeout) if run.save_local_every else None

    def save(self, step: int, engine, loader) -> None:
        """After step `step`: this rank's state, snapshotted now and copied out in the background."""
        if step % self.every:
            return
        loop_state: dict[str, Any] = {"loader": loader.state_dict(), "rng": checkpoint.rng_state(self.mesh.device)}
        rank_state = engine.rank_state_dict()
        if rank_state:
            loop_state[checkpoint.ENGINE_RANK_STATE] = rank_state
        self.copies.save(step, {"engine": engine.local_state_dict(), "loop": loop_state, "step": step})

    def close(self, finished: bool) -> None:
        self.copies.close(finished)

    def restore(self, engine, durable: str, restart: dict | None) -> tuple[dict, int, dict] | None:
        """Collective. On a restart: load the newest complete local step into the engine when it is at least as
        new as `durable` (the newest durable checkpoint, or ""); returns (loop state, step, recovery record).
        None: nothing to restore locally (a fresh start clears stale copies; otherwise the durable path)."""
        if restart and restart.get("in_place") and restart.get("rank") == self.mesh.rank:
            self.copies.forget_node()  # a replacement stands for a new machine: the shard comes from the partner
        wanted = torch.tensor([int(bool(durable) or restart is not None)], dtype=torch.int64)
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=self.copies.group)  # every rank decides the same
        if not int(wanted):
            self.copies.clear()
            return None
        agreed = time.time()
        self.clock.mark("decide")
        step, lost = self.copies.newest_complete()
        durable_step = checkpoint.read_meta(durable)["step"] if durable else 0
        rank0 = self.mesh.rank == 0
        if step is None or step < durable_step:
            if lost and rank0:
                shards = ", ".join(f"rank {r}" for r in lost)
                print(
                    f"lmt: in-memory copies lost (own and partner's) for {shards}: resuming from "
                    f"{durable or 'the start (no durable checkpoint)'}",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        loaded = time.time()
        self.clock.mark("agree")
        state, source = self.copies.load(step)
        engine.load_local_state_dict(state["engine"])
        sources: list[Any] = [None] * self.mesh.world_size
        restarted = bool((restart or {}).get("restarted_stuck"))  # a survivor's process restarted (in_place.py)
        dist.all_gather_object(sources, (source, os.getpid(), restarted), group=self.copies.group)
        done = time.time()
        self.clock.mark("load")
        reason = (restart or {}).get("reason", "")
        failed = re.search(r"rank (\d+)", reason)
        record = {
            "failed_rank": int(failed.group(1)) if failed else None,
            "why": reason,
            "from": "in-memory copies",
            "step": step,
            "copies": {str(r): s for r, (s, _, _) in enumerate(sources) if s != "own"} or "own",
            "in_place": bool((restart or {}).get("in_place")),  # the survivors kept their processes (--spares)
            "pids": [pid for _, pid, _ in sources],
            "restarted_stuck": [r for r, (_, _, stuck) in enumerate(sources) if stuck],  # but these (in_place.py)
            "phases_s": {
                "restart_to_build": round(self.started - restart["detected_at"], 3)
                if restart and "detected_at" in restart
                else None,
                "build": round(agreed - self.started, 3),
                "agree": round(loaded - agreed, 3),
                "load": round(done - loaded, 3),
            },
            "steps_redone": max(0, last_logged_step(self.run_dir) - step) if rank0 else None,
            "durable_read": False,
        }
        if rank0:
            print(
                f"lmt: recovered {'in place ' if record['in_place'] else ''}from the in-memory copies of step "
                f"{step} ({record['copies']}), "
                f"{record['steps_redone']} steps redone, no durable checkpoint read",
                flush=True,
            )
        return state["loop"], step, record

    def report_phases(self, recovery: dict) -> None:
        """Collective, after the first step completed again: every rank's phases into the recovery record
        (`rebuild_s`, by rank) and one line of the slowest per phase into the run log."""
        if self.clock.start is None:
            return
        by_rank: list[Any] = [None] * self.mesh.world_size
        dist.all_gather_object(by_rank, self.clock.phases(), group=self.copies.group)
        recovery["rebuild_s"] = {str(r): phases for r, phases in enumerate(by_rank)}
        if self.mesh.rank == 0:
            slowest = slowest_phases(recovery["rebuild_s"])
            total = slowest.pop("total")
            said = ", ".join(f"{phase} {s:.3f}" for phase, s in slowest.items())
            print(
                f"lmt: recovery took {total:.2f} s from the verdict to the next step (slowest rank per phase, s: "
                f"{said})",
                flush=True,
            )
