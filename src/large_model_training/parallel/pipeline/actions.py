"""The vocabulary of pipeline schedules: actions, and which rank holds which virtual stage (placement).

Split from `schedules.py` so that the compute orders (`schedules.py`, `zero_bubble.py`), the replay
(`simulate.py`) and the checks share one definition of who talks to whom, without an import circle.

Placement. The model is cut into p*v virtual stages, in order. Two ways to deal them to p ranks:
  - "loop" (every kind but zbv): stage j on rank j % p, so with v >= 2 a rank holds the non-adjacent chunks
    r, r+p, r+2p, ... (Narayanan et al. 2021, section 2.2.1). With p >= 2 neighbouring stages are always on
    different ranks.
  - "v" (zbv; Qi et al. 2023, section 6): chunk c of rank r is stage c*p + r for even c and c*p + p-1-r for
    odd c, so the model runs down the ranks and back up. With v = 2: stage j < p on rank j, stage j >= p on
    rank 2p-1-j. Rank p-1 holds stages p-1 and p, and rank 0 the first and the last stage.
Whenever stages j and j+1 live on the same rank (every pair at p = 1, the turn of a V), the tensor is handed
over in memory: no message, and the rank's own order (F of j before F of j+1, B of j+1 before B of j) is
the only dependency.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from large_model_training.choices import Schedule


class ScheduleError(ValueError):
    """A schedule that cannot be built (bad kind or sizes) or that breaks a property the runtime relies on."""


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    """The whole backward, or (split kinds, `choices.SPLIT_BACKWARD`) the input gradient only."""
    WEIGHT = "W"
    """Split kinds only: the weight gradient of a (stage, micro-batch) whose B has run on this rank."""
    SEND_ACT = "SEND_F"
    RECV_ACT = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
SENDS = (Op.SEND_ACT, Op.SEND_GRAD)
RECVS = (Op.RECV_ACT, Op.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: `op` for virtual stage `stage` (in [0, p*v)) on micro-batch `microbatch`."""

    op: Op
    stage: int
    microbatch: int

    def __str__(self) -> str:
        # Same spelling as torch.distributed.pipelining: "2F5", "2W5", "2SEND_F5".
        return f"{self.stage}{self.op.value}{self.microbatch}"


PLACEMENTS = ("loop", "v")


def placement_of(kind: str) -> str:
    """How `kind` deals its stages to ranks: "v" for zbv, "loop" for every other kind."""
    return "v" if str(kind) == Schedule.ZBV.value else "loop"


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ScheduleError(f"unknown stage placement '{placement}'; choose one of {', '.join(PLACEMENTS)}")


def stage_to_rank(stage: int, p: int, placement: str = "loop") -> int:
    """Pipeline rank that holds virtual stage `stage` (module docstring: "loop" or "v")."""
    if placement == "loop":
        return stage % p
    check_placement(placement)
    chunk, offset = divmod(stage, p)
    return offset if chunk % 2 == 0 else p - 1 - offset


def rank_stages(rank: int, p: int, v: int, placement: str = "loop") -> list[int]:
    """The v virtual stages of a rank, in model order (loop: rank, rank+p, ...; v: rank, 2p-1-rank, ...)."""
    check_placement(placement)
    if placement == "loop":
        return [rank + chunk * p for chunk in range(v)]
    return [chunk * p + (rank if chunk % 2 == 0 else p - 1 - rank) for chunk in range(v)]


def local_handover(stage: int, p: int, placement: str = "loop") -> bool:
    """Whether stages `stage` and `stage + 1` live on one rank: the activation and its gradient then pass in
    memory, without a message."""
    return stage_to_rank(stage, p, placement) == stage_to_rank(stage + 1, p, placement)


_NEIGHBOUR = {Op.SEND_ACT: 1, Op.RECV_GRAD: 1, Op.RECV_ACT: -1, Op.SEND_GRAD: -1}


def peer(action: Action, p: int, placement: str = "loop") -> int:
    """The rank at the other end of a communication action."""
    if placement == "loop":
        return (action.stage + _NEIGHBOUR[action.op]) % p  # stage_to_rank, inlined: the simulator's hot path
    return stage_to_rank(action.stage + _NEIGHBOUR[action.op], p, placement)


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
