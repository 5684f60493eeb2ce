"""Start the ranks of a job: spawn them on this machine, or join the ones torchrun started.

`run_on_ranks(fn, n, args)` is the one way a function runs on several processes, for `lmt train` and for
the tests alike: it spawns n processes ('spawn' start method: safe with OpenMP and accelerator runtimes), initialises torch.distributed in each over a file rendezvous (no port to race for),
gives each rank cores/n threads, and returns every rank's result. When one rank fails or dies, the others
are terminated at once and `RankFailure` names the rank and its error; the full traceback is kept.

Under torchrun (RANK, WORLD_SIZE and LOCAL_RANK in the environment) nothing is spawned: `join_torchrun`
initialises this process from the environment, and torchrun's agent tears the job down if a rank dies.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # multiprocessing with torch's tensor sharing

from large_model_training.mesh import backend_for, select_device

DEFAULT_TIMEOUT_S = 300.0


class RankFailure(RuntimeError):
    """A rank raised or died. `rank`, a one-line `summary` and the rank's `traceback` (if it raised)."""

    def __init__(self, rank: int, summary: str, rank_traceback: str = ""):
        super().__init__(f"rank {rank} failed: {summary}")
        self.rank = rank
        self.summary = summary
        self.traceback = rank_traceback


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def threads_per_rank(local_ranks: int) -> int:
    """Cores shared evenly; 1 thread per rank when ranks outnumber cores (oversubscription thrashes)."""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def init_process_group(rank: int, world_size: int, local_rank: int, init_method: str,
                       timeout_s: float) -> torch.device:
    """Pick this rank's device, then initialise the default group with that device's backend."""
    device = select_device(local_rank)
    dist.init_process_group(backend=backend_for(device), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def join_torchrun(timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Initialise this process as one of torchrun's ranks."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(threads_per_rank(local_world))
    return init_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                              int(os.environ["LOCAL_RANK"]), "env://", timeout_s)


def _die_with_parent(parent_pid: int) -> None:
    """If the launching process dies (even by SIGKILL), take this rank down too: no orphaned ranks."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent was already gone before the request took effect
        os._exit(1)


def _rank_entry(rank: int, fn: Callable, args: tuple, world_size: int, workdir: str, timeout_s: float,
                threads: int, parent_pid: int) -> None:
    """Body of one spawned rank: set up, run fn(*args), write the result or the error for the parent.

    The rank leaves with os._exit once its result or error is on disk and its process group is destroyed:
    interpreter finalisation can abort the process ("terminate called without an active exception", about 1
    run in 13 here) when gloo's worker threads still hold tensors as Python tears down (pytorch/pytorch#179291
    describes it), which would turn a finished rank into one "killed by SIGABRT". Nothing is left to finalise:
    fn has returned and the streams are flushed.
    """
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    exit_code = 0
    try:
        init_process_group(rank, world_size, rank, f"file://{os.path.join(workdir, 'rendezvous')}", timeout_s)
        result = fn(*args)
        with open(os.path.join(workdir, f"result_{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException as e:  # noqa: BLE001 - any failure must reach the parent with its rank
        summary = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        with open(os.path.join(workdir, f"error_{rank}.pkl"), "wb") as f:
            pickle.dump((summary, traceback.format_exc()), f)
        exit_code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(exit_code)


PEER_LOST = ("Connection closed by peer", "Connection reset", "Broken pipe", "remote worker", "NCCL communicator was aborted")


def _recorded_errors(workdir: str, world_size: int) -> dict[int, tuple[str, str]]:
    recorded = {}
    for rank in range(world_size):
        path = os.path.join(workdir, f"error_{rank}.pkl")
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    recorded[rank] = pickle.load(f)
            except (EOFError, pickle.UnpicklingError):  # being written right now
                continue
    return recorded


def _culprit(workdir: str, exitcodes: dict[int, int], world_size: int) -> RankFailure:
    """The rank that failed first, judged from every rank's recorded error and the exit codes seen so far.

    A peer's failure shows up on the survivors as a connection error, and a survivor may exit before the
    culprit has finished dying; so a rank's own error beats a death by signal, which beats a 'peer lost' error,
    and when only 'peer lost' errors are in, the culprit gets a moment to record its own.
    """
    for attempt in range(2):
        recorded = _recorded_errors(workdir, world_size)
        for rank, (summary, tb) in sorted(recorded.items()):
            if not any(s in summary for s in PEER_LOST):
                return RankFailure(rank, summary, tb)
        for rank, code in sorted(exitcodes.items()):
            if code < 0:
                return RankFailure(rank, f"process killed by {signal.Signals(-code).name}")
        if attempt == 0:
            time.sleep(2.0)
    rank = min(recorded) if recorded else min(exitcodes)
    summary, tb = recorded.get(rank, (f"process exited with code {exitcodes.get(rank)}", ""))
    return RankFailure(rank, summary, tb)


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run fn(*args) on world_size new local ranks with torch.distributed initialised; return their results.

    fn must be importable by name (a module-level function). Raises RankFailure naming the failed rank; the
    other ranks are terminated at once, so a failure never leaves the job hanging or orphans behind.
    """
    workdir = tempfile.mkdtemp(prefix="lmt-ranks-")
    threads = threads_per_rank(world_size)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(rank, fn, args, world_size, workdir, timeout_s, threads,
                                                   os.getpid()),
                         name=f"lmt-rank-{rank}") for rank in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        running = {proc.sentinel: proc for proc in procs}
        while running:
            for sentinel in multiprocessing.connection.wait(list(running)):
                running.pop(sentinel)
            exited = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode is not None}
            if any(code != 0 for code in exited.values()):
                raise _culprit(workdir, exited, world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(workdir, ignore_errors=True)


def run_in_process(fn: Callable[..., Any], args: tuple = (), *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Run fn(*args) as a world of one in this process (no spawn cost; the terminal stays attached)."""
    workdir = tempfile.mkdtemp(prefix="lmt-rank-")
    try:
        init_process_group(0, 1, 0, f"file://{os.path.join(workdir, 'rendezvous')}", timeout_s)
        return fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(workdir, ignore_errors=True)
