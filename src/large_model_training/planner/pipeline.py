"""The planner's view of pipeline schedules: the runtime's own schedule definitions, built, counted and
simulated once per shape, with the steady state extrapolated instead of simulated event by event.

One source of truth: schedules come from `parallel/pipeline/schedules.py` and are timed by
`parallel/pipeline/simulate.py`, the same action lists the runtime executes. A search over thousands of
layouts cannot replay every step of a 64-stage pipeline with hundreds of micro-batches, so:

- in-flight activations: after the warm-up, every schedule here holds a number of activations that stops
  growing with m (1f1b, interleaved) or grows by one per micro-batch (gpipe). `in_flight` orders one rank
  at two small m of the same residue modulo p, both with at least two micro-batch groups (interleaving's
  last group takes the remainder and changes the count of a single-group schedule), and extends the line.
- makespan: once the pipeline is full, each further group of p micro-batches adds the same time.
  `makespan` simulates the same two sizes and extends the line; for m up to three groups it simulates the
  real m. Exact for gpipe and 1f1b (tests/test_planner.py checks it against the full simulation), within a
  few percent for interleaved, whose steady state repeats only approximately. The bubble fraction follows
  from the extrapolated makespan and the exact busy time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from large_model_training.parallel.pipeline.schedules import Action, build_schedule, compute_order, in_flight
from large_model_training.parallel.pipeline.simulate import Timeline, save_gantt_png, simulate, theoretical_bubble


@dataclass
class PipelineModel:
    """Caches of built schedules and their counts for one planning session (no module-level state)."""

    schedules: dict[tuple[str, int, int, int], list[list[Action]]] = field(default_factory=dict)
    counts: dict[tuple, int] = field(default_factory=dict)
    spans: dict[tuple, float] = field(default_factory=dict)

    def schedule(self, kind: str, p: int, m: int, v: int) -> list[list[Action]]:
        key = (kind, p, m, v)
        if key not in self.schedules:
            self.schedules[key] = build_schedule(kind, p, m, v)
        return self.schedules[key]

    def _base(self, p: int, m: int) -> int:
        """Smallest micro-batch count >= p with the residue of m modulo p (a valid interleaved size)."""
        return p + m % p

    def _count(self, kind: str, p: int, m: int, v: int, rank: int, last_stage_only: bool) -> int:
        key = (kind, p, m, v, rank, last_stage_only)
        if key not in self.counts:
            # One rank's F/B order without the messages a full build adds (the costly part for 64 ranks):
            # `in_flight` only reads F and B.
            actions = compute_order(kind, rank, p, m, v)
            if last_stage_only:
                last = p * v - 1
                actions = [a for a in actions if a.stage == last]
            self.counts[key] = in_flight(actions)
        return self.counts[key]

    def in_flight(self, kind: str, p: int, m: int, v: int, rank: int, last_stage_only: bool = False) -> int:
        """Peak (chunk, micro-batch) activations held on `rank` (only the last virtual stage's if asked)."""
        base = self._base(p, m) + p  # two groups or more: interleaving's larger last group is behind
        if m <= base + p:
            return self._count(kind, p, m, v, rank, last_stage_only)
        lo = self._count(kind, p, base, v, rank, last_stage_only)
        hi = self._count(kind, p, base + p, v, rank, last_stage_only)
        return lo + (hi - lo) * (m - base) // p

    def makespan(self, kind: str, p: int, m: int, v: int, forward: list[float], backward: list[float],
                 p2p: float) -> tuple[float, float]:
        """(makespan, bubble fraction) of one step; forward/backward: seconds per virtual stage."""
        busy = m * (sum(forward) + sum(backward))
        if p == 1:
            return busy, 0.0
        # Two groups or more, as for in_flight; past 16 ranks one group less (the builds dominate the
        # search's time there; the line through them is then within a few percent).
        base = self._base(p, m) + (p if p <= 16 else 0)
        if m <= base + p:
            span = self._span(kind, p, m, v, forward, backward, p2p)
        else:
            lo = self._span(kind, p, base, v, forward, backward, p2p)
            hi = self._span(kind, p, base + p, v, forward, backward, p2p)
            span = lo + (hi - lo) * (m - base) / p
        return span, max(0.0, 1.0 - busy / (p * span))

    def _span(self, kind: str, p: int, m: int, v: int, forward: list[float], backward: list[float],
              p2p: float) -> float:
        key = (kind, p, m, v, tuple(forward), tuple(backward), p2p)
        if key not in self.spans:
            self.spans[key] = self._simulate(kind, p, m, v, forward, backward, p2p).makespan
        return self.spans[key]

    def _simulate(self, kind: str, p: int, m: int, v: int, forward: list[float], backward: list[float],
                  p2p: float) -> Timeline:
        return simulate(self.schedule(kind, p, m, v), p, m, v, forward.__getitem__, backward.__getitem__, p2p)

    def estimate_makespan(self, kind: str, p: int, m: int, v: int, rank_busy: float, p2p: float) -> float:
        """Closed-form makespan for ranking: the bottleneck rank's busy time over (1 - theoretical bubble),
        plus the point-to-point hops of the fill and drain."""
        if p == 1:
            return rank_busy
        bubble = theoretical_bubble(kind, p, m, v)
        return rank_busy / (1.0 - bubble) + 2 * (p - 1) * p2p

    def draw(self, kind: str, p: int, m: int, v: int, forward: list[float], backward: list[float], p2p: float,
             path: str, title: str, max_actions: int = 3000) -> int:
        """Save the Gantt chart of the step; m is reduced (same residue mod p) past max_actions boxes.
        Returns the m drawn."""
        drawn = m
        while drawn > self._base(p, m) and 2 * p * drawn * v > max_actions:
            drawn -= p
        timeline = self._simulate(kind, p, drawn, v, forward, backward, p2p)
        suffix = "" if drawn == m else f" (first {drawn} of {m} micro-batches drawn)"
        save_gantt_png(timeline, path, title + suffix)
        return drawn

