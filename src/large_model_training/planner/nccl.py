"""Collectives as NCCL runs them: an alpha-beta model per protocol, with the bus bandwidth NCCL reaches on each
fabric, in place of the links' line rates.

A link's line rate (the catalogue's NVLink or NIC figure) is not what a collective sees. NCCL's kernels move
data through SMs in 128-byte payloads with flags, which costs about a fifth of NVLink ("450GB/s is the line
rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s", S. Jeaugey,
NVIDIA/nccl-tests#212; "Each NVLink has a line rate of 25GB/s ... ~20GB/s effective bandwidth with a 128B
payload ... some other bottlenecks on the GPUs limits it to ~230GB/s" on A100, NVIDIA/nccl-tests#149, which
NCCL's own tuner caps at 235 GB/s for sm80), and little of an InfiniBand NIC ("For NDR @ 400Gbps you should
see 46-48GB/s per NIC", NVIDIA/nccl-tests#290; "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and
we measure 192GB/s AllReduce BusBW", NVIDIA/nccl#812, quoted in NVIDIA/nccl#1576). Those are the large-message
plateaus (bus bandwidth, nccl-tests' doc/PERFORMANCE.md).

Below the plateau the time is NCCL's own model (src/graph/tuning.cc, ncclTopoTuneModel / ncclTopoGetAlgoTime,
NVIDIA/nccl at commit 01afd20a): time = base latency + steps x per-step latency + bytes / bandwidth, for each
protocol, and NCCL picks the fastest: Simple (the plateau), LL128 (92% of it, NVLink only by default, 1.9 us
a step), LL (a quarter of it for all-reduce and across nodes, a third otherwise; 0.47 us a step on NVLink,
2.7 us across the network). A ring all-reduce has 2(n-1) steps, all-gather and reduce-scatter n-1. So a tp
all-reduce of a few MB is latency-bound and a 25 MB one runs at about two thirds of the plateau.

NVLink SHARP (NVLS: the NVSwitch reduces; H100/H200 HGX, NCCL >= 2.17) makes an all-reduce inside a node
faster than any ring: bus bandwidth 365-370 GB/s at 2-4 GPUs, like the ring, then 420, 440, 460 and 480 GB/s
at 5, 6, 7 and 8 (NVIDIA/nccl#1455, measured on 8 H100 SXM with NCCL_ALGO=NVLS; 480 at 8 also in
NVIDIA/nccl-tests#212). It does not speed all-gather and reduce-scatter (sequence parallelism's pairs).

Entries without a published NCCL figure (AMD, Ascend, a calibrated CPU) keep the catalogue's alpha-beta at
the line rate: `fabric` returns None for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from large_model_training.planner.comm import ring_all_gather, ring_all_reduce
from large_model_training.planner.hardware import Hardware

US = 1e-6
# NCCL's ring protocols (tuning.cc): base latency, per-step latency on NVLink and on the network (us)
BASE = {"LL": 3.6, "LL128": 10.0, "Simple": 8.4}
STEP_NVLINK = {"LL": 0.47, "LL128": 1.9, "Simple": 3.4}
STEP_NET = {"LL": 2.7, "LL128": 4.0, "Simple": 9.6}


@dataclass(frozen=True)
class Fabric:
    """One side of an entry's links as NCCL sees it."""

    efficiency: float
    """Bus bandwidth NCCL's ring reaches at large messages, as a fraction of the line rate."""
    net: bool
    """Across nodes (NICs) rather than NVLink."""
    nvls: tuple[float, ...] = ()
    """NVLS all-reduce bus bandwidth over the ring's, at 2, 3, ... ranks in the node (empty: no NVLS)."""


# The plateaus quoted above, as fractions of the catalogue's line rates (hardware.py): A100 NVLink 3 230 of
# 300 GB/s; H100/H200/H20 NVLink 4 370 of 450; H800 160 of 200 (DeepSeek-V3 report, section 3.2.2: "achievable"
# NVLink); B200/GB200 NVLink 5: no published NCCL figure, NVLink 4's 128-byte protocol share assumed.
# HDR 200 Gb/s NICs 24 of 25 GB/s (192 of 200 per DGX A100); NDR 400 Gb/s 47 of 50 (46-48).
_NVLINK3 = Fabric(230 / 300, net=False)
_NVLINK4 = Fabric(370 / 450, net=False)
_NVLS8 = (1.0, 1.0, 1.0, 420 / 370, 440 / 370, 460 / 370, 480 / 370)  # 2..8 ranks (NVIDIA/nccl#1455)
_HDR = Fabric(192 / 200, net=True)
_NDR = Fabric(47 / 50, net=True)
FABRICS: dict[str, tuple[Fabric, Fabric]] = {
    "a100-40gb": (_NVLINK3, _HDR),
    "a100-80gb": (_NVLINK3, _HDR),
    "h100-sxm": (Fabric(370 / 450, net=False, nvls=_NVLS8), _NDR),
    "h200": (Fabric(370 / 450, net=False, nvls=_NVLS8), _NDR),
    "h800": (Fabric(160 / 200, net=False), _NDR),
    "h20": (_NVLINK4, _NDR),
    "b200": (_NVLINK4, _NDR),
    "gb200-nvl72": (_NVLINK4, _NDR),
}


def fabric(hw: Hardware, intra: bool) -> Fabric | None:
    pair = FABRICS.get(hw.name)
    return None if pair is None else pair[0 if intra else 1]


class LinkRate(float):
    """A link's line rate in bytes/s that knows its fabric: `collective_time` prices collectives over it as NCCL
    runs them. Arithmetic on it gives a plain float (a derived rate is no longer a link's)."""

    fabric: Fabric | None

    def __new__(cls, rate: float, fab: Fabric | None) -> LinkRate:
        obj = super().__new__(cls, rate)
        obj.fabric = fab
        return obj


def link(hw: Hardware, span: int, devices_per_node: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group spanning `span` consecutive ranks: the intra-node link when they fit in one
    node, else the inter-node one (the slowest link it crosses)."""
    intra = span <= devices_per_node
    rate = hw.intra_node_bandwidth if intra else hw.inter_node_bandwidth
    return LinkRate(rate, fabric(hw, intra)), hw.intra_node_latency if intra else hw.inter_node_latency


def collective_time(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """all_reduce / all_gather / reduce_scatter of an nbytes tensor over n ranks, or one p2p transfer. Over a link
    with a known fabric: NCCL's fastest protocol (module docstring); otherwise the ring at the line rate, one
    `latency` per step."""
    fab = getattr(bandwidth, "fabric", None)
    if kind == "p2p":
        if fab is None:
            return latency + nbytes / bandwidth
        return (BASE["Simple"] + (STEP_NET if fab.net else STEP_NVLINK)["Simple"]) * US + nbytes / (
            bandwidth * fab.efficiency
        )
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    sent = ring_all_reduce(nbytes, n) if kind == "all_reduce" else ring_all_gather(nbytes, n)
    if fab is None:
        return steps * latency + sent / bandwidth
    plateau = bandwidth * fab.efficiency
    step = STEP_NET if fab.net else STEP_NVLINK
    share = {"Simple": 1.0, "LL": 0.25 if (fab.net or kind == "all_reduce") else 1 / 3}
    if not fab.net:
        share["LL128"] = 0.92
    if kind == "all_reduce" and fab.nvls and n <= len(fab.nvls) + 1:
        share["Simple"] = fab.nvls[n - 2]  # NVLS: the switch reduces; Simple's latency
    return min((BASE[p] + steps * step[p]) * US + sent / (plateau * s) for p, s in share.items())
