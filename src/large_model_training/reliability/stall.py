"""From heartbeats to a verdict: which rank stalled the job, or that the ranks are out of step (desync), or
that a collective itself hangs.

`StallMonitor.observe(records, now)` is fed the board every second or so and keeps, with the observer's own
clock (so clock skew between hosts does not matter), when each rank's beat counter and progress signature
(step, phase, position, sequence numbers) last changed. It returns a `RankStall` when

- a rank's beat has not advanced for `window` seconds: its process is stopped or frozen (SIGSTOP, swapped
  out, a hung driver call holding the interpreter): that rank is named; or
- no rank has made progress for `window` seconds. Then the sequence numbers decide. On a group where some
  members have issued more collectives than others, the ones behind are waited on; a rank that is behind
  somewhere and waits nowhere is the cause (it is stuck in its own work: a hung file system, a wedged
  device, an endless loop outside communication). If every rank waits on another, the ranks issued their
  collectives in different orders: a desync, reported with each rank's position. If all counts agree, ranks
  outside communication are the cause; if all are inside the same collective, the collective itself hangs
  (network or backend), and if they are inside different ones at the same count, that is a desync too
  (a rank skipped one).

A victim (a rank waiting on the culprit, which may time out first) is never named as the cause.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from large_model_training.launch import RankFailure


class RankStall(RankFailure):
    """The job stalled. `ranks` are the causes (empty when no single rank is, e.g. a hung collective)."""

    def __init__(self, ranks: list[int], summary: str, kind: str):
        super().__init__(ranks[0] if ranks else -1, summary)
        self.ranks, self.kind = ranks, kind
        self.args = (summary,)

    def __str__(self) -> str:
        return self.summary


def progress_signature(record: dict[str, Any]) -> tuple:
    """What changes while a rank makes progress: step, phase, positions, collective counts."""
    return (
        record.get("step"),
        record.get("phase"),
        record.get("where"),
        record.get("comm"),
        record.get("inner"),
        tuple(sorted(record.get("seqs", {}).items())),
    )


def _describe(record: dict[str, Any]) -> str:
    where = record.get("where") or "?"
    comm = record.get("comm")
    inside = ""
    if comm:
        group = record.get("group") or ""
        seq = record.get("seqs", {}).get(group)
        inside = f"{comm}" + (f" on {group}" if group else "") + (f" #{seq}" if seq is not None else "") + " at "
    return f"step {record.get('step')} {record.get('phase')}, {inside}{where}"


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass
class _Seen:
    beat: int
    beat_since: float
    signature: tuple
    progress_since: float
    record: dict[str, Any] = field(default_factory=dict)


class StallMonitor:
    """Keeps what it saw of every rank's heartbeat; `observe` returns a RankStall once the job is stalled."""

    def __init__(self, world_size: int, window: float, interval: float):
        self.world_size, self.window, self.interval = world_size, window, interval
        self.seen: dict[int, _Seen] = {}
        self.started: float | None = None

    def observe(self, records: dict[int, dict[str, Any]], now: float) -> RankStall | None:
        if self.started is None:
            self.started = now
        for rank, rec in records.items():
            signature = progress_signature(rec)
            old = self.seen.get(rank)
            if old is None:
                self.seen[rank] = _Seen(rec["beat"], now, signature, now, rec)
                continue
            if rec["beat"] != old.beat:
                old.beat, old.beat_since = rec["beat"], now
            if signature != old.signature:
                old.signature, old.progress_since = signature, now
            old.record = rec
        return self.verdict(now)

    def verdict(self, now: float) -> RankStall | None:
        if any(s.record.get("phase") == "done" for s in self.seen.values()):
            return None  # the job is finishing; ranks leave at different moments
        frozen = sorted(r for r, s in self.seen.items() if now - s.beat_since >= self.window)
        if frozen:
            return self._frozen(frozen, now)
        if len(self.seen) < self.world_size:  # some ranks are still starting, or stalled before their first beat
            if self.seen and now - self.started >= self.window and self._all_stuck(now):
                missing = sorted(set(range(self.world_size)) - set(self.seen))
                return RankStall(
                    missing,
                    f"{_ranks_text(missing)} never sent a heartbeat in {now - self.started:.0f} s"
                    f" while the others wait ({self._others(missing)})",
                    "stalled",
                )
            return None
        if not self._all_stuck(now):
            return None
        return self.diagnose({r: s.record for r, s in self.seen.items()}, now)

    def _stuck_for(self, rank: int, now: float) -> str:
        seen = self.seen.get(rank)
        return f"{now - seen.progress_since:.0f} s" if seen else "?"

    def blame(self, now: float) -> RankStall | None:
        """A verdict without waiting for the window, for a job that already failed (a victim timed out)."""
        frozen = sorted(r for r, s in self.seen.items() if now - s.beat_since >= 2 * self.interval)
        if frozen:
            return self._frozen(frozen, now)
        if len(self.seen) < self.world_size:
            return None
        return self.diagnose({r: s.record for r, s in self.seen.items()}, now)

    def _all_stuck(self, now: float) -> bool:
        return all(now - s.progress_since >= self.window for s in self.seen.values())

    def _frozen(self, frozen: list[int], now: float) -> RankStall:
        silent = max(now - self.seen[r].beat_since for r in frozen)
        last = "; ".join(f"rank {r} last at {_describe(self.seen[r].record)}" for r in frozen)
        return RankStall(
            frozen,
            f"{_ranks_text(frozen)} stalled: no heartbeat for {silent:.0f} s (process stopped or "
            f"frozen); {last}; {self._others(frozen)}",
            "stalled",
        )

    def _others(self, culprits: list[int]) -> str:
        rest = [r for r in sorted(self.seen) if r not in culprits]
        if not rest:
            return "no other rank"
        return "others waiting: " + "; ".join(f"rank {r} in {_describe(self.seen[r].record)}" for r in rest)

    def diagnose(self, records: dict[int, dict[str, Any]], now: float) -> RankStall:
        """Name the cause of a job in which no rank progresses (see the module docstring)."""
        waits_on: dict[int, set[int]] = {r: set() for r in records}
        behind: set[int] = set()
        for _, _, seqs in _groups(records):
            top = max(seqs.values())
            late = {r for r, s in seqs.items() if s < top}
            for r, s in seqs.items():
                if s == top and late:
                    waits_on[r] |= late
            behind |= late
        waiting = {r for r, peers in waits_on.items() if peers}
        causes = sorted(behind - waiting)
        if causes:
            return RankStall(
                causes,
                f"{_ranks_text(causes)} stalled: no progress for "
                f"{self._stuck_for(causes[0], now)} at "
                + "; ".join(f"rank {r} {_describe(records[r])}" for r in causes)
                + f" (not inside a collective the others wait in); {self._others(causes)}",
                "stalled",
            )
        if behind:
            return RankStall(
                [],
                "desync: the ranks issued collectives in different orders, each waits on another: "
                + "; ".join(f"rank {r} in {_describe(records[r])}" for r in sorted(records)),
                "desync",
            )
        outside = sorted(r for r, rec in records.items() if not rec.get("comm"))
        if outside and len(outside) < len(records):
            return RankStall(
                outside,
                f"{_ranks_text(outside)} stalled: no progress for "
                f"{self._stuck_for(outside[0], now)} at "
                + "; ".join(f"rank {r} {_describe(records[r])}" for r in outside)
                + f"; {self._others(outside)}",
                "stalled",
            )
        calls = {(rec.get("comm"), rec.get("group"), rec.get("where")) for rec in records.values()}
        if len(calls) > 1 and not outside:
            return RankStall(
                [],
                "desync: at the same collective count the ranks are inside different collectives "
                "(one skipped or reordered one): "
                + "; ".join(f"rank {r} in {_describe(records[r])}" for r in sorted(records)),
                "desync",
            )
        rec = records[min(records)]
        return RankStall(
            [],
            f"hang: no rank progressed for {self._stuck_for(min(records), now)}, all at the same "
            f"collective count ({_describe(rec)}); no rank is behind: the network or the backend",
            "hang",
        )


def _groups(records: dict[int, dict[str, Any]]):
    """(name, members, {rank: sequence number}) for every group instance that the ranks report."""
    by_key: dict[tuple, dict[int, int]] = {}
    for rank, rec in records.items():
        for name, seq in rec.get("seqs", {}).items():
            members = tuple(rec.get("members", {}).get(name, ()))
            by_key.setdefault((name, members), {})[rank] = seq
    for (name, members), seqs in by_key.items():
        if len(seqs) == len(members):  # compare only when every member reported
            yield name, members, seqs
