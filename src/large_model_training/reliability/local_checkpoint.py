"""In-memory checkpoints replicated to a partner rank (`--save-local-every N`), and restoring from them.

Every N steps each rank snapshots what it alone holds (its model shard, its optimizer state, its RNG and loader
position, compression residuals) into host memory, and a side thread writes that copy into its node's holder and
sends a second copy to its partner: the rank `ranks_per_node` further on the ring, i.e. on the next node, over a
stream of their own (copy_ring.py: not gloo, whose per-message cost was the copies' whole overhead). The
partner's receiving thread files it in its own node's holder.

Where the copies live: a holder is a folder in /dev/shm (tmpfs: host memory, no disk), one per node, named after
the run folder. Memory of the rank process itself would die with it, and today a failure restarts every rank's
process (`--max-restarts`, torchrun); tmpfs outlives the process, as NVIDIA's resiliency extension keeps its
local checkpoints in node-local storage. A lost node takes its holder with it: its ranks' shards then come
from the partner's holder, sent over the network by the partner rank. When both copies of a shard are gone the
durable DCP checkpoint is the fallback (one line says so).

Why torch.distributed and not torchft: torchft 0.2.0 (on the index, requires torch >= 2.7) heals a replica from
a live peer in the replicated-dp case only, through its own Manager that must own the dp all-reduce and the
quorum of every step; our engine reduces over its own flat buffers and groups (and shards over tp, pp, ZeRO),
so a torchft replica would not see a tp x pp shard as a unit to heal. A copy per rank, replicated on a ring, fits
every layout.

Last gasp: on SIGTERM (the launcher stopping a rank) the copy in flight is finished before the process exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from large_model_training.reliability import flat_state
from large_model_training.reliability.copy_ring import CopyRing
from large_model_training.reliability.mapped_file import MappedFile

KEEP = 3  # steps kept per holder: the newest may be half written when a rank dies, the one before is complete
LAST_GASP_S = 10.0  # how long a SIGTERMed rank waits for its copy in flight


def holder_root(run_dir: str) -> str:
    """The folder under which this run's per-node holders live (host memory where /dev/shm exists)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    key = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return os.path.join(base, f"lmt-local-{key}")


def node_holder(run_dir: str, node: int) -> str:
    return os.path.join(holder_root(run_dir), f"node_{node}")


def _copy_path(holder: str, step: int, rank: int) -> str:
    return os.path.join(holder, f"step_{step}", f"rank_{rank}.pt")


def _write_atomically(path: str, payload: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)  # a copy whose name is visible is whole


