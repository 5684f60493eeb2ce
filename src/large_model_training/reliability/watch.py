"""Who watches the heartbeats, and what happens on a verdict.

- Built-in launcher (`lmt train` spawning local ranks): every rank writes its heartbeat into RUN/heartbeat/;
  the launching process polls them with a `BoardWatcher` (`launch.run_on_ranks(monitor=...)`), and on a verdict
  ends every rank (SIGTERM, then SIGKILL after a grace period: a stopped process does not answer SIGTERM)
  and reports the verdict.
- Under torchrun there is no process that sees every node, so every rank runs a `Watchdog` on its heartbeat
  thread: while the rank itself progresses it only publishes its own record to the job's store; once it has
  made no progress for half the stall timeout it reads everyone's each beat, and after the other half it
  judges. On a verdict the rank reports (only the lowest-numbered rank that is not a cause prints it) and
  exits with EXIT_STALLED; torchrun's agent then ends the other workers and, with --max-restarts, restarts
  them (they resume with --resume auto).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch.distributed as dist

from large_model_training.reliability.heartbeat import FileBoard, Heartbeat, NoHeartbeat, StoreBoard, beat_interval
from large_model_training.reliability.stall import RankStall, StallMonitor, progress_signature

EXIT_STALLED = 3
HEARTBEAT_FOLDER = "heartbeat"


class BoardWatcher:
    """The launcher's view of a file board: `check()` each second, `blame()` once a rank has failed."""

    def __init__(self, folder: str, world_size: int, stall_timeout: float):
        self.board = FileBoard(folder)
        self.world_size = world_size
        self.monitor = StallMonitor(world_size, stall_timeout, beat_interval(stall_timeout))

    def check(self) -> RankStall | None:
        return self.monitor.observe(self.board.read(self.world_size), time.monotonic())

    def blame(self) -> RankStall | None:
        self.monitor.observe(self.board.read(self.world_size), time.monotonic())
        return self.monitor.blame(time.monotonic())


def clear_board(run_dir: str) -> str:
    """Empty RUN/heartbeat before a launch (records of an earlier attempt would read as frozen ranks)."""
    folder = os.path.join(run_dir, HEARTBEAT_FOLDER)
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
    return folder


class Watchdog:
    """Runs after each beat on a torchrun rank's heartbeat thread (see the module docstring)."""

    def __init__(self, heartbeat: Heartbeat, world_size: int, stall_timeout: float, run_dir: str):
        self.heartbeat, self.world_size = heartbeat, world_size
        self.stall_timeout, self.run_dir = stall_timeout, run_dir
        self.monitor: StallMonitor | None = None
        self.signature: tuple = ()
        self.progress_since = time.monotonic()

    def __call__(self, record: dict) -> None:
        now = time.monotonic()
        signature = progress_signature(record)
        if signature != self.signature:
            self.signature, self.progress_since, self.monitor = signature, now, None
            return
        if now - self.progress_since < self.stall_timeout / 2:
            return
        if self.monitor is None:
            self.monitor = StallMonitor(self.world_size, self.stall_timeout / 2, self.heartbeat.interval)
        verdict = self.monitor.observe(self.heartbeat.board.read(self.world_size), now)
        if verdict is not None:
            self.end(verdict)

    def end(self, verdict: RankStall) -> None:
        """Report (the lowest rank that is not a cause), kill the stalled ranks that run on this host (torchrun's
        agent would give a stopped worker 30 s to answer SIGTERM), and leave."""
        rank = self.heartbeat.rank
        if rank == min(set(range(self.world_size)) - set(verdict.ranks)):
            print(f"lmt: {verdict}", file=sys.stderr, flush=True)
            with open(os.path.join(self.run_dir, "stall.log"), "w") as f:
                f.write(f"{verdict}\n")
        records = self.monitor.seen if self.monitor else {}
        for cause in verdict.ranks:
            seen = records.get(cause)
            if seen and seen.record.get("host") == self.heartbeat.host and seen.record.get("pid"):
                try:
                    os.kill(int(seen.record["pid"]), signal.SIGKILL)
                except OSError:  # already gone
                    pass
        os._exit(EXIT_STALLED)


def start_heartbeat(run_dir: str, stall_timeout: float, watched: bool) -> Heartbeat | NoHeartbeat:
    """This rank's heartbeat (after init_process_group), or a stand-in when heartbeats are off or pointless.

    `watched`: the built-in launcher reads RUN/heartbeat; else the records go to the job's store and this rank
    runs a Watchdog (torchrun or any launcher that only starts processes)."""
    world = dist.get_world_size()
    if stall_timeout <= 0 or world == 1:
        return NoHeartbeat()
    rank, interval = dist.get_rank(), beat_interval(stall_timeout)
    if not watched:
        board = StoreBoard(dist.distributed_c10d._get_default_store())
        heartbeat = Heartbeat(board, rank, interval)
        heartbeat.on_beat = Watchdog(heartbeat, world, stall_timeout, run_dir)
    else:
        heartbeat = Heartbeat(FileBoard(os.path.join(run_dir, HEARTBEAT_FOLDER)), rank, interval)
    return heartbeat.start()
