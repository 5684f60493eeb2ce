"""Proof that a schedule is one the runtime can execute: complete, ordered, FIFO-matched, free of deadlock.

The deadlock check is the simulator's replay in zero time, so the point-to-point behaviour that the planner
times and the one the check proves are a single definition (`simulate._replay`). Here, not in
`schedules.py`, because it needs both the schedules and the simulator.
"""

from __future__ import annotations

from collections import defaultdict

from large_model_training.parallel.pipeline.schedules import (RECVS, SENDS, Action, Op, ScheduleError,
                                                              check_counts, message_key, peer, rank_stages,
                                                              stage_to_rank)
from large_model_training.parallel.pipeline.simulate import simulate


def _expected(rank: int, p: int, m: int, v: int, forward_only: bool) -> set[Action]:
    last = p * v - 1
    out = set()
    for j in rank_stages(rank, p, v):
        for mb in range(m):
            out.add(Action(Op.FORWARD, j, mb))
            if p > 1 and j > 0:
                out.add(Action(Op.RECV_ACT, j, mb))
            if p > 1 and j < last:
                out.add(Action(Op.SEND_ACT, j, mb))
            if forward_only:
                continue
            out.add(Action(Op.BACKWARD, j, mb))
            if p > 1 and j > 0:
                out.add(Action(Op.SEND_GRAD, j, mb))
            if p > 1 and j < last:
                out.add(Action(Op.RECV_GRAD, j, mb))
    return out


def _check_rank(rank: int, actions: list[Action], p: int, m: int, v: int, forward_only: bool) -> None:
    where: dict[Action, int] = {}
    for i, a in enumerate(actions):
        if not isinstance(a, Action):
            raise ScheduleError(f"rank {rank}, position {i}: {a!r} is not an Action")
        if a in where:
            raise ScheduleError(f"rank {rank}: action {a} appears twice (positions {where[a]} and {i})")
        where[a] = i
    expected = _expected(rank, p, m, v, forward_only)
    extra = sorted(set(where) - expected, key=where.get)
    if extra:
        a = extra[0]
        home = stage_to_rank(a.stage, p) if 0 <= a.stage < p * v else None
        why = (f"stage {a.stage} lives on rank {home}" if home not in (None, rank)
               else f"it is not part of p={p}, m={m}, v={v}{' forward-only' if forward_only else ''} on this rank")
        raise ScheduleError(f"rank {rank}: unexpected action {a} ({why})")
    missing = sorted(expected - set(where), key=lambda a: (a.stage, a.microbatch, a.op.value))
    if missing:
        raise ScheduleError(f"rank {rank}: missing {len(missing)} action(s), first {missing[0]}")

    def before(first: Action, then: Action, why: str) -> None:
        if first in where and where[first] > where[then]:
            raise ScheduleError(f"rank {rank}: {then} (position {where[then]}) runs before {first} "
                                f"(position {where[first]}); {why}")

    for a in actions:
        if a.op is Op.FORWARD:
            before(Action(Op.RECV_ACT, a.stage, a.microbatch), a, "a forward needs its input activation")
        elif a.op is Op.BACKWARD:
            before(Action(Op.FORWARD, a.stage, a.microbatch), a, "a backward needs its forward")
            before(Action(Op.RECV_GRAD, a.stage, a.microbatch), a, "a backward needs its output gradient")
        elif a.op is Op.SEND_ACT:
            before(Action(Op.FORWARD, a.stage, a.microbatch), a, "an activation is sent after it is computed")
        elif a.op is Op.SEND_GRAD:
            before(Action(Op.BACKWARD, a.stage, a.microbatch), a, "a gradient is sent after it is computed")


def _check_fifo(schedule: list[list[Action]], p: int) -> None:
    sent: dict[tuple[int, int], list[Action]] = defaultdict(list)
    received: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.op in SENDS:
                sent[(rank, peer(a, p))].append(a)
            elif a.op in RECVS:
                received[(peer(a, p), rank)].append(a)
    for channel in sorted(set(sent) | set(received)):
        sends, recvs = sent[channel], received[channel]
        for k, (s, r) in enumerate(zip(sends, recvs)):
            if message_key(s) != message_key(r):
                raise ScheduleError(
                    f"channel rank {channel[0]} -> rank {channel[1]} out of order: message #{k} is sent as {s} "
                    f"but received as {r} (point-to-point messages between two ranks match in posting order)")
        if len(sends) != len(recvs):
            raise ScheduleError(f"channel rank {channel[0]} -> rank {channel[1]}: {len(sends)} sends but "
                                f"{len(recvs)} receives")


def validate_schedule(schedule: list[list[Action]], p: int, m: int, v: int, forward_only: bool = False) -> None:
    """Raise ScheduleError unless the schedule is complete, ordered, FIFO-matched and free of deadlock.

    forward_only: the lists are an evaluation program (`build_forward_schedule`): no backwards, no gradients.
    """
    check_counts(p, m, v)
    if len(schedule) != p:
        raise ScheduleError(f"expected one action list per pipeline rank (p={p}), got {len(schedule)}")
    for rank, actions in enumerate(schedule):
        _check_rank(rank, list(actions), p, m, v, forward_only)
    _check_fifo(schedule, p)
    simulate(schedule, p, m, v, forward_time=0.0, backward_time=0.0, p2p_time=0.0)  # raises "deadlock: rank ..."