def read_copy(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return flat_state.parse(f.read())


def held_copies(holder: str) -> dict[int, list[int]]:
    """{step: [ranks whose complete copy this holder has]}."""
    held: dict[int, list[int]] = {}
    if not os.path.isdir(holder):
        return held
    for name in os.listdir(holder):
        if name.startswith("step_"):
            files = os.listdir(os.path.join(holder, name))
            held[int(name[5:])] = sorted(int(f[5:-3]) for f in files if f.startswith("rank_") and f.endswith(".pt"))
    return held


class LocalCheckpoints:
    """This rank's side of the replicated in-memory checkpoints. Built collectively (it creates a gloo group)."""

    def __init__(self, run_dir: str, every: int, ranks_per_node: int = 1, timeout_s: float = 300.0):
        self.run_dir, self.every = run_dir, every
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.per_node = max(1, min(ranks_per_node, self.world))
        nodes = max(1, self.world // self.per_node)
        self.node = self.rank // self.per_node
        # one node: no other node to replicate to
        self.partner = (self.rank + self.per_node) % self.world if nodes > 1 else None
        self.source = (self.rank - self.per_node) % self.world if nodes > 1 else None
        self.holder = node_holder(run_dir, self.node)
        self.group = dist.new_group(backend="gloo")
        # This process's files in the holder, by the rank whose copies they hold (its own, its source's): the
        # ones holding a step's copy, and one that fell out of the KEEP newest, written next (mapped_file.py).
        # Names in the free folder carry the pid: a restarted process's never meet an earlier one's.
        self._held: dict[int, dict[int, MappedFile | None]] = {}
        self._free: dict[int, list[MappedFile]] = {}
        self._names = itertools.count()
        self._snapshot = flat_state.Snapshot()  # taken into the own copy's file
        self._writing: MappedFile | None = None  # the file the snapshot in flight was taken into
        self._receiving: MappedFile | None = None  # the file the source's copy is being received into
        self.ring = (
            CopyRing(self.group, self.partner, self.source, self._receive_into, self._received, timeout_s)
            if self.partner is not None and self.source is not None
            else None
        )
        # One copier thread for the run, handed each step under a condition: starting a thread per snapshot cost
        # the training thread 1.5-2 ms a step here (the new thread takes the interpreter lock at once).
        self._ready = threading.Condition()
        self._pending: int | None = None  # the step handed to the copier and not copied yet
        self._copier: threading.Thread | None = None
        self._closing = False
        self._error: BaseException | None = None
        self.copy_s = 0.0  # side-thread seconds of the last copy (metrics: local_copy_s)
        self._previous_handler = None
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._last_gasp)

    def partner_of(self, rank: int) -> int:
        return (rank + self.per_node) % self.world

    def clear(self) -> None:
        """A fresh run: copies an earlier run in the same folder left are not ours to restore."""
        self._close_files()
        if self.rank % self.per_node == 0:
            shutil.rmtree(self.holder, ignore_errors=True)
        dist.barrier(group=self.group)

    def forget_node(self) -> None:
        """This rank took over a lost rank's coordinates on another machine: that node's holder is not its to read."""
        self._close_files()
        shutil.rmtree(self.holder, ignore_errors=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot `state` (this rank's, copied now into host memory) and copy it out from a side thread."""
        self.wait()
        self._writing = self._free_file(self.rank)
        self._snapshot.take(state, self._writing.tensor)
        with self._ready:
            self._pending = step
            self._ready.notify_all()
        if self._copier is None:
            self._copier = threading.Thread(target=self._copy_each, name="lmt-local-copy", daemon=True)
            self._copier.start()

    def _copy_each(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._pending is not None or self._closing)
                step = self._pending
            if step is None:
                return
            self._copy(step)
            with self._ready:
                self._pending = None
                self._ready.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Finish the copy in flight; a failed copy is raised here, in the training thread."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._pending is None, timeout):
                return
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"in-memory checkpoint copy failed: {error}") from error

    def _copy(self, step: int) -> None:
        """Own copy whole in its file (the snapshot's payload is there already), the same bytes to the partner,
        then until the source's copy of this step is filed too (a copy in flight, once waited for, is whole at
        both ends)."""
        started = time.perf_counter()
        try:
            tail = flat_state.tail(self._snapshot.header())
            assert self._writing is not None
            self._writing.finish(self._snapshot.used, tail)
            self._file(step, self.rank, self._writing)
            if self.ring is not None:
                self.ring.send(step, [self._snapshot.payload().numpy(), *tail])
                self.ring.wait_for(step)
        except BaseException as e:  # noqa: BLE001 - reported by wait() in the training thread
            self._error = e
        self.copy_s = time.perf_counter() - started

    def _receive_into(self, step: int, nbytes: int) -> memoryview:
        assert self.source is not None
        self._receiving = self._free_file(self.source)
        return self._receiving.view(nbytes)

    def _received(self, step: int, nbytes: int) -> None:
        assert self.source is not None and self._receiving is not None
        self._receiving.finish(nbytes, [])
        self._file(step, self.source, self._receiving)

    def _free_file(self, rank: int) -> MappedFile:
        free = self._free.setdefault(rank, [])
        if free:
            return free.pop()
        return MappedFile(self._free_name(rank))

    def _free_name(self, rank: int) -> str:
        return os.path.join(self.holder, "free", f"rank_{rank}.{os.getpid()}.{next(self._names)}")

    def _file(self, step: int, rank: int, copy: MappedFile) -> None:
        """`rank`'s copy of `step`, whole in `copy`, renamed into its step's folder; the oldest past KEEP leaves."""
        copy.move(_copy_path(self.holder, step, rank))
        if rank not in self._held:  # copies of this rank an earlier process left here retire first
            self._held[rank] = {s: None for s, ranks in held_copies(self.holder).items() if rank in ranks}
        held = self._held[rank]
        held[step] = copy
        for old in sorted(held)[:-KEEP]:
            path, retired = _copy_path(self.holder, old, rank), held.pop(old)
            if retired is not None and not self._free.get(rank):  # this process's: written again next time
                retired.move(self._free_name(rank))
                self._free.setdefault(rank, []).append(retired)
            else:  # a copy an earlier process left, or a file more than the one kept
                if retired is not None:
                    retired.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            with contextlib.suppress(OSError):  # empty once every rank's copy there has left: the folder goes
                os.rmdir(os.path.dirname(path))

    def _close_files(self) -> None:
        for copy in [*(f for held in self._held.values() for f in held.values()), *sum(self._free.values(), [])]:
            if copy is not None:
                copy.close()
        self._held, self._free = {}, {}

    def _last_gasp(self, signum, frame) -> None:
        """SIGTERM: let the copy in flight complete (bounded), then leave as a terminated process would."""
        with contextlib.suppress(Exception):  # a failed copy: nothing more to finish
            self.wait(LAST_GASP_S)  # (the condition's lock is reentrant: the training thread may hold it here)
        os._exit(128 + signum)

    def close(self, finished: bool = False) -> None:
        """`finished`: the run reached its last step (its durable checkpoint written): the copies are let go."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        self.wait()
        if self._copier is not None:
            with self._ready:
                self._closing = True
                self._ready.notify_all()
            self._copier.join()
            self._copier = None
        if self.ring is not None:  # every copy handed out was received at both ends (wait): nothing in flight
            self.ring.close()
            self.ring = None
        self._close_files()
        if finished:
            dist.barrier(group=self.group)  # the node's other ranks have filed their last copies here
        if finished and self.rank % self.per_node == 0:
            shutil.rmtree(self.holder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.holder))  # the last node's holder gone: the run's folder too

    def newest_complete(self) -> tuple[int | None, list[int]]:
        """Collective: the newest step every rank's shard is held for somewhere (own or partner's holder), and
        the ranks none of whose copies survive, of any step (the shards whose both copies were lost)."""
        mine = held_copies(self.holder) if self.rank % self.per_node == 0 else {}
        everyone: list[dict[int, list[int]]] = [{} for _ in range(self.world)]
        dist.all_gather_object(everyone, mine, group=self.group)
        covered: dict[int, set[int]] = {}
        for held in everyone:
            for step, ranks in held.items():
                covered.setdefault(step, set()).update(ranks)
        complete = [s for s, ranks in covered.items() if len(ranks) == self.world]
        lost = sorted(set(range(self.world)) - set().union(*covered.values())) if covered else []
        return (max(complete) if complete else None), lost

    def load(self, step: int) -> tuple[dict[str, Any], str]:
        """Collective: this rank's copy of `step`, from its own holder or sent by the partner that holds it.
        Returns the state and where it came from ('own' or 'partner rank P')."""
        present = torch.tensor(
            [int(os.path.exists(_copy_path(self.holder, step, r))) for r in range(self.world)], dtype=torch.int64
        )
        everyone = [torch.zeros_like(present) for _ in range(self.world)]
        dist.all_gather(everyone, present, group=self.group)  # everyone[h][r]: holder of rank h has rank r's copy
        own = lambda r: bool(everyone[(r // self.per_node) * self.per_node][r])  # noqa: E731
        payload, source = None, "own"
        for r in range(self.world):
            if own(r):
                continue
            holder = self.partner_of(r)
            holder = (holder // self.per_node) * self.per_node  # the rank that reads that node's holder
            if self.rank == holder:
                with open(_copy_path(self.holder, step, r), "rb") as f:
                    data = f.read()
                dist.send(torch.tensor([len(data)], dtype=torch.int64), r, group=self.group)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), r, group=self.group)
            elif self.rank == r:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, holder, group=self.group)
                data_t = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(data_t, holder, group=self.group)
                payload, source = data_t.numpy().tobytes(), f"partner rank {holder}"
                _write_atomically(_copy_path(self.holder, step, r), payload)  # own copy again
        if payload is None:
            with open(_copy_path(self.holder, step, self.rank), "rb") as f:
                payload = f.read()
        return flat_state.parse(payload), source
