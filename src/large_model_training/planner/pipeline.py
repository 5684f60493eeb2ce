"""The planner's view of pipeline schedules: the runtime's own schedule definitions, built, walked and
simulated once per shape, with the steady state extrapolated instead of simulated event by event.

One source of truth: schedules come from `parallel/pipeline/schedules.py` and are timed by
`parallel/pipeline/simulate.py`, the same action lists the runtime executes, with the stages placed as the
runtime places them (`placement_of(kind)`: zbv's V puts stage 0 and the last stage on rank 0). A search over
thousands of layouts cannot replay every step of a 64-stage pipeline with hundreds of micro-batches, so:

- occupancy: which (chunk, micro-batch) pairs a rank holds, walked on its compute order: per chunk, how many
  are between their F and their B (all saves held) and how many between B and W (split kinds: only what the
  weight gradients read). A rank's activation peak is the largest weighted sum over the states the walk
  passes through (weights: `activations.ChunkActivations`, per chunk, so uneven chunks count exactly), plus
  what a pair occupies inside its own B. Only states no other state dominates are kept. After the warm-up
  these states stop growing with m (1f1b, interleaved, zb-h1, zbv) or grow by one per micro-batch (gpipe):
  `occupancy` walks two small m of the same residue modulo p, both past the warm-up, and extends the line.
- makespan: once the pipeline is full, each further group of p micro-batches adds the same time.
  `makespan` simulates the same two sizes and extends the line; for m up to three groups it simulates the
  real m. Exact for gpipe, 1f1b, zb-h1 and zbv (tests/test_planner.py checks it against the full simulation),
  within a few percent for interleaved, whose steady state repeats only approximately when p does not divide
  m. The bubble fraction follows from the extrapolated makespan and the exact busy time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import ge

from large_model_training.choices import splits_backward
from large_model_training.parallel.pipeline.schedules import (
    Action,
    Op,
    build_schedule,
    compute_order,
    placement_of,
    rank_stages,
)
from large_model_training.parallel.pipeline.simulate import Timeline, save_gantt_png, simulate, theoretical_bubble
from large_model_training.planner.activations import ChunkActivations

State = tuple[int, ...]
"""Per chunk of a rank (its stages in model order): pairs between F and B, then pairs between B and W."""


def _undominated(states: set[State]) -> list[State]:
    """The states that no other state is at least as large as, in every count (the only possible peaks)."""
    kept: list[State] = []
    for s in sorted(states, key=lambda s: (-sum(s), s)):  # a dominating state comes first
        if not any(all(map(ge, other, s)) for other in kept):
            kept.append(s)
    return kept


@dataclass(frozen=True)
class Occupancy:
    """The states one rank's schedule passes through (see the module docstring)."""

    stages: tuple[int, ...]
    """The rank's virtual stages, in model order: chunk c of a state is stages[c]."""
    held: tuple[State, ...]
    """After each run of F's, and after each B (split kinds: what B leaves for W may outweigh what it frees)."""
    in_backward: tuple[tuple[State, int], ...]
    """During a B of chunk c: the other pairs' state, and c (that pair occupies `in_backward` bytes)."""
    _merged: dict = field(default_factory=dict, compare=False, repr=False)
    """Cache: the states with chunks of equal bytes merged, per pattern of equal chunks (`peak`)."""

    def peak(self, chunks: list[ChunkActivations]) -> float:
        """Peak activation bytes of the rank; chunks[c]: what a pair of chunk c occupies."""
        kinds = list(dict.fromkeys(chunks))  # chunks of equal bytes (most of them, on most ranks) add up
        held, in_backward = self._merge(tuple(kinds.index(c) for c in chunks), len(kinds))
        weights = [k.held for k in kinds] + [k.pending for k in kinds]

        def load(state: State) -> float:
            return sum(n * w for n, w in zip(state, weights) if n)

        best = max((load(s) for s in held), default=0.0)
        for state, k in in_backward:
            best = max(best, load(state) + kinds[k].in_backward)
        return best

    def _merge(self, pattern: tuple[int, ...], groups: int) -> tuple[list[State], list[tuple[State, int]]]:
        """The states summed over the chunks of each group (pattern[c]: chunk c's group), undominated."""
        if pattern not in self._merged:
            v = len(pattern)

            def merged(state: State) -> State:
                out = [0] * (2 * groups)
                for c, g in enumerate(pattern):
                    out[g] += state[c]
                    out[groups + g] += state[v + c]
                return tuple(out)

            held = _undominated({merged(s) for s in self.held})
            in_backward = [
                (s, g)
                for g in range(groups)
                for s in _undominated({merged(s) for s, c in self.in_backward if pattern[c] == g})
            ]
            self._merged[pattern] = (held, in_backward)
        return self._merged[pattern]

    def pairs(self) -> int:
        """Most pairs held at once between F and W (the runtime's `in_flight`, for reports)."""
        return max((sum(s) for s in self.held), default=0)


