"""Pipeline schedules as data: one ordered list of compute and point-to-point actions per pipeline rank.

Why data and no torch: one runtime executes these lists, the planner's simulator times them, and the tests
check them (every F before its B, sends matching receives in order, no deadlock) without starting a process.

Conventions. The model is cut into p*v virtual stages, in order, dealt to ranks by the kind's placement
(`actions.py`: "loop", stage j on rank j % p, for every kind but zbv, whose "v" placement runs down the
ranks and back up). The last stage computes the loss inside its F, so its B needs no incoming gradient.
Actions: F (forward), B (backward), and for the split kinds (`SPLIT_BACKWARD`) W: there B computes only
the input gradient, which upstream waits for, and the (stage, micro-batch)'s one W, later on the same rank,
its weight gradient, which nobody waits for.

Kinds:
  - gpipe (Huang et al. 2019): all forwards, then all backwards in the same micro-batch order. Holds m
    activations per rank; its bubble is (p-1)/(m+p-1) of the step.
  - 1f1b (PipeDream-Flush, Narayanan et al. 2021): rank r runs p-r-1 warm-up forwards, then alternates one
    F and one B, then drains the backwards. Same bubble as GPipe, but rank r holds at most p-r activations.
  - interleaved (Narayanan et al. 2021, section 2.2.1; ordering of Megatron-Core's
    forward_backward_pipelining_with_interleaving): each rank runs v chunks; micro-batches go through the
    chunks in groups of p (any m >= p: see `interleaved_groups`). The bubble shrinks by v: (p-1)/(v*m+p-1).
  - zb-h1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B with split backward and
    rank r's W's r micro-batches late, filling 1F1B's cool-down: at F = B = W a third of 1F1B's idle time,
    and at most p activations per rank (1F1B's rank 0). v = 1, any m >= 1.
  - zbv (same paper, section 6): v = 2 chunks per rank in a V, split backward; idles only the (p-1) half-size
    forwards before the last rank's first input, at 1F1B's activation memory. Any m >= 1; the order is
    complete from m = 2p-1 (`zero_bubble.zbv_full_micro_batches`), below it the missing micro-batches are
    left out of that order.
`zero_bubble.py` builds the two zero-bubble orders; `simulate.theoretical_bubble` gives every kind's bubble.

Communication. The runtime posts sends as non-blocking isend and a receive blocks until its data is there,
and NCCL matches the messages between two ranks in posting order. So:
  - each SEND comes right after the compute that produced its tensor: it never blocks, and the peer can
    start as early as possible;
  - each RECV comes as late as possible, right before the compute that consumes it, unless the order of the
    channel forces it earlier (below). Late receives add the fewest waits, and because every rank posts
    its send before moving on to its next receive, the classic 1F1B trap (two neighbours each blocked on a
    receive from the other, neither having sent) cannot happen: whoever computed first has already sent.
  - per ordered rank pair the receives are in the order of the sends (FIFO). The sends on a channel follow
    the sender's compute order; where the receiver consumes in another order (possible only when one
    channel carries activations and gradients: interleaving with p == 2, seen with unequal groups, and the
    V, whose ranks r -> r+1 carry chunk 0's activations and chunk 1's gradients), a receive is hoisted to
    just before the earliest use of any later message on its channel. `checks.validate_schedule` then
    proves the result.
  - two neighbouring stages on one rank (`actions.local_handover`: every pair at p = 1, the turn of a V)
    exchange nothing: the rank's own order carries the tensor.

Evaluation has a program of its own, `build_forward_schedule`: forwards only, with the same messages, so
one action loop runs training and evaluation. It is no kind a user picks (not in KINDS).
"""

from __future__ import annotations

from collections import defaultdict

