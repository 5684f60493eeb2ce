"""Pipeline parallelism: schedules as data (`actions` and `schedules`, with the zero-bubble orders in
`zero_bubble`; no torch), their replay (`simulate`: timing, deadlock, send releases), the checks that prove a
schedule runnable (`checks`), and the runtime that executes them over point-to-point messages."""

from large_model_training.parallel.pipeline.checks import validate_schedule
from large_model_training.parallel.pipeline.schedules import (
    KINDS,
    SPLIT_BACKWARD,
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
    splits_backward,
    stage_to_rank,
)
from large_model_training.parallel.pipeline.simulate import Timeline, save_gantt_png, simulate, theoretical_bubble

__all__ = [
    "KINDS",
    "SPLIT_BACKWARD",
    "Action",
    "Op",
    "ScheduleError",
    "build_forward_schedule",
    "build_schedule",
    "compute_order",
    "format_grid",
    "in_flight",
    "local_handover",
    "placement_of",
    "rank_stages",
    "splits_backward",
    "stage_to_rank",
    "validate_schedule",
    "Timeline",
    "save_gantt_png",
    "simulate",
    "theoretical_bubble",
]
