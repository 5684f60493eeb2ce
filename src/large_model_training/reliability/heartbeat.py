"""Each rank's heartbeat: a small record, published every second or so by a daemon thread, that says where
the rank is, so that a stalled rank can be found and named instead of hanging the job.

A record holds: a beat counter (advances while the process runs at all: a stopped or frozen process stops
it), the step and phase the trainer last set, the rank's position in its main thread (file:line, and, when
that thread is inside torch.distributed, which collective on which of our groups), and every group's
collective sequence number. The sequence numbers are the backend's own per-group counters
(`ProcessGroup._get_sequence_number_for_group`, kept by gloo and NCCL for every collective and point-to-point
operation), read from the thread: the training loop pays nothing per collective, unlike
`TORCH_DISTRIBUTED_DEBUG=DETAIL`'s checks. Where a backend has no counter, the field is absent and stall
diagnosis falls back on phases and positions.

Records go to a board: files in the run folder when every rank is on this machine (the launcher reads them;
`cat RUN/heartbeat/rank_3.json` shows a user where rank 3 is), or the job's c10d store under torchrun (each
rank's watchdog reads the others'). `reliability.stall` turns a series of boards into a verdict.
"""

from __future__ import annotations

import json
import linecache
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def beat_interval(stall_timeout: float) -> float:
    """A tenth of the stall timeout, between 0.2 s and 2 s: ten looks per timeout, at most 5 writes a second."""
    return min(2.0, max(0.2, stall_timeout / 10))


class FileBoard:
    """Heartbeats as one JSON file per rank in a folder (written whole, then renamed: never read half-written)."""

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank_{rank}.json")

    def publish(self, rank: int, record: dict[str, Any]) -> None:
        tmp = self.path(rank) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path(rank))

    def read(self, world_size: int) -> dict[int, dict[str, Any]]:
        out = {}
        for rank in range(world_size):
            try:
                with open(self.path(rank)) as f:
                    out[rank] = json.load(f)
            except (OSError, ValueError):  # not written yet
                continue
        return out


class StoreBoard:
    """Heartbeats as keys of the job's c10d store (torchrun's agent hosts it, so a stopped rank does not
    stop it). The default group's store is this attempt's own (`launch.join_torchrun`), so a restarted job never
    reads the previous attempt's records."""

    def __init__(self, store: dist.Store):
        self.store = store
        self.prefix = "lmt/heartbeat/"

    def publish(self, rank: int, record: dict[str, Any]) -> None:
        self.store.set(self.prefix + str(rank), json.dumps(record))

    def read(self, world_size: int) -> dict[int, dict[str, Any]]:
        keys = [self.prefix + str(r) for r in range(world_size)]
        present = [r for r, key in enumerate(keys) if self.store.check([key])]  # get() would wait for absent keys
        values = self.store.multi_get([keys[r] for r in present]) if present else []
        return {r: json.loads(bytes(v).decode()) for r, v in zip(present, values)}


def _short(filename: str) -> str:
    if filename.startswith(PACKAGE_DIR):
        return os.path.relpath(filename, PACKAGE_DIR)
    return os.path.basename(filename)