def walk(actions: list[Action], stages: list[int]) -> Occupancy:
    """The `Occupancy` of one rank's compute order (F, B and, for split kinds, W actions)."""
    local = {stage: c for c, stage in enumerate(stages)}
    v = len(stages)
    split = any(a.op is Op.WEIGHT for a in actions)
    counts = [0] * (2 * v)
    held: set[State] = set()
    backward: set[tuple[State, int]] = set()
    for i, a in enumerate(actions):
        c = local[a.stage]
        if a.op is Op.FORWARD:
            counts[c] += 1
        elif a.op is Op.BACKWARD:
            counts[c] -= 1
            backward.add((tuple(counts), c))
            counts[v + c] += split
        elif a.op is Op.WEIGHT:
            counts[v + c] -= 1
            continue
        if i + 1 == len(actions) or actions[i + 1].op is not Op.FORWARD:  # a forward next would only add
            held.add(tuple(counts))
    by_chunk = [_undominated({s for s, chunk in backward if chunk == c}) for c in range(v)]
    return Occupancy(tuple(stages), tuple(_undominated(held)), tuple((s, c) for c in range(v) for s in by_chunk[c]))


def _extend(lo: Occupancy, hi: Occupancy, steps: float) -> Occupancy | None:
    """`lo` moved `steps` times by (hi - lo), state by state; None when the two do not pair up."""
    if lo == hi:
        return lo
    if len(lo.held) != len(hi.held) or len(lo.in_backward) != len(hi.in_backward):
        return None

    def line(a: State, b: State) -> State:
        return tuple(x + round((y - x) * steps) for x, y in zip(a, b))

    held = tuple(line(a, b) for a, b in zip(sorted(lo.held), sorted(hi.held)))
    backward = []
    for (a, c), (b, d) in zip(
        sorted(lo.in_backward, key=lambda e: (e[1], e[0])), sorted(hi.in_backward, key=lambda e: (e[1], e[0]))
    ):
        if c != d:
            return None
        backward.append((line(a, b), c))
    return Occupancy(lo.stages, held, tuple(backward))


def rank_stage_list(kind: str, p: int, v: int, rank: int) -> list[int]:
    """The virtual stages pipeline rank `rank` runs under `kind`'s placement, in model order."""
    return rank_stages(rank, p, v, placement_of(kind))


def rank_loads(kind: str, p: int, v: int, per_stage: list[float]) -> list[float]:
    """Per pipeline rank, the sum of `per_stage` over the virtual stages it runs (kind's placement)."""
    if placement_of(kind) == "loop":
        return [sum(per_stage[r::p]) for r in range(p)]
    return [sum(per_stage[j] for j in rank_stages(r, p, v, "v")) for r in range(p)]


