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

from large_model_training.choices import bf16_compute
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
    attention_backward_efficiency: float | None = None
    """The flash backward's own fraction of peak where a source gives it apart (FlashAttention-2's backward is slower
    than its forward on H100); None: as attention_efficiency."""
    memory_efficiency: float = 0.8
    """Fraction of memory_bandwidth that elementwise kernels and the optimizer reach (STREAM-like); 1.0 for a
    calibrated entry, whose bandwidth is already the rate such kernels achieve."""
    reserved_fraction: float = 0.08
    """Memory kept back for the runtime context, communicator buffers and allocator fragmentation."""
    fused_kernels: bool = True
    """Accelerator kernels: fused RMSNorm, flash attention with in-kernel dropout, 1-byte dropout masks.
    False for the CPU, whose kernels save more for backward (see memory.activation_bytes_per_layer)."""
    source: str = ""
    peak_flops_fp8: float | None = None
    """Dense float8 matmul FLOP/s (`--precision fp8`'s block linears); None: no float8 GEMMs (they run at the
    16-bit rate)."""
    kernel_launch_s: float = 5e-6
    """Seconds a kernel costs beyond its work (launch, prologue, tail): what makes small models launch-bound."""
    tdp_watts: float | None = None
    """Board power the datasheet rates the peak at; a `--hardware.power-cap` below it slows compute."""
    nics_per_node: int | None = None
    """Scale-out NICs per node (None: one per device); inter_node_bandwidth is the node's NIC bandwidth shared
    by its devices, so `--hardware.nics-per-node` rescales it."""
    gemm_table: tuple = ()
    """Measured GEMMs (m, n, k, precision, FLOP/s), from `lmt calibrate --from gpu_suite.json`: the efficiency
    curve (planner/kernel_time.py) equals them at their shapes."""

    def __post_init__(self) -> None:  # JSON gives lists; keep the entry hashable
        object.__setattr__(self, "gemm_table", tuple(tuple(row) for row in self.gemm_table))

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.reserved_fraction)

    def peak(self, precision: str) -> float:
        """The 16-bit or fp32 rate: what MFU is quoted against (fp8 runs report BF16-equivalent MFU, as
        torchtitan does)."""
        return self.peak_flops if bf16_compute(precision) else self.peak_flops_fp32

    def gemm_peak(self, precision: str) -> float:
        """The rate a GEMM in `precision` runs at: float8's where the device has it."""
        return self.peak_flops_fp8 if precision == "fp8" and self.peak_flops_fp8 else self.peak(precision)

    @property
    def stream_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel moves."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def attention_fraction(self) -> float:
        return self.gemm_efficiency if self.attention_efficiency is None else self.attention_efficiency

    @property
    def attention_backward_fraction(self) -> float:
        b = self.attention_backward_efficiency
        return self.attention_fraction if b is None else b


