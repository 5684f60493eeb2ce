"""Zero-bubble schedules (zb-h1, zbv) as data: split backward, V placement, the published bubbles, 1F1B's memory
bound, and the layout rules. No processes; the (p, m) grids of validity live in tests/test_schedules.py."""

import random

import pytest

from large_model_training.choices import SPLIT_BACKWARD, Schedule, splits_backward
from large_model_training.config import build_config
from large_model_training.layout import Job, Layout, layout_problems
from large_model_training.parallel.pipeline.checks import validate_schedule
from large_model_training.parallel.pipeline.schedules import (
    KINDS,
    SENDS,
    Action,
    Op,
    ScheduleError,
    build_forward_schedule,
    build_schedule,
    compute_order,
    format_grid,
    in_flight,
    local_handover,
    placement_of,
    rank_stages,
    stage_to_rank,
)
from large_model_training.parallel.pipeline.simulate import save_gantt_png, simulate, theoretical_bubble


def idle_per_rank(kind, p, m, f=1.0, b=1.0, w=1.0):
    """Simulated makespan minus a rank's compute, in the time unit of a whole stage's F."""
    v = 2 if kind == "zbv" else 1
    schedule = build_schedule(kind, p, m, v)
    if splits_backward(kind):
        timeline = simulate(schedule, p, m, v, f / v, b / v, 0.0, w / v, placement=placement_of(kind))
    else:  # B is the whole backward
        timeline = simulate(schedule, p, m, v, f, b + w)
    return timeline.makespan - m * (f + b + w)


def test_kinds_and_names():
    assert SPLIT_BACKWARD == ("zb-h1", "zbv") and set(SPLIT_BACKWARD) < set(KINDS)
    assert Schedule.parse("ZB-H1", "--schedule") is Schedule.ZB_H1
    assert Schedule.parse("zbv", "--schedule") is Schedule.ZBV
    assert splits_backward(Schedule.ZBV) and splits_backward("zb-h1") and not splits_backward("1f1b")
    assert [placement_of(k) for k in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")] == ["loop"] * 4 + ["v"]
    assert str(Action(Op.WEIGHT, 2, 5)) == "2W5"
    grid = format_grid(build_schedule("zb-h1", 2, 3))
    assert "0W0" in grid and "1W2" in grid and "SEND" not in grid
    assert not any(a.op is Op.WEIGHT for k in ("gpipe", "1f1b") for rank in build_schedule(k, 3, 4) for a in rank)


def test_v_placement():
    p = 4
    assert [stage_to_rank(j, p, "v") for j in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [rank_stages(r, p, 2, "v") for r in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert rank_stages(1, p, 3, "v") == [1, 6, 9]  # a third chunk goes down again
    assert all(stage_to_rank(j, p, "v") == r for r in range(p) for j in rank_stages(r, p, 2, "v"))
    assert [j for j in range(2 * p - 1) if local_handover(j, p, "v")] == [p - 1]  # only the turn of the V
    assert not any(local_handover(j, p) for j in range(2 * p - 1))  # loop: never with p >= 2...
    assert all(local_handover(j, 1) for j in range(3))  # ...and always with p = 1
    with pytest.raises(ScheduleError, match="unknown stage placement 'zigzag'"):
        stage_to_rank(5, p, "zigzag")


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 7), (4, 2)])
def test_the_turn_of_the_v_hands_over_without_messages(p, m):
    schedule = build_schedule("zbv", p, m, 2)
    turn = schedule[p - 1]
    local = {(Op.SEND_ACT, p - 1), (Op.RECV_ACT, p), (Op.SEND_GRAD, p), (Op.RECV_GRAD, p - 1)}
    assert not [a for a in turn if (a.op, a.stage) in local]
    for mb in range(m):  # the rank's own order carries the tensor: F of p-1 before F of p, B of p before B of p-1
        assert turn.index(Action(Op.FORWARD, p - 1, mb)) < turn.index(Action(Op.FORWARD, p, mb))
        assert turn.index(Action(Op.BACKWARD, p, mb)) < turn.index(Action(Op.BACKWARD, p - 1, mb))
    # 2p stages, 2p-1 boundaries, one of them local: 2p-2 activations and 2p-2 gradients per micro-batch.
    sends = [a for rank in schedule for a in rank if a.op in SENDS]
    assert len(sends) == 2 * (2 * p - 2) * m


def test_each_b_has_one_w_on_its_rank_after_it():
    for kind, v in (("zb-h1", 1), ("zbv", 2)):
        for p, m in ((3, 2), (4, 9)):
            for rank in range(p):
                order = compute_order(kind, rank, p, m, v)
                weights = [a for a in order if a.op is Op.WEIGHT]
                assert len(weights) == len(set(weights)) == m * v
                for w in weights:
                    assert order.index(Action(Op.BACKWARD, w.stage, w.microbatch)) < order.index(w)


