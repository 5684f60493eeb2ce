"""Writing a measured pipeline step: a Chrome-trace JSON (opens in Perfetto or chrome://tracing, one track per
rank) and a Gantt chart PNG of the pipeline ranks (the same drawing as simulated timelines)."""

from __future__ import annotations

import json

from large_model_training.parallel.pipeline.schedules import Action
from large_model_training.parallel.pipeline.simulate import Timeline, save_gantt_png

Events = list[tuple[Action, float, float]]


def write_chrome_trace(events_by_rank: dict[int, Events], path: str) -> None:
    """Complete ('X') events in microseconds; a thread-name record labels each rank's track."""
    trace = []
    for rank, events in sorted(events_by_rank.items()):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for action, start, end in events:
            trace.append(
                {
                    "name": str(action),
                    "cat": action.op.value,
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": start * 1e6,
                    "dur": max(end - start, 0.0) * 1e6,
                    "args": {"stage": action.stage, "microbatch": action.microbatch},
                }
            )
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def write_gantt(pipeline_events: list[Events], path: str, title: str) -> None:
    """Gantt chart of one measured step; `pipeline_events[r]` are pipeline rank r's events."""
    makespan = max((end for events in pipeline_events for _, _, end in events), default=0.0)
    save_gantt_png(Timeline(events=pipeline_events, makespan=makespan), path, title)