# Sources (datasheets; per-direction bandwidths are half the bidirectional figures vendors quote). Where a figure
# is an assumption the comment says so.
#  a100-*: NVIDIA A100 Tensor Core GPU datasheet (bf16 312 TFLOP/s dense, fp32 19.5; 40 GB HBM2 1,555 GB/s,
#    80 GB HBM2e 2,039 GB/s; NVLink 3 600 GB/s bidirectional; 400 W), NVIDIA Ampere GA100 whitepaper (108 SMs),
#    DGX A100 datasheet (8 GPUs, 8 x 200 Gb/s HDR InfiniBand compute NICs = 25 GB/s per GPU).
#  h100-sxm: NVIDIA H100 Tensor Core GPU datasheet (bf16 989 TFLOP/s dense, fp32 67; 80 GB HBM3 3.35 TB/s;
#    NVLink 4 900 GB/s bidirectional; 132 SMs; 700 W), DGX H100 datasheet (8 x 400 Gb/s NDR = 50 GB/s per GPU).
#  fp8 (H100 SXM, H200, H800): 1,979 TFLOP/s dense (the datasheets' 3,958 is with 2:4 sparsity).
#  h200: NVIDIA H200 Tensor Core GPU datasheet (same GH100 compute as H100; 141 GB HBM3e 4.8 TB/s;
#    NVLink 900 GB/s bidirectional; 700 W), HGX H200 with 400 Gb/s per GPU.
#  h800: the H100 SXM's compute and memory with NVLink cut to 400 GB/s bidirectional (NVIDIA H800 product
#    brief); DeepSeek-V3 report (arXiv:2412.19437) section 3.2.2: 8 GPUs per node, IB 50 GB/s per GPU (it
#    measures NVLink at 160 GB/s achievable: planner/nccl.py's plateau; here the datasheet's 200 line rate).
#  h20: NVIDIA HGX H20 product brief as reported (bf16 148 TFLOP/s dense, fp8 296, fp32 44; 96 GB HBM3
#    4.0 TB/s; NVLink 900 GB/s bidirectional; 400 W); 78 SMs (Geekbench listing); 400 Gb/s per GPU assumed.
#  b200: NVIDIA DGX/HGX B200 datasheet (per GPU at 1,000 W: bf16 2.25 PFLOP/s dense, fp8 4.5, fp32 75 TFLOP/s;
#    180 GB HBM3e, 64 TB/s per 8 GPUs = 8 TB/s; NVLink 5 1.8 TB/s bidirectional; 8 x 400 Gb/s ConnectX-7);
#    148 SMs (assumed: two dies of 74 enabled SMs).
#  gb200-nvl72: NVIDIA GB200 NVL72 datasheet divided by its 72 GPUs (bf16 360 PFLOP/s with sparsity = 2.5
#    dense per GPU, fp8 5.0, fp32 80 TFLOP/s; 13.4 TB HBM3e = 186 GB, 576 TB/s = 8 TB/s; NVLink 130 TB/s =
#    1.8 TB/s bidirectional per GPU, all 72 in one NVLink domain: devices_per_node 72; 1,200 W per GPU
#    (glennklockwood.com B200 notes)); scale-out 400 Gb/s per GPU (ConnectX-7, assumed).
#  mi300x: AMD Instinct MI300X datasheet (bf16 1,307.4 TFLOP/s dense, fp8 2,614.9, fp32 matrix 163.4;
#    192 GB HBM3 5.3 TB/s; 304 CUs; 750 W; 7 Infinity Fabric links of 64 GB/s per direction to the other 7
#    GPUs: a ring uses a link per direction pair, we count half of the 448 GB/s aggregate, as for HCCS);
#    8 x 400 Gb/s per node assumed (MI300X platforms ship with 8 NICs).
#  ascend-910b: Huawei publishes no full datasheet; figures of the Atlas 800T A2 (8 x 910B) as reported by
#    third parties: ~313 TFLOP/s fp16/bf16 (910B3), 64 GB HBM2e ~1.6 TB/s, HCCS full mesh 7 x 56 GB/s
#    (392 GB/s aggregate; a ring uses one link per direction pair, we count half the aggregate),
#    8 x 200GE RoCE = 25 GB/s per NPU, 20 AI cores, ~400 W (assumed). Treat as approximate.
#  ascend-910c / cloudmatrix-384: the 910C is two 910B-class dies in one package: 752 TFLOP/s bf16
#    (2 x 376; Huawei's CloudMatrix384 paper, arXiv:2506.12708), 128 GB HBM (2 x 64), 3.2 TB/s (2 x 1.6),
#    40 AI cores (2 x 20, assumed), fp32 at the 910B's quarter rate (assumed). ascend-910c: the Atlas 800T A3
#    node, 8 NPUs on HCCS (196 GB/s per NPU, as the 910B), 400 Gb/s RoCE per NPU (assumed, the seed's
#    platform: HCCS within a node, RoCE between). cloudmatrix-384: all 384 NPUs on the Unified Bus, 196 GB/s
#    per NPU (third-party summaries of the paper), one UB domain: devices_per_node 384. Power: no figure
#    published (no `--hardware.power-cap`).
# Latencies: ~5 us per HCCS/UB/IF ring step, ~10 us across RoCE; NVIDIA entries: NCCL's own (planner/nccl.py).
# gemm_efficiency: large bf16 cuBLAS GEMMs reach ~80% of peak on A100 and H200 (about 790 TFLOP/s measured
#    on this workplace's H200), ~75% on H100 SXM / H800 (power-capped clocks); assumed elsewhere: 0.75 H20
#    (the same SM as H100), 0.70 B200 / GB200 (early Blackwell BLAS), 0.60 MI300X (hipBLASLt as reported by
#    third-party benchmarks), 0.70 for the Ascend parts.
# attention_efficiency: the fraction of peak flash attention's forward + backward reaches. FlashAttention-3
#    paper (Shah et al. 2024, abstract): FlashAttention-2 (PyTorch SDPA's flash kernel, what lmt runs) reaches
#    35% of the H100's peak: 0.35 for H100, H200, H800, H20; its backward figure (FlashAttention-3 paper,
#    "Attention backward speed, head dim 128 (H100 80GB SXM5)"): FlashAttention-2 at 318 and 322 TFLOP/s for
#    8K and 16K tokens, 0.32 of the 989 peak, as attention_backward_efficiency. FlashAttention-2 paper (Dao
#    2023): 50-73% of the A100's peak: 0.60. Assumed: 0.45 for B200 / GB200 (cuDNN attention, no published
#    fraction found), 0.35 for MI300X (CK flash attention), the GEMM rate on Ascend (torch_npu's fused attention).
CATALOGUE: dict[str, Hardware] = {
    "a100-40gb": Hardware(
        "a100-40gb",
        312e12,
        19.5e12,
        40 * GB,
        1555 * GB,
        300 * GB,
        5e-6,
        25 * GB,
        10e-6,
        8,
        108,
        0.80,
        attention_efficiency=0.60,
        tdp_watts=400,
        source="NVIDIA A100 datasheet; DGX A100 datasheet",
    ),
    "a100-80gb": Hardware(
        "a100-80gb",
        312e12,
        19.5e12,
        80 * GB,
        2039 * GB,
        300 * GB,
        5e-6,
        25 * GB,
        10e-6,
        8,
        108,
        0.80,
        attention_efficiency=0.60,
        tdp_watts=400,
        source="NVIDIA A100 80GB datasheet; DGX A100 datasheet",
    ),
    "h100-sxm": Hardware(
        "h100-sxm",
        989e12,
        67e12,
        80 * GB,
        3350 * GB,
        450 * GB,
        5e-6,
        50 * GB,
        10e-6,
        8,
        132,
        0.75,
        attention_efficiency=0.35,
        attention_backward_efficiency=0.32,
        tdp_watts=700,
        source="NVIDIA H100 datasheet; DGX H100 datasheet",
        peak_flops_fp8=1979e12,
    ),
    "h200": Hardware(
        "h200",
        989e12,
        67e12,
        141 * GB,
        4800 * GB,
        450 * GB,
        5e-6,
        50 * GB,
        10e-6,
        8,
        132,
        0.80,
        attention_efficiency=0.35,
        attention_backward_efficiency=0.32,
        tdp_watts=700,
        source="NVIDIA H200 datasheet; HGX H200",
        peak_flops_fp8=1979e12,
    ),
    "h800": Hardware(
        "h800",
        989e12,
        67e12,
        80 * GB,
        3350 * GB,
        200 * GB,
        5e-6,
        50 * GB,
        10e-6,
        8,
        132,
        0.75,
        attention_efficiency=0.35,
        attention_backward_efficiency=0.32,
        tdp_watts=700,
        peak_flops_fp8=1979e12,
        source="NVIDIA H800 product brief; DeepSeek-V3 report section 3.2.2",
    ),
    "h20": Hardware(
        "h20",
        148e12,
        44e12,
        96 * GB,
        4000 * GB,
        450 * GB,
        5e-6,
        50 * GB,
        10e-6,
        8,
        78,
        0.75,
        attention_efficiency=0.35,
        attention_backward_efficiency=0.32,
        tdp_watts=400,
        peak_flops_fp8=296e12,
        source="NVIDIA HGX H20 product brief (as reported); NIC assumed",
    ),
    "b200": Hardware(
        "b200",
        2250e12,
        75e12,
        180 * GB,
        8000 * GB,
        900 * GB,
        5e-6,
        50 * GB,
        10e-6,
        8,
        148,
        0.70,
        attention_efficiency=0.45,
        tdp_watts=1000,
        peak_flops_fp8=4500e12,
        source="NVIDIA DGX B200 / HGX B200 datasheet; SM count and efficiencies assumed",
    ),
    "gb200-nvl72": Hardware(
        "gb200-nvl72",
        2500e12,
        80e12,
        186 * GB,
        8000 * GB,
        900 * GB,
        5e-6,
        50 * GB,
        10e-6,
        72,
        148,
        0.70,
        attention_efficiency=0.45,
        tdp_watts=1200,
        peak_flops_fp8=5000e12,
        nics_per_node=72,
        source="NVIDIA GB200 NVL72 datasheet / 72; NIC, SMs and efficiencies assumed",
    ),
    "mi300x": Hardware(
        "mi300x",
        1307.4e12,
        163.4e12,
        192 * GB,
        5300 * GB,
        224 * GB,
        5e-6,
        50 * GB,
        10e-6,
        8,
        304,
        0.60,
        attention_efficiency=0.35,
        tdp_watts=750,
        peak_flops_fp8=2614.9e12,
        source="AMD Instinct MI300X datasheet; efficiencies and NICs assumed",
    ),
    "ascend-910b": Hardware(
        "ascend-910b",
        313e12,
        78e12,
        64 * GB,
        1600 * GB,
        196 * GB,
        5e-6,
        25 * GB,
        10e-6,
        8,
        20,
        0.70,
        tdp_watts=400,
        source="Atlas 800T A2 (third-party reports; approximate)",
    ),
    "ascend-910c": Hardware(
        "ascend-910c",
        752e12,
        188e12,
        128 * GB,
        3200 * GB,
        196 * GB,
        5e-6,
        50 * GB,
        10e-6,
        8,
        40,
        0.70,
        source="CloudMatrix384 paper (arXiv:2506.12708); node figures assumed",
    ),
    "cloudmatrix-384": Hardware(
        "cloudmatrix-384",
        752e12,
        188e12,
        128 * GB,
        3200 * GB,
        196 * GB,
        5e-6,
        50 * GB,
        10e-6,
        384,
        40,
        0.70,
        source="CloudMatrix384 paper (arXiv:2506.12708); UB per NPU as reported",
    ),
}


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


