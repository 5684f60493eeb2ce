"""The error band printed with every plan: how far the planner has been from published runs like this one.

The numbers are the residuals of `python bench/planner_vs_published.py` (its last lines print them): per subset of
published runs, the root mean square of (predicted - published) / published over the rows not held out as
what-ifs. A plan reads the subset closest to its own kind of run (MoE, long context, FSDP / ZeRO-3, else every
row), so a prediction of 1,000 tokens/s with a band of 0.12 means runs like it landed between ~880 and ~1,120
(one standard deviation of the table's errors, not a bound). Re-run the bench and update these after any change
to the time model.
"""

from __future__ import annotations

from large_model_training.layout import Job, Layout

# From `python bench/planner_vs_published.py` (docs/planner.md, "Against published runs"), 2026-12-05, after issue
# 35's eager ops, host time, sac, dispatch kernels, the collectives' SM share, batched materialised-attention
# GEMMs, NCCL's collective model (planner/nccl.py) and the runs' own gradient sync, schedules and DualPipe.
RESIDUALS = {  # subset: (rms of relative errors, rows, mean signed error)
    "all": (0.153, 25, 0.086),
    "Megatron": (0.166, 16, 0.101),
    "Meta": (0.056, 2, 0.056),
    "long context": (0.242, 1, 0.242),
    "FSDP": (0.139, 4, 0.037),
    "MoE": (0.017, 2, 0.015),
}


def subset_of(job: Job, layout: Layout | None) -> str:
    """The subset of published runs a plan is judged by."""
    if job.model.moe_experts:
        return "MoE"
    if job.seq_len > 8192 or (layout is not None and layout.cp > 1):
        return "long context"
    if layout is not None and layout.zero == 3:
        return "FSDP"
    return "all"


def band(job: Job, layout: Layout | None) -> tuple[float, int, float, str]:
    """(rms, rows, mean signed error, subset) for this plan; the whole table where its subset has no row."""
    name = subset_of(job, layout)
    if name not in RESIDUALS:
        name = "all"
    return (*RESIDUALS[name], name)


def band_note(job: Job, layout: Layout | None) -> str:
    rms, rows, signed, name = band(job, layout)
    return (
        f"error band: +-{rms:.0%} on step time and throughput (rms of {rows} published runs' residuals, "
        f"subset '{name}', mean signed {signed:+.0%}: bench/planner_vs_published.py)"
    )
