"""Hardware catalogue: what one device can compute, hold and move, from vendor datasheets or `lmt calibrate`.

Each entry gives peak dense matmul FLOP/s (16-bit and fp32), memory and its bandwidth, the bus bandwidth a
ring collective sees per device inside a node (NVLink/HCCS) and across nodes (one NIC per device), the
latency of one ring step on each link, devices per node, and the number of compute units (for the wave
quantisation of GEMM tiles, see `timing.gemm_time`).

`gemm_efficiency` is the one calibrated number per entry: the fraction of peak that large bf16 GEMMs reach
with the vendor BLAS. It is set from GEMM microbenchmarks, never from the published training runs the
planner is compared against (docs/planner.md), so those comparisons stay honest.

The `cpu` entry is not in the code: `lmt calibrate` measures this machine and stores it as JSON in
$LMT_HARDWARE_FILE, else $XDG_CONFIG_HOME/lmt/hardware.json, else ~/.cache/lmt/hardware.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace

from large_model_training.config import ConfigError

GB = 1e9
GiB = 1024**3


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float
    """Dense 16-bit (bf16) matmul FLOP/s of one device (no structured sparsity)."""
    peak_flops_fp32: float
    """Dense fp32 matmul FLOP/s (what `--precision fp32` runs at; TF32 is not assumed)."""
    memory_bytes: float
    """Device memory."""
    memory_bandwidth: float
    """Device memory bytes/s (memory-bound kernels, optimizer step)."""
    intra_node_bandwidth: float
    """Bytes/s one device sends (and receives) at once inside a node: the bus bandwidth of a ring."""
    intra_node_latency: float
    """Seconds per ring step inside a node (the alpha of the alpha-beta model)."""
    inter_node_bandwidth: float
    """Bytes/s per device across nodes (its share of the node's NICs)."""
    inter_node_latency: float
    """Seconds per ring step across nodes."""
    devices_per_node: int
    compute_units: int
    """SMs / AI cores: a GEMM's output tiles run in waves of this many."""
    gemm_efficiency: float
    """Achievable fraction of peak on large GEMMs (the one calibration of the entry)."""
    attention_efficiency: float | None = None
    """Fraction of peak the causal attention core reaches on the FLOPs it executes; None: as gemm_efficiency
    (flash kernels on accelerators). `lmt calibrate` measures it on the CPU, whose SDPA kernel runs at well
    under half its GEMM rate."""
    memory_efficiency: float = 0.8
    """Fraction of memory_bandwidth that elementwise kernels and the optimizer reach (STREAM-like); 1.0 for a
    calibrated entry, whose bandwidth is already the rate such kernels achieve."""
    reserved_fraction: float = 0.08
    """Memory kept back for the runtime context, communicator buffers and allocator fragmentation."""
    fused_kernels: bool = True
    """Accelerator kernels: fused RMSNorm, flash attention with in-kernel dropout, 1-byte dropout masks.
    False for the CPU, whose kernels save more for backward (see memory.activation_bytes_per_layer)."""
    source: str = ""

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.reserved_fraction)

    def peak(self, precision: str) -> float:
        return self.peak_flops if precision == "bf16" else self.peak_flops_fp32

    @property
    def stream_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel moves."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def attention_fraction(self) -> float:
        return self.gemm_efficiency if self.attention_efficiency is None else self.attention_efficiency


# Sources (datasheets; per-direction bandwidths are half the bidirectional figures vendors quote):
#  a100-*: NVIDIA A100 Tensor Core GPU datasheet (bf16 312 TFLOP/s dense, fp32 19.5; 40 GB HBM2 1,555 GB/s,
#    80 GB HBM2e 2,039 GB/s; NVLink 3 600 GB/s bidirectional), NVIDIA Ampere GA100 whitepaper (108 SMs),
#    DGX A100 datasheet (8 GPUs, 8 x 200 Gb/s HDR InfiniBand compute NICs = 25 GB/s per GPU).
#  h100-sxm: NVIDIA H100 Tensor Core GPU datasheet (bf16 989 TFLOP/s dense, fp32 67; 80 GB HBM3 3.35 TB/s;
#    NVLink 4 900 GB/s bidirectional; 132 SMs), DGX H100 datasheet (8 x 400 Gb/s NDR = 50 GB/s per GPU).
#  h200: NVIDIA H200 Tensor Core GPU datasheet (same GH100 compute as H100; 141 GB HBM3e 4.8 TB/s;
#    NVLink 900 GB/s bidirectional), HGX H200 with 400 Gb/s per GPU.
#  ascend-910b: Huawei publishes no full datasheet; figures of the Atlas 800T A2 (8 x 910B) as reported by
#    third parties: ~313 TFLOP/s fp16/bf16 (910B3), 64 GB HBM2e ~1.6 TB/s, HCCS full mesh 7 x 56 GB/s
#    (392 GB/s aggregate; a ring uses one link per direction pair, we count half the aggregate),
#    8 x 200GE RoCE = 25 GB/s per NPU, 20 AI cores. Treat as approximate.
# Latencies: ~5 us per NVLink/HCCS ring step and ~10 us across InfiniBand/RoCE (typical NCCL alpha).
# gemm_efficiency: large bf16 cuBLAS GEMMs reach ~80% of peak on A100 and H200 (about 790 TFLOP/s measured
#    on this workplace's H200), ~75% on H100 SXM (power-capped clocks); 0.70 assumed for the 910B.
CATALOGUE: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", 312e12, 19.5e12, 40 * GB, 1555 * GB, 300 * GB, 5e-6, 25 * GB, 10e-6,
                          8, 108, 0.80, source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    "a100-80gb": Hardware("a100-80gb", 312e12, 19.5e12, 80 * GB, 2039 * GB, 300 * GB, 5e-6, 25 * GB, 10e-6,
                          8, 108, 0.80, source="NVIDIA A100 80GB datasheet; DGX A100 datasheet"),
    "h100-sxm": Hardware("h100-sxm", 989e12, 67e12, 80 * GB, 3350 * GB, 450 * GB, 5e-6, 50 * GB, 10e-6,
                         8, 132, 0.75, source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    "h200": Hardware("h200", 989e12, 67e12, 141 * GB, 4800 * GB, 450 * GB, 5e-6, 50 * GB, 10e-6,
                     8, 132, 0.80, source="NVIDIA H200 datasheet; HGX H200"),
    "ascend-910b": Hardware("ascend-910b", 313e12, 78e12, 64 * GB, 1600 * GB, 196 * GB, 5e-6, 25 * GB, 10e-6,
                            8, 20, 0.70, source="Atlas 800T A2 (third-party reports; approximate)"),
}


