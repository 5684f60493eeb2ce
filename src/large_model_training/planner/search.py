"""Layout search: every tp x cp x pp x dp (x ep for MoE models) x micro-batch x schedule x virtual stages x ZeRO x
recompute x sequence parallel that divides the cluster and the model; infeasible ones pruned; ranked by predicted
tokens/s.

Why it answers in seconds for 1T parameters on 8,192 devices: the loops are nested so that whole subtrees
are cut by a cheap bound (model states depend only on tp, pp, dp and ZeRO; if full recompute does not fit,
no other policy does), stage times are cached per shape, and candidates are ranked with the closed-form
bubble of the schedule; only the best ones are then timed by the event simulator of the real schedules
(planner/pipeline.py), and re-ranked.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from large_model_training.choices import RecomputePolicy, Schedule
from large_model_training.errors import ConfigError
from large_model_training.layout import Job, Layout, layout_problems
from large_model_training.parallel.pipeline.schedules import placement_of
from large_model_training.planner.context import ATTENTIONS, cp_degrees
from large_model_training.planner.hardware import GiB, Hardware
from large_model_training.planner.memory import (
    MemoryBreakdown,
    rank_activation_bytes,
    stage_memory,
    state_bytes_per_parameter,
    total_parameters,
)
from large_model_training.planner.moe import ep_degrees
from large_model_training.planner.pipeline import PipelineTiming, rank_loads, rank_stage_list
from large_model_training.planner.shapes import virtual_stage_layers
from large_model_training.planner.timing import StageTimes, StepTime, stage_times, step_time

MAX_MICRO_BATCH = 64
MAX_VIRTUAL_STAGES = 8
SIMULATION_BUDGET_S = 1.5
"""Wall time the search spends simulating its best candidates; later ones keep the closed-form bubble."""


@dataclass(frozen=True)
class Axes:
    """Axes fixed by the user (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    schedule: Schedule | None = None
    virtual_stages: int | None = None
    zero: int | None = None
    recompute: RecomputePolicy | None = None
    sequence_parallel: bool | None = None
    cp: int | None = None
    cp_attention: str | None = None
    ep: int | None = None


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryBreakdown
    """The device with the most memory in use (first or last pipeline stage)."""
    usable_bytes: float
    time: StepTime | None = None
    simulated: bool = False

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def shortfall_bytes(self) -> float:
        return max(0.0, self.memory.total - self.usable_bytes)

    def to_json(self) -> dict:
        """The fields of `lmt plan --json`, exactly."""
        lay, t = self.layout, self.time
        return {
            "tp": lay.tp,
            "cp": lay.cp,
            "cp_attention": lay.cp_attention,
            "pp": lay.pp,
            "dp": lay.dp,
            "ep": lay.ep,
            "micro_batch_size": lay.micro_batch_size,
            "schedule": str(lay.schedule),
            "virtual_stages": lay.virtual_stages,
            "zero": lay.zero,
            "recompute": str(lay.recompute),
            "memory_per_device_bytes": int(self.memory.total),
            "step_time_s": t.step_time_s if t else None,
            "tokens_per_s": t.tokens_per_s if t else None,
            "tflops_per_device": t.tflops_per_device if t else None,
            "mfu": t.mfu if t else None,
            "bubble_fraction": t.bubble_fraction if t else None,
        }


def candidate_ranks(kind: str, p: int, v: int, chunks: list[int]) -> list[int]:
    """The pipeline ranks that can hold the most memory. Ranks whose chunks are alike (blocks, embedding,
    head) differ only by their place in the schedule: in 1F1B-like kinds the earliest of them holds the most
    pairs; in zb-h1 and zbv every count of rank r's order is affine in r (zb-h1: p-r held pairs, up to r
    deferred W's; zbv: 2(p-r)-1 warm-up forwards, r cool-down pairs), so its peak, a maximum of linear
    functions of r, is at one of the group's ends. (Checked against every rank on 1,600 layouts.)"""
    final = len(chunks) - 1
    groups: dict[tuple, list[int]] = {}
    for r in range(p):
        groups.setdefault(tuple((chunks[j], j == 0, j == final) for j in rank_stage_list(kind, p, v, r)), []).append(r)
    ends = [[g[0], g[-1]] if str(kind) in ("zb-h1", "zbv") else [g[0]] for g in groups.values()]
    return list(dict.fromkeys(r for pair in ends for r in pair))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Planner:
    """Evaluates layouts of one job on one cluster; holds the caches of a planning session."""

    job: Job
    hardware: Hardware
    devices: int
    devices_per_node: int
    pipelines: PipelineTiming = field(default_factory=PipelineTiming)
    _times: dict[tuple, StageTimes] = field(default_factory=dict)
    _chunks: dict[tuple, list[int]] = field(default_factory=dict)
    _activations: dict[tuple, float] = field(default_factory=dict)
    _ranks: dict[tuple, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.job.compression.kind == "threshold":
            raise ConfigError(
                f"compression '{self.job.compression}': the volume of threshold sparsification "
                "depends on the gradients and cannot be predicted; plan with topk:R at the density "
                "you expect"
            )

    def chunks(self, layout: Layout) -> list[int]:
        """Blocks per virtual stage (the runtime's partitioner, cached per pipeline shape)."""
        # One chunk per rank splits the same for every kind; chunks split by placement (loop or zbv's V).
        placement = placement_of(layout.schedule) if layout.virtual_stages > 1 else ""
        key = (layout.pp, layout.virtual_stages, placement, layout.pp_layers)
        if key not in self._chunks:
            self._chunks[key] = virtual_stage_layers(self.job, layout)
        return self._chunks[key]

    def memory(self, layout: Layout, limit: float | None = None) -> MemoryBreakdown:
        """The most loaded device of the layout, among the ranks that can be it (`candidate_ranks`). With a
        `limit`, the first device found above it is returned at once: the layout does not fit either way."""
        key = (str(layout.schedule), layout.pp, layout.virtual_stages, layout.pp_layers)
        if key not in self._ranks:
            self._ranks[key] = candidate_ranks(layout.schedule, layout.pp, layout.virtual_stages, self.chunks(layout))
        worst = None
        for rank in self._ranks[key]:
            mem = self.rank_memory(layout, rank)
            if worst is None or mem.total > worst.total:
                worst = mem
            if limit is not None and worst.total > limit:
                break
        return worst

    def rank_memory(self, layout: Layout, rank: int) -> MemoryBreakdown:
        """Memory of one device of pipeline rank `rank`, on the schedule's own occupancy."""
        m, p, v = self.job.micro_batches(layout), layout.pp, layout.virtual_stages
        held = self.pipelines.occupancy(layout.schedule, p, m, v, rank)
        key = (
            layout.tp,
            p,
            m,
            layout.micro_batch_size,
            layout.schedule,
            v,
            layout.recompute,
            layout.sequence_parallel,
            layout.pp_layers,
            rank,
            layout.cp,
            layout.cp_attention,
        )  # what the activations depend on (not ZeRO)
        if key not in self._activations:
            self._activations[key] = rank_activation_bytes(
                self.job, layout, self.chunks(layout), held, self.hardware.fused_kernels
            )
        return stage_memory(
            self.job, layout, rank, self.chunks(layout), held, self.hardware.fused_kernels, self._activations[key]
        )

    def stage_times(self, layout: Layout) -> StageTimes:
        key = (
            layout.tp,
            layout.pp,
            layout.dp,
            layout.micro_batch_size,
            layout.schedule,
            layout.virtual_stages,
            layout.zero,
            layout.recompute.kind,
            layout.sequence_parallel,
            layout.cp,
            layout.cp_attention,
            layout.ep,
        )
        if key not in self._times:
            self._times[key] = stage_times(self.job, layout, self.hardware, self.devices_per_node, self.chunks(layout))
        return self._times[key]

    def evaluate(self, layout: Layout, simulate: bool = True) -> Plan:
        """Memory and step time of one layout (the bubble simulated, or closed-form when simulate=False)."""
        plan = Plan(layout, self.memory(layout), self.hardware.usable_memory_bytes)
        return self.timed(plan, simulate)

    def timed(self, plan: Plan, simulate: bool) -> Plan:
        lay, m = plan.layout, self.job.micro_batches(plan.layout)
        times = self.stage_times(lay)
        p, v = lay.pp, lay.virtual_stages
        if simulate:
            span, bubble = self.pipelines.makespan(
                lay.schedule, p, m, v, times.forward, times.backward, times.p2p, times.weight
            )
        else:
            per_micro_batch = [times.forward[j] + times.backward[j] + times.weight[j] for j in range(p * v)]
            busy = m * max(rank_loads(lay.schedule, p, v, per_micro_batch))
            span = self.pipelines.estimate_makespan(lay.schedule, p, m, v, busy, times.p2p)
            bubble = max(0.0, 1.0 - m * sum(per_micro_batch) / (p * span))
        step = step_time(self.job, lay, self.hardware, span, bubble, times, self.devices_per_node, self.chunks(lay))
        return Plan(lay, plan.memory, plan.usable_bytes, step, simulate)

    # ---- enumeration ---------------------------------------------------------------------------------------

    def candidates(self, axes: Axes):
        """Every layout of the fixed axes that divides the cluster and the model, cheapest bounds first."""
        cfg, n = self.job.model, self.devices
        tps = [axes.tp] if axes.tp else [t for t in divisors(n) if t <= cfg.n_heads and cfg.n_heads % t == 0]
        for tp, cp in ((t, c) for t in tps if n % t == 0 for c in cp_degrees(self.job.seq_len, n // t, axes.cp)):
            if n % (tp * cp):
                continue
            pps = [axes.pp] if axes.pp else [p for p in divisors(n // (tp * cp)) if p <= cfg.n_layers]
            for pp in pps:
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                if axes.dp and dp != axes.dp:
                    continue
                per_rank = self.job.global_batch_size // dp if self.job.global_batch_size % dp == 0 else 0
                mbs = (
                    [axes.micro_batch_size]
                    if axes.micro_batch_size
                    else [b for b in divisors(per_rank) if b <= MAX_MICRO_BATCH]
                    if per_rank
                    else []
                )
                zeros = [axes.zero] if axes.zero is not None else ([0, 1, 2, 3] if dp > 1 else [0])
                # Sequence parallelism moves the same bytes as plain tp and divides norm/dropout memory and
                # traffic by tp: the layout without it is never better, so it is only tried when asked for.
                sps = (
                    [axes.sequence_parallel]
                    if axes.sequence_parallel is not None
                    else [True]
                    if tp > 1 and self.job.seq_len // cp % tp == 0
                    else [False]
                )
                attentions = ["ring"] if cp == 1 else [axes.cp_attention] if axes.cp_attention else list(ATTENTIONS)
                yield tp, cp, attentions, pp, dp, mbs, zeros, sps

    def schedules(self, pp: int, axes: Axes) -> list[tuple[Schedule, int]]:
        """(kind, v) pairs to try: every kind with its v (interleaved: 2..MAX_VIRTUAL_STAGES); which of them
        can split the model (uneven chunks allowed) is `layout_problems`' to say, per candidate."""
        interleaved = [axes.virtual_stages] if axes.virtual_stages else range(2, MAX_VIRTUAL_STAGES + 1)
        if axes.schedule == Schedule.INTERLEAVED:
            return [(Schedule.INTERLEAVED, v) for v in interleaved]
        if axes.schedule == Schedule.ZBV:
            return [(Schedule.ZBV, axes.virtual_stages or 2)]
        if axes.schedule:
            return [(axes.schedule, axes.virtual_stages or 1)]
        if pp == 1:
            return [(Schedule.ONE_F_ONE_B, axes.virtual_stages or 1)]
        out = []
        if axes.virtual_stages in (None, 1):
            out += [(Schedule.ONE_F_ONE_B, 1), (Schedule.GPIPE, 1), (Schedule.ZB_H1, 1)]
        if axes.virtual_stages in (None, 2):
            out.append((Schedule.ZBV, 2))
        return out + [(Schedule.INTERLEAVED, v) for v in interleaved if v > 1]

    def recomputes(self, layers_per_chunk: int, axes: Axes) -> list[RecomputePolicy]:
        if axes.recompute:
            return [axes.recompute]
        # Fastest first: each later policy recomputes at least as much, so the search stops at the first
        # that fits (the later ones are slower and add nothing to the ranking).
        every = [RecomputePolicy("every", k) for k in (8, 4, 2) if k < layers_per_chunk]
        return [RecomputePolicy(kind) for kind in ("none", "selective", "sac")] + every + [RecomputePolicy("full")]

    def layout_groups(self, axes: Axes, misses: list[Plan]) -> Iterator[list[Layout]]:
        """Every valid layout of these axes, grouped by all but the recompute policy (fastest policy first).

        A (tp, pp, dp, zero) whose model states alone exceed the device is skipped whole, its plan added to
        `misses`: no micro-batch, schedule or policy can help it."""
        for tp, cp, attentions, pp, dp, mbs, zeros, sps in self.candidates(axes):
            for zero, ep in ((z, e) for z in zeros for e in ep_degrees(self.job.model, dp, axes.ep)):
                if mbs and self._states_exceed(
                    Layout(tp, pp, dp, mbs[0], Schedule.ONE_F_ONE_B, 1, zero, RecomputePolicy("full"), cp=cp, ep=ep),
                    misses,
                ):
                    continue
                for mb, sp, attention in ((mb, sp, a) for mb in mbs for sp in sps for a in attentions):
                    for kind, v in self.schedules(pp, axes):
                        probe = Layout(
                            tp, pp, dp, mb, kind, v, zero, RecomputePolicy(), sp, cp=cp, cp_attention=attention, ep=ep
                        )
                        if layout_problems(self.job, probe):  # the recompute policy cannot cure it
                            continue
                        chunk = max(self.chunks(probe))  # every:K below the largest chunk (uneven: its K)
                        # layout_problems(probe) checked all but the policy against the model
                        n_layers = self.job.model.n_layers
                        yield [
                            replace(probe, recompute=rc)
                            for rc in self.recomputes(chunk, axes)
                            if not rc.problem(n_layers)
                        ]

    def search(self, axes: Axes, top: int = 5) -> tuple[list[Plan], list[Plan]]:
        """(best feasible plans, simulated and ranked; the closest infeasible ones, smallest shortfall first)."""
        feasible: list[Plan] = []
        misses: list[Plan] = []
        usable = self.hardware.usable_memory_bytes
        for group in self.layout_groups(axes, misses):
            for layout in group:
                plan = Plan(layout, self.memory(layout, limit=usable), usable)
                if plan.fits:  # the later policies are slower and add nothing to the ranking
                    feasible.append(self.timed(plan, simulate=False))
                    break
                misses.append(plan)
        feasible.sort(key=lambda pl: -pl.time.tokens_per_s)
        # A miss's memory stopped at its first device over the limit; the closest ones are measured whole.
        misses.sort(key=lambda pl: pl.shortfall_bytes)
        closest = [Plan(pl.layout, self.memory(pl.layout), usable) for pl in misses[: 3 * top]]
        return self._simulate_best(feasible, top), sorted(closest, key=lambda pl: pl.shortfall_bytes)[:top]

    def any_fits(self, axes: Axes) -> bool:
        """Whether any layout of these axes fits (memory only, stops at the first)."""
        usable = self.hardware.usable_memory_bytes
        return any(
            self.memory(layout, limit=usable).total <= usable
            for group in self.layout_groups(axes, [])
            for layout in group
        )

    def _states_exceed(self, layout: Layout, misses: list[Plan]) -> bool:
        if self.job.model.n_layers < layout.pp:
            return False
        plan = Plan(
            layout, self.memory(layout, limit=self.hardware.usable_memory_bytes), self.hardware.usable_memory_bytes
        )
        if plan.memory.model_states > plan.usable_bytes:
            misses.append(plan)
            return True
        return False

    def _simulate_best(self, ranked: list[Plan], top: int) -> list[Plan]:
        """Replace the closed-form bubble by the simulated one for the best candidates, then re-rank. The best
        of every schedule kind is simulated too: the closed forms assume equal stages and err differently per
        kind (interleaving's most), so the kinds are compared on the simulator, not on them."""
        start, out = time.perf_counter(), list[Plan]()
        chosen = ranked[: top + 3]
        firsts = {str(plan.layout.schedule): plan for plan in reversed(ranked)}  # each kind's best
        chosen += [plan for plan in firsts.values() if plan not in chosen]
        for plan in chosen:
            if out and time.perf_counter() - start > SIMULATION_BUDGET_S:
                out.append(plan)
                continue
            out.append(self.timed(plan, simulate=True))
        out.sort(key=lambda pl: -pl.time.tokens_per_s)
        return out[:top]

    # ---- advice when nothing fits ----------------------------------------------------------------------------

    def advice(self, axes: Axes, closest: Plan | None) -> str:
        """What would make the job fit: relaxing fixed axes, more devices, or a larger device."""
        hw, usable = self.hardware, self.hardware.usable_memory_bytes
        tips = []
        full = RecomputePolicy("full")
        relaxed = [
            ("--recompute full", replace(axes, recompute=full), axes.recompute not in (None, full)),
            ("--zero 3", replace(axes, zero=3), axes.zero is not None and axes.zero < 3),
            (
                "leaving --tp/--cp/--pp/--dp/--ep/--micro-batch-size free",
                replace(axes, tp=None, cp=None, pp=None, dp=None, ep=None, micro_batch_size=None),
                any((axes.tp, axes.cp, axes.pp, axes.dp, axes.ep, axes.micro_batch_size)),
            ),
        ]
        for text, other, applies in relaxed:
            if applies and self.any_fits(other):
                tips.append(text)
        p_b, g_b, o_b = state_bytes_per_parameter(
            self.job.precision, self.job.grad_reduce_fp32, self.job.optimizer_states
        )
        states = total_parameters(self.job.model) * (p_b + g_b + o_b)
        lower = int(-(-states // usable))
        tips.append(f"at least {lower:,} devices of this kind (model states alone are {states / GiB:,.0f} GiB)")
        if closest is not None:
            tips.append(
                f"a device with at least {closest.memory.total / (1 - hw.reserved_fraction) / GiB:.1f} GiB "
                f"for the closest layout"
            )
        head = (
            f"no layout of {self.job.model.preset} fits on {self.devices} x {hw.name} "
            f"({usable / GiB:.1f} GiB usable per device)"
        )
        if closest is not None:
            head += (
                f"; the closest, {closest.layout.describe()}, needs {closest.memory.total / GiB:.1f} GiB "
                f"({closest.shortfall_bytes / GiB:.1f} GiB too much)"
            )
        return head + ". Would fit with: " + "; or ".join(tips)


def plan_layouts(planner: Planner, axes: Axes, top: int) -> tuple[list[Plan], list[Plan]]:
    """Search, raising ConfigError with advice when nothing fits or nothing divides."""
    feasible, misses = planner.search(axes, top)
    if feasible:
        return feasible, misses
    if not misses:
        raise ConfigError(
            f"no layout divides {planner.devices} devices for {planner.job.model.preset} with the "
            f"fixed axes ({_fixed(axes)}) and global batch {planner.job.global_batch_size}"
        )
    raise ConfigError(planner.advice(axes, misses[0]))


def _fixed(axes: Axes) -> str:
    fixed = {k: v for k, v in axes.__dict__.items() if v is not None}
    return ", ".join(f"{k}={v}" for k, v in fixed.items()) or "none"
