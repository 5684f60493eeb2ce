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
  [TT]  torchtitan, docs/performance.md (pytorch/torchtitan; the paper arXiv:2410.06511): Llama 3.1 8B with FSDP2
        alone (ZeRO-3), sequence 8,192, bf16, eager (the rows without torch.compile and Float8), local batch 2,
        selective activation checkpointing, on Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s, 500 W power limit,
        400 Gb/s per GPU (given as --hardware.* overrides of h100-sxm, not tuned). Table 1: 8 GPUs, 5,762
        tokens/s/GPU, 82.4 GiB; Table 3: 128 GPUs, 5,605, 67.0 GiB.
  [TA]  torchtitan, docs/performance.md at its 2024 version (the A100 table): Llama 3 8B and 70B, FSDP2 on 64
        A100 80 GB, local batch 1, sequence 8,192: 8B selective op AC 2,973 tokens/s/GPU; 70B full AC 331.
  [MC24] NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md: Mixtral 8x7B, 64 H100, tp 1 ep 8 pp 4 vp 8,
        micro-batch 1, global batch 256, sequence 4,096, bf16: 468 TFLOP/s per GPU (MCore v0.9).
  [DS24] DeepSeek-V3 technical report (arXiv:2412.19437): 2,048 H800, 14.8T tokens in 2,664K GPU hours = 1,543
        tokens/s/GPU (sequence 4,096, batch 15,360); the planner chooses the layout (tp 1 fixed, as DeepSeek ran),
        in bf16 (DeepSeek ran FP8 GEMMs and hid its all-to-alls under DualPipe).

Subsets (the mean signed error of each is reported): Megatron ([N21] [S22] [K22]), Meta ([L24] 8K), long context
([L24] 128K), FSDP ([TT] [TA]), MoE ([MC24] [DS24]).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from large_model_training.choices import RecomputePolicy, Schedule
from large_model_training.config import model_from_preset
from large_model_training.planner.hardware import CATALOGUE, GiB, with_overrides
from large_model_training.layout import Job
from large_model_training.planner.search import Axes, Planner

GPT = model_from_preset("megatron-18b")
META = dict(schedule=Schedule.INTERLEAVED, virtual_stages=8, zero=2, what_if=True)
# Grand Teton's H100s as torchtitan describes them: the h100-sxm entry with the published memory and power
GRAND_TETON = with_overrides(CATALOGUE["h100-sxm"], {"memory-gb": 96, "memory-bandwidth": 2400, "power-cap": 500})
FSDP = dict(zero=3, micro_batch_size=2)
LLAMA2_13B = dataclasses.replace(model_from_preset("llama3-8b"), preset="llama2-13b", vocab_size=32000,
                                 hidden_size=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden_size=13824,
                                 max_seq_len=4096)
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
    # MT-NLG ran DeepSpeed's pipeline engine, whose TrainSchedule is 1F1B (deepspeed/runtime/pipe/schedule.py)
    ("S22", "MT-NLG 530B, 280 nodes", model_from_preset("megatron-530b"), "a100-80gb", 2240, 8, 35, 1920, 2048,
     "full", "hw", 126, dict(schedule=Schedule.ONE_F_ONE_B)),
    ("S22", "MT-NLG 530B, 420 nodes", model_from_preset("megatron-530b"), "a100-80gb", 3360, 8, 35, 1920, 2048,
     "full", "hw", 113, dict(schedule=Schedule.ONE_F_ONE_B)),
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
    # FSDP2 (ZeRO-3) runs: torchtitan's eager bf16 rows; published memory beside the prediction
    # torchtitan's "selective" is op-level SAC (every other matmul's output and attention's kept): lmt's
    # --recompute sac, the same policy (memory/op_checkpoint.py)
    ("TT", "Llama 3.1 8B, FSDP 8", model_from_preset("llama3-8b"), GRAND_TETON, 8, 1, 1, 16, 8192, "sac",
     "tps", 5762, dict(FSDP, published_gib=82.4)),
    ("TT", "Llama 3.1 8B, FSDP 128", model_from_preset("llama3-8b"), GRAND_TETON, 128, 1, 1, 256, 8192, "sac",
     "tps", 5605, dict(FSDP, published_gib=67.0)),
    ("TA", "Llama 3 8B, FSDP 64, A100", model_from_preset("llama3-8b"), "a100-80gb", 64, 1, 1, 64, 8192, "sac",
     "tps", 2973, dict(zero=3, micro_batch_size=1)),
    ("TA", "Llama 3 70B, FSDP 64, A100", model_from_preset("llama3-70b"), "a100-80gb", 64, 1, 1, 64, 8192, "full",
     "tps", 331, dict(zero=3, micro_batch_size=1)),
    # MoE
    ("MC24", "Mixtral 8x7B, Megatron-Core", model_from_preset("mixtral-8x7b"), "h100-sxm", 64, 1, 4, 256, 4096, None,
     "model", 468, dict(ep=8, micro_batch_size=1, schedule=Schedule.INTERLEAVED, virtual_stages=8)),
    # DeepSeek's dispatch is DeepEP's (intra/inter-node link shares, one RDMA copy per node) under DualPipe (the
    # all-to-alls beside the paired micro-batch's compute), its GEMMs FP8 with fine-grained scales (section 3.3):
    # our nearest recipe is rowwise
    ("DS24", "DeepSeek-V3 pre-training, planner's layout", model_from_preset("deepseek-v3"), "h800", 2048, 1, None,
     15360, 4096, None, "tps", 1543, dict(moe_dispatch="deepep-dualpipe", precision="fp8", fp8_recipe="rowwise")),
]

