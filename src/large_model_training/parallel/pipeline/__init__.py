"""Pipeline parallelism: schedules as data (`schedules`, no torch), their simulator (`simulate`), and the
runtime that executes them over point-to-point messages."""

from large_model_training.parallel.pipeline.schedules import (KINDS, Action, Op, ScheduleError, build_schedule,
                                                              format_grid, in_flight, rank_stages, stage_to_rank,
                                                              validate_schedule)
from large_model_training.parallel.pipeline.simulate import Timeline, save_gantt_png, simulate, theoretical_bubble

__all__ = ["KINDS", "Action", "Op", "ScheduleError", "build_schedule", "format_grid", "in_flight", "rank_stages",
           "stage_to_rank", "validate_schedule", "Timeline", "save_gantt_png", "simulate", "theoretical_bubble"]