@dataclass
class PipelineTiming:
    """Caches of built schedules, walks and spans for one planning session (no module-level state)."""

    schedules: dict[tuple[str, int, int, int], list[list[Action]]] = field(default_factory=dict)
    walks: dict[tuple, Occupancy] = field(default_factory=dict)
    occupancies: dict[tuple, Occupancy] = field(default_factory=dict)
    spans: dict[tuple, float] = field(default_factory=dict)

    def schedule(self, kind: str, p: int, m: int, v: int) -> list[list[Action]]:
        key = (kind, p, m, v)
        if key not in self.schedules:
            self.schedules[key] = build_schedule(kind, p, m, v)
        return self.schedules[key]

    def _base(self, kind: str, p: int, m: int) -> int:
        """Smallest micro-batch count >= p with the residue of m modulo p (a valid interleaved size); zbv's
        handcrafted order reaches its steady state only from 2p - 1 micro-batches, so one group more."""
        return p + m % p + (p if str(kind) == "zbv" else 0)

    def _walk(self, kind: str, p: int, m: int, v: int, rank: int) -> Occupancy:
        key = (str(kind), p, m, v, rank)
        if key not in self.walks:
            # One rank's compute order, without the messages a full build adds (the costly part for 64 ranks).
            self.walks[key] = walk(compute_order(kind, rank, p, m, v), rank_stage_list(kind, p, v, rank))
        return self.walks[key]

    def occupancy(self, kind: str, p: int, m: int, v: int, rank: int) -> Occupancy:
        """The states of `rank`'s schedule at m micro-batches (module docstring)."""
        key = (str(kind), p, m, v, rank)
        if key not in self.occupancies:
            # Past the warm-up: p micro-batches for 1f1b and zb-h1, two groups for interleaving (its larger last
            # group behind) and zbv (steady from 2p - 1).
            base = self._base(kind, p, m) + (p if str(kind) == "interleaved" else 0)
            if m <= base + p:
                self.occupancies[key] = self._walk(kind, p, m, v, rank)
            else:
                lo, hi = self._walk(kind, p, base, v, rank), self._walk(kind, p, base + p, v, rank)
                self.occupancies[key] = _extend(lo, hi, (m - base) / p) or self._walk(kind, p, m, v, rank)
        return self.occupancies[key]

    def makespan(
        self,
        kind: str,
        p: int,
        m: int,
        v: int,
        forward: list[float],
        backward: list[float],
        p2p: float,
        weight: list[float] | None = None,
    ) -> tuple[float, float]:
        """(makespan, bubble fraction) of one step; forward/backward/weight: seconds per virtual stage
        (weight: the W actions of split kinds, whose backward is then B only)."""
        weight = weight or [0.0] * len(forward)
        busy = m * (sum(forward) + sum(backward) + sum(weight))
        if p == 1:
            return busy, 0.0
        # Two groups or more, as for occupancy; past 16 ranks one group less (the builds dominate the
        # search's time there; the line through them is then within a few percent).
        base = self._base(kind, p, m) + (p if p <= 16 else 0)
        if m <= base + p:
            span = self._span(kind, p, m, v, forward, backward, weight, p2p)
        else:
            lo = self._span(kind, p, base, v, forward, backward, weight, p2p)
            hi = self._span(kind, p, base + p, v, forward, backward, weight, p2p)
            span = lo + (hi - lo) * (m - base) / p
        return span, max(0.0, 1.0 - busy / (p * span))

    def _span(
        self,
        kind: str,
        p: int,
        m: int,
        v: int,
        forward: list[float],
        backward: list[float],
        weight: list[float],
        p2p: float,
    ) -> float:
        key = (str(kind), p, m, v, tuple(forward), tuple(backward), tuple(weight), p2p)
        if key not in self.spans:
            self.spans[key] = self._simulate(kind, p, m, v, forward, backward, weight, p2p).makespan
        return self.spans[key]

    def _simulate(
        self,
        kind: str,
        p: int,
        m: int,
        v: int,
        forward: list[float],
        backward: list[float],
        weight: list[float],
        p2p: float,
    ) -> Timeline:
        return simulate(
            self.schedule(kind, p, m, v),
            p,
            m,
            v,
            forward.__getitem__,
            backward.__getitem__,
            p2p,
            weight_time=weight.__getitem__,
            placement=placement_of(kind),
        )

    def estimate_makespan(self, kind: str, p: int, m: int, v: int, rank_busy: float, p2p: float) -> float:
        """Closed-form makespan for ranking: the bottleneck rank's busy time over (1 - theoretical bubble),
        plus the point-to-point hops of the fill and drain."""
        if p == 1:
            return rank_busy
        bubble = theoretical_bubble(kind, p, m, v)
        return rank_busy / (1.0 - bubble) + 2 * (p - 1) * p2p

    def draw(
        self,
        kind: str,
        p: int,
        m: int,
        v: int,
        forward: list[float],
        backward: list[float],
        p2p: float,
        path: str,
        title: str,
        weight: list[float] | None = None,
        max_actions: int = 3000,
    ) -> int:
        """Save the Gantt chart of the step; m is reduced (same residue mod p) past max_actions boxes.
        Returns the m drawn."""
        drawn = m
        per_micro_batch = (3 if splits_backward(kind) else 2) * p * v
        while drawn > self._base(kind, p, m) and per_micro_batch * drawn > max_actions:
            drawn -= p
        timeline = self._simulate(kind, p, drawn, v, forward, backward, weight or [0.0] * len(forward), p2p)
        suffix = "" if drawn == m else f" (first {drawn} of {m} micro-batches drawn)"
        save_gantt_png(timeline, path, title + suffix)
        return drawn
