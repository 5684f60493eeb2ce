"""The shared multi-rank helpers of the tests: run a module-level function on N gloo ranks (`run_ranks`), or
several `lmt train` command lines of one world size (`train_together`).

Starting a rank (a Python that imports torch) costs more than most of what the tests then run on it, so the ranks
of each world size are started once per session and kept: a pool of N processes that run one job after another,
each job on a process group of its own. The ranks are forked by a fork server that imported torch and the package
once (nothing ran in it: no threads, no OpenMP pool for a child to inherit), so a pool of 8 starts in well under a
second, not the ~2 s a rank takes to import torch on a loaded 2-core machine. Each job carries the test process's
environment as it is then, as if the ranks had just been spawned. The pool plays torchrun's part: this process
hosts each job's rendezvous store, and every rank joins it as a torchrun worker does (`launch.join_torchrun`, the
path `lmt train` takes under torchrun; `test_launch` holds it to the spawned launcher's curve and checks the
launcher itself). A job that fails on any rank fails the test with that rank's traceback and ends the pool; the
next job starts a new one.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing.connection
import os
import pickle
import select
import signal
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# What the fork server imports before it forks ranks: what `lmt train` imports on a rank, lazy imports included
# (torch._dynamo, by the optimizer: ~1 s of CPU). A rank imports anything else itself.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "large_model_training.cli",
    "large_model_training.train.trainer",
    "large_model_training.reliability.watch",
    "matplotlib.pyplot",
    "matplotlib.backends.backend_agg",
    "torch.utils.tensorboard",
    "tomli_w",
    "pytest",
    "tests.dist",
]
# Ranks kept alive at once (~0.4 GB each): every pool the suite uses (2 + 3 + 4 + 8 ranks) where half the memory
# holds them; past that the least recently used pool is closed.
MAX_POOLED_RANKS = min(17, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 // (400 * 1024**2))
PEER_LOST = ("Connection closed by peer", "Connection reset", "Broken pipe", "remote worker")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """fn(*args) on world_size ranks, torch.distributed initialised on each (gloo); every rank's result in order."""
    return _pool(world_size).run(_Call(fn, args, timeout_s))


def world_size(args: list[str]) -> int:
    """tp x cp x pp x dp of an `lmt train` command line (each 1 unless given)."""
    sizes = dict(zip(args, args[1:]))
    return int(sizes.get("--tp", 1)) * int(sizes.get("--cp", 1)) * int(sizes.get("--pp", 1)) * int(sizes.get("--dp", 1))


def train_together(world: int, runs: dict[str, list[str]]) -> None:
    """`lmt train --out OUT ARGS...` for every OUT: ARGS of `runs`, in order, on the pooled ranks of `world`:
    each run is `lmt train` as torchrun starts it. A run that exits non-zero fails the test."""
    if any(world_size(args) != world for args in runs.values()):
        raise ValueError(f"every run must have world size {world}: {runs}")
    for out, args in runs.items():
        _pool(world).run(_Train(["train", "--out", out, *args]))


def start_process(fn: Callable[..., Any], *args: Any) -> mp.Process:
    """fn(*args) in a new process (stdout and stderr to /dev/null), forked by the ranks' fork server: torch and
    the package already imported, so it starts at once. For a test that kills a process mid-way; it dies with
    the test process, and is daemonic (it cannot start processes itself). Exit code 0 if fn returns, 1 if it
    raises."""
    proc = _forkserver().Process(target=_process_entry, args=(fn, args, dict(os.environ), os.getpid()), daemon=True)
    proc.start()
    return proc


def _forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the fork server starts (the first process of the session)
    return ctx


