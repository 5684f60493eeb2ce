"""ZeRO-3 (FSDP2) as it runs, in the runtime and the planner (issue 35): the once-per-step gradient sync
(`parallel.fsdp_sync_per_step`) on the per-micro-batch curve, and the planner's FSDP timing terms."""

from __future__ import annotations

import pytest

from tests.helpers import Runs, assert_close_curves, losses

MODEL = [
    "--model.hidden_size",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.ffn_hidden_size",
    "128",
    "--seq-len",
    "32",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--eval-every",
    "0",
    "--steps",
    "5",
    "--dp",
    "2",
    "--zero",
    "3",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    common = [*MODEL, "--data", small_corpus]
    return Runs(
        tmp_path_factory.mktemp("fsdp"),
        {"per-micro-batch": common, "per-step": [*common, "--parallel.fsdp_sync_per_step", "true"]},
    )


@pytest.mark.slow
def test_one_reduce_scatter_per_step_keeps_the_curve_and_moves_less(runs):
    per_mb, per_step = runs["per-micro-batch"], runs["per-step"]
    assert_close_curves(losses(per_step), losses(per_mb), rtol=1e-5, what="fsdp sync per step")
    # 2 micro-batches per dp rank: the reduce-scatters 2 -> 1, the gathers as they were; FSDP2's bytes are
    # counted at its collectives (parallel/fsdp_counters.py) and equal the planner's count exactly
    from large_model_training.config import build_config
    from large_model_training.planner.comm import zero3_bytes_per_step
    from large_model_training.planner.memory import block_norm_parameters, block_parameters_per_rank, stage_parameters

    cfg = build_config(str(runs.folder("per-step") / "config.toml")).model
    sizes = dict(
        layers=cfg.n_layers,
        block_params=block_parameters_per_rank(cfg, 1),
        block_norm_params=block_norm_parameters(cfg),
        chunk_params=stage_parameters(cfg, 1, 0, True, True),
    )
    for rows, once in ((per_mb, False), (per_step, True)):
        assert rows[-1]["comm_bytes_dp"] == zero3_bytes_per_step(
            2, 2, param_bytes=4, grad_bytes=4, sync_per_step=once, **sizes
        )
    assert per_step[-1]["comm_bytes_dp"] < per_mb[-1]["comm_bytes_dp"]


def _plan(sync_per_step: bool, micro_batch: int = 1, hardware: str = "h100-sxm"):
    from dataclasses import replace as dc_replace

    from large_model_training.choices import RecomputePolicy
    from large_model_training.config import model_from_preset
    from large_model_training.layout import Job, Layout
    from large_model_training.planner.hardware import CATALOGUE
    from large_model_training.planner.search import Planner

    hw = CATALOGUE[hardware]
    job = Job(model_from_preset("llama3-8b"), 4096, 512, "bf16", fsdp_sync_per_step=sync_per_step)
    layout = Layout(tp=1, pp=1, dp=128, micro_batch_size=micro_batch, zero=3, recompute=RecomputePolicy.parse("full"))
    return Planner(job, dc_replace(hw, inter_node_bandwidth=hw.inter_node_bandwidth / 8), 128, 8).evaluate(layout)


def test_the_planner_times_fsdp_groups_and_the_once_per_step_sync():
    from large_model_training.planner.hardware import GB

    per_mb, per_step = _plan(False), _plan(True)
    # 4 micro-batches per rank over a slow link: deferring the reduce-scatter saves 3 of 4 of its passes
    assert per_step.time.step_time_s < per_mb.time.step_time_s
    # ... for this rank's unsharded gradients held meanwhile (bf16: 2 bytes a parameter, less its own shard)
    params = 8.03e9
    assert per_step.memory.buffers - per_mb.memory.buffers == pytest.approx(params * 2 * 127 / 128, rel=0.01)
    assert per_step.memory.buffers - per_mb.memory.buffers > 15 * GB
    # one micro-batch per rank: nothing to defer, the same step
    assert _plan(True, 4).time.step_time_s == pytest.approx(_plan(False, 4).time.step_time_s)
