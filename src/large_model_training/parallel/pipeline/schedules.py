"""Pipeline schedules as data: one ordered list of compute and point-to-point actions per pipeline rank.

Why data and no torch: one runtime executes these lists, the planner's simulator times them, and the tests
check them (every F before its B, sends matching receives in order, no deadlock) without starting a process.

Conventions. The model is cut into p*v virtual stages, in order; stage j lives on rank j % p, so with v >= 2
a rank holds the non-adjacent chunks r, r+p, r+2p, ... (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.1). The last stage computes the loss
inside its F, so its B needs no incoming gradient.

Kinds:
  - gpipe (Huang et al. 2019): all forwards, then all backwards in the same micro-batch order. Holds m
    activations per rank; its bubble is (p-1)/(m+p-1) of the step.
  - 1f1b (PipeDream-Flush, Narayanan et al. 2021): rank r runs p-r-1 warm-up forwards, then alternates one
    F and one B, then drains the backwards. Same bubble as GPipe, but rank r holds at most p-r activations.
  - interleaved (Narayanan et al. 2021, section 2.2.1; ordering of Megatron-Core's
    forward_backward_pipelining_with_interleaving): each rank runs v chunks; micro-batches go through the
    chunks in groups of p (any m >= p: see `interleaved_groups`). The bubble shrinks by v: (p-1)/(v*m+p-1).

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
    channel carries activations and gradients: interleaving with p == 2, seen with unequal groups), a
    receive is hoisted to just before the earliest use of any later message on its channel.
    `checks.validate_schedule` then proves the result.

Evaluation has a program of its own, `build_forward_schedule`: forwards only, with the same messages, so
one action loop runs training and evaluation. It is no kind a user picks (not in KINDS).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass

from large_model_training.choices import Schedule

KINDS = tuple(kind.value for kind in Schedule)
"""The training schedules a user can pick (the config's `Schedule` choice): one list for both."""


class ScheduleError(ValueError):
    """A schedule that cannot be built (bad kind or sizes) or that breaks a property the runtime relies on."""


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SEND_F"
    RECV_ACT = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"


COMPUTE = (Op.FORWARD, Op.BACKWARD)
SENDS = (Op.SEND_ACT, Op.SEND_GRAD)
RECVS = (Op.RECV_ACT, Op.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: `op` for virtual stage `stage` (in [0, p*v)) on micro-batch `microbatch`."""

    op: Op
    stage: int
    microbatch: int

    def __str__(self) -> str:
        # Same spelling as torch.distributed.pipelining: "2F5", "2SEND_F5".
        return f"{self.stage}{self.op.value}{self.microbatch}"


def stage_to_rank(stage: int, p: int) -> int:
    """Pipeline rank that holds virtual stage `stage` (chunks are dealt round-robin)."""
    return stage % p


def rank_stages(rank: int, p: int, v: int) -> list[int]:
    """The v virtual stages of a rank, in model order: rank, rank+p, ..."""
    return [rank + chunk * p for chunk in range(v)]


_NEIGHBOUR = {Op.SEND_ACT: 1, Op.RECV_GRAD: 1, Op.RECV_ACT: -1, Op.SEND_GRAD: -1}


def peer(action: Action, p: int) -> int:
    """The rank at the other end of a communication action."""
    return (action.stage + _NEIGHBOUR[action.op]) % p  # stage_to_rank, inlined: the simulator's hot path


def message_key(action: Action) -> tuple[str, int, int]:
    """What travels, named the same on both ends: (kind, producing stage, micro-batch)."""
    if action.op is Op.SEND_ACT:
        return ("act", action.stage, action.microbatch)
    if action.op is Op.RECV_ACT:
        return ("act", action.stage - 1, action.microbatch)
    if action.op is Op.SEND_GRAD:
        return ("grad", action.stage, action.microbatch)
    return ("grad", action.stage + 1, action.microbatch)


def check_counts(p: int, m: int, v: int) -> None:
    """Raise ScheduleError unless p, m and v are integers >= 1."""
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {value!r} (p={p}, m={m}, v={v})")


def _check_sizes(kind: str, p: int, m: int, v: int) -> None:
    if kind not in KINDS:
        raise ScheduleError(f"unknown pipeline schedule '{kind}'; choose one of {', '.join(KINDS)}")
    check_counts(p, m, v)
    if kind in ("gpipe", "1f1b") and v != 1:
        raise ScheduleError(f"schedule '{kind}' runs one chunk per rank: v must be 1, got v={v}")
    if kind == "interleaved":
        if v < 2:
            raise ScheduleError(f"schedule 'interleaved' needs v >= 2 chunks per rank, got v={v}")
        if m < p:
            raise ScheduleError(f"schedule 'interleaved' needs m >= p micro-batches, got m={m}, p={p}")


# ---- compute orders (F and B only), one per rank -------------------------------------------------------------


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
    return order + backwards[m * v - warmup:]


_ORDERS = {"gpipe": _gpipe_order, "1f1b": _one_f_one_b_order, "interleaved": _interleaved_order}


def compute_order(kind: str, rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """The F and B actions of one rank in execution order: `build_schedule` without the messages, which are
    the costly part of a build for many ranks (the planner counts in-flight activations from this)."""
    _check_sizes(kind, p, m, v)
    if not 0 <= rank < p:
        raise ScheduleError(f"rank must be in [0, {p}), got {rank}")
    return _ORDERS[kind](rank, p, m, v)


def _forward_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    # Micro-batch by micro-batch, each through this rank's chunks in model order: data only flows to later
    # stages, so nothing waits on a message that has not been sent.
    return [Action(Op.FORWARD, stage, mb) for mb in range(m) for stage in rank_stages(rank, p, v)]


# ---- communication -------------------------------------------------------------------------------------------


def _produced(action: Action, last: int) -> Action | None:
    """The send that follows a compute action, if its result leaves the stage."""
    if action.op is Op.FORWARD and action.stage < last:
        return Action(Op.SEND_ACT, action.stage, action.microbatch)
    if action.op is Op.BACKWARD and action.stage > 0:
        return Action(Op.SEND_GRAD, action.stage, action.microbatch)
    return None


def _consumer(recv: Action) -> Action:
    op = Op.FORWARD if recv.op is Op.RECV_ACT else Op.BACKWARD
    return Action(op, recv.stage, recv.microbatch)


def _matching_recv(send: Action) -> Action:
    if send.op is Op.SEND_ACT:
        return Action(Op.RECV_ACT, send.stage + 1, send.microbatch)
    return Action(Op.RECV_GRAD, send.stage - 1, send.microbatch)


def _add_communication(compute: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    if p == 1:  # every neighbour stage is local: the runtime hands the tensor over without messages
        return [list(actions) for actions in compute]
    last = p * v - 1
    position = [{a: i for i, a in enumerate(actions)} for actions in compute]
    channels: dict[tuple[int, int], list[Action]] = defaultdict(list)  # receives, in the sender's order
    for rank, actions in enumerate(compute):
        for a in actions:
            send = _produced(a, last)
            if send is not None:
                channels[(rank, peer(send, p))].append(_matching_recv(send))
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
            send = _produced(a, last)
            if send is not None:
                program.append(send)
        schedule.append(program)
    return schedule


def build_schedule(kind: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per-rank action lists for `kind` with p pipeline ranks, m micro-batches and v chunks per rank."""
    _check_sizes(kind, p, m, v)
    compute = [_ORDERS[kind](rank, p, m, v) for rank in range(p)]
    return _add_communication(compute, p, v)


def build_forward_schedule(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per-rank action lists that take every micro-batch through every stage, forwards only (evaluation)."""
    check_counts(p, m, v)
    return _add_communication([_forward_order(rank, p, m, v) for rank in range(p)], p, v)


def in_flight(schedule_for_rank: list[Action]) -> int:
    """Peak number of (stage, micro-batch) activations held on a rank: F done, B not yet."""
    held: set[tuple[int, int]] = set()
    peak = 0
    for a in schedule_for_rank:
        if a.op is Op.FORWARD:
            held.add((a.stage, a.microbatch))
            peak = max(peak, len(held))
        elif a.op is Op.BACKWARD:
            held.discard((a.stage, a.microbatch))
    return peak


def format_grid(schedule: list[list[Action]], include_comm: bool = False) -> str:
    """One row per rank, one column per program step (compute only unless include_comm), for docs and logs."""
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
