"""The shared multi-rank helpers of the tests: run a module-level function on N gloo ranks, or several `lmt train`
runs of one world size on one set of spawned ranks.

`run_ranks` is `lmt.launch.run_on_ranks` (the same code `lmt train` spawns with), turned into a test failure that
shows the failing rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

from large_model_training.launch import RankFailure, run_on_ranks


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    try:
        return run_on_ranks(fn, world_size, args, timeout_s=timeout_s)
    except RankFailure as e:
        raise AssertionError(f"{e}\n--- traceback of rank {e.rank} ---\n{e.traceback}") from None


def world_size(args: list[str]) -> int:
    """tp x pp x dp of an `lmt train` command line (each 1 unless given)."""
    sizes = dict(zip(args, args[1:]))
    return int(sizes.get("--tp", 1)) * int(sizes.get("--pp", 1)) * int(sizes.get("--dp", 1))


def train_together(world: int, runs: dict[str, list[str]]) -> None:
    """`lmt train --out OUT ARGS...` for every OUT: ARGS of `runs`, in order, on one spawn of `world` ranks.

    Spawning ranks (a Python with torch in each) costs more than a short run itself, so the runs share one set of
    ranks: each run is `lmt train` as torchrun starts it (RANK/WORLD_SIZE in the environment, a fresh rendezvous
    store per run, hosted by rank 0 as torchrun's agent would), the path `test_launch` holds to the spawned
    launcher's curve. A run that exits non-zero fails its rank, and so the test.
    """
    if any(world_size(args) != world for args in runs.values()):
        raise ValueError(f"every run must have world size {world}: {runs}")
    with tempfile.TemporaryDirectory(prefix="lmt-runs-") as store_dir:
        run_ranks(_train_each, world, [["train", "--out", out, *args] for out, args in runs.items()], store_dir,
                  timeout_s=600.0)


def _train_each(argvs: list[list[str]], store_dir: str) -> None:
    import torch.distributed as dist

    from large_model_training.cli import main

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()  # every run joins a group of its own, as a torchrun worker does
    ports = dist.FileStore(os.path.join(store_dir, "ports"), world)
    servers = []
    for i, argv in enumerate(argvs):
        if rank == 0:  # the kernel picks the port as the store binds it: nothing to race for
            servers.append(dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False))
            ports.set(f"run{i}", str(servers[-1].port))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=ports.get(f"run{i}").decode(),
                          TORCHELASTIC_USE_AGENT_STORE="True")
        code = main(argv)
        if code != 0:
            raise RuntimeError(f"lmt {' '.join(argv)} exited {code}")