from large_model_training.choices import SPLIT_BACKWARD, Schedule, splits_backward
from large_model_training.parallel.pipeline.actions import (
    COMPUTE,
    PLACEMENTS,
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
    placement_of,
    rank_stages,
    stage_to_rank,
)
from large_model_training.parallel.pipeline.zero_bubble import zb_h1_order, zbv_full_micro_batches, zbv_order

KINDS = tuple(kind.value for kind in Schedule)
"""The training schedules a user can pick (the config's `Schedule` choice): one list for both."""

__all__ = [
    "COMPUTE",
    "KINDS",
    "PLACEMENTS",
    "RECVS",
    "SENDS",
    "SPLIT_BACKWARD",
    "Action",
    "Op",
    "ScheduleError",
    "build_forward_schedule",
    "build_schedule",
    "check_counts",
    "compute_order",
    "format_grid",
    "in_flight",
    "interleaved_groups",
    "interleaved_table",
    "interleaved_warmup",
    "local_handover",
    "message_key",
    "peer",
    "placement_of",
    "rank_stages",
    "splits_backward",
    "stage_to_rank",
    "zbv_full_micro_batches",
]


def _check_sizes(kind: str, p: int, m: int, v: int) -> None:
    if kind not in KINDS:
        raise ScheduleError(f"unknown pipeline schedule '{kind}'; choose one of {', '.join(KINDS)}")
    check_counts(p, m, v)
    if kind in ("gpipe", "1f1b", "zb-h1") and v != 1:
        raise ScheduleError(f"schedule '{kind}' runs one chunk per rank: v must be 1, got v={v}")
    if kind == "zbv" and v != 2:
        raise ScheduleError(f"schedule 'zbv' runs two chunks per rank in a V: v must be 2, got v={v}")
    if kind == "interleaved":
        if v < 2:
            raise ScheduleError(f"schedule 'interleaved' needs v >= 2 chunks per rank, got v={v}")
        if m < p:
            raise ScheduleError(f"schedule 'interleaved' needs m >= p micro-batches, got m={m}, p={p}")


# ---- compute orders (F, B and W), one per rank; the zero-bubble ones are in zero_bubble.py ------------------


def _gpipe_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    # Backwards in forward order: the same drain order as 1F1B's cool-down, so micro-batch 0 frees first.
    return [Action(Op.FORWARD, rank, i) for i in range(m)] + [Action(Op.BACKWARD, rank, i) for i in range(m)]


