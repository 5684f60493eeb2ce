"""Recovery without restarting the healthy ranks (`--spares K`, built-in launcher, with --save-local-every).

The launcher hosts a TCPStore and starts K idle spare processes beside the world. When a rank's process dies, the
launcher picks an idle spare (or, when none is left alive, starts a fresh process), tells it which rank it now
is, and moves the job to a new *generation*: a counter in that store. Every survivor stays in its process: a
watcher thread sees the counter move and cuts the rank's gloo connections, so a collective the training thread
waits in fails at once instead of after `--run.timeout`; the survivor then leaves its process groups and joins
the new generation's (a fresh store prefix `gen<g>/`, as launch.join_torchrun's handshake gives each torchrun
round a fresh one: no stale key can be read), builds its Trainer again and restores the newest step whose every
shard survives from the in-memory copies (train/recovery.py). The replacement stands for a new machine: it does
not read the dead rank's holder, and gets its shard from the partner's copy.

Why torch.distributed primitives and not torchft or nvidia-resiliency-ext: torchft (0.2.0, torch >= 2.7) heals
a *replica group* from a live peer through its Manager, which must own the dp all-reduce and a quorum every step
(agreed with a Lighthouse server; its "baby" process groups run gloo or NCCL in a child process that can be killed
to abort a collective), built for DDP and HSDP; our engine reduces
over its own flat buffers and groups and shards every rank over tp, pp and ZeRO, so a lost tp or pp shard has no
live replica to heal from, only the partner copy. nvidia-resiliency-ext's in-process restart wraps the training
function the same way as here (a monitor thread, abort, re-initialise, re-enter), but aborts through NCCL's
communicator abort and needs its own launcher; gloo has no working abort (ProcessGroupGloo.abort in torch 2.13
leaves a waiting collective blocked until its timeout), hence the connection cut. What is cut: the rank's
connected TCP sockets whose both ends are on this host, except those to the store (listening sockets are left
alone: gloo aborts the process when its listener fails) - on one machine that is exactly gloo's pairs.
"""

from __future__ import annotations

import datetime
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

from large_model_training.launch import EXIT_STUCK, PEER_LOST, init_process_group
from large_model_training.reliability.heartbeat import TORCH_DISTRIBUTED

POLL_S = 0.02  # how often a rank looks at the generation counter (one tiny store request)
OWN_ERROR_GRACE_S = 2.0  # how long an error that does not look like a lost peer waits for a new generation
WAIT_FOR_WAIT_S = 2.0  # how long a survivor's cut waits for its training thread to block in a wait (_Watcher)
STUCK_AFTER_CUT_S = 10.0  # a survivor still in its failed generation this long after the cut restarts its process


def cut_connections(store_port: int) -> int:
    """Shut down this process's connected same-host TCP sockets but the store's: gloo's pairs. Returns how many."""
    cut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                local, peer = sock.getsockname(), sock.getpeername()
                if peer[1] != store_port and local[1] != store_port and peer[0] == local[0]:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
        except OSError:  # not connected (a listener): left alone
            pass
        finally:
            sock.close()
    return cut


