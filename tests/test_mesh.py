"""The rank grid: pure arithmetic, and the real DeviceMesh groups agreeing with it on 8 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from large_model_training.launch import threads_per_rank
from large_model_training.mesh import ParallelMesh, RankGrid, backend_for, bound_device
from tests.dist import run_ranks


def test_grid_puts_tp_innermost_and_pp_outermost():
    grid = RankGrid(pp=2, dp=2, tp=2)
    assert grid.group_ranks("tp", 0) == [0, 1]  # neighbours: one node
    assert grid.group_ranks("dp", 0) == [0, 2]
    assert grid.group_ranks("pp", 0) == [0, 4]
    assert grid.coordinate(6) == {"pp": 1, "dp": 1, "tp": 0}
    assert all(grid.rank(**grid.coordinate(r)) == r for r in range(8))


def test_backend_follows_device_type():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for("npu") == "hccl"  # torch knows the 'npu' type only once torch_npu is imported
    assert bound_device(torch.device("cuda", 1)) == torch.device("cuda", 1)  # NCCL: init and barriers on it
    assert bound_device(torch.device("cpu")) is None


def test_ranks_share_the_cores_this_process_may_use(monkeypatch):
    """A taskset or container cpuset of 4 cores on a 16-core machine: 4 ranks get 1 thread each, not 4."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert threads_per_rank(4) == 1
    assert threads_per_rank(1) == 4
    assert threads_per_rank(8) == 1


def _mesh_facts():
    mesh = ParallelMesh.for_this_rank(pp=2, dp=2, tp=2)
    facts = {"coord": (mesh.pp_rank, mesh.grad_rank, mesh.tp_rank)}
    for axis in ("pp", "dp", "tp"):
        group = mesh.group(axis)
        # Which global ranks are in this rank's group: all-gather over the group itself.
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, torch.tensor([mesh.rank]), group=group)
        facts[axis] = [int(t) for t in gathered]
    facts["next_stage"] = mesh.stage_rank((mesh.pp_rank + 1) % mesh.pp_size)
    return facts


@pytest.mark.slow
def test_device_mesh_groups_match_the_grid():
    grid = RankGrid(pp=2, dp=2, tp=2)
    for rank, facts in enumerate(run_ranks(_mesh_facts, 8)):
        c = grid.coordinate(rank)
        assert facts["coord"] == (c["pp"], c["dp"], c["tp"])
        for axis in ("pp", "dp", "tp"):
            assert facts[axis] == grid.group_ranks(axis, rank), (rank, axis)
        assert facts["next_stage"] == grid.rank((c["pp"] + 1) % 2, c["dp"], c["tp"])
