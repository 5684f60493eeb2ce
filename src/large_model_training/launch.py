"""Start the ranks of a job: spawn them on this machine, or join the ones torchrun started.

`run_on_ranks(fn, n, args)` is the one way a function runs on several processes, for `lmt train` and for
the tests alike: it spawns n processes ('spawn' start method: safe with OpenMP and accelerator runtimes), initialises
torch.distributed in each over a file rendezvous (no port to race for), gives each rank cores/n threads, and returns
every rank's result. When one rank fails or dies, the others are terminated at once and `RankFailure` names the rank and
its error; the full traceback is kept.

Under torchrun (RANK, WORLD_SIZE and LOCAL_RANK in the environment) nothing is spawned: `join_torchrun`
initialises this process from the environment (through a store prefix of this attempt's own where torchrun's agents
share their store across restarts), and torchrun's agent tears the job down if a rank dies.
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

from large_model_training.mesh import backend_for, bound_device, select_device

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
    """Cores shared evenly; 1 thread per rank when ranks outnumber cores (oversubscription thrashes). The cores
    are those this process may run on (taskset, a container's cpuset), not all the machine has."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def init_process_group(
    rank: int,
    world_size: int,
    local_rank: int,
    init_method: str | None,
    timeout_s: float,
    store: dist.Store | None = None,
) -> torch.device:
    """Pick this rank's device, then initialise the default group with that device's backend."""
    device = select_device(local_rank)
    dist.init_process_group(
        backend=backend_for(device),
        init_method=None if store else init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=bound_device(device),
    )
    return device


