"""The shared multi-rank helper of the tests: run a module-level function on N gloo ranks.

It is `lmt.launch.run_on_ranks` (the same code `lmt train` spawns with), turned into a test failure that shows
the failing rank's traceback.
"""

from __future__ import annotations

from typing import Any, Callable

from large_model_training.launch import RankFailure, run_on_ranks


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    try:
        return run_on_ranks(fn, world_size, args, timeout_s=timeout_s)
    except RankFailure as e:
        raise AssertionError(f"{e}\n--- traceback of rank {e.rank} ---\n{e.traceback}") from None
