"""`lmt rehearse`: the real runtime at a real 100B-1T shape, one rank at a time, on fake devices.

Each distinct kind of rank in the layout (the first, a middle and the last pipeline stage; the first and last
ZeRO shard position where they differ) runs in this process as rank r of a world of N on PyTorch's `fake`
process-group backend (collectives return at once, moving nothing) with every tensor a FakeTensor (shapes,
dtypes and devices, no storage). What runs is the product: `assemble` builds and initialises the rank's shards,
the pipeline executor runs the schedule's forward and backward, the engine reduces, clips, steps and
re-gathers, exactly as `lmt train` does. Measured per kind, by `memory/tracker.py`: bytes of parameters,
gradients, optimizer states and other buffers after a step, the peak during a step, the bytes each axis's
collectives move, and the operators dispatched per step (an accelerator's launch count), next to the
planner's `lmt estimate` figures for the same layout and the same (CPU) kernels.

What cannot run without data is stood in for, and the report says so: the loss and gradient norm are never
read to the host (the step applies a clip scale of 1 and counts as finite), the batch is random token ids,
under ep > 1 every rank sends and receives an equal share of its token copies (balanced routing: the
all-to-all's split sizes are data), and nothing is saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from large_model_training.assembly import assemble
from large_model_training.config import Config
from large_model_training.data.loader import Shard
from large_model_training.errors import ConfigError
from large_model_training.memory.caching_allocator import CachingAllocator
from large_model_training.memory.tracker import AllocationTracker
from large_model_training.mesh import ParallelMesh, RankGrid
from large_model_training.parallel.engine import apply_step, backward_step

STAND_INS = (
    "loss and gradient norm not read (clip scale 1, every step finite)",
    "random token ids as data",
    "no checkpoint saved",
)
RESERVED = (
    "what PyTorch's CUDA caching allocator would reserve for these allocations in this order, with its default "
    "segments and with expandable_segments:True (memory/caching_allocator.py; one stream, no empty_cache)"
)
EP_STAND_IN = "balanced routing (every ep rank sends and receives an equal share of its token copies)"
KERNELS = (
    "CPU: fake tensors on the CPU device save what PyTorch's CPU kernels save (SDPA's CPU flash "
    "kernel); the estimate is `lmt estimate --hardware cpu`'s (fused_kernels off). An accelerator's "
    "kernels save other tensors: there the planner's accelerator terms are the reference."
)


def steps_to_run(zero: int) -> int:
    """Our AdamW allocates its state when it is built, so one step is the steady state; under ZeRO-3 the
    first step creates FSDP2's AdamW moments, and the second is the steady one."""
    return 2 if zero == 3 else 1


@dataclass(frozen=True)
class RankKind:
    """One kind of rank and the rank that stands for it."""

    label: str
    rank: int
    stage: int
    dp_rank: int


def rank_kinds(grid: RankGrid, zero: int) -> list[RankKind]:
    """First, middle and last pipeline stage (tp ranks are alike: equal shards); under ZeRO also the last dp
    position, whose shard of each bucket may be shorter."""
    stages = {0: "first", grid.pp // 2: "middle", grid.pp - 1: "last"} if grid.pp > 1 else {0: "only"}
    group = grid.dp * grid.cp  # ZeRO shards over the gradient group, dp x cp
    positions = [0, group - 1] if zero and group > 1 else [0]
    kinds = []
    for stage, name in sorted(stages.items()):
        for dp in positions:
            suffix = f", dp rank {dp}" if len(positions) > 1 else ""
            kinds.append(RankKind(f"{name} stage{suffix}", grid.rank(stage, dp // grid.cp, 0, dp % grid.cp), stage, dp))
    return kinds


class _FakeAndTracked:
    """Enter the fake mode and the tracker together (re-entrant: assembly enters it once per chunk)."""

    def __init__(self, fake, tracker: AllocationTracker):
        self.fake, self.tracker = fake, tracker

    def __enter__(self):
        self.fake.__enter__()
        self.tracker.__enter__()

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)
        return self.fake.__exit__(*exc)


def measure_steps(cfg: Config, mesh: ParallelMesh, tracker: AllocationTracker, context) -> dict:
    """Assemble this rank inside `context` (which holds `tracker`, and for a rehearsal a FakeTensorMode) and run
    `steps_to_run` training steps; bytes by kind after them, the peak and operators of the last, bytes per axis."""
    t = cfg.train
    shard = Shard(mesh.dp_rank, mesh.dp_size, t.global_batch_size, t.micro_batch_size)
    parts = assemble(cfg, mesh, shard.micro_batches, materialise=context)
    assembly_peak = tracker.peak  # building, sharding and initialising the rank's state
    seq = t.seq_len // mesh.cp_size  # a cp rank's zig-zag part of each sequence
    engine, executor = parts.engine, parts.executor
    with context:
        batches = [
            (
                torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, seq), device=mesh.device),
                torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, seq), device=mesh.device),
            )
            for _ in range(shard.micro_batches)
        ]
        for _ in range(steps_to_run(cfg.parallel.zero)):
            before, first_op = tracker.current, tracker.ops
            tracker.reset_peak()
            mesh.tp.bytes = mesh.cp.bytes = mesh.ep.bytes = 0
            backward_step(engine, executor, batches, shard.micro_batches)
            apply_step(engine, t.lr, 1.0, True)
            peak, ops = tracker.peak, tracker.ops - first_op
        kinds = engine.memory_by_kind()
        del batches
        held = tracker.current
    return {
        "param_bytes": kinds["parameters"],
        "grad_bytes": kinds["gradients"],
        "optimizer_bytes": kinds["optimizer_states"],
        "buffer_bytes": max(0, held - sum(kinds.values())),
        "peak_bytes": peak,
        "assembly_peak_bytes": assembly_peak,
        "step_peak_above_start_bytes": peak - before,
        "comm_bytes_tp": int(mesh.tp.bytes),
        "comm_bytes_pp": int(executor.bytes),
        "comm_bytes_dp": int(engine.comm_bytes()),
        "comm_bytes_cp": int(mesh.cp.bytes),
        "comm_bytes_ep": int(mesh.ep.bytes),
        "ops_per_step": ops,
    }