SUBSETS = {"N21": "Megatron", "S22": "Megatron", "K22": "Megatron", "TT": "FSDP", "TA": "FSDP", "MC24": "MoE",
           "DS24": "MoE"}


def subset(row) -> str:
    if row[0] == "L24":
        return "long context" if row[8] > 8192 else "Meta"
    return SUBSETS[row[0]]


def predict(row) -> tuple[str, float | None, str]:
    source, label, model, hw_name, devices, tp, pp, gbs, seq, recompute, metric, published, *fixed = row
    job_fields = ("moe_dispatch", "precision", "fp8_recipe")  # Job's, not the search's
    # Megatron-LM 2021's local DDP and DeepSpeed's pipeline engine reduce the gradients after the last backward
    what_if = {k: v for k, v in (fixed[0] if fixed else {}).items()
               if k not in ("what_if", "published_gib") + job_fields}
    timed_anyway = bool(fixed and fixed[0].get("what_if"))  # Meta's own layouts: timed where they do not fit
    hw = CATALOGUE[hw_name] if isinstance(hw_name, str) else hw_name
    # [N21], [S22], [K22] ran Megatron's fused softmax on materialised scores (flash attention came in 2023)
    given = {k: v for k, v in (fixed[0] if fixed else {}).items() if k in job_fields}
    # Every framework here steps a fused AdamW: Apex's FusedAdam (Megatron-LM's megatron/optimizer, DeepSpeed's
    # Adam), torchtitan's `implementation = "fused"`; Meta and DeepSeek do not say (ZeRO shards make it negligible)
    job = Job(model, seq, gbs, given.pop("precision", "bf16"), flash_attention=source not in ("N21", "S22", "K22"),
              grad_overlap=source not in ("N21", "S22"), fused_optimizer=True, **given)
    planner = Planner(job, hw, devices, hw.devices_per_node)
    # [K22] runs sequence parallelism with selective recompute; [N21] and [S22] predate it (introduced by [K22])
    sp = True if recompute == "selective" else (False if source in ("N21", "S22") and tp > 1 else None)
    policy = RecomputePolicy.parse(recompute) if recompute else None
    axes = dict(tp=tp, pp=pp, cp=1, zero=0 if source in ("N21", "S22", "K22") else None, recompute=policy,
                sequence_parallel=sp)
    # Megatron-LM 2021-2022 had two pipeline schedules, 1F1B and interleaved 1F1B (get_forward_backward_func);
    # zero-bubble schedules came in 2023: those rows search the two
    kinds = [{}] if source not in ("N21", "K22") or pp == 1 else [
        dict(schedule=Schedule.ONE_F_ONE_B), dict(schedule=Schedule.INTERLEAVED)]
    best, misses = [], []
    for kind in kinds:
        found, missed = planner.search(Axes(**{**axes, **what_if, **kind}), top=1)
        best, misses = best + found, misses + missed
    best = sorted(best, key=lambda plan: -plan.time.tokens_per_s)[:1]
    if not best and timed_anyway and misses:  # the published layout, timed though our runtime can't hold it
        best = [planner.evaluate(misses[0].layout)]
    if not best:
        miss = misses[0] if misses else None
        need = f"does not fit ({miss.memory.total / GiB:.0f} GiB)" if miss else "no layout"
        return need, None, "-"
    plan = best[0]
    t = plan.time
    value = {"hw": t.hardware_tflops_per_device, "model": t.tflops_per_device, "mfu": t.mfu,
             "tps": t.tokens_per_s / plan.layout.devices}[metric]
    lay = plan.layout
    chosen = ("" if lay.cp == 1 else f"cp={lay.cp}/{lay.cp_attention} ") + ("" if lay.ep == 1 else f"ep={lay.ep} ")
    chosen += (f"pp={lay.pp} " if pp is None else "") + f"mb={lay.micro_batch_size} {lay.schedule}"
    chosen += (f"/v{lay.virtual_stages}" if lay.virtual_stages > 1 else "") + f" zero={lay.zero} {lay.recompute}"
    memory = f"{plan.memory.total / GiB:.1f}" + ("" if plan.fits else " (does not fit)")
    if fixed and fixed[0].get("published_gib"):
        memory += f" (published {fixed[0]['published_gib']})"
    return chosen, value, memory


