"""Initialisation of one large-model rank: wall time and peak host memory, before and after O(shard) init.

Builds one rank's pipeline chunk with `build_model(cfg, mesh, seed, stage=...)` (meta construction, tp swap,
materialise, initialise) from real tensors in bf16 on the CPU, with no process group: initialisation reads only
the tp rank and size, so a stand-in mesh carries those. Each variant runs in a fresh subprocess (its peak RSS,
`ru_maxrss`, is then its own) against a source tree given by path; "before" is a checkout of the commit before
issue 16, made with `git worktree add /tmp/lmt-before <commit>` (it does not touch this tree). A tiny model is
built first in each process, so the one-off lazy imports of the first meta-device construction are not timed.
Each process runs one intra-op thread by default, as torchrun starts every rank of a multi-rank node
(`--threads 2` on this 2-core VM makes the many tile-sized copies wait on OpenMP wake-ups: see docs/benchmarks.md).

    git worktree add /tmp/lmt-before e04db7f
    python bench/init_scale.py --before /tmp/lmt-before/src           # llama-100b, tp8 pp8, tp rank 3, pp rank 3
    python bench/init_scale.py --before /tmp/lmt-before/src --model llama-1b --tp 2 --pp 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

PROBE = r"""
import json, resource, sys, time
from types import SimpleNamespace
import torch
from large_model_training.assembly import build_model
from large_model_training.config import model_from_preset
from large_model_training.mesh import AxisGroup
from large_model_training.parallel.pipeline.partition import stage_layers, stage_specs

args = json.loads(sys.argv[1])
cfg = model_from_preset(args["model"])
spec = stage_specs(stage_layers(cfg, args["pp"], 1, "1f1b", args["seq_len"]))[args["pp_rank"]]
mesh = SimpleNamespace(tp_size=args["tp"], tp=AxisGroup(None, args["tp"], args["tp_rank"]), device=torch.device("cpu"))
torch.set_default_dtype(torch.bfloat16)
build_model(model_from_preset("tiny"), None, seed=0)  # one-off lazy imports, not timed
start = time.perf_counter()
model = build_model(cfg, mesh, seed=0, stage=spec)
seconds = time.perf_counter() - start
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"seconds": seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "params": params, "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "layers": [spec.first_layer, spec.last_layer], "threads": torch.get_num_threads()}))
"""


def measure(src: str, args: argparse.Namespace) -> dict:
    """One build in a fresh Python whose package comes from `src`."""
    spec = {k: getattr(args, k) for k in ("model", "tp", "pp", "tp_rank", "pp_rank", "seq_len")}
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="src folder of the tree before O(shard) init")
    parser.add_argument("--after", default=HERE_SRC, help="src folder of the tree after (default: this one)")
    parser.add_argument("--model", default="llama-100b")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--tp-rank", type=int, default=3)
    parser.add_argument("--pp-rank", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=4096, help="for the pipeline's balanced layer split")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (torchrun: 1)")
    parser.add_argument("--rounds", type=int, default=1, help="after/before pairs, alternating")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in ("after", "before"):
            runs[name].append(measure(getattr(args, name), args))
            print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    first = runs["after"][0]
    print(f"\n{args.model} tp{args.tp} pp{args.pp}, tp rank {args.tp_rank}, pp rank {args.pp_rank} "
          f"(layers {first['layers'][0]}-{first['layers'][1] - 1}): {first['params'] / 1e9:.2f}B params, "
          f"{first['param_bytes'] / 1e9:.2f} GB in bf16; medians of {args.rounds}")
    for name in ("before", "after"):
        seconds = statistics.median(r["seconds"] for r in runs[name])
        rss = statistics.median(r["peak_rss_bytes"] for r in runs[name])
        print(f"  {name:6s}  init {seconds:7.1f} s   peak RSS {rss / 1e9:6.2f} GB")
    ratio = statistics.median(r["seconds"] for r in runs["before"]) / statistics.median(
        r["seconds"] for r in runs["after"])
    print(f"  before/after time: {ratio:.1f}x")


if __name__ == "__main__":
    main()