def rehearse_rank(cfg: Config, kind: RankKind) -> dict:
    """`kind.rank` of the layout on the fake backend with fake tensors: `measure_steps`'s report."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = cfg.parallel
    started = time.perf_counter()
    dist.init_process_group("fake", rank=kind.rank, world_size=p.world_size, store=dist.HashStore())
    try:
        mesh = ParallelMesh(p.pp, p.dp, p.tp, torch.device("cpu"), p.cp, p.ep)
        tracker = AllocationTracker(record=True)
        report = measure_steps(cfg, mesh, tracker, _FakeAndTracked(FakeTensorMode(allow_non_fake_inputs=True), tracker))
    finally:
        dist.destroy_process_group()
    events = tracker.events or []
    return {
        "kind": kind.label,
        "rank": kind.rank,
        "stage": kind.stage,
        "dp_rank": kind.dp_rank,
        **report,
        **reserved_peaks(events),
        "seconds": round(time.perf_counter() - started, 2),
    }


def reserved_peaks(events: list[tuple[int, int]]) -> dict:
    """What PyTorch's CUDA caching allocator would reserve for the rank's allocations, in their order
    (memory/caching_allocator.py): with its default segments and with `expandable_segments:True`."""
    default = CachingAllocator().replay(events)
    expandable = CachingAllocator(expandable_segments=True).replay(events)
    return {
        "allocator_allocated_peak_bytes": default.allocated_peak,
        "reserved_peak_bytes": default.reserved_peak,
        "reserved_peak_expandable_bytes": expandable.reserved_peak,
    }


def with_estimates(cfg: Config, reports: list[dict], tolerance: float = 0.10) -> list[dict]:
    """Each report next to the planner's figures for its stage on this machine's (CPU) kernels; a difference
    above `tolerance` of the estimate is flagged."""
    from large_model_training.planner.estimate import local_hardware, memory_by_stage

    stages = memory_by_stage(cfg, local_hardware())
    for report in reports:
        mem = stages[report["stage"]]
        report.update(
            estimate_peak_bytes=int(mem.total),
            estimate_param_bytes=int(mem.parameters),
            estimate_grad_bytes=int(mem.gradients),
            estimate_optimizer_bytes=int(mem.optimizer_states),
            estimate_activation_bytes=int(mem.activations),
        )
        flags = []
        for ours, theirs in (
            ("peak_bytes", "estimate_peak_bytes"),
            ("param_bytes", "estimate_param_bytes"),
            ("grad_bytes", "estimate_grad_bytes"),
            ("optimizer_bytes", "estimate_optimizer_bytes"),
        ):
            if report[theirs] and abs(report[ours] - report[theirs]) > tolerance * report[theirs]:
                flags.append(f"{ours} {report[ours] / report[theirs] - 1:+.0%} vs estimate")
        report["flags"] = flags
        report["kernels"], report["stand_ins"] = "cpu", [*STAND_INS, *([EP_STAND_IN] if cfg.parallel.ep > 1 else [])]
    return reports


def rehearse(cfg: Config) -> list[dict]:
    """Every kind of rank of the validated layout `cfg`, rehearsed one after another, with the estimates."""
    if cfg.parallel.ep > 1 and cfg.parallel.ep_overlap:  # its parts are cut by routed values fakes do not have
        raise ConfigError("lmt rehearse runs --ep > 1 with the synchronous dispatch only: drop --parallel.ep_overlap")
    grid = RankGrid(cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.cp)
    return with_estimates(cfg, [rehearse_rank(cfg, kind) for kind in rank_kinds(grid, cfg.parallel.zero)])