class _Call:
    """A job: fn(*args) inside a process group of the job's own."""

    def __init__(self, fn: Callable[..., Any], args: tuple, timeout_s: float):
        self.fn, self.args, self.timeout_s = fn, args, timeout_s

    def __call__(self) -> Any:
        import torch.distributed as dist

        from large_model_training.launch import join_torchrun

        join_torchrun(self.timeout_s)
        try:
            return self.fn(*self.args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class _Train:
    """A job: `lmt <argv>` on every rank (it joins and leaves its process group itself, as under torchrun)."""

    def __init__(self, argv: list[str]):
        self.argv = argv

    def __call__(self) -> None:
        from large_model_training.cli import main

        code = main(self.argv)
        if code != 0:
            raise RuntimeError(f"lmt {' '.join(self.argv)} exited {code}")


class _Pool:
    def __init__(self, world: int):
        ctx = _forkserver()
        self.world, self.conns, self.procs = world, [], []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_loop, args=(rank, world, theirs, os.getpid()), daemon=True, name=f"test-rank-{rank}"
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, job) -> list[Any]:
        """Run job() on every rank; the results in rank order. Any rank's failure ends the pool."""
        import torch.distributed as dist

        # The job's rendezvous store, hosted here as torchrun's agent hosts it; the kernel picks a free port.
        store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False)
        try:
            message = pickle.dumps((job, store.port, dict(os.environ)))  # the environment the test sees now
            for conn in self.conns:
                conn.send_bytes(message)
            results: list[Any] = [None] * self.world
            waiting = dict(enumerate(self.conns))
            while waiting:
                for conn in multiprocessing.connection.wait(list(waiting.values())):
                    rank = self.conns.index(conn)
                    try:
                        status, payload = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        status, payload = "error", (self._death(rank), "")
                    if status == "error":
                        raise self._failure(rank, *payload)
                    results[rank] = payload
                    del waiting[rank]
            return results
        except BaseException:
            self.close()
            raise

    def _death(self, rank: int) -> str:
        self.procs[rank].join(timeout=5)
        code = self.procs[rank].exitcode
        return f"process killed by {signal.Signals(-code).name}" if code and code < 0 else f"process exited ({code})"

    def _failure(self, rank: int, summary: str, rank_traceback: str) -> AssertionError:
        """The culprit: a peer's failure shows on the survivors as a lost connection, so a rank's own error wins."""
        if any(s in summary for s in PEER_LOST):
            for other, conn in enumerate(self.conns):
                if other != rank and conn.poll(5.0):
                    try:
                        status, payload = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        continue
                    if status == "error" and not any(s in payload[0] for s in PEER_LOST):
                        rank, (summary, rank_traceback) = other, payload
                        break
        return AssertionError(f"rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{rank_traceback}")

    def close(self) -> None:
        if _POOLS.get(self.world) is self:
            del _POOLS[self.world]
        for conn in self.conns:
            conn.close()  # a rank waiting for its next job reads the end and exits
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


_POOLS: OrderedDict[int, _Pool] = OrderedDict()


def _pool(world: int) -> _Pool:
    if world in _POOLS:
        _POOLS.move_to_end(world)
        return _POOLS[world]
    while _POOLS and sum(_POOLS) + world > MAX_POOLED_RANKS:
        next(iter(_POOLS.values())).close()
    _POOLS[world] = _Pool(world)
    return _POOLS[world]


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


def _die_with(test_pid: int) -> None:
    """SIGKILL this rank when the test process ends, even if it is killed (the rank's parent is the fork server,
    so PR_SET_PDEATHSIG alone would wait for that; it is set too, for the fork server's own death)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    try:
        handle = os.pidfd_open(test_pid)  # readable once the process has exited (already, if it has)
    except (AttributeError, OSError):
        handle = None

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:  # no pidfd (not Linux): look once a second
            while _alive(test_pid):
                threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-the-test", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _process_entry(fn: Callable[..., Any], args: tuple, environment: dict[str, str], test_pid: int) -> None:
    _die_with(test_pid)
    os.environ.clear()
    os.environ.update(environment)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - the exit code tells
        os._exit(1)
    os._exit(0)


def _rank_loop(rank: int, world: int, conn, test_pid: int) -> None:
    """Body of a pooled rank: the environment torchrun gives its workers, then one job after another."""
    _die_with(test_pid)
    torchrun = dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    while True:
        try:
            job, port, environment = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        os.environ.clear()
        os.environ.update(environment, **torchrun, MASTER_PORT=str(port))
        try:
            reply = ("ok", job())
        except BaseException as e:  # noqa: BLE001 - any failure must reach the test with its rank
            summary = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
            reply = ("error", (summary, traceback.format_exc()))
        try:
            conn.send_bytes(pickle.dumps(reply))
        except (BrokenPipeError, OSError):
            break
        if reply[0] == "error":
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalisation with gloo threads around (see launch._rank_entry)