def test_checks_know_w_and_local_handover():
    p, m = 3, 4
    good = build_schedule("zbv", p, m, 2)
    validate_schedule(good, p, m, 2, placement="v", weights=True)
    with pytest.raises(ScheduleError, match="missing .* first 0W0"):  # W's are part of a split schedule
        validate_schedule([[a for a in r if a.op is not Op.WEIGHT] for r in good], p, m, 2, placement="v", weights=True)
    with pytest.raises(ScheduleError, match="no W actions"):
        validate_schedule(good, p, m, 2, placement="v")
    with pytest.raises(ScheduleError, match="lives on rank"):  # the V's lists are not a loop's
        validate_schedule(good, p, m, 2, weights=True)

    def swapped(rank, first, then):
        out = [list(r) for r in good]
        i, j = out[rank].index(first), out[rank].index(then)
        out[rank][i], out[rank][j] = then, first
        return out

    turn = swapped(p - 1, Action(Op.FORWARD, p - 1, 0), Action(Op.FORWARD, p, 0))
    with pytest.raises(ScheduleError, match="handed over on this rank"):
        validate_schedule(turn, p, m, 2, placement="v", weights=True)
    back = swapped(p - 1, Action(Op.BACKWARD, p, 1), Action(Op.BACKWARD, p - 1, 1))
    with pytest.raises(ScheduleError, match="handed over on this rank"):
        validate_schedule(back, p, m, 2, placement="v", weights=True)
    early_w = swapped(0, Action(Op.BACKWARD, 0, 2), Action(Op.WEIGHT, 0, 2))
    with pytest.raises(ScheduleError, match="needs its backward"):
        validate_schedule(early_w, p, m, 2, placement="v", weights=True)
    message = [list(r) for r in good]
    message[p - 1].append(Action(Op.SEND_ACT, p - 1, 0))
    with pytest.raises(ScheduleError, match="hand over locally on rank 2"):
        validate_schedule(message, p, m, 2, placement="v", weights=True)


def test_published_bubbles_at_equal_f_b_w():
    """Qi et al. 2023 at F = B = W = 1 (a stage's F), p = 4, m = 8: every rank computes 3m = 24.
    1F1B idles (p-1)(F+B+W) = 9 per rank, ZB-H1 (p-1)(F+B-W) = 3, a third, ZB-V (p-1)F/2 = 1.5."""
    p, m = 4, 8
    assert idle_per_rank("1f1b", p, m) == pytest.approx(9.0)
    assert idle_per_rank("zb-h1", p, m) == pytest.approx(3.0)
    assert idle_per_rank("zbv", p, m) == pytest.approx(1.5)
    assert theoretical_bubble("1f1b", p, m) == pytest.approx(9 / 33)
    assert theoretical_bubble("zb-h1", p, m) == pytest.approx(3 / 27)
    assert theoretical_bubble("zbv", p, m, 2) == pytest.approx(1.5 / 25.5)
    for p in range(2, 7):
        for m in range(p, 3 * p + 2):  # ZB-H1: a third of 1F1B's idle time from m = p on
            assert idle_per_rank("zb-h1", p, m) == pytest.approx(idle_per_rank("1f1b", p, m) / 3) == p - 1
        for m in range(2 * p - 1, 3 * p + 2):  # ZB-V: half a stage's F per rank and hop, the least possible
            assert idle_per_rank("zbv", p, m) == pytest.approx((p - 1) / 2)
            if m >= 2 * p:  # (p-1)/(6m+p-1) < 1/13
                assert theoretical_bubble("zbv", p, m, 2) < 1 / 13


def test_zb_h1_bubble_for_unequal_f_b_w():
    """(p-1)(F+B-min(F,B,W)) for m >= p: the paper's (p-1)(F+B-W) where W is the shortest of the three."""
    rng = random.Random(0)
    for _ in range(40):
        f, b, w = (rng.uniform(0.2, 3.0) for _ in range(3))
        p = rng.randint(2, 5)
        m = rng.randint(p, 3 * p)
        assert idle_per_rank("zb-h1", p, m, f, b, w) == pytest.approx((p - 1) * (f + b - min(f, b, w)))