class Spares:
    """Both sides of in-place recovery. The launcher builds it (`start` hosts the store); each spawned process gets
    a pickled copy (the store left behind) and runs `run` in it. `restart_index`: the position of the restart
    record among fn's arguments (filled for a generation after the first). `warm` (optional, importable by name):
    called with fn's arguments by an idle spare before it waits for a rank, to do then what does not depend on
    the rank (imports, first-use costs, a measured device peak) instead of during a recovery."""

    def __init__(self, count: int, restart_index: int, timeout_s: float, warm: Callable | None = None):
        self.count, self.restart_index, self.timeout_s, self.warm = count, restart_index, timeout_s, warm
        self.port = 0
        self.generation = 0
        self.store: dist.TCPStore | None = None
        self.idle: list[int] = []  # spare slots not yet given a rank
        self.replaced = 0
        self.stuck_restarts = 0  # survivors' processes restarted (EXIT_STUCK)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "store": None}

    # -- the launcher's side --------------------------------------------------------------------------------------
    def start(self, world_size: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = self.store.port
        self.store.set("gen", "0")
        self.idle = list(range(world_size, world_size + self.count))

    def can_replace(self) -> bool:
        return self.replaced < self.count

    def spare_died(self, slot: int, code: int | None) -> None:
        if slot in self.idle:
            self.idle.remove(slot)
            print(f"lmt: spare process {slot} died (exit {code}); idle spares left: {len(self.idle)}", flush=True)

    def replace(self, slot: int, rank: int, why: str) -> None:
        """Give `rank` to the process in `slot` and move the job to the next generation (the survivors rebuild)."""
        assert self.store is not None
        if slot in self.idle:
            self.idle.remove(slot)
        self.replaced += 1
        self.generation += 1
        g = self.generation
        record = {"in_place": g, "rank": rank, "reason": why, "detected_at": time.time()}
        self.store.set(f"gen{g}/record", json.dumps(record))
        self.store.set(f"assign/{slot}", json.dumps([rank, g]))
        self.store.set("gen", str(g))
        print(
            f"lmt: {why}; rank {rank} replaced in place by process {slot} (generation {g}, "
            f"{self.count - self.replaced} replacements left); the other ranks keep their processes",
            flush=True,
        )

    def can_restart_stuck(self, world_size: int) -> bool:
        """After a replacement only (the cut comes with one), at most every rank once per replacement."""
        return self.stuck_restarts < world_size * self.replaced

    def restart_stuck(self, slot: int, rank: int) -> None:
        """Give `rank` to the fresh process in `slot` in the current generation: its survivor's process exited
        with EXIT_STUCK (a collective gloo never ended, see _Watcher). Not a lost machine: no spare is used, and
        the rank restores from its own node's copies."""
        assert self.store is not None
        self.stuck_restarts += 1
        self.store.set(f"assign/{slot}", json.dumps([rank, self.generation]))
        print(
            f"lmt: rank {rank} stayed stuck in a collective after the recovery began; its process is restarted "
            f"in place (process {slot}, generation {self.generation})",
            flush=True,
        )

    # -- a rank's side --------------------------------------------------------------------------------------------
    def _client(self) -> dist.TCPStore:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timeout)

    def run(self, slot: int, fn: Callable, args: tuple, world_size: int, where: dict) -> Any:
        """Body of one process: a rank from the start (slot < world_size) or a spare waiting for a rank; each
        generation joins fresh groups and calls fn; a peer lost makes it wait for the next generation."""
        store = self._client()
        marks: list[tuple[str, float]] = []  # the way back's phases so far, for the recovery record (wall clock)
        if slot < world_size:
            rank, generation = slot, 0
        else:
            if self.warm is not None:
                self.warm(*args)
            rank, generation = self._assignment(store, slot)
            marks = [("abort", time.time())]  # the replacement: from the verdict to its assignment seen
        where["rank"] = rank
        restarted = slot >= world_size  # a spare, or a fresh process: for the failed rank or a stuck survivor
        while True:
            self._join(store, rank, world_size, generation)
            if generation:
                record = json.loads(store.get(f"gen{generation}/record"))
                record["marks"] = [*marks, ("rejoin", time.time())]
                if restarted and record["rank"] != rank:
                    record["restarted_stuck"] = True  # this rank's survivor process was restarted (EXIT_STUCK)
                restarted = False
                args = (*args[: self.restart_index], record, *args[self.restart_index + 1 :])
            watcher = _Watcher(self._client(), generation, self.port, rank)
            try:
                return fn(*args)
            except Exception as e:
                marks = [("abort", time.time())]  # a survivor: from the verdict until its failed step gave up
                # A peer lost shows as a connection error, but a cut can surface as other gloo errors too: any
                # error waits a moment for the launcher (which sees a dead process at once) to move the job on;
                # if it does not, the error is the rank's own and ends the job as before.
                lost = watcher.moved() or any(s in str(e) for s in PEER_LOST)
                watcher.stop()
                cut_connections(self.port)  # peers waiting on this rank fail now, not at their timeout
                generation = self._next_generation(store, generation, e, self.timeout_s if lost else OWN_ERROR_GRACE_S)
            finally:
                watcher.stop()

    def _assignment(self, store: dist.TCPStore, slot: int) -> tuple[int, int]:
        while not store.check([f"assign/{slot}"]):
            time.sleep(POLL_S)
        rank, generation = json.loads(store.get(f"assign/{slot}"))
        return int(rank), int(generation)

    def _next_generation(self, store: dist.TCPStore, generation: int, error: Exception, wait_s: float) -> int:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            newest = int(store.get("gen"))
            if newest > generation:
                return newest
            time.sleep(POLL_S)
        raise error

    def _join(self, store: dist.TCPStore, rank: int, world_size: int, generation: int) -> None:
        """Leave the old generation's groups (if any) and join this one's, under a prefix of its own."""
        if dist.is_initialized():
            dist.destroy_process_group()
        prefixed = dist.PrefixStore(f"gen{generation}", store)
        local = int(os.environ.get("LOCAL_RANK", rank))  # the process's slot: a spare brings a device of its own
        init_process_group(rank, world_size, local, None, self.timeout_s, store=prefixed)


