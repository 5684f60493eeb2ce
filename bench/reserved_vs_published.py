"""Reserved memory as a device's allocator would report it, against published FSDP runs (issue 35).

torchtitan's docs/performance.md reports the memory of its runs as the caching allocator's `max_reserved`
(its logger's "memory" figure), which exceeds the peak of live tensors by what the allocator keeps cached and
cannot reuse. This rehearses our runtime at each run's shape and layout (`lmt rehearse`: fake tensors, every
allocation in order) and replays the allocations through PyTorch's CUDA caching allocator
(memory/caching_allocator.py), with torchtitan's `expandable_segments:True` (its run_train.sh) and with the default
segments. What the rows fix, as torchtitan ran them: Llama 3.1 8B, FSDP2 (ZeRO-3) over all GPUs, local batch 2 x
8,192 tokens, bf16, op-level selective checkpointing (our `sac`), and the loss over the whole fp32 logits
(torchtitan's cross-entropy upcasts them; `--train.fused_loss false`).

    python bench/reserved_vs_published.py     # two rehearsals, about a minute each on this CPU
"""

from __future__ import annotations

from large_model_training.config import build_config
from large_model_training.layout import validate
from large_model_training.mesh import RankGrid
from large_model_training.train.rehearse import rank_kinds, rehearse_rank

GiB = 2**30
# (run, GPUs, published GiB): torchtitan docs/performance.md, Table 1 (8 GPUs) and Table 3 (128 GPUs), eager bf16 rows
RUNS = [("Llama 3.1 8B, FSDP 8", 8, 82.4), ("Llama 3.1 8B, FSDP 128", 128, 67.0)]


def main() -> None:
    print("| run | live peak | allocated (rounded) | reserved, expandable | reserved, default | published | error "
          "(expandable) | error (default) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, gpus, published in RUNS:
        overrides = {"model.preset": "llama3-8b", "parallel.dp": gpus, "parallel.zero": 3, "train.seq_len": 8192,
                     "train.global_batch_size": 2 * gpus, "train.micro_batch_size": 2, "train.recompute": "sac",
                     "train.precision": "bf16", "train.fused_loss": False}
        cfg = validate(build_config(overrides=overrides))
        r = rehearse_rank(cfg, rank_kinds(RankGrid(1, gpus, 1), 3)[0])
        expandable, default = r["reserved_peak_expandable_bytes"] / GiB, r["reserved_peak_bytes"] / GiB
        print(f"| {name} | {r['peak_bytes'] / GiB:.1f} | {r['allocator_allocated_peak_bytes'] / GiB:.1f} | "
              f"{expandable:.1f} | {default:.1f} | {published} | {expandable / published - 1:+.1%} | "
              f"{default / published - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
