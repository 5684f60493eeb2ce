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


class LocalRecovery:
    """Built by every rank of a run with --save-local-every (collective: it creates the copies' group)."""

    def __init__(self, every: int, mesh: ParallelMesh, run_dir: str):
        self.started = time.time()
        self.every, self.mesh, self.run_dir = every, mesh, run_dir
        self.copies = LocalCheckpoints(run_dir, every, ranks_per_node())

    def save(self, step: int, engine, loader) -> None:
        """After step `step`: this rank's state, snapshotted now and copied out in the background."""
        if step % self.every:
            return
        loop_state: dict[str, Any] = {"loader": loader.state_dict(), "rng": checkpoint.rng_state(self.mesh.device)}
        rank_state = engine.rank_state_dict()
        if rank_state:
            loop_state[checkpoint.ENGINE_RANK_STATE] = rank_state
        self.copies.save(
            step, {"model": engine.model_state_dict(), "optim": engine.state_dict(), "loop": loop_state, "step": step}
        )

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
        state, source = self.copies.load(step)
        engine.load_model_state_dict(state["model"])
        engine.reload_parameters()
        engine.load_state_dict(state["optim"])
        sources: list[Any] = [None] * self.mesh.world_size
        dist.all_gather_object(sources, (source, os.getpid()), group=self.copies.group)
        done = time.time()
        reason = (restart or {}).get("reason", "")
        failed = re.search(r"rank (\d+)", reason)
        record = {
            "failed_rank": int(failed.group(1)) if failed else None,
            "why": reason,
            "from": "in-memory copies",
            "step": step,
            "copies": {str(r): s for r, (s, _) in enumerate(sources) if s != "own"} or "own",
            "in_place": bool((restart or {}).get("in_place")),  # the survivors kept their processes (--spares)
            "pids": [pid for _, pid in sources],
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
