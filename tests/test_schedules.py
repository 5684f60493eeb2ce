"""Pipeline schedules checked as data: no processes, no torch, a few seconds for the whole file."""

import random

import pytest

from large_model_training.parallel.pipeline.checks import validate_schedule
from large_model_training.parallel.pipeline.schedules import (
    COMPUTE,
    KINDS,
    RECVS,
    SENDS,
    Action,
    Op,
    ScheduleError,
    build_forward_schedule,
    build_schedule,
    compute_order,
    format_grid,
    in_flight,
    interleaved_groups,
    interleaved_warmup,
    placement_of,
    rank_stages,
    splits_backward,
    stage_to_rank,
)
from large_model_training.parallel.pipeline.simulate import (
    Timeline,
    save_gantt_png,
    send_releases,
    simulate,
    theoretical_bubble,
)


def layouts(kind):
    """(p, m, v) grid: p in 1..4 (interleaved 2..4), m in 1..2p+3 (interleaved p..2p+3), v in 2..3 (zbv 2).
    The grid tests loop over it inside one test per kind: a test per layout costs more in pytest than in
    the check, and each assertion names its layout."""
    for p in range(2 if kind == "interleaved" else 1, 5):
        for m in range(p if kind == "interleaved" else 1, 2 * p + 4):
            for v in {"interleaved": (2, 3), "zbv": (2,)}.get(kind, (1,)):
                yield p, m, v


def validate(kind, schedule, p, m, v):
    """validate_schedule with the placement and the W actions of `kind`."""
    validate_schedule(schedule, p, m, v, placement=placement_of(kind), weights=splits_backward(kind))