def catalogue_entry(device_name: str) -> Hardware | None:
    """The catalogue entry of a device by the name its runtime reports (mesh.device_name), or None: the CPU, and
    parts whose peaks differ from the entries' (H100 PCIe and NVL), are measured instead (train/mfu.py)."""
    name = device_name.upper()
    if "H200" in name:
        return CATALOGUE["h200"]
    if "H100" in name and ("HBM3" in name or "SXM" in name):  # "NVIDIA H100 80GB HBM3"
        return CATALOGUE["h100-sxm"]
    if "A100" in name:  # every A100 has the same peaks; the memory size tells the two entries apart
        return CATALOGUE["a100-80gb" if "80G" in name else "a100-40gb"]
    if "910B" in name:  # torch_npu: "Ascend910B3"
        return CATALOGUE["ascend-910b"]
    return None


def hardware_file() -> str:
    """Where `lmt calibrate` stores measured entries."""
    if os.environ.get("LMT_HARDWARE_FILE"):
        return os.environ["LMT_HARDWARE_FILE"]
    if os.environ.get("XDG_CONFIG_HOME"):
        return os.path.join(os.environ["XDG_CONFIG_HOME"], "lmt", "hardware.json")
    return os.path.join(os.path.expanduser("~"), ".cache", "lmt", "hardware.json")


def load_measured() -> dict[str, Hardware]:
    """Entries written by `lmt calibrate` (empty if none)."""
    path = hardware_file()
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            doc = json.load(f)
        names = {f.name for f in fields(Hardware)}
        return {name: Hardware(**{k: v for k, v in entry.items() if k in names}) for name, entry in doc.items()}
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot read hardware file {path}: {e}") from None


def save_measured(entry: Hardware) -> str:
    """Add or replace one measured entry in the hardware file; returns its path."""
    path = hardware_file()
    doc = {name: asdict(hw) for name, hw in load_measured().items()}
    doc[entry.name] = asdict(entry)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)
    return path


def get_hardware(name: str) -> Hardware:
    """A catalogue entry or a measured one; ConfigError naming the choices otherwise."""
    measured = load_measured()
    if name in measured:
        return measured[name]
    if name in CATALOGUE:
        return CATALOGUE[name]
    known = sorted(set(CATALOGUE) | set(measured) | {"cpu"})
    hint = " (run `lmt calibrate` first to measure this machine)" if name == "cpu" else ""
    raise ConfigError(f"unknown hardware '{name}'{hint}; choose one of: {', '.join(known)}")


def per_rank(hw: Hardware, ranks_on_node: int) -> Hardware:
    """A measured CPU entry as seen by one of `ranks_on_node` local ranks.

    `lmt calibrate` stores whole-machine rates (all cores busy on one matmul; memory bandwidth of the whole
    machine). Local ranks share the cores equally (launch.threads_per_rank), so one rank gets cores/ranks of
    the compute and 1/ranks of the memory bandwidth. Accelerator entries are per device already.
    """
    if hw.fused_kernels:
        return hw
    ranks = max(1, ranks_on_node)
    cores = max(1, hw.devices_per_node)
    share = max(1, cores // ranks) / cores if ranks <= cores else 1.0 / ranks
    return replace(hw, peak_flops=hw.peak_flops * share, peak_flops_fp32=hw.peak_flops_fp32 * share,
                   memory_bandwidth=hw.memory_bandwidth / ranks, devices_per_node=max(ranks, cores))
