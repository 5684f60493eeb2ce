"""NCCL's collective model (planner/nccl.py): the plateaus as published, the latency-bound small messages, NVLS."""

from __future__ import annotations

import pytest

from large_model_training.planner.hardware import CATALOGUE, get_hardware
from large_model_training.planner.nccl import collective_time, link


def bus_bandwidth(kind: str, nbytes: float, n: int, hw_name: str, span: int) -> float:
    """nccl-tests' busbw: algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather / reduce-scatter."""
    t = collective_time(kind, nbytes, n, *link(CATALOGUE[hw_name], span, 8))
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return nbytes / t * factor


@pytest.mark.parametrize(
    "hw_name, span, kind, plateau",
    [
        ("a100-80gb", 8, "all_reduce", 230e9),  # NVIDIA/nccl-tests#149
        ("h100-sxm", 8, "all_gather", 370e9),  # NVIDIA/nccl-tests#212: ring / non-all-reduce
        ("h100-sxm", 8, "all_reduce", 480e9),  # NVLS at 8 GPUs (NVIDIA/nccl#1455)
        ("h100-sxm", 64, "all_reduce", 47e9),  # NDR NICs (NVIDIA/nccl-tests#290)
        ("a100-80gb", 64, "reduce_scatter", 24e9),  # HDR NICs
    ],
)
def test_large_messages_reach_the_published_bus_bandwidth(hw_name, span, kind, plateau):
    busbw = bus_bandwidth(kind, 16 * 2**30, 8, hw_name, span)
    assert busbw == pytest.approx(plateau, rel=0.01)


def test_small_messages_are_latency_bound_and_bandwidth_grows_with_size():
    sizes = [2**k for k in range(10, 34, 2)]
    busbw = [bus_bandwidth("all_reduce", s, 8, "a100-80gb", 8) for s in sizes]
    assert all(a < b for a, b in zip(busbw, busbw[1:]))
    assert busbw[0] < 0.01 * busbw[-1]  # 1 KiB: microseconds of latency, no bandwidth to speak of
    # a tp all-reduce of one 2,048 x 6,144 bf16 activation (25 MB) runs well below the plateau
    assert 0.6 < bus_bandwidth("all_reduce", 2048 * 6144 * 2, 8, "a100-80gb", 8) / busbw[-1] < 0.95
    # NCCL's fastest protocol at 1 KiB is LL: 3.6 us + 14 steps x 0.47 us
    t = collective_time("all_reduce", 1024, 8, *link(CATALOGUE["a100-80gb"], 8, 8))
    assert t == pytest.approx((3.6 + 14 * 0.47) * 1e-6, rel=0.05)


def test_nvls_speeds_all_reduce_only_beyond_four_ranks():
    hw = CATALOGUE["h100-sxm"]
    for n, ratio in ((4, 1.0), (8, 480 / 370)):
        ar = collective_time("all_reduce", 2**32, n, *link(hw, n, 8))
        rs = collective_time("reduce_scatter", 2**32, n, *link(hw, n, 8))
        assert ar / (2 * rs) == pytest.approx(1 / ratio, rel=0.01)


def test_an_entry_without_an_nccl_figure_keeps_the_line_rate_alpha_beta():
    hw = get_hardware("mi300x")
    bw, lat = link(hw, 8, 8)
    t = collective_time("all_gather", 1e9, 8, bw, lat)
    assert t == pytest.approx(7 * hw.intra_node_latency + 7 / 8 * 1e9 / hw.intra_node_bandwidth)


def test_a_framework_that_reduces_after_backward_exposes_the_whole_reduction():
    """Job.grad_overlap False (Megatron-LM 2021's local DDP, DeepSpeed's pipeline engine): the dp all-reduce starts
    after the last backward, so all of it is exposed; overlapped (ours) only its last bucket and the SMs it takes."""
    from dataclasses import replace

    from large_model_training.config import model_from_preset
    from large_model_training.layout import Job, Layout
    from large_model_training.planner.search import Planner
    from large_model_training.planner.timing import dp_gradient_time

    hw, job = CATALOGUE["a100-80gb"], Job(model_from_preset("llama3-8b"), 2048, 256, "bf16")
    lay = Layout(tp=1, pp=1, dp=8, micro_batch_size=1, zero=0)  # inside a node: the backward outlasts the reduction
    after = Planner(replace(job, grad_overlap=False), hw, 8, 8).evaluate(lay, simulate=False).time
    during = Planner(job, hw, 8, 8).evaluate(lay, simulate=False).time
    assert after.dp_exposed_s > 3 * during.dp_exposed_s
    from large_model_training.planner.memory import rank_parameters  # the reduction as the planner prices it

    dense, _ = rank_parameters(job.model, 1, 1, [job.model.n_layers], [0])
    assert after.dp_exposed_s == pytest.approx(dp_gradient_time(job, lay, hw, dense, 8), rel=0.05)