def test_memory_stays_at_1f1b_bound():
    """At most p stage activations per rank (1F1B's rank 0), counting from F to W; zbv's chunks are half stages."""
    for p, m in ((2, 6), (4, 4), (4, 12), (5, 3)):
        one_f_one_b = max(in_flight(r) for r in build_schedule("1f1b", p, m))
        assert one_f_one_b == min(p, m)
        assert max(in_flight(r) for r in build_schedule("zb-h1", p, m)) == one_f_one_b
        assert max(in_flight(r) for r in build_schedule("zbv", p, m, 2)) / 2 <= one_f_one_b
    # W frees, not B: rank 3 of zb-h1 (p=4) defers its W's by 3 micro-batches.
    actions = compute_order("zb-h1", 3, 4, 8)
    assert in_flight(actions) == 4 and in_flight([a for a in actions if a.op is not Op.WEIGHT]) == 1


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_forward_schedules_fill_the_pipeline(placement):
    """Evaluation of either placement: valid for every size, and as short as the pipeline allows with unit
    forwards: the first micro-batch's way through all stages plus the others behind it, or the busiest rank
    (its first input comes after p-1 hops; in a V the last output leaves p-1 hops after it)."""
    for p in range(1, 5):
        for m in range(1, 2 * p + 3):
            for v in (1, 2, 3):
                schedule = build_forward_schedule(p, m, v, placement)
                validate_schedule(schedule, p, m, v, forward_only=True, placement=placement)
                if v == 2 or placement == "loop":
                    hops = 2 * p - 2 if placement == "v" else p - 1
                    span = simulate(schedule, p, m, v, 1.0, 0.0, placement=placement).makespan
                    assert span == max(p * v + m - 1, m * v + hops), (p, m, v)


@pytest.mark.parametrize(
    "kind,p,m,v,match",
    [
        ("zb-h1", 2, 4, 2, "v must be 1"),
        ("zbv", 2, 4, 1, "v must be 2"),
        ("zbv", 2, 4, 3, "v must be 2"),
        ("zbv", 2, 0, 2, "m must be"),
    ],
)
def test_bad_sizes(kind, p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(kind, p, m, v)
    with pytest.raises(ScheduleError, match=match):
        compute_order(kind, 0, p, m, v)


def test_any_m_works_and_few_micro_batches_leave_a_bubble():
    # zbv below 2p-1 micro-batches: the full order with the missing ones left out; idles 2p-1-m like zb-h1 < p.
    assert idle_per_rank("zbv", 4, 3) == pytest.approx(4.0) == idle_per_rank("zb-h1", 4, 3)
    assert idle_per_rank("zbv", 4, 5) == pytest.approx(2.0)
    assert idle_per_rank("zb-h1", 4, 5) == pytest.approx(3.0)
    f, b, w = Op.FORWARD, Op.BACKWARD, Op.WEIGHT  # one micro-batch down the V and back
    assert compute_order("zbv", 0, 3, 1, 2) == [
        Action(f, 0, 0),
        Action(f, 5, 0),
        Action(b, 5, 0),
        Action(w, 5, 0),
        Action(b, 0, 0),
        Action(w, 0, 0),
    ]


def test_gantt_draws_w(tmp_path):
    p, m = 3, 6
    timeline = simulate(build_schedule("zbv", p, m, 2), p, m, 2, 0.5, 0.5, 0.05, 0.5, placement="v")
    assert sum(end - start for r in timeline.events for a, start, end in r if a.op is Op.WEIGHT) == pytest.approx(
        p * 2 * m * 0.5
    )  # busy time counts W
    path = tmp_path / "zbv.png"
    save_gantt_png(timeline, str(path), "zbv p=3 m=6")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _problems(pp=2, v=1, schedule="1f1b", zero=0, dp=1, gbs=16):
    cfg = build_config(None, {"model.n_layers": 8})
    return layout_problems(Job(cfg.model, 128, gbs), Layout(1, pp, dp, 1, Schedule(schedule), v, zero))


def test_layout_rules():
    assert _problems(schedule="zb-h1") == [] and _problems(pp=1, schedule="zb-h1") == []
    assert _problems(pp=4, v=2, schedule="zbv", gbs=2) == []  # any m: 2 micro-batches on 4 ranks run
    assert _problems(v=2, schedule="zb-h1") == [
        "--virtual-stages 2 needs --schedule interleaved (any v >= 2) or zbv (v = 2)"
    ]
    assert "must be 2, got 3" in _problems(v=3, schedule="zbv")[0]
    assert "must be 2, got 1" in _problems(v=1, schedule="zbv")[0]
    assert _problems(pp=1, v=2, schedule="zbv") == ["the zbv schedule needs --pp >= 2"]
    for kind, v in (("zb-h1", 1), ("zbv", 2)):
        assert _problems(v=v, schedule=kind, zero=2, dp=2) == []
        [problem] = _problems(v=v, schedule=kind, zero=3, dp=2)
        assert problem.startswith(f"the {kind} schedule composes with --zero 0, 1 or 2: ZeRO-3") and "W" in problem
    assert _problems(zero=3, dp=2) == []