def test_action_names_and_placement():
    assert str(Action(Op.FORWARD, 2, 5)) == "2F5"
    assert str(Action(Op.SEND_ACT, 2, 5)) == "2SEND_F5"
    assert str(Action(Op.RECV_GRAD, 0, 1)) == "0RECV_B1"
    assert [stage_to_rank(j, 4) for j in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rank_stages(1, 4, 3) == [1, 5, 9]


@pytest.mark.parametrize("kind", KINDS)
def test_schedules_validate(kind):
    for p, m, v in layouts(kind):
        schedule = build_schedule(kind, p, m, v)
        validate(kind, schedule, p, m, v)
        if p == 1:  # neighbouring stages are local: no messages at all
            assert all(a.op in COMPUTE for a in schedule[0]), (kind, p, m, v)
        for rank, actions in enumerate(schedule):  # the planner's compute order: the schedule without messages
            assert compute_order(kind, rank, p, m, v) == [a for a in actions if a.op in COMPUTE], (kind, p, m, v)


@pytest.mark.parametrize("p,m,v", [(1, 3, 1), (2, 1, 1), (2, 5, 1), (3, 4, 2), (4, 6, 3)])
def test_forward_schedule_validates(p, m, v):
    schedule = build_forward_schedule(p, m, v)
    validate_schedule(schedule, p, m, v, forward_only=True)
    assert all(a.op not in (Op.BACKWARD, Op.SEND_GRAD, Op.RECV_GRAD) for actions in schedule for a in actions)
    with pytest.raises(ScheduleError, match="missing"):  # a training check would ask for the backwards
        validate_schedule(schedule, p, m, v)
    with pytest.raises(ScheduleError, match="unexpected action"):
        validate_schedule(build_schedule("gpipe", p, m), p, m, 1, forward_only=True)


@pytest.mark.parametrize("kind", KINDS)
def test_in_flight(kind):
    for p, m, v in layouts(kind):
        for rank, actions in enumerate(build_schedule(kind, p, m, v)):
            held, where = in_flight(actions), (kind, p, m, v, rank)
            if kind == "gpipe":
                assert held == m, where
            elif kind == "1f1b":
                assert held <= min(m, p - rank), where
                if rank == 0 and m >= p:
                    assert held == p, where
            elif kind == "zb-h1":  # F until W: 1F1B's rank-0 bound p on every rank, reached from m = p
                assert held == min(m, p), where
            elif kind == "zbv":  # half-size chunks: 2p chunk activations are p stages' worth, from m = 2p-1
                assert held <= 2 * p, where
                if m >= 2 * p - 1:
                    assert held == 2 * p, where
            else:
                warmup = interleaved_warmup(rank, p, m, v)
                if m % p == 0:  # Megatron-Core's count, unchanged where it applies
                    assert warmup == min((p - rank - 1) * 2 + (v - 1) * p, m * v), where
                assert held <= min(warmup + 1, m * v), where


def test_interleaved_groups_cover_any_m():
    assert interleaved_groups(4, 8) == [4, 4]
    assert interleaved_groups(4, 11) == [6, 5]
    assert interleaved_groups(3, 4) == [4]
    for p in range(1, 6):
        for m in range(p, 4 * p):
            groups = interleaved_groups(p, m)
            assert sum(groups) == m and min(groups) >= p and max(groups) - min(groups) <= 1


@pytest.mark.parametrize(
    "kind,backward_ratio",
    [(kind, ratio) for kind in KINDS for ratio in ((2.0,) if splits_backward(kind) else (1.0, 2.0))],
)
def test_simulated_bubble_matches_theory(kind, backward_ratio):
    # Chunk times scale with 1/v so that every kind does the same work; the bubble fraction is exact. The
    # split kinds' formulas are for F = B = W, i.e. a full backward B + W of twice the forward.
    for p, m, v in layouts(kind):
        times = (1.0 / v, 1.0 / v, 0.0, 1.0 / v) if splits_backward(kind) else (1.0 / v, backward_ratio / v)
        timeline = simulate(build_schedule(kind, p, m, v), p, m, v, *times, placement=placement_of(kind))
        assert timeline.bubble_fraction() == pytest.approx(theoretical_bubble(kind, p, m, v), abs=1e-9), (p, m, v)
        if kind == "interleaved":
            one_f_one_b = simulate(build_schedule("1f1b", p, m), p, m, 1, 1.0, backward_ratio)
            assert timeline.bubble_fraction() < one_f_one_b.bubble_fraction(), (p, m, v)
            assert timeline.makespan < one_f_one_b.makespan, (p, m, v)


def test_simulation_with_p2p_and_uneven_stages():
    p, m, tf, tb, c = 4, 6, 1.0, 2.0, 0.25
    gpipe = simulate(build_schedule("gpipe", p, m), p, m, 1, tf, tb, p2p_time=c)
    # Fill and drain each cross p-1 links twice (forward, then backward).
    assert gpipe.makespan == pytest.approx((m + p - 1) * (tf + tb) + 2 * (p - 1) * c)
    assert len(gpipe.events[1]) == len(build_schedule("gpipe", p, m)[1])
    even = simulate(build_schedule("1f1b", p, m), p, m, 1, tf, tb)
    heavy_last = simulate(build_schedule("1f1b", p, m), p, m, 1, lambda j: 2 * tf if j == p - 1 else tf, tb)
    assert heavy_last.makespan > even.makespan
    assert heavy_last.bubble_fraction() > even.bubble_fraction()


def test_fifo_check_catches_swapped_sends():
    p, m = 2, 3
    schedule = build_schedule("gpipe", p, m)
    rank0 = schedule[0]
    sends = [a for a in rank0 if a.op is Op.SEND_ACT]
    rest = [a for a in rank0 if a.op is not Op.SEND_ACT]
    last_f = max(i for i, a in enumerate(rest) if a.op is Op.FORWARD)
    sends[0], sends[1] = sends[1], sends[0]  # each still after its F: only the channel order is wrong
    schedule[0] = rest[: last_f + 1] + sends + rest[last_f + 1 :]
    with pytest.raises(ScheduleError, match="out of order"):
        validate_schedule(schedule, p, m, 1)


def test_fifo_needs_hoisted_receives_when_one_channel_carries_both_directions():
    # Interleaving on 2 ranks: the 0 -> 1 channel carries activations and gradients. With groups of unequal
    # size (m=5: 3 and 2), receiving each message right before its use would disagree with the send order;
    # the builder hoists those receives instead.
    p, m, v = 2, 5, 2
    schedule = build_schedule("interleaved", p, m, v)
    naive = []
    for actions in schedule:
        recvs = {
            Action(Op.FORWARD if a.op is Op.RECV_ACT else Op.BACKWARD, a.stage, a.microbatch): a
            for a in actions
            if a.op in RECVS
        }
        program = []
        for a in actions:
            if a.op in RECVS:
                continue
            if a in recvs:
                program.append(recvs[a])
            program.append(a)
        naive.append(program)
    assert naive != schedule
    with pytest.raises(ScheduleError, match="out of order"):
        validate_schedule(naive, p, m, v)


def test_deadlock_check():
    p, m = 2, 2
    schedule = build_schedule("1f1b", p, m)
    recv = Action(Op.RECV_GRAD, 0, 0)
    schedule[0].remove(recv)
    schedule[0].insert(0, recv)  # rank 0 waits for a gradient before sending any activation
    # Both ranks stuck: rank 0 on the gradient, rank 1 on the activation rank 0 would send first.
    stuck = r"deadlock: rank 0 waits at 0RECV_B0 \(position 0\) for rank 1; rank 1 waits at 1RECV_F0 .* for rank 0"
    with pytest.raises(ScheduleError, match=stuck):
        validate_schedule(schedule, p, m, 1)
    with pytest.raises(ScheduleError, match=stuck):
        simulate(schedule, p, m, 1, 1.0, 2.0)


def test_validate_catches_incomplete_or_misordered():
    p, m = 2, 2
    good = build_schedule("1f1b", p, m)
    missing = [list(r) for r in good]
    missing[1].remove(Action(Op.BACKWARD, 1, 0))
    with pytest.raises(ScheduleError, match="missing"):
        validate_schedule(missing, p, m, 1)
    wrong_rank = [list(r) for r in good]
    wrong_rank[0].append(Action(Op.FORWARD, 1, 0))
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        validate_schedule(wrong_rank, p, m, 1)
    b_first = [list(r) for r in good]
    f, b = Action(Op.FORWARD, 1, 0), Action(Op.BACKWARD, 1, 0)
    i, j = b_first[1].index(f), b_first[1].index(b)
    b_first[1][i], b_first[1][j] = b, f
    with pytest.raises(ScheduleError, match="needs its forward"):
        validate_schedule(b_first, p, m, 1)
    with pytest.raises(ScheduleError, match="one action list per pipeline rank"):
        validate_schedule(good[:1], p, m, 1)


@pytest.mark.parametrize(
    "kind,p,m,v,match",
    [
        ("zigzag", 2, 4, 1, "unknown pipeline schedule"),
        ("1f1b", 0, 4, 1, "p must be"),
        ("1f1b", 2, 0, 1, "m must be"),
        ("gpipe", 2, 4, 0, "v must be"),
        ("gpipe", 2, 4, 2, "v must be 1"),
        ("1f1b", 2, 4, 2, "v must be 1"),
        ("interleaved", 2, 4, 1, "v >= 2"),
        ("interleaved", 4, 3, 2, "m >= p"),
    ],
)
def test_bad_inputs(kind, p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(kind, p, m, v)
    with pytest.raises(ScheduleError, match=match):
        compute_order(kind, 0, p, m, v)


def test_bad_forward_inputs():
    with pytest.raises(ScheduleError, match="m must be"):
        build_forward_schedule(2, 0)
    with pytest.raises(ScheduleError, match="rank must be"):
        compute_order("1f1b", 2, 2, 4)


@pytest.mark.parametrize(
    "kind,p,m,v",
    [
        ("gpipe", 3, 5, 1),
        ("1f1b", 2, 8, 1),
        ("1f1b", 4, 9, 1),
        ("interleaved", 2, 5, 2),
        ("interleaved", 3, 7, 3),
        ("zb-h1", 4, 9, 1),
        ("zbv", 3, 7, 2),
        ("zbv", 4, 5, 2),
    ],
)
def test_send_releases_come_after_the_receive(kind, p, m, v):
    """A released send's receive ends before the action that releases it, whatever the durations (random
    stage times and link latency); and 1f1b holds at most p sends at once instead of one per micro-batch."""
    schedule, placement = build_schedule(kind, p, m, v), placement_of(kind)
    rng = random.Random(0)
    timelines = [
        simulate(
            schedule,
            p,
            m,
            v,
            [rng.uniform(0.1, 2) for _ in range(p * v)].__getitem__,
            [rng.uniform(0.1, 4) for _ in range(p * v)].__getitem__,
            rng.uniform(0, 1),
            [rng.uniform(0.1, 2) for _ in range(p * v)].__getitem__,
            placement=placement,
        )
        for _ in range(20)
    ]
    for rank, actions in enumerate(schedule):
        releases = send_releases(schedule, p, rank, placement)
        released = [s for sends in releases.values() for s in sends]
        assert len(released) == len(set(released)) and set(released) <= {a for a in actions if a.op in SENDS}
        for timeline in timelines:
            end = {a: e for a, _, e in timeline.events[rank]}
            received = {}
            for q in range(p):
                received.update({(a.op, a.stage, a.microbatch): e for a, _, e in timeline.events[q] if a.op in RECVS})
            for after, sends in releases.items():
                for s in sends:
                    recv = Action(
                        Op.RECV_ACT if s.op is Op.SEND_ACT else Op.RECV_GRAD,
                        s.stage + 1 if s.op is Op.SEND_ACT else s.stage - 1,
                        s.microbatch,
                    )
                    assert received[(recv.op, recv.stage, recv.microbatch)] <= end[after], (rank, s, after)
        held, peak = set(), 0
        for a in actions:
            if a.op in SENDS:
                held.add(a)
            held -= set(releases.get(a, ()))
            peak = max(peak, len(held))
        if kind == "1f1b":
            assert peak <= p < m
        if kind == "gpipe" and rank < p - 1:
            assert peak == m  # every activation is out before the first gradient comes back


def test_theoretical_bubble():
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("1f1b", 4, 8) == theoretical_bubble("gpipe", 4, 8)
    assert theoretical_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ScheduleError):
        theoretical_bubble("zigzag", 4, 8)


def test_format_grid():
    grid = format_grid(build_schedule("1f1b", 2, 3))
    lines = grid.splitlines()
    assert len(lines) == 3 and lines[1].startswith("rank 0") and "0F0" in lines[1] and "1B2" in lines[2]
    assert "SEND" not in grid
    assert "0SEND_F0" in format_grid(build_schedule("1f1b", 2, 3), include_comm=True)


def test_gantt_png(tmp_path):
    p, m, v = 2, 4, 2
    timeline = simulate(build_schedule("interleaved", p, m, v), p, m, v, 1.0, 2.0, p2p_time=0.1)
    path = tmp_path / "gantt.png"
    save_gantt_png(timeline, str(path), "interleaved p=2 m=4 v=2")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    # A measured timeline is the same object, filled by the runtime.
    measured = Timeline([[(Action(Op.FORWARD, 0, 0), 0.0, 1.5), (Action(Op.BACKWARD, 0, 0), 1.5, 4.0)]], 4.0)
    assert measured.bubble_fraction() == pytest.approx(0.0)
    save_gantt_png(measured, str(tmp_path / "measured.png"), "measured")
    assert (tmp_path / "measured.png").stat().st_size > 1000
