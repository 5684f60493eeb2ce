"""The pipeline runtime itself: pp = 1 through the executor as the plain loop, evaluation as a forward-only
program, and send buffers freed as the schedule proves them received."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from large_model_training.api import PipelineParallelism
from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.pipeline.runtime import PipelineExecutor
from large_model_training.parallel.pipeline.schedules import build_schedule, in_flight
from tests.dist import run_ranks
from tests.helpers import model_config

CFG = model_config()


def _micro_batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, CFG.vocab_size, (m, 2, 17), generator=torch.Generator().manual_seed(0))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_one_stage_is_the_plain_loop_bit_for_bit(kind):
    """pp = 1: the executor with {0: model} gives the old loop's loss and gradients exactly (dropout on: the
    masks are drawn in the same order). gpipe would too, but holds every activation: the trainer runs 1f1b."""
    cfg = ModelConfig(**{**CFG.__dict__, "dropout": 0.1})
    micro = _micro_batches(4)
    plain, ours = build_model(cfg, None, seed=3), build_model(cfg, None, seed=3)
    torch.manual_seed(7)
    expected = torch.zeros(())
    for x, y in micro:  # the loop the trainer ran for pp = 1 before the executor took it over
        loss = plain.loss_fn(plain(x), y) * 0.25
        loss.backward()
        expected += loss.detach()
    # One rank sends nothing: of a mesh the executor reads only the pipeline size, rank and device.
    mesh = SimpleNamespace(pp_size=1, pp_rank=0, device=torch.device("cpu"))
    executor = PipelineExecutor({0: ours}, ours.loss_fn, mesh, kind, 4, 1)
    torch.manual_seed(7)
    loss = executor.forward_backward(micro, 0.25)
    grads = dict(plain.named_parameters())
    assert torch.equal(loss, expected) and executor.peak_in_flight == (1 if kind == "1f1b" else 4)
    assert all(torch.equal(p.grad, grads[n].grad) for n, p in ours.named_parameters())
    assert [str(a) for a, _, _ in executor.events][:3] == (
        ["0F0", "0B0", "0F1"] if kind == "1f1b" else ["0F0", "0F1", "0F2"]
    )
    plain.eval()
    ours.eval()
    with torch.no_grad():
        unscaled = sum(plain.loss_fn(plain(x), y) for x, y in micro)
    assert torch.equal(executor.forward_only(micro), torch.zeros(()) + unscaled)


def _two_stage_step(kind: str, m: int):
    mesh = ParallelMesh.for_this_rank(2, 1, 1)
    micro = _micro_batches(m)
    full = build_model(CFG, None, seed=2)
    ref = sum(full.loss_fn(full(x), y) for x, y in micro)
    (ref / m).backward()
    stage = PipelineParallelism(mesh, schedule=kind).split_model(CFG, seed=2)
    executor = PipelineExecutor(stage.chunks, stage.loss_fn, mesh, kind, m, 1)
    loss = executor.forward_backward(micro, 1.0 / m)
    torch.distributed.all_reduce(loss, group=mesh.pp_group)
    trained = executor.peak_sends
    full_params = dict(full.named_parameters())
    worst = max(float((p.grad - full_params[n].grad).abs().max()) for n, p in stage.named_parameters())
    with torch.no_grad():
        val = executor.forward_only(micro)
    torch.distributed.all_reduce(val, group=mesh.pp_group)
    return float(loss), float(ref) / m, worst, trained, float(val), float(ref)


@pytest.mark.slow
def test_sends_are_freed_as_the_schedule_proves_them_received():
    """pp = 2, m = 8, 1f1b: a rank holds at most the schedule's in-flight count of send buffers (2), not one per
    micro-batch (8, as when every send was waited at the end of the step); the step and the forward-only
    evaluation still give the unsplit model's loss and gradients."""
    p, m = 2, 8
    bound = max(in_flight(actions) for actions in build_schedule("1f1b", p, m))
    for loss, ref, worst_grad_error, held, val, val_ref in run_ranks(_two_stage_step, p, "1f1b", m):
        assert abs(loss - ref) < 1e-5 * abs(ref) and worst_grad_error < 1e-6
        assert abs(val - val_ref) < 1e-5 * abs(val_ref)
        assert 1 <= held <= bound < m