def main() -> int:
    start = time.perf_counter()
    print("| source | run | devices | tp x cp x pp x dp | planner's choice | GiB/GPU | metric | published | "
          "predicted | error |")
    print("|---|---|---:|---|---|---:|---|---:|---:|---:|")
    errors: dict[str, list[float]] = {}
    for row in ROWS:
        source, label, model, hw_name, devices, tp, pp, gbs, seq, recompute, metric, published, *fixed = row
        chosen, value, memory = predict(row)
        fmt = (lambda x: f"{x:.1%}") if metric == "mfu" else (lambda x: f"{x:,.0f}")
        name = {"hw": "TFLOP/s/GPU (with recompute)", "model": "model TFLOP/s/GPU", "mfu": "MFU",
                "tps": "tokens/s/GPU"}[metric]
        err = "-" if value is None else f"{(value - published) / published:+.0%}"
        cp = fixed[0].get("cp", 1) if fixed else 1
        if value is not None and not (fixed and fixed[0].get("what_if")):
            errors.setdefault(subset(row), []).append((value - published) / published)
        shape = f"{tp} x {cp} x {pp or '?'} x {devices // (tp * cp * pp) if pp else '?'}"
        print(f"| [{source}] | {label} | {devices:,} | {shape} | {chosen} | {memory} | "
              f"{name} | {fmt(published)} | {'-' if value is None else fmt(value)} | {err} |")
    every = [e for errs in errors.values() for e in errs]
    if every:
        print(f"\nmean absolute error {sum(abs(e) for e in every) / len(every):.1%} over {len(every)} rows "
              f"({time.perf_counter() - start:.0f} s); mean signed error by subset: "
              + ", ".join(f"{k} {sum(v) / len(v):+.1%} ({len(v)})" for k, v in errors.items()))
        rms = (sum(e * e for e in every) / len(every)) ** 0.5
        print(f"error band (planner/error_band.py): rms {rms:.3f} over {len(every)} rows; by subset "
              + ", ".join(f"{k} {(sum(e * e for e in v) / len(v)) ** 0.5:.3f}" for k, v in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
