"""ParallelMesh: the one rank grid (pp x dp x cp x tp, tp innermost) and, with kernels.py (which kernel computes
what on each device type), the only place that knows device types.

Every process group comes from this grid, so every module that talks over a group receives it from here
instead of from a module global. tp is innermost because tensor-parallel collectives run twice per layer and
must stay on the fastest link: with 8 devices per node, ranks 0-7 form tp groups of up to 8 on one node.
Context parallelism (cp) comes next, as in Megatron: its ring passes key/value blocks once per layer, less often
than tp but more than dp. Every cp rank of a dp position holds the same parameters and computes their gradients
from another part of the same sequences, so the gradient group (`grad_group`, `grad_size`, `grad_rank`: what
the engine reduces and shards over) is dp x cp flattened, while the loader shards the batch by `dp_rank` alone.
Expert parallelism (ep) is carved from dp, not a new axis of the grid: ep ranks adjacent within dp, an expert
mesh (pp, edp, ep, cp, tp) beside the main one only when ep > 1 (`_expert_groups`).

The device comes from `torch.accelerator` (CUDA, or an out-of-tree backend such as Ascend's `npu` once
`torch_npu` is imported) and falls back to the CPU; the collective backend follows the device type.
"""

from __future__ import annotations

import copy
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "cp", "tp")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def _import_accelerator_plugins() -> None:
    """Importing torch_npu registers Ascend's 'npu' device with torch.accelerator; absent elsewhere."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        pass


def select_device(local_rank: int = 0, prefer_cpu: bool = False) -> torch.device:
    """This rank's device: accelerator number local_rank % count, or the CPU."""
    if not prefer_cpu and os.environ.get("LMT_DEVICE", "") != "cpu":
        _import_accelerator_plugins()
        if torch.accelerator.is_available():
            kind = torch.accelerator.current_accelerator().type
            index = local_rank % torch.accelerator.device_count()
            torch.accelerator.set_device_index(index)
            return torch.device(kind, index)
    return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    """Collective backend for a device (or device type): gloo on CPU, NCCL on CUDA, HCCL on Ascend."""
    kind = device if isinstance(device, str) else device.type
    try:
        return BACKENDS[kind]
    except KeyError:
        raise ValueError(f"no collective backend known for device type '{kind}'") from None


def accelerator_counts() -> dict[str, int]:
    """Devices of each accelerator type torch can see here ('cuda'; 'npu' once torch_npu imports), whatever
    LMT_DEVICE says; an empty dict on a CPU-only machine. For `lmt doctor`: select_device picks among them."""
    _import_accelerator_plugins()
    counts = {}
    for kind in BACKENDS:
        module = getattr(torch, kind, None) if kind != "cpu" else None  # torch.cuda; torch.npu from torch_npu
        if module is not None and module.is_available():
            counts[kind] = module.device_count()
    return counts


def device_name(device: torch.device) -> str:
    """The device's product name ('NVIDIA H100 80GB HBM3', 'Ascend910B3') from its type's torch module; the
    processor's on the CPU (often empty on Linux: then the architecture)."""
    if device.type == "cpu":
        import platform

        return platform.processor() or platform.machine() or "cpu"
    getter = getattr(getattr(torch, device.type, None), "get_device_name", None)
    return str(getter(device)) if getter else device.type


def bound_device(device: torch.device) -> torch.device | None:
    """The device the default process group is bound to (init_process_group's device_id): CUDA's, so NCCL
    builds its communicator at init and a barrier uses this rank's GPU instead of guessing it from the global
    rank (a hang where nodes number their GPUs differently); none for gloo and HCCL."""
    return device if device.type == "cuda" else None


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 compute is supported (and fast enough to be worth it) on this device."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True


def fp8_gemm_problem(device: torch.device) -> str | None:
    """Why this device cannot run float8 GEMMs (`torch._scaled_mm`), or None: the CPU can (slowly; the tests run
    there), CUDA from compute capability 8.9 (Ada, Hopper and later); Ascend's float8 path is not wired."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (
                f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no float8 GEMMs; "
                "they need 8.9 or later (Ada, Hopper)"
            )
        return None
    return f"float8 training is not available on {device.type} in lmt"


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (for honest timings); no-op on the CPU."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device.index)


def runs_on_host(t: torch.Tensor) -> bool:
    """Whether `t` is computed by the host CPU, where an operator is a function call and caches matter; else an
    accelerator, where each operator is a kernel launch and passes stream from device memory (the optimizer's
    slice size follows, parallel/adamw.py). A fake tensor (`lmt rehearse`) stands for an accelerator's."""
    return t.device.type == "cpu" and not is_fake(t)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Allocator peak on accelerators; None on the CPU, where callers use their own measure."""
    if device.type == "cpu":
        return None
    return int(torch.accelerator.max_memory_allocated(device.index))


@dataclass
class AxisGroup:
    """The tensor-parallel group a layer talks over, with this rank's index and a byte counter."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    bytes: float = 0.0

    @staticmethod
    def single() -> AxisGroup:
        return AxisGroup(group=None, size=1, rank=0)

    def count_all_reduce(self, t: torch.Tensor) -> None:
        self.bytes += 2 * (self.size - 1) / self.size * t.numel() * t.element_size()

    def count_gather_or_scatter(self, full: torch.Tensor) -> None:
        self.bytes += (self.size - 1) / self.size * full.numel() * full.element_size()