class _Watcher:
    """A thread that cuts this rank's connections once the launcher moves the job past `generation`, at a moment
    the training thread waits.

    Why wait for a wait: gloo (torch 2.13) loses a send that is posted on a connection between its shutdown and
    its own loop seeing it: the write fails with EPIPE, the send is queued, and the error that then closes the
    connection wakes pending receives but not queued sends of unbound buffers, so the collective waits out the
    process group's timeout (seen here: a survivor cut while computing, its next tp all-reduce stuck in
    UnboundBuffer::waitSend for minutes while the others had moved on). Cut while the training thread is blocked
    in a wait, its collective is already posted and waiting to receive, which the cut ends at once. A thread that
    does not reach a wait within WAIT_FOR_WAIT_S is cut anyway. The same loss can follow a peer's cut or death (the
    failing write is then the peer's doing), which no timing here avoids: a training thread still in its failed
    generation STUCK_AFTER_CUT_S after the cut ends its process with EXIT_STUCK, and the launcher starts a fresh
    one for the rank (Spares.restart_stuck)."""

    def __init__(self, store: dist.TCPStore, generation: int, store_port: int, rank: int):
        self.store, self.generation, self.port, self.rank = store, generation, store_port, rank
        self.training_thread = threading.get_ident()  # built by the thread that trains
        self._stop = threading.Event()
        self._moved = False
        self._thread = threading.Thread(target=self._watch, name="lmt-in-place", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                moved = int(self.store.get("gen")) > self.generation
            except Exception:  # noqa: BLE001 - the launcher is gone: the process dies with it
                return
            if moved:
                self._moved = True
                self._cut_when_waiting()
                return

    def _cut_when_waiting(self) -> None:
        deadline = time.monotonic() + WAIT_FOR_WAIT_S
        previous = None
        while not self._stop.is_set() and time.monotonic() < deadline:
            here = _blocked_at(self.training_thread)
            if here is not None and here == previous:  # the same wait on two looks in a row
                break
            previous = here
            time.sleep(POLL_S / 4)
        if self._stop.is_set():
            return
        cut_connections(self.port)
        if not self._stop.wait(STUCK_AFTER_CUT_S):
            # The training thread never left the failed generation: a collective the cut did not end (gloo's
            # lost send, when the failing write was a peer's doing) waits out the group's timeout. A fresh
            # process for this rank rejoins in seconds; its copies are in this node's holder.
            print(
                f"lmt: rank {self.rank}: a collective did not end {STUCK_AFTER_CUT_S:.0f} s after the cut; "
                "restarting this rank's process",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_STUCK)

    def moved(self) -> bool:
        return self._moved

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _blocked_at(thread_id: int) -> tuple | None:
    """(code, line) of the thread's innermost frame when that frame is a wait: inside torch.distributed (a
    collective waits for its work there), a line that calls `.wait(` (an asynchronous collective's handle), or
    threading's waits (the copier's condition). None when it computes."""
    frame = sys._current_frames().get(thread_id)
    if frame is None or frame.f_lineno is None:
        return None
    filename = frame.f_code.co_filename
    line = linecache.getline(filename, frame.f_lineno)
    waiting = (
        TORCH_DISTRIBUTED in filename
        or ".wait(" in line
        or (filename.endswith("threading.py") and "wait" in frame.f_code.co_name)
    )
    return (frame.f_code, frame.f_lineno) if waiting else None
