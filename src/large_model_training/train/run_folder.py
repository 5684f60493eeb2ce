"""The run folder across attempts: what `lmt train` writes before the ranks start, and what a restarted attempt
reads there (which attempt this is, why the previous one ended, where it can resume).

    RUN/config.toml      the resolved config          RUN/.attempt        the current attempt's number
    RUN/metrics.jsonl    one row per step (continued on resume: rows past the checkpoint are dropped)
    RUN/error_rank<r>.log, RUN/stall.log              why an attempt ended (read by the next one)
    RUN/.lock            flock-ed by the one `lmt train` writing the folder; holds its pid and host
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket

from large_model_training.config import to_toml
from large_model_training.errors import ConfigError
from large_model_training.launch import PEER_LOST, RankFailure
from large_model_training.train.checkpoint import read_meta, resolve_checkpoint

ATTEMPT_MARKER = ".attempt"  # rewritten by rank 0 as each attempt starts


LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_folder_lock(run_dir: str):
    """Held by the process that writes the run folder (the launcher, or rank 0 under torchrun) for the run's
    lifetime, so that a second `lmt train` into the same folder stops with one line instead of interleaving
    metrics and checkpoints. An flock, not a pid file: the kernel drops it when its process ends, however it
    ends, so the file a finished or killed run leaves behind blocks no later run (--resume auto included)."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot write the run folder {run_dir}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown pid"
            raise ConfigError(
                f"the run folder {run_dir} is in use by another lmt train ({holder}); wait for it to "
                f"end or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_run_folder(cfg, run_dir: str, attempt: int = 0) -> None:
    """config.toml, metrics.jsonl continued (rows up to the checkpoint resumed from) or started anew (a fresh
    start, --resume auto without a checkpoint included: rows of an attempt that saved nothing are redone), and
    the attempt marker."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if cfg.run.save_local_every:
        pass  # the step resumed from is known on the ranks only (in-memory copies): the trainer truncates
    elif not cfg.run.resume and os.path.exists(metrics):
        os.remove(metrics)  # a new run in an old folder starts a new record, never a mixed one
    elif cfg.run.resume and os.path.exists(metrics):
        # Continuing in place: drop rows of steps after the checkpoint, they are about to be redone.
        step = read_meta(cfg.run.resume)["step"]
        with open(metrics) as f:
            rows = [line for line in f if _step_of(line) <= step]
        with open(metrics, "w") as f:
            f.writelines(rows)
    with open(os.path.join(run_dir, ATTEMPT_MARKER), "w") as f:  # failure logs newer than this: this attempt's
        f.write(f"{attempt}\n")


def _step_of(line: str) -> float:
    """A metrics row's step; a row that is not whole (its writer was killed mid-line) counts as past any step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def restartable(e: Exception) -> bool:
    """A failure a new attempt can get past (a rank that died, raised or stalled); not non-finite losses (they
    would come back from the same checkpoint) nor bad input found on a rank."""
    return isinstance(e, RankFailure) and not getattr(e, "summary", "").startswith(("TrainingError", "ConfigError"))


def write_quietly(path: str, text: str) -> str:
    """Write a log on the way out of a failure: a failure to write it must not hide the failure itself.
    Returns what to tell the user about it ('details in PATH', or why there is no log, e.g. a full disk)."""
    try:  # through a temporary name: a rank killed while writing (torchrun stops the others) leaves no empty log
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError as e:
        return f"no log written: {e.strerror}"
    return f"details in {path}"


def restart_record(cfg, attempt: int, reason: str) -> dict:
    """What the trainer logs with an attempt's first step: which attempt, the step it resumed from, at which
    world size (torchrun may restart with fewer or more nodes), and why."""
    return {
        "attempt": attempt,
        "resumed_from": read_meta(cfg.run.resume)["step"] if cfg.run.resume else 0,
        "world_size": cfg.parallel.world_size,
        "reason": reason,
    }


def previous_attempt(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, ATTEMPT_MARKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


FAILURE_LOG = re.compile(r"^(error_rank\d+|stall)\.log$")
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Failure|Interrupt|Exit)\b.*")


def left_behind(run_dir: str) -> str:
    """Why the previous attempt ended, as far as the run folder tells: the failure logs written since it began
    (newer than its attempt marker), one line each, a rank's own error before a rank that only lost a peer."""
    marker = os.path.join(run_dir, ATTEMPT_MARKER)
    since = os.path.getmtime(marker) if os.path.exists(marker) else 0.0
    seen = {}
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        path = os.path.join(run_dir, name)
        if FAILURE_LOG.match(name) and os.path.getmtime(path) >= since:
            with open(path, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
            if not lines:  # says nothing (written by a rank stopped mid-write, before writes were atomic)
                continue
            errors = [line for line in lines if EXCEPTION_LINE.match(line)]
            seen[name] = (errors or lines)[-1][:300]
    own = [f"{name}: {line}" for name, line in seen.items() if not any(s in line for s in PEER_LOST)]
    if own:
        return "; ".join(own)
    silent = (
        "a rank killed by a signal (SIGKILL, the OOM killer) or lost with its machine leaves none; the "
        "launcher's log has its exit code"
    )
    if seen:
        return f"no rank recorded an error of its own: {silent}. Lost a peer: {', '.join(seen)}"
    return f"the previous attempt left no error in the run folder: {silent}"


def last_checkpoint_note(run_dir: str) -> str:
    try:
        return (
            f"last complete checkpoint: {resolve_checkpoint(run_dir)} (continue with --resume latest --out {run_dir})"
        )
    except ConfigError:
        return "no complete checkpoint yet"