class Heartbeat:
    """This rank's heartbeat. The trainer sets `phase(name, step)`; `watch(groups)` names the process groups
    whose sequence numbers are published; `start()` runs the publishing thread (and, when given, a watchdog
    callback after each beat, on that thread)."""

    def __init__(self, board, rank: int, interval: float):
        self.board, self.rank, self.interval = board, rank, interval
        self.main_thread = threading.get_ident()  # the thread that trains: its position is reported
        self.beat = 0
        self.step = 0
        self.phase_name = "start"
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.members: dict[str, list[int]] = {}
        self._names_by_group: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # optional callable(record), run on the heartbeat thread after publishing
        self.on_beat: Callable[[dict[str, Any]], None] | None = None
        self.host = socket.gethostname()
        self._last_position = {"where": "", "comm": "", "group": "", "inner": ""}

    def phase(self, name: str, step: int | None = None) -> None:
        """Called by the training loop at phase boundaries: two attribute stores, nothing else."""
        self.phase_name = name
        if step is not None:
            self.step = step

    def watch(self, groups: dict[str, dist.ProcessGroup | None]) -> None:
        """Publish these groups' sequence numbers (by our names: world, pp, dp, tp, embedding)."""
        for name, group in groups.items():
            if group is None or dist.get_world_size(group) < 2:
                continue
            self.groups[name] = group
            self.members[name] = dist.get_process_group_ranks(group)
            self._names_by_group[id(group)] = name

    def _sequence_numbers(self) -> dict[str, int]:
        seqs = {}
        for name, group in self.groups.items():
            try:
                seqs[name] = int(group._get_sequence_number_for_group())
            except (AttributeError, RuntimeError):  # a backend without the counter
                continue
        return seqs

    def _position(self) -> dict[str, str]:
        """Where the training thread is: our innermost frame, the collective it is inside (if any), and the
        innermost frame of any module (`inner`: it moves while a library works, e.g. DCP writing a checkpoint,
        matplotlib drawing, so long legitimate work is progress, not a stall)."""
        frame = sys._current_frames().get(self.main_thread)
        where, comm, group = "", "", ""
        inner = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else ""
        while frame is not None:
            filename = frame.f_code.co_filename
            if TORCH_DISTRIBUTED in filename and not filename.endswith("c10d_logger.py"):  # not its wrappers
                comm = frame.f_code.co_name  # keeps the outermost torch.distributed frame: the API called
                if "distributed_c10d" in filename:
                    try:
                        pg = frame.f_locals.get("group")
                    except Exception:  # noqa: BLE001 - a frame being torn down
                        pg = None
                    group = self._names_by_group.get(id(pg), "world" if pg is None else "other")
            elif filename.startswith(PACKAGE_DIR):
                where = f"{_short(filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
                # f_lineno is None for a frame sampled mid-teardown from another thread: no line to read then
                line = linecache.getline(filename, frame.f_lineno) if frame.f_lineno is not None else ""
                if not comm and ".wait()" in line:
                    comm = "wait"  # blocked on an asynchronous collective's handle
                break
            frame = frame.f_back
        return {"where": where, "comm": comm, "group": group, "inner": inner}

    def record(self) -> dict[str, Any]:
        if threading.get_ident() != self.main_thread:  # the training thread's own position, not the caller's
            self._last_position = self._position()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": self.host,
            "beat": self.beat,
            "time": time.time(),
            "step": self.step,
            "phase": self.phase_name,
            "seqs": self._sequence_numbers(),
            "members": self.members,
            **self._last_position,
        }

    def publish(self) -> dict[str, Any]:
        self.beat += 1
        record = self.record()
        self.board.publish(self.rank, record)
        return record

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                record = self.publish()
                if self.on_beat is not None:
                    self.on_beat(record)
            except Exception as e:  # noqa: BLE001 - the heartbeat must never take the rank down
                print(
                    f"lmt: rank {self.rank}: heartbeat failed ({type(e).__name__}: {e}); stall detection is off "
                    "for this rank",
                    file=sys.stderr,
                    flush=True,
                )
                return

    def start(self) -> Heartbeat:
        self.publish()  # from the training thread: no position yet
        self._thread = threading.Thread(target=self._run, name="lmt-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, phase: str = "done") -> None:
        self.phase_name = phase
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.publish()
        except Exception:  # noqa: BLE001 - the store may already be gone at the end of a job
            pass


class NoHeartbeat:
    """Stands in when heartbeats are off (run.stall_timeout 0, or a one-process run)."""

    def phase(self, name: str, step: int | None = None) -> None:
        pass

    def watch(self, groups) -> None:
        pass

    def stop(self, phase: str = "done") -> None:
        pass