def _one_f_one_b_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    # p-rank-1 warm-up forwards are exactly enough to keep every rank busy until the first gradient
    # comes back; after them each B frees the activation the next F allocates, so at most p-rank are held.
    warmup = min(p - rank - 1, m)
    order = [Action(Op.FORWARD, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(Op.FORWARD, rank, warmup + i), Action(Op.BACKWARD, rank, i)]
    return order + [Action(Op.BACKWARD, rank, i) for i in range(m - warmup, m)]


def interleaved_groups(p: int, m: int) -> list[int]:
    """Sizes of the micro-batch groups that go through the chunks together: m // p groups, each of p or more.

    Groups of p keep the ring full: chunk c+1 of micro-batch i on rank 0 needs chunk c of it from rank p-1,
    which finishes exactly p slots later. A group smaller than p would stall the ring, so when p does not
    divide m the remainder is spread over the groups (sizes differ by at most one, larger ones first).
    This extends Megatron-Core, whose groups all have one size and which refuses a short last group.
    """
    n_groups = m // p
    return [m // n_groups + (1 if g < m % n_groups else 0) for g in range(n_groups)]


def interleaved_table(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward slot, the same on every rank (Megatron-Core's schedule table).

    A group goes through chunk 0, then chunk 1, ..., then the next group starts: for p=2, m=4, v=2 the
    micro-batches are 0 1 0 1 2 3 2 3 through chunks 0 0 1 1 0 0 1 1.
    """
    table: list[tuple[int, int]] = []
    start = 0
    for size in interleaved_groups(p, m):
        table += [(mb, chunk) for chunk in range(v) for mb in range(start, start + size)]
        start += size
    return table


def interleaved_warmup(rank: int, p: int, m: int, v: int) -> int:
    """Forwards before the first backward on `rank` (Megatron-Core): (p-rank-1)*2 + (v-1)*group, capped at m*v.

    (v-1)*group forwards take the first group through all but the last chunk, so that backward slot k (the
    mirrored chunk of forward slot k) always finds its own forward done; the extra 2 per downstream rank
    cover the forward and the backward that must cross it before the first gradient arrives. With unequal
    groups the largest sets the count, which keeps the bubble at (p-1)/(v*m+p-1) (tested).
    """
    return min((p - rank - 1) * 2 + (v - 1) * max(interleaved_groups(p, m)), m * v)


def _interleaved_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    table = interleaved_table(p, m, v)
    forwards = [Action(Op.FORWARD, chunk * p + rank, mb) for mb, chunk in table]
    # Backward slot k takes the micro-batch of forward slot k through the mirrored chunk: gradients enter
    # at the last chunk, as activations entered at the first.
    backwards = [Action(Op.BACKWARD, (v - 1 - chunk) * p + rank, mb) for mb, chunk in table]
    warmup = interleaved_warmup(rank, p, m, v)
    order = forwards[:warmup]
    for k in range(m * v - warmup):  # steady state: forward slot warmup+k, then backward slot k
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[m * v - warmup :]


_ORDERS = {
    "gpipe": _gpipe_order,
    "1f1b": _one_f_one_b_order,
    "interleaved": _interleaved_order,
    "zb-h1": lambda rank, p, m, v: zb_h1_order(rank, p, m),
    "zbv": lambda rank, p, m, v: zbv_order(rank, p, m),
}


def compute_order(kind: str, rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """The F, B and W actions of one rank in execution order: `build_schedule` without the messages, which
    are the costly part of a build for many ranks (the planner counts in-flight activations from this)."""
    _check_sizes(kind, p, m, v)
    if not 0 <= rank < p:
        raise ScheduleError(f"rank must be in [0, {p}), got {rank}")
    return _ORDERS[kind](rank, p, m, v)


def _forward_order(rank: int, p: int, m: int, v: int, placement: str) -> list[Action]:
    # Each forward in its slot of a full pipeline (stage + micro-batch, one slot per forward): every input is
    # produced in an earlier slot, so nothing waits on a message not yet sent, and a rank keeps feeding new
    # micro-batches into its first chunk instead of waiting for one to come round to its next chunk (which
    # would serialise a V). Tested to be as short as the pipeline allows.
    stages = rank_stages(rank, p, v, placement)
    return sorted(
        (Action(Op.FORWARD, stage, mb) for mb in range(m) for stage in stages),
        key=lambda a: (a.stage + a.microbatch, a.stage),
    )


# ---- communication -------------------------------------------------------------------------------------------


def _produced(action: Action, last: int, remote: list[bool]) -> Action | None:
    """The send that follows a compute action, if its result leaves the rank (`remote[j]`: stages j and
    j+1 are on different ranks)."""
    if action.op is Op.FORWARD and action.stage < last and remote[action.stage]:
        return Action(Op.SEND_ACT, action.stage, action.microbatch)
    if action.op is Op.BACKWARD and action.stage > 0 and remote[action.stage - 1]:
        return Action(Op.SEND_GRAD, action.stage, action.microbatch)
    return None


def _consumer(recv: Action) -> Action:
    op = Op.FORWARD if recv.op is Op.RECV_ACT else Op.BACKWARD
    return Action(op, recv.stage, recv.microbatch)


def _matching_recv(send: Action) -> Action:
    if send.op is Op.SEND_ACT:
        return Action(Op.RECV_ACT, send.stage + 1, send.microbatch)
    return Action(Op.RECV_GRAD, send.stage - 1, send.microbatch)


def _add_communication(compute: list[list[Action]], p: int, v: int, placement: str) -> list[list[Action]]:
    last = p * v - 1
    remote = [not local_handover(j, p, placement) for j in range(last)]
    position = [{a: i for i, a in enumerate(actions)} for actions in compute]
    channels: dict[tuple[int, int], list[Action]] = defaultdict(list)  # receives, in the sender's order
    for rank, actions in enumerate(compute):
        for a in actions:
            send = _produced(a, last, remote)
            if send is not None:
                channels[(rank, peer(send, p, placement))].append(_matching_recv(send))
    # A receive goes right before the earliest use of itself or of any later message on its channel: as
    # late as possible while keeping the channel's order.
    slots: list[dict[int, list[tuple[tuple[int, int], int, Action]]]] = [defaultdict(list) for _ in range(p)]
    for (src, dst), recvs in channels.items():
        deadline = len(compute[dst])
        for idx in range(len(recvs) - 1, -1, -1):
            deadline = min(deadline, position[dst][_consumer(recvs[idx])])
            slots[dst][deadline].append(((src, dst), idx, recvs[idx]))
    schedule = []
    for rank, actions in enumerate(compute):
        program = []
        for i, a in enumerate(actions):
            program += [recv for _, _, recv in sorted(slots[rank][i], key=lambda s: (s[0], s[1]))]
            program.append(a)
            send = _produced(a, last, remote)
            if send is not None:
                program.append(send)
        schedule.append(program)
    return schedule


def build_schedule(kind: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per-rank action lists for `kind` with p pipeline ranks, m micro-batches and v chunks per rank, its
    stages placed by `placement_of(kind)`."""
    _check_sizes(kind, p, m, v)
    compute = [_ORDERS[kind](rank, p, m, v) for rank in range(p)]
    return _add_communication(compute, p, v, placement_of(kind))


def build_forward_schedule(p: int, m: int, v: int = 1, placement: str = "loop") -> list[list[Action]]:
    """Per-rank action lists that take every micro-batch through every stage, forwards only (evaluation of a
    model placed as `placement`: "v" for a zbv model)."""
    check_counts(p, m, v)
    check_placement(placement)
    return _add_communication([_forward_order(rank, p, m, v, placement) for rank in range(p)], p, v, placement)


def in_flight(schedule_for_rank: list[Action]) -> int:
    """Peak number of (stage, micro-batch) activations held on a rank: from F until the action that frees
    them, the B, or the W where the list has W's (split kinds: W still reads the saved layer inputs)."""
    frees = Op.WEIGHT if any(a.op is Op.WEIGHT for a in schedule_for_rank) else Op.BACKWARD
    held: set[tuple[int, int]] = set()
    peak = 0
    for a in schedule_for_rank:
        if a.op is Op.FORWARD:
            held.add((a.stage, a.microbatch))
            peak = max(peak, len(held))
        elif a.op is frees:
            held.discard((a.stage, a.microbatch))
    return peak


def format_grid(schedule: list[list[Action]], include_comm: bool = False) -> str:
    """One row per rank, one column per program step (F, B and W only unless include_comm), for docs and logs."""
    rows = [[str(a) for a in actions if include_comm or a.op in COMPUTE] for actions in schedule]
    steps = max((len(r) for r in rows), default=0)
    labels = [f"rank {r}" for r in range(len(rows))]
    label_width = max((len(s) for s in labels), default=4)
    widths = [max([len(str(i))] + [len(r[i]) for r in rows if i < len(r)]) for i in range(steps)]
    lines = ["step".ljust(label_width) + " | " + " ".join(str(i).rjust(w) for i, w in enumerate(widths))]
    for label, row in zip(labels, rows):
        cells = [(row[i] if i < len(row) else "").rjust(w) for i, w in enumerate(widths)]
        lines.append(label.ljust(label_width) + " | " + " ".join(cells))
    return "\n".join(line.rstrip() for line in lines)
