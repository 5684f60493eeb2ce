"""In-memory checkpoints replicated to a partner rank (`--save-local-every N`), and restoring from them.

Every N steps each rank snapshots what it alone holds (its model shard, its optimizer state, its RNG and loader
position, compression residuals) into host memory, and a side thread (over a gloo group of its own, so its
traffic never interleaves with training's collectives) writes that copy into its node's holder and sends a
second copy to its partner: the rank `ranks_per_node` further on the ring, i.e. on the next node. The partner's
side thread files it in its own node's holder.

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


def _write_copy(path: str, header: bytes, payload: torch.Tensor) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    flat_state.write(path + ".tmp", header, payload)
    os.replace(path + ".tmp", path)


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

    def __init__(self, run_dir: str, every: int, ranks_per_node: int = 1):
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
        self._snapshot = flat_state.Snapshot()  # one host buffer, reused: the next snapshot waits for this copy
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
        if self.rank % self.per_node == 0:
            shutil.rmtree(self.holder, ignore_errors=True)
        dist.barrier(group=self.group)

    def forget_node(self) -> None:
        """This rank took over a lost rank's coordinates on another machine: that node's holder is not its to read."""
        shutil.rmtree(self.holder, ignore_errors=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot `state` (this rank's, copied now into host memory) and copy it out from a side thread."""
        self.wait()
        self._snapshot.take(state)
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
        started = time.perf_counter()
        try:
            header, payload = self._snapshot.header(), self._snapshot.payload()
            _write_copy(_copy_path(self.holder, step, self.rank), header, payload)
            if self.partner is not None:  # sizes, then the header, then the payload, each way round the ring
                sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64)
                theirs = torch.zeros(2, dtype=torch.int64)
                self._exchange(sizes, theirs)
                their_header = torch.empty(int(theirs[0]), dtype=torch.uint8)
                header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)  # alive until sent
                self._exchange(header_t, their_header)
                their_payload = torch.empty(int(theirs[1]), dtype=torch.uint8)
                self._exchange(payload, their_payload)
                path = _copy_path(self.holder, step, self.source)
                _write_copy(path, their_header.numpy().tobytes(), their_payload)
            self._prune()
        except BaseException as e:  # noqa: BLE001 - reported by wait() in the training thread
            self._error = e
        self.copy_s = time.perf_counter() - started

    def _exchange(self, mine: torch.Tensor, theirs: torch.Tensor) -> None:
        """Send to the partner while receiving from the source (every rank does both: a ring)."""
        send = dist.isend(mine, self.partner, group=self.group)
        dist.recv(theirs, self.source, group=self.group)
        send.wait()

    def _prune(self) -> None:
        steps = sorted(int(name[5:]) for name in os.listdir(self.holder) if name.startswith("step_"))
        for old in steps[:-KEEP]:
            shutil.rmtree(os.path.join(self.holder, f"step_{old}"), ignore_errors=True)

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
        if finished and self.rank % self.per_node == 0:  # the writes into this holder were this rank's own
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