def entry_for_device(name: str) -> Hardware | None:
    """The catalogue entry of a device by its product name (`mesh.device_name`), or None. Only the parts whose
    figures the entry holds: the SXM A100 and H100 (the PCIe and NVL parts have other clocks and links), the
    H200 (not the NVL), H800, H20, B200, GB200, MI300X, Ascend 910B and 910C; a CPU has none (`lmt calibrate`
    measures one)."""
    n = name.upper().replace(" ", "").replace("-", "")
    key = None
    if "H200" in n and "NVL" not in n:
        key = "h200"
    elif "H100" in n and ("SXM" in n or "HBM3" in n):  # "NVIDIA H100 80GB HBM3" is the SXM part
        key = "h100-sxm"
    elif "H800" in n and "PCIE" not in n:
        key = "h800"
    elif "H20" in n and "H200" not in n:
        key = "h20"
    elif "GB200" in n:
        key = "gb200-nvl72"
    elif "B200" in n:
        key = "b200"
    elif "MI300X" in n:
        key = "mi300x"
    elif "A100SXM" in n:  # "NVIDIA A100-SXM4-80GB"
        key = "a100-80gb" if "80GB" in n else "a100-40gb"
    elif "910B" in n:  # "Ascend910B3"
        key = "ascend-910b"
    elif "910C" in n:
        key = "ascend-910c"
    return CATALOGUE[key] if key else None


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
    return replace(
        hw,
        peak_flops=hw.peak_flops * share,
        peak_flops_fp32=hw.peak_flops_fp32 * share,
        memory_bandwidth=hw.memory_bandwidth / ranks,
        devices_per_node=max(ranks, cores),
    )


