"""Replaying pipeline schedules without running them: the planner's bubble and step-time estimates, the
deadlock check (a replay in zero time) and the runtime's send releases.

The simulator replays the same action lists the runtime executes, so a schedule's simulated bubble is the one
it will have (up to the cost model), and uneven stages (an embedding or a head on one stage) show up as
they will. Cost model, matching the runtime's point-to-point semantics:
  - a rank runs its list in order; F, B and W take forward_time(stage), backward_time(stage) and
    weight_time(stage) (W: split kinds only, whose B is then the input gradient alone);
  - a SEND costs its sender nothing (isend) and its data lands at the peer p2p_time later;
  - a RECV blocks its rank until that data has landed.
`_replay` is the one definition of that behaviour (which send a receive takes, when a rank is stuck); timing
and `send_releases` both walk it.

`Timeline` is also the container for measured timelines: the runtime fills it with wall-clock times and
reuses `bubble_fraction` and `save_gantt_png`, so simulated and measured steps are drawn the same way.
No torch here; matplotlib is imported only when a chart is drawn.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from large_model_training.parallel.pipeline.actions import (
    COMPUTE,
    RECVS,
    SENDS,
    Action,
    Op,
    ScheduleError,
    check_placement,
    peer,
)
from large_model_training.parallel.pipeline.schedules import KINDS

Duration = float | Callable[[int], float]


@dataclass
class Timeline:
    """Per rank, (action, start, end) for compute and communication actions, in program order."""

    events: list[list[tuple[Action, float, float]]]
    makespan: float

    def busy_time(self) -> float:
        """Compute time (F, B and W) summed over ranks; communication and waiting are not busy."""
        return sum(end - start for rank in self.events for a, start, end in rank if a.op in COMPUTE)

    def bubble_fraction(self) -> float:
        """Share of the p x makespan device time that no compute used: 1 - busy / (p * makespan)."""
        p = len(self.events)
        if p == 0 or self.makespan <= 0:
            return 0.0
        return 1.0 - self.busy_time() / (p * self.makespan)


def _as_callable(t: Duration) -> Callable[[int], float]:
    if callable(t):
        return t
    value = float(t)
    return lambda stage: value


def _replay(
    schedule: list[list[Action]], p: int, placement: str
) -> Iterator[tuple[int, int, Action, tuple[int, int] | None]]:
    """(rank, position, action, sender) of every action, in an order each rank could run it: a SEND never
    blocks (isend); the k-th RECV on a channel takes the k-th SEND on it (NCCL's posting order) and waits
    for it. `sender` is (rank, position) of the send a receive takes, None for other actions. Raises
    ScheduleError naming each stuck rank when the lists deadlock."""
    pc = [0] * p
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)  # per channel, sender positions in send order
    taken: dict[tuple[int, int], int] = defaultdict(int)
    # Any order of visiting ranks gives the same matching: per channel, receives take sends in order.
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            actions = schedule[rank]
            while pc[rank] < len(actions):
                a = actions[pc[rank]]
                sender = None
                if a.op in SENDS:
                    sends[(rank, peer(a, p, placement))].append(pc[rank])
                elif a.op in RECVS:
                    channel = (peer(a, p, placement), rank)
                    if taken[channel] >= len(sends[channel]):
                        break
                    sender = (channel[0], sends[channel][taken[channel]])
                    taken[channel] += 1
                yield rank, pc[rank], a, sender
                pc[rank] += 1
                progress = True
    stuck = [
        f"rank {r} waits at {schedule[r][pc[r]]} (position {pc[r]}) for rank {peer(schedule[r][pc[r]], p, placement)}"
        for r in range(p)
        if pc[r] < len(schedule[r])
    ]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))


def simulate(
    schedule: list[list[Action]],
    p: int,
    m: int,
    v: int,
    forward_time: Duration,
    backward_time: Duration,
    p2p_time: float = 0.0,
    weight_time: Duration = 0.0,
    placement: str = "loop",
) -> Timeline:
    """Event-driven replay of `schedule`; forward_time, backward_time and weight_time (of the W actions of
    split kinds, whose B is then the input gradient only) are seconds or callables of the stage.

    No validation here (`checks.validate_schedule` runs this with zero durations); m and v name the shape
    the lists were built for, the replay needs p and the placement the lists were built for
    (`schedules.placement_of(kind)`). A schedule that deadlocks raises ScheduleError.
    """
    check_placement(placement)
    times = {
        Op.FORWARD: _as_callable(forward_time),
        Op.BACKWARD: _as_callable(backward_time),
        Op.WEIGHT: _as_callable(weight_time),
    }
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    clock = [0.0] * p
    # An action's times depend only on the previous action of its rank and, for a receive, on the send it
    # takes, which the replay has visited before it.
    for rank, _, a, sender in _replay(schedule, p, placement):
        start = clock[rank]
        if a.op in COMPUTE:
            end = clock[rank] = start + times[a.op](a.stage)
        elif sender is None:  # a send: the time its data lands at the peer
            end = start + p2p_time
        else:
            end = clock[rank] = max(start, events[sender[0]][sender[1]][2])
        events[rank].append((a, start, end))
    makespan = max((end for rank in events for _, _, end in rank), default=0.0)
    return Timeline(events, makespan)


def send_releases(
    schedule: list[list[Action]], p: int, rank: int, placement: str = "loop"
) -> dict[Action, list[Action]]:
    """Which sends of `rank` are received for certain once each of its actions has run: a chain of messages
    leads from the peer's receive to that action (vector clocks over the replay). Waiting on such a send
    cannot block, so the runtime frees its buffer there instead of at the end of the step; sends that no
    message acknowledges (the last ones of a step) are absent and are waited at the end."""
    known = [[0] * p for _ in range(p)]  # known[r][q]: how many of q's actions r knows to be done
    stamps: dict[tuple[int, int], list[int]] = {}  # a send's sender's knowledge, carried to its receiver
    received: dict[int, tuple[int, int]] = {}  # position of a send of `rank` -> (peer, position of its receive)
    releases: dict[Action, list[Action]] = {}
    for r, pos, a, sender in _replay(schedule, p, placement):
        if sender is not None:
            known[r] = [max(mine, theirs) for mine, theirs in zip(known[r], stamps.pop(sender))]
            if sender[0] == rank:
                received[sender[1]] = (r, pos)
        known[r][r] = pos + 1
        if a.op in SENDS:
            stamps[(r, pos)] = list(known[r])
        if r == rank:
            done = sorted(s for s, (q, i) in received.items() if known[r][q] > i)
            if done:
                releases[a] = [schedule[r][s] for s in done]
                for s in done:
                    del received[s]
    return releases


def theoretical_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """Idle share of the step with equal stages and free communication; for the split kinds at F = B = W.

    GPipe and 1F1B idle (p-1) stage-times of forward and backward out of m+p-1; interleaving cuts each
    stage-time by v, so the bubble is (p-1)/v against m: (p-1)/(v*m + p-1) (Narayanan et al. 2021, eq. 1-2).

    zb-h1 and zbv (Qi et al. 2023) depend on the ratio of F, B and W; at the paper's F = B = W a rank is
    busy 3m F-times and idles `idle` more, so the bubble is idle / (3m + idle):
      - zb-h1: idle = p-1, the paper's (p-1)(F+B-W) (section 3.1), a third of 1F1B's (p-1)(F+B+W); for any
        F, B, W it is (p-1)(F+B-min(F,B,W)) (checked by simulation). With m < p it is 2p-1-m: rank 0's first B
        waits (2p-1) slots for its gradient and then has m B's and m W's to run.
      - zbv: idle = (p-1)/2, the half-size F of p-1 chunks that rank p-1 waits before its first input: no
        order fills it, so ZB-V is optimal (section 6 calls this near-zero: under 1/13 of the step from m = 2p).
        With m < 2p-1 our lists (`zero_bubble.zbv_order`) idle 2p-1-m, as zb-h1 does below m = p.
    tests/test_schedules.py checks every formula against the simulator on a grid of p and m.
    """
    if kind not in KINDS:
        raise ScheduleError(f"unknown pipeline schedule '{kind}'; choose one of {', '.join(KINDS)}")
    if min(p, m, v) < 1:
        raise ScheduleError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if kind in ("zb-h1", "zbv"):
        idle = max(2 * p - 1 - m, (p - 1) if kind == "zb-h1" else (p - 1) / 2)
        return idle / (3 * m + idle)
    return (p - 1) / (m + p - 1)


def save_gantt_png(timeline: Timeline, path: str, title: str = "") -> None:
    """Gantt chart of a (simulated or measured) timeline: one row per rank, F, B and W boxes (blue, green,
    orange) with micro-batch ids.

    Communication is left out: sends take no rank time and receive waits show as gaps. With v > 1 chunks,
    later chunks of a rank (stage // p, in either placement) are drawn in darker shades of the same colour.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    p = max(len(timeline.events), 1)
    boxes = [(r, a, s, e) for r, rank in enumerate(timeline.events) for a, s, e in rank if a.op in COMPUTE]
    n_chunks = max((a.stage // p for _, a, _, _ in boxes), default=0) + 1
    shades = {
        Op.FORWARD: ("#9ecae1", "#4292c6", "#08519c", "#08306b"),
        Op.BACKWARD: ("#a1d99b", "#41ab5d", "#006d2c", "#00441b"),
        Op.WEIGHT: ("#fdae6b", "#f16913", "#a63603", "#7f2704"),
    }
    width = min(max(8.0, 0.12 * max((len(rank) for rank in timeline.events), default=0)), 40.0)
    fig = Figure(figsize=(width, 0.6 * p + 1.2))
    FigureCanvasAgg(fig)  # the Agg canvas, without touching pyplot's global backend
    ax = fig.add_subplot()
    for rank, a, start, end in boxes:
        chunk = a.stage // p
        colour = shades[a.op][min(chunk * 4 // max(n_chunks, 1), 3) if n_chunks > 1 else 1]
        ax.barh(rank, end - start, left=start, height=0.8, color=colour, edgecolor="white", linewidth=0.5)
        ax.text(
            (start + end) / 2,
            rank,
            str(a.microbatch),
            ha="center",
            va="center",
            fontsize=7,
            color="white" if chunk * 2 >= n_chunks else "black",
        )
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the papers' figures
    ax.set_xlim(0, timeline.makespan or 1.0)
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble {timeline.bubble_fraction():.1%}")
    split = any(a.op is Op.WEIGHT for _, a, _, _ in boxes)  # B is then the input gradient only
    legend = [(Op.FORWARD, "forward"), (Op.BACKWARD, "input gradient" if split else "backward")]
    legend += [(Op.WEIGHT, "weight gradient")] if split else []
    ax.legend(
        handles=[Patch(color=shades[op][1], label=label) for op, label in legend],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )  # outside the axes: never over a box
    fig.tight_layout()
    fig.savefig(path, dpi=120)
