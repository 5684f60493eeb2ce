"""Proof that a schedule is one the runtime can execute: complete, ordered, FIFO-matched, free of deadlock.

Ordered means, per rank: an F after the receive of its input, a B after its F and the receive of its
gradient, a send after the compute that made its tensor, a W (split kinds) after its B, and where two
neighbouring stages share a rank (`actions.local_handover`), F of j before F of j+1 and B of j+1 before B of
j, with no message between them.

The deadlock check is the simulator's replay in zero time, so the point-to-point behaviour that the planner
times and the one the check proves are a single definition (`simulate._replay`). Here, not in
`schedules.py`, because it needs both the schedules and the simulator.
"""

from __future__ import annotations

from collections import defaultdict

from large_model_training.parallel.pipeline.actions import (
    RECVS,
    SENDS,
    Action,
    Op,
    ScheduleError,
    check_counts,
    check_placement,
    local_handover,
    message_key,
    peer,
    rank_stages,
    stage_to_rank,
)
from large_model_training.parallel.pipeline.simulate import simulate


def _expected(rank: int, p: int, m: int, v: int, forward_only: bool, placement: str, weights: bool) -> set[Action]:
    last = p * v - 1
    out = set()
    for j in rank_stages(rank, p, v, placement):
        receives = j > 0 and not local_handover(j - 1, p, placement)  # input from (gradient to) another rank
        sends = j < last and not local_handover(j, p, placement)  # output to (gradient from) another rank
        for mb in range(m):
            out.add(Action(Op.FORWARD, j, mb))
            if receives:
                out.add(Action(Op.RECV_ACT, j, mb))
            if sends:
                out.add(Action(Op.SEND_ACT, j, mb))
            if forward_only:
                continue
            out.add(Action(Op.BACKWARD, j, mb))
            if weights:
                out.add(Action(Op.WEIGHT, j, mb))
            if receives:
                out.add(Action(Op.SEND_GRAD, j, mb))
            if sends:
                out.add(Action(Op.RECV_GRAD, j, mb))
    return out


def _unexpected(a: Action, rank: int, p: int, v: int, placement: str, weights: bool) -> str | None:
    """Why an action has no place on `rank`, where a specific reason is known."""
    if not 0 <= a.stage < p * v:
        return None
    home = stage_to_rank(a.stage, p, placement)
    if home != rank:
        return f"stage {a.stage} lives on rank {home}"
    if a.op is Op.WEIGHT and not weights:
        return "this schedule has no W actions (B is the whole backward)"
    if a.op in SENDS or a.op in RECVS:
        other = a.stage + (1 if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1)
        if 0 <= other < p * v and stage_to_rank(other, p, placement) == rank:
            return f"stages {a.stage} and {other} hand over locally on rank {rank}, without a message"
    return None


def _check_rank(
    rank: int, actions: list[Action], p: int, m: int, v: int, forward_only: bool, placement: str, weights: bool
) -> None:
    where: dict[Action, int] = {}
    for i, a in enumerate(actions):
        if not isinstance(a, Action):
            raise ScheduleError(f"rank {rank}, position {i}: {a!r} is not an Action")
        if a in where:
            raise ScheduleError(f"rank {rank}: action {a} appears twice (positions {where[a]} and {i})")
        where[a] = i
    expected = _expected(rank, p, m, v, forward_only, placement, weights)
    extra = sorted(set(where) - expected, key=where.get)
    if extra:
        a = extra[0]
        shape = f"p={p}, m={m}, v={v}, placement {placement}{', forward-only' if forward_only else ''}"
        why = _unexpected(a, rank, p, v, placement, weights) or f"it is not part of {shape} on this rank"
        raise ScheduleError(f"rank {rank}: unexpected action {a} ({why})")
    missing = sorted(expected - set(where), key=lambda a: (a.stage, a.microbatch, a.op.value))
    if missing:
        raise ScheduleError(f"rank {rank}: missing {len(missing)} action(s), first {missing[0]}")

    def before(first: Action, then: Action, why: str) -> None:
        if first in where and where[first] > where[then]:
            raise ScheduleError(
                f"rank {rank}: {then} (position {where[then]}) runs before {first} (position {where[first]}); {why}"
            )

    for a in actions:
        if a.op is Op.FORWARD:
            before(Action(Op.RECV_ACT, a.stage, a.microbatch), a, "a forward needs its input activation")
            before(
                Action(Op.FORWARD, a.stage - 1, a.microbatch),
                a,
                "a forward needs the output of the previous stage, handed over on this rank",
            )
        elif a.op is Op.BACKWARD:
            before(Action(Op.FORWARD, a.stage, a.microbatch), a, "a backward needs its forward")
            before(Action(Op.RECV_GRAD, a.stage, a.microbatch), a, "a backward needs its output gradient")
            before(
                Action(Op.BACKWARD, a.stage + 1, a.microbatch),
                a,
                "a backward needs the input gradient of the next stage, handed over on this rank",
            )
        elif a.op is Op.WEIGHT:
            before(Action(Op.BACKWARD, a.stage, a.microbatch), a, "a weight gradient needs its backward")
        elif a.op is Op.SEND_ACT:
            before(Action(Op.FORWARD, a.stage, a.microbatch), a, "an activation is sent after it is computed")
        elif a.op is Op.SEND_GRAD:
            before(Action(Op.BACKWARD, a.stage, a.microbatch), a, "a gradient is sent after it is computed")


def _check_fifo(schedule: list[list[Action]], p: int, placement: str) -> None:
    sent: dict[tuple[int, int], list[Action]] = defaultdict(list)
    received: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.op in SENDS:
                sent[(rank, peer(a, p, placement))].append(a)
            elif a.op in RECVS:
                received[(peer(a, p, placement), rank)].append(a)
    for channel in sorted(set(sent) | set(received)):
        sends, recvs = sent[channel], received[channel]
        for k, (s, r) in enumerate(zip(sends, recvs)):
            if message_key(s) != message_key(r):
                raise ScheduleError(
                    f"channel rank {channel[0]} -> rank {channel[1]} out of order: message #{k} is sent as {s} "
                    f"but received as {r} (point-to-point messages between two ranks match in posting order)"
                )
        if len(sends) != len(recvs):
            raise ScheduleError(
                f"channel rank {channel[0]} -> rank {channel[1]}: {len(sends)} sends but {len(recvs)} receives"
            )


def validate_schedule(
    schedule: list[list[Action]],
    p: int,
    m: int,
    v: int,
    forward_only: bool = False,
    placement: str = "loop",
    weights: bool = False,
) -> None:
    """Raise ScheduleError unless the schedule is complete, ordered, FIFO-matched and free of deadlock.

    forward_only: the lists are an evaluation program (`build_forward_schedule`): no backwards, no gradients.
    placement: how the stages were dealt to ranks (`schedules.placement_of(kind)`); weights: the kind splits
    its backward (`choices.splits_backward(kind)`), so each (stage, micro-batch) has one W after its B.
    """
    check_counts(p, m, v)
    check_placement(placement)
    if len(schedule) != p:
        raise ScheduleError(f"expected one action list per pipeline rank (p={p}), got {len(schedule)}")
    for rank, actions in enumerate(schedule):
        _check_rank(rank, list(actions), p, m, v, forward_only, placement, weights and not forward_only)
    _check_fifo(schedule, p, placement)
    simulate(schedule, p, m, v, forward_time=0.0, backward_time=0.0, placement=placement)  # raises "deadlock: ..."