# --hardware.* overrides: flag name -> (field it sets, unit the flag is given in, what it means)
OVERRIDES = {
    "inter-node-bandwidth": ("inter_node_bandwidth", GB, "GB/s per device across nodes (its share of the NICs)"),
    "intra-node-bandwidth": ("intra_node_bandwidth", GB, "GB/s per device and direction inside a node"),
    "nics-per-node": ("nics_per_node", 1, "scale-out NICs per node (rescales the inter-node bandwidth)"),
    "memory-gb": ("memory_bytes", GB, "device memory in GB (1e9 bytes)"),
    "memory-bandwidth": ("memory_bandwidth", GB, "device memory bandwidth in GB/s (e.g. HBM2e H100s: 2400)"),
    "power-cap": ("tdp_watts", 1, "board power cap in W (compute slows as (cap / rated power)^(1/3))"),
}


def with_overrides(hw: Hardware, values: dict[str, float]) -> Hardware:
    """The entry as one run sees it: `--hardware.*` flags applied (None values ignored).

    A power cap below the rated power lowers the clocks: dynamic power goes as f V^2 with V about proportional
    to f, so compute-bound throughput scales as (cap / rated)^(1/3) (an assumption; memory bandwidth is left
    alone). NICs per node rescale the per-device inter-node bandwidth, which is the node's NICs shared."""
    unknown = sorted(set(values) - set(OVERRIDES))
    if unknown:
        raise ConfigError(f"unknown --hardware.{unknown[0]}; choose one of: {', '.join(OVERRIDES)}")
    changes: dict = {}
    for flag in OVERRIDES:  # in this order: the NIC count rescales a given inter-node bandwidth too
        value = values.get(flag)
        if value is None:
            continue
        if value <= 0:
            raise ConfigError(f"--hardware.{flag} must be positive, got {value}")
        name, unit, _ = OVERRIDES[flag]
        if flag == "power-cap":
            if hw.tdp_watts is None:
                raise ConfigError(f"--hardware.power-cap: {hw.name} has no rated power in the catalogue")
            scale = min(1.0, value / hw.tdp_watts) ** (1 / 3)
            # fractions of the datasheet peak, which MFU stays quoted against
            changes.update(
                gemm_efficiency=hw.gemm_efficiency * scale,
                attention_efficiency=hw.attention_fraction * scale,
                attention_backward_efficiency=hw.attention_backward_fraction * scale,
            )
        elif flag == "nics-per-node":
            nics = hw.nics_per_node or hw.devices_per_node
            bandwidth = changes.get("inter_node_bandwidth", hw.inter_node_bandwidth)
            changes["inter_node_bandwidth"] = bandwidth * int(value) / nics
        changes[name] = int(value) if unit == 1 and flag == "nics-per-node" else value * unit
    return replace(hw, **changes) if changes else hw
