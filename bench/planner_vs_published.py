"""The planner's predictions for published large-scale runs, next to what was published, with the error of each row.

    python bench/planner_vs_published.py            # prints a markdown table (docs/planner.md holds a copy)

Each row fixes what the paper fixes (model shape, devices, tp, pp, dp, global batch, sequence length, recompute
policy) and lets the planner choose the rest (micro-batch, schedule, virtual stages, ZeRO for Llama 3). The two
"Meta's layout" rows also fix Meta's schedule (interleaved, uneven chunks, no recomputation) and are timed even
where our runtime could not hold them (a what-if, left out of the mean error). Constants are the
catalogue's (planner/hardware.py): one calibration per hardware entry, nothing tuned per row.

Sources:
  [N21] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
        SC'21 (arXiv:2104.04473), Table 1: GPT, vocab 51,200, sequence 2,048, A100 80 GB (Selene), full
        activation recomputation; "achieved teraFLOP/s per GPU" counts the recomputation (their eq. 3), so
        it is compared with the planner's hardware FLOP/s.
  [S22] Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990),
        system performance table: 105 layers, h 20,480, 128 heads, tp 8, pp 35, batch 1,920, A100 80 GB;
        TFLOP/s per GPU with recomputation.
  [K22] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
        (arXiv:2205.05198), Table 3 configurations; MFU as in the Megatron-LM README (dp = 1, selective
        recomputation + sequence parallelism).
  [L24] Meta, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4: Llama 3 405B on H100 80 GB, tp 8,
        pp 16, sequence 8,192, 16M tokens per batch; BF16 model TFLOP/s per GPU. Its long-context row: 16,384
        GPUs, tp 8, cp 16, pp 16, dp 8, sequence 131,072, 16 sequences per dp rank (128 per step, 16M tokens),
        380 TFLOP/s per GPU; cp by all-gathering K and V (section 3.3.2).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from large_model_training.choices import RecomputePolicy, Schedule
from large_model_training.config import model_from_preset
from large_model_training.planner.hardware import CATALOGUE, GiB
from large_model_training.layout import Job
from large_model_training.planner.search import Axes, Planner

GPT = model_from_preset("megatron-18b")
META = dict(schedule=Schedule.INTERLEAVED, virtual_stages=8, zero=2)
LONG = dataclasses.replace(model_from_preset("llama3-405b"), max_seq_len=131072)  # Llama 3.1's 128K context


def gpt(h: int, a: int, layers: int):
    return dataclasses.replace(GPT, preset=f"gpt-h{h}-L{layers}", hidden_size=h, n_heads=a, n_layers=layers,
                               ffn_hidden_size=4 * h)


# (source, label, model, hardware, devices, tp, pp, global batch, seq, recompute, metric, published value)
# metric: "hw" = hardware TFLOP/s per GPU (recompute counted), "model" = model TFLOP/s per GPU, "mfu" = MFU.
ROWS = [
    ("N21", "1.7B", gpt(2304, 24, 24), "a100-80gb", 32, 1, 1, 512, 2048, "full", "hw", 137),
    ("N21", "3.6B", gpt(3072, 32, 30), "a100-80gb", 64, 2, 1, 512, 2048, "full", "hw", 138),
    ("N21", "7.5B", gpt(4096, 32, 36), "a100-80gb", 128, 4, 1, 512, 2048, "full", "hw", 142),
    ("N21", "18.4B", model_from_preset("megatron-18b"), "a100-80gb", 256, 8, 1, 1024, 2048, "full", "hw", 135),
    ("N21", "39.1B", gpt(8192, 64, 48), "a100-80gb", 512, 8, 2, 1536, 2048, "full", "hw", 138),
    ("N21", "76.1B", gpt(10240, 80, 60), "a100-80gb", 1024, 8, 4, 1792, 2048, "full", "hw", 140),
    ("N21", "145.6B", model_from_preset("megatron-145b"), "a100-80gb", 1536, 8, 8, 2304, 2048, "full", "hw", 148),
    ("N21", "310.1B", gpt(16384, 128, 96), "a100-80gb", 1920, 8, 16, 2160, 2048, "full", "hw", 155),
    ("N21", "529.6B", model_from_preset("megatron-530b"), "a100-80gb", 2520, 8, 35, 2520, 2048, "full", "hw", 163),
    ("N21", "1008B", model_from_preset("megatron-1t"), "a100-80gb", 3072, 8, 64, 3072, 2048, "full", "hw", 163),
    ("S22", "MT-NLG 530B, 280 nodes", model_from_preset("megatron-530b"), "a100-80gb", 2240, 8, 35, 1920, 2048,
     "full", "hw", 126),
    ("S22", "MT-NLG 530B, 420 nodes", model_from_preset("megatron-530b"), "a100-80gb", 3360, 8, 35, 1920, 2048,
     "full", "hw", 113),
    ("K22", "22B", gpt(6144, 64, 48), "a100-80gb", 8, 8, 1, 4, 2048, "selective", "mfu", 0.415),
    ("K22", "175B", model_from_preset("gpt3-175b"), "a100-80gb", 64, 8, 8, 64, 2048, "selective", "mfu", 0.514),
    ("K22", "530B", model_from_preset("megatron-530b"), "a100-80gb", 280, 8, 35, 280, 2048, "selective", "mfu",
     0.560),
    ("K22", "1T", model_from_preset("megatron-1t"), "a100-80gb", 512, 8, 64, 512, 2048, "selective", "mfu", 0.563),
    ("L24", "Llama 3 405B, 8,192 GPUs", model_from_preset("llama3-405b"), "h100-sxm", 8192, 8, 16, 2048, 8192,
     None, "model", 430),
    ("L24", "Llama 3 405B, 16,384 GPUs", model_from_preset("llama3-405b"), "h100-sxm", 16384, 8, 16, 2048, 8192,
     None, "model", 400),
    # Meta's own layout (Llama 3 section 3.3.2: interleaved, one block less on the first and the last rank, no
    # activation checkpointing, FSDP without resharding after forward: ZeRO-2): 126 blocks in 128 chunks, v = 8,
    # the first chunk embedding only, the last head only. Shown even where it does not fit our runtime's
    # memory; left out of the mean error.
    ("L24", "Llama 3 405B, 8,192 GPUs, Meta's layout", model_from_preset("llama3-405b"), "h100-sxm", 8192, 8, 16,
     2048, 8192, "none", "model", 430, META),
    ("L24", "Llama 3 405B, 16,384 GPUs, Meta's layout", model_from_preset("llama3-405b"), "h100-sxm", 16384, 8, 16,
     2048, 8192, "none", "model", 400, META),
    # The 128K stage: Meta's tp8 cp16 pp16 dp8, the planner choosing the rest (ring or all-gather included) ...
    ("L24", "Llama 3 405B, 128K, 16,384 GPUs", LONG, "h100-sxm", 16384, 8, 16, 128, 131072, None, "model", 380,
     dict(cp=16)),
    # ... and as Meta ran it: all-gather cp, interleaved v8, ZeRO-2, no recomputation (a what-if).
    ("L24", "Llama 3 405B, 128K, 16,384 GPUs, Meta's layout", LONG, "h100-sxm", 16384, 8, 16, 128, 131072, "none",
     "model", 380, dict(META, cp=16, cp_attention="allgather")),
]


def predict(row) -> tuple[str, float | None, str]:
    source, label, model, hw_name, devices, tp, pp, gbs, seq, recompute, metric, published, *fixed = row
    what_if = fixed[0] if fixed else {}  # cp alone is what Meta fixed; a schedule makes the row a what-if
    hw = CATALOGUE[hw_name]
    # [N21], [S22], [K22] ran Megatron's fused softmax on materialised scores (flash attention came in 2023)
    job = Job(model, seq, gbs, "bf16", flash_attention=source == "L24")
    planner = Planner(job, hw, devices, hw.devices_per_node)
    sp = True if recompute == "selective" else None  # [K22] runs sequence parallelism with selective recompute
    policy = RecomputePolicy.parse(recompute) if recompute else None
    axes = dict(tp=tp, pp=pp, cp=1, zero=0 if source != "L24" else None, recompute=policy, sequence_parallel=sp)
    best, misses = planner.search(Axes(**{**axes, **what_if}), top=1)
    if not best and "schedule" in what_if and misses:  # the published layout, timed though our runtime can't hold it
        best = [planner.evaluate(misses[0].layout)]
    if not best:
        miss = misses[0] if misses else None
        need = f"does not fit ({miss.memory.total / GiB:.0f} GiB)" if miss else "no layout"
        return need, None, "-"
    plan = best[0]
    t = plan.time
    value = {"hw": t.hardware_tflops_per_device, "model": t.tflops_per_device, "mfu": t.mfu}[metric]
    lay = plan.layout
    chosen = ("" if lay.cp == 1 else f"cp={lay.cp}/{lay.cp_attention} ") + f"mb={lay.micro_batch_size} {lay.schedule}"
    chosen += (f"/v{lay.virtual_stages}" if lay.virtual_stages > 1 else "") + f" zero={lay.zero} {lay.recompute}"
    memory = f"{plan.memory.total / GiB:.1f}" + ("" if plan.fits else " (does not fit)")
    return chosen, value, memory


def main() -> int:
    start = time.perf_counter()
    print("| source | run | devices | tp x cp x pp x dp | planner's choice | GiB/GPU (of 80) | metric | published | "
          "predicted | error |")
    print("|---|---|---:|---|---|---:|---|---:|---:|---:|")
    errors = []
    for row in ROWS:
        source, label, model, hw_name, devices, tp, pp, gbs, seq, recompute, metric, published, *what_if = row
        chosen, value, memory = predict(row)
        fmt = (lambda x: f"{x:.1%}") if metric == "mfu" else (lambda x: f"{x:.0f}")
        name = {"hw": "TFLOP/s/GPU (with recompute)", "model": "model TFLOP/s/GPU", "mfu": "MFU"}[metric]
        err = "-" if value is None else f"{(value - published) / published:+.0%}"
        cp = what_if[0].get("cp", 1) if what_if else 1
        if value is not None and not (what_if and "schedule" in what_if[0]):
            errors.append(abs(value - published) / published)
        shape = f"{tp} x {cp} x {pp} x {devices // (tp * cp * pp)}"
        print(f"| [{source}] | {label} | {devices:,} | {shape} | {chosen} | {memory} | "
              f"{name} | {fmt(published)} | {'-' if value is None else fmt(value)} | {err} |")
    if errors:
        print(f"\nmean absolute error {sum(errors) / len(errors):.0%} over {len(errors)} rows "
              f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