@dataclass(frozen=True)
class RankGrid:
    """Pure rank arithmetic for a pp x dp x cp x tp grid (no processes needed; DeviceMesh uses the same order).
    cp comes last in the arguments so that the three-axis calls (pp, dp, tp) keep their meaning."""

    pp: int
    dp: int
    tp: int
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coordinate(self, rank: int) -> dict[str, int]:
        out = {
            "pp": rank // (self.dp * self.cp * self.tp),
            "dp": rank // (self.cp * self.tp) % self.dp,
            "tp": rank % self.tp,
        }
        if self.cp > 1:
            out["cp"] = rank // self.tp % self.cp
        return out

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that share every coordinate of `rank` except `axis`."""
        c = self.coordinate(rank)
        size = getattr(self, axis)
        return [self.rank(**{**c, axis: i}) for i in range(size)]


class ParallelMesh:
    """Groups, ranks, coordinates and device of this process in the pp x dp x cp x tp grid.

    Needs an initialised default process group. Build it once per run and pass it to whoever communicates.
    With cp = 1 the DeviceMesh has the three axes (pp, dp, tp) it always had.
    """

    def __init__(self, pp: int, dp: int, tp: int, device: torch.device, cp: int = 1, ep: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs torch.distributed to be initialised (see lmt.launch)")
        self.grid = RankGrid(pp=pp, dp=dp, tp=tp, cp=cp)
        if self.grid.world_size != dist.get_world_size():
            raise ValueError(f"world size {dist.get_world_size()} != pp x dp x cp x tp = {pp} x {dp} x {cp} x {tp}")
        self.device = device
        axes = AXES if cp > 1 else ("pp", "dp", "tp")
        shape = tuple(getattr(self.grid, a) for a in axes)
        self.device_mesh: DeviceMesh = init_device_mesh(device.type, shape, mesh_dim_names=axes)
        self.rank = dist.get_rank()
        coord = self.grid.coordinate(self.rank)
        self.pp_rank, self.dp_rank, self.tp_rank = coord["pp"], coord["dp"], coord["tp"]
        """`dp_rank`: this rank's dp coordinate, by which the loader shards the global batch."""
        self.cp_rank = coord.get("cp", 0)
        self.grad_rank = self.dp_rank * cp + self.cp_rank
        """Index in the gradient group (dp x cp, row-major as DeviceMesh flattens it); = dp_rank at cp = 1."""
        self.tp = AxisGroup(self.device_mesh.get_group("tp") if tp > 1 else None, tp, self.tp_rank)
        """The tensor-parallel group every layer of this rank talks over; its byte counter is `comm_bytes_tp`."""
        self.cp = AxisGroup(self.device_mesh.get_group("cp") if cp > 1 else None, cp, self.cp_rank)
        """The context-parallel group attention talks over; its byte counter is `comm_bytes_cp`."""
        # Flattening creates the dp x cp groups: collective, so every rank does it here, once. `_flatten` is
        # private, but it is how torchtitan gets FSDP2 its dp x cp group as the 1-D DeviceMesh FSDP2 needs.
        self._dp_cp_mesh = self.device_mesh["dp", "cp"]._flatten("dp_cp") if cp > 1 else None
        self.embedding_group = self._embedding_group() if pp > 1 else None
        self._gradient_group: tuple[dist.ProcessGroup | None, int] | None = None
        self._expert_groups(ep)

    def _expert_groups(self, ep: int) -> None:
        """Expert parallelism, carved from dp: dp coordinate d = edp_index x ep + ep_index (the ep ranks of a
        group adjacent within dp). A second DeviceMesh (pp, edp, ep, cp, tp) over the same ranks, only when
        ep > 1, so the main mesh and its dp semantics stay as they are; checkpoints shard experts over its
        "ep" axis. `mesh.ep` carries the dispatch's byte counter (`comm_bytes_ep`); `edp_group` (size dp / ep)
        holds the same experts. Expert gradients are reduced and sharded over `expert_dp_mesh`: edp, and under
        cp edp x cp flattened (every cp rank computes the same experts' gradients from other sequence chunks,
        as the dense gradient group is dp x cp)."""
        self.ep_rank, self.edp_rank, self.edp_size = self.dp_rank % ep, self.dp_rank // ep, self.grid.dp // ep
        self.expert_mesh: DeviceMesh | None = None
        self.edp_group: dist.ProcessGroup | None = None
        self.ep = AxisGroup.single()
        """The expert-parallel group the MoE dispatch talks over; its byte counter is `comm_bytes_ep`."""
        self.expert_dp_mesh: DeviceMesh | None = None
        """1-D mesh of the expert gradient group: edp, or edp x cp (FSDP2 shards experts over it)."""
        if ep > 1:
            g = self.grid
            shape = (g.pp, g.dp // ep, ep, g.cp, g.tp)
            self.expert_mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
            self.ep = AxisGroup(self.expert_mesh.get_group("ep"), ep, self.ep_rank)
            self.edp_group = self.expert_mesh.get_group("edp")
            cp = g.cp > 1
            self.expert_dp_mesh = self.expert_mesh["edp", "cp"]._flatten("edp_cp") if cp else self.expert_mesh["edp"]

    def expert_view(self) -> ParallelMesh:
        """The mesh expert parameters reduce over: the expert-data-parallel group (size dp / ep), times cp."""
        assert self.expert_dp_mesh is not None, "expert_view needs ep > 1"
        size = self.edp_size * self.grid.cp
        return self.reducing_over(self.expert_dp_mesh.get_group(), size, self.edp_rank * self.grid.cp + self.cp_rank)

    def reducing_over(self, group: dist.ProcessGroup | None, size: int, rank: int) -> ParallelMesh:
        """A view of this mesh whose gradient group (grad_group, grad_size, grad_rank: what an engine reduces and
        shards over) is `group` instead of dp x cp; every other group is shared. Expert parameters reduce over
        their expert-data-parallel group, and DiLoCo's inner steps over no group at all (size 1, group None)."""
        view = copy.copy(self)
        view._gradient_group, view.grad_rank = (group, size), rank
        return view

    def _embedding_group(self) -> dist.ProcessGroup | None:
        """First and last pipeline stage of this (dp, tp) position: they sum the tied embedding's gradients.

        new_group is collective: every rank creates every pair, in the same order, and keeps its own.
        """
        mine = None
        for dp in range(self.grid.dp):
            for cp in range(self.grid.cp):
                for tp in range(self.grid.tp):
                    ranks = [self.grid.rank(0, dp, tp, cp), self.grid.rank(self.grid.pp - 1, dp, tp, cp)]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
        return mine

    @classmethod
    def for_this_rank(cls, pp: int, dp: int, tp: int, cp: int = 1, ep: int = 1) -> ParallelMesh:
        """The mesh on this process's device (the one `select_device` chose when the group was initialised)."""
        return cls(pp, dp, tp, select_device(int(os.environ.get("LOCAL_RANK", "0"))), cp, ep)

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    @property
    def grad_size(self) -> int:
        """Size of the gradient group: dp x cp (or what `reducing_over` set)."""
        if self._gradient_group is not None:
            return self._gradient_group[1]
        return self.grid.dp * self.grid.cp

    @property
    def grad_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the gradient group, dp x cp (FSDP2 shards over it)."""
        return self._dp_cp_mesh if self._dp_cp_mesh is not None else self.device_mesh["dp"]

    @property
    def dp_size(self) -> int:
        """How many shares the loader cuts the global batch into: dp (every cp rank of a share reads it all)."""
        return self.grid.dp

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def cp_size(self) -> int:
        return self.grid.cp

    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group along one axis ('pp', 'dp', 'cp' or 'tp') that contains this rank, or 'grad': the
        gradient group (dp x cp, or what `reducing_over` set), which every reduction of gradients runs over."""
        if axis == "grad" and self._gradient_group is not None:
            return self._gradient_group[0]
        if axis == "grad":
            return self.grad_mesh.get_group()
        return self.device_mesh.get_group(axis)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def grad_group(self) -> dist.ProcessGroup:
        return self.group("grad")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.grid.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the same (dp, cp, tp) position on pipeline stage pp_rank (for point-to-point)."""
        return self.grid.rank(pp_rank, self.dp_rank, self.tp_rank, self.cp_rank)

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(rank={self.rank}, pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size}, "
            f"grad={self.grad_rank}/{self.grad_size}, cp={self.cp_rank}/{self.cp_size}, "
            f"tp={self.tp_rank}/{self.tp_size}, device={self.device})"
        )