def join_torchrun(timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Initialise this process as one of torchrun's ranks."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(threads_per_rank(local_world))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agents' store, kept across restarts
    store = _attempt_store(rank, world_size, timeout_s) if shared else None
    return init_process_group(rank, world_size, int(os.environ["LOCAL_RANK"]), "env://", timeout_s, store)


def _attempt_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The agents' shared store (MASTER_ADDR:MASTER_PORT), seen through a prefix that only this attempt uses.

    Under torchrun's c10d rendezvous the agents share one TCPStore with every round of workers, so a restarted
    worker reads the keys the previous round left (gloo then dials dead ranks' addresses: "Connection refused";
    pytorch/pytorch#135712). TORCHELASTIC_RESTART_COUNT cannot name the round: each agent counts its own
    restarts, and an agent that restarts because another node rejoined does not count it. So the ranks agree on
    a fresh prefix themselves. All ranks of earlier rounds are dead by now, so a key whose name holds a token made
    up now cannot be stale: each rank r > 0 posts a new random token under `hello/r`; rank 0 answers every token
    it sees there with its own new prefix under `welcome/<token>` (answering a dead rank's leftover token too,
    harmlessly) until all world_size - 1 ranks have taken it.
    """
    import uuid

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    join = dist.PrefixStore("lmt/join", store)
    if rank > 0:
        token = uuid.uuid4().hex
        join.set(f"hello/{rank}", token)
        prefix = join.get(f"welcome/{token}").decode()  # waits up to the store's timeout
        join.add(f"{prefix}/joined", 1)
    else:
        prefix = f"lmt/{uuid.uuid4().hex}"
        hellos = [f"hello/{r}" for r in range(1, world_size)]
        answered: set[bytes] = set()
        deadline = time.monotonic() + timeout_s
        if hellos:
            join.wait(hellos, timeout)
        while join.add(f"{prefix}/joined", 0) < world_size - 1:
            for token in set(join.multi_get(hellos)) - answered:
                join.set(f"welcome/{token.decode()}", prefix)
                answered.add(token)
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun ranks did not all join within {timeout_s:.0f} s")
            time.sleep(0.01)
    return dist.PrefixStore(prefix, store)


def _die_with_parent(parent_pid: int) -> None:
    """If the launching process dies (even by SIGKILL), take this rank down too: no orphaned ranks."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent was already gone before the request took effect
        os._exit(1)


def _rank_entry(
    rank: int,
    fn: Callable,
    args: tuple,
    world_size: int,
    workdir: str,
    timeout_s: float,
    threads: int,
    parent_pid: int,
    spares=None,
) -> None:
    """Body of one spawned rank: set up, run fn(*args), write the result or the error for the parent.

    The rank leaves with os._exit once its result or error is on disk and its process group is destroyed:
    interpreter finalisation can abort the process ("terminate called without an active exception", about 1
    run in 13 here) when gloo's worker threads still hold tensors as Python tears down (pytorch/pytorch#179291
    describes it), which would turn a finished rank into one "killed by SIGABRT". Nothing is left to finalise:
    fn has returned and the streams are flushed.
    """
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    exit_code = 0
    where = {"rank": rank}  # under --spares, a spare's slot becomes the rank it replaces
    try:
        if spares is not None:  # the process groups, and their rebuilds, are the spares' (reliability/in_place.py)
            result = spares.run(rank, fn, args, world_size, where)
        else:
            init_process_group(rank, world_size, rank, f"file://{os.path.join(workdir, 'rendezvous')}", timeout_s)
            result = fn(*args)
        rank = where["rank"]
        with open(os.path.join(workdir, f"result_{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - any failure must reach the parent with its rank
        summary = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        with open(os.path.join(workdir, f"error_{where['rank']}.pkl"), "wb") as f:
            pickle.dump((summary, traceback.format_exc()), f)
        exit_code = 1  # no destroy_process_group here: with a stalled peer it can wait as long as a collective
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(exit_code)


EXIT_STUCK = 75
"""A survivor's exit code under --spares when a collective outlived the recovery's connection cut
(reliability/in_place._Watcher): the launcher starts a fresh process for the same rank, no spare used."""

# What a rank reports when another rank failed or stalled: such a rank is a victim, never named the cause.
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset",
    "Broken pipe",
    "remote worker",
    "NCCL communicator was aborted",
    "Timed out waiting",
    "timed out",
    "Timeout",
    "watchdog",
)


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


def _culprit(workdir: str, exitcodes: dict[int, int], world_size: int, monitor=None) -> RankFailure:
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
        stalled = monitor.blame() if monitor is not None else None
        if stalled is not None:  # the survivors timed out waiting: the heartbeats say on whom
            return stalled
        if attempt == 0:
            time.sleep(2.0)
    rank = min(recorded) if recorded else min(exitcodes)
    summary, tb = recorded.get(rank, (f"process exited with code {exitcodes.get(rank)}", ""))
    return RankFailure(rank, summary, tb)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    monitor=None,
    grace_s: float = 5.0,
    spares=None,
) -> list[Any]:
    """Run fn(*args) on world_size new local ranks with torch.distributed initialised; return their results.

    fn must be importable by name (a module-level function). Raises RankFailure naming the failed rank; the
    other ranks are terminated at once, so a failure never leaves the job hanging or orphans behind.
    `monitor` (optional; `reliability.watch.BoardWatcher`) is polled every second: `check()` returns a
    RankFailure once the job has stalled, `blame()` names the cause when survivors failed only by timing out.
    `spares` (optional; `reliability.in_place.Spares`): its count of idle spare processes start beside the ranks,
    and a rank killed by a signal is replaced in place (by an idle spare, else by a process started then) while the
    other ranks keep their processes, up to that count of replacements; other failures end the job as above.
    Ranks get SIGTERM, and SIGKILL after `grace_s` (a stopped process does not answer SIGTERM).
    """
    workdir = tempfile.mkdtemp(prefix="lmt-ranks-")
    threads = threads_per_rank(world_size)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []  # by slot: the ranks first, then spares and replacements

    def start(slot: int) -> None:
        entry = (slot, fn, args, world_size, workdir, timeout_s, threads, os.getpid(), spares)
        procs.append(ctx.Process(target=_rank_entry, args=entry, name=f"lmt-rank-{slot}"))
        procs[-1].start()

    rank_of = {slot: slot for slot in range(world_size)}  # the slots holding a rank now
    # Under --spares every waiting rank waits on the verdict: a killed rank's sentinel does not always wake the wait
    # (seen here in about half of the kills: its pipe stays open past the death, the reason not pinned down), so
    # the exit codes are also polled every 50 ms rather than every second (a waitpid per process each time).
    poll_s = 0.05 if spares is not None else 1.0
    try:
        if spares is not None:
            spares.start(world_size)
        for slot in range(world_size + (spares.count if spares is not None else 0)):
            start(slot)
        while True:
            # One snapshot of the exit codes per pass: a rank that exits between a failure check and the loop's end
            # test would otherwise end the loop unchecked (seen in CI: its result file then is missing).
            codes = [p.exitcode for p in procs]
            failed = [s for s, code in enumerate(codes) if code not in (None, 0)]
            for slot in failed:  # idle spares first: a dead one is never handed a rank
                if slot not in rank_of and spares is not None:
                    spares.spare_died(slot, codes[slot])
            for slot in (s for s in failed if s in rank_of):
                code = codes[slot]
                stuck = spares is not None and code == EXIT_STUCK and spares.can_restart_stuck(world_size)
                if not stuck and (spares is None or code >= 0 or not spares.can_replace()):
                    exited = {rank_of[s]: codes[s] for s in rank_of if codes[s] is not None}
                    raise _culprit(workdir, exited, world_size, monitor)
                assert spares is not None
                rank = rank_of.pop(slot)
                # a stuck survivor gets a fresh process (no spare used); a killed rank an idle spare, else a fresh one
                replacement = spares.idle[0] if spares.idle and not stuck else len(procs)
                if replacement == len(procs):
                    start(replacement)
                    codes.append(None)
                rank_of[replacement] = rank
                if stuck:
                    spares.restart_stuck(replacement, rank)
                else:
                    why = f"rank {rank} failed: process killed by {signal.Signals(-code).name}"
                    spares.replace(replacement, rank, why)
            if all(codes[slot] is not None for slot in rank_of):
                break
            stalled = monitor.check() if monitor is not None else None
            if stalled is not None:
                raise stalled
            live = [p.sentinel for p in procs if p.exitcode is None]
            if live:  # (every process may have ended since the snapshot: then look again at once)
                multiprocessing.connection.wait(live, timeout=poll_s)
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
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
