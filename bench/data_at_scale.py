"""Training start-up and memory per rank on a 10 GB prepared set against a 10 MB one, and loader throughput.

Writes two prepared folders in our format (random uint16 tokens, a document every ~2,000 tokens, the real
writer's manifest with checksums), then, for each, in fresh processes:
  1. the data path alone: open the folder, build the loader, draw the first batch (seconds, and RSS after);
  2. `lmt train` itself (2 ranks, dp=2, 3 steps of the tiny model): wall time to the end and each rank's peak
     resident memory (`peak_mem_bytes` in metrics.jsonl);
  3. loader throughput: batches of 64 x 2048 tokens drawn per second from the 10 GB set, next to the tokens per
     second the same run's training step consumes.
The ratios (10 GB / 10 MB) are what the issue asks to stay within 10%.

    python bench/data_at_scale.py                      # 10 GB + 10 MB in /tmp (needs ~10.1 GB free); deleted after
    python bench/data_at_scale.py --big-gb 1 --keep
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

VOCAB, DOC_TOKENS, SHARD_TOKENS = 32000, 2000, 1 << 29  # 1 GiB uint16 shards

PROBE = r"""
import os, sys, time, json
t0 = time.perf_counter()
import torch
from large_model_training.config import DataConfig
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
t1 = time.perf_counter()
data = load_training_data(DataConfig(path=sys.argv[1]))
loader = BatchLoader(data.train, 2048, Shard(0, 1, 64, 8), 1234, torch.device("cpu"), prefetch=False)
loader.next()
t2 = time.perf_counter()
n = 20
for _ in range(n):
    loader.next()
t3 = time.perf_counter()
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
print(json.dumps({"open_and_first_batch_s": t2 - t1, "rss_bytes": rss, "batches_per_s": n / (t3 - t2),
                  "tokens_per_s": n * 64 * 2048 / (t3 - t2), "import_s": t1 - t0}))
"""


def write_synthetic(folder: str, total_bytes: int, seed: int) -> None:
    """A valid prepared folder of `total_bytes` of uint16 training tokens, written in 64 MB pieces."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    total, shards, index = total_bytes // 2, [], 0
    written = 0
    while written < total:
        n = min(SHARD_TOKENS, total - written)
        name = f"train-{index:05d}"
        digest = hashlib.sha256()
        with open(os.path.join(folder, name + ".bin"), "wb") as f:
            left = n
            while left:
                piece = rng.integers(1, VOCAB, size=min(left, 1 << 25), dtype=np.uint16)
                f.write(piece.tobytes())
                digest.update(piece.tobytes())
                left -= len(piece)
        ends = np.arange(DOC_TOKENS, n + 1, DOC_TOKENS, dtype=np.int64)
        if len(ends) == 0 or ends[-1] != n:
            ends = np.append(ends, n)
        ends.tofile(os.path.join(folder, name + ".idx"))
        shards.append({"bin": name + ".bin", "idx": name + ".idx", "tokens": int(n), "documents": len(ends),
                       "bin_sha256": digest.hexdigest(), "idx_sha256": hashlib.sha256(ends.tobytes()).hexdigest()})
        written += n
        index += 1
    val = rng.integers(1, VOCAB, size=1 << 16, dtype=np.uint16)
    val.tofile(os.path.join(folder, "val-00000.bin"))
    val_ends = np.array([len(val)], dtype=np.int64)
    val_ends.tofile(os.path.join(folder, "val-00000.idx"))
    val_shard = {"bin": "val-00000.bin", "idx": "val-00000.idx", "tokens": len(val), "documents": 1,
                 "bin_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
                 "idx_sha256": hashlib.sha256(val_ends.tobytes()).hexdigest()}
    identity = {"kind": "synthetic", "name": "random-uint16", "vocab_size": VOCAB, "eod_id": 0,
                "sha256": hashlib.sha256(b"synthetic").hexdigest()}
    splits = {"train": {"tokens": int(total), "documents": sum(s["documents"] for s in shards), "shards": shards},
              "val": {"tokens": len(val), "documents": 1, "shards": [val_shard]}}
    manifest = {"format": "lmt-tokens", "version": 1, "tokenizer": identity, "dtype": "uint16",
                "val_fraction": 0.0, "splits": splits, "documents": splits["train"]["documents"] + 1,
                "tokens": int(total) + len(val), "inputs": ["synthetic"], "files": 0, "sources": []}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def probe(folder: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, folder], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def train(folder: str, run: str) -> dict:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "large_model_training.cli", "train", "--data", folder, "--out", run,
                    "--dp", "2", "--steps", "3", "--global-batch-size", "8", "--micro-batch-size", "4",
                    "--seq-len", "256", "--model.vocab_size", str(VOCAB), "--eval-every", "0", "--save-every", "0"],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return {"wall_s": wall, "peak_mem_bytes": rows[-1]["peak_mem_bytes"],
            "train_tokens_per_s": rows[-1]["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big-gb", type=float, default=10.0)
    parser.add_argument("--small-mb", type=float, default=10.0)
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--keep", action="store_true", help="keep the generated folders")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probe-only", action="store_true", help="skip the lmt train runs")
    args = parser.parse_args()
    root = os.path.join(args.root, "lmt-data-at-scale")
    sizes = {"small": int(args.small_mb * 1e6), "big": int(args.big_gb * 1e9)}
    folders = {k: os.path.join(root, k) for k in sizes}
    for name, size in sizes.items():
        if not os.path.isfile(os.path.join(folders[name], "manifest.json")):
            started = time.perf_counter()
            write_synthetic(folders[name], size, seed=len(name))
            print(f"wrote {name}: {size / 1e9:.3f} GB in {time.perf_counter() - started:.0f} s", flush=True)
    try:
        results = {k: {"probe": [], "train": []} for k in sizes}
        for r in range(args.rounds):  # alternate so machine noise hits both alike
            for name in sizes:
                results[name]["probe"].append(probe(folders[name]))
                if not args.probe_only:
                    results[name]["train"].append(train(folders[name], os.path.join(root, f"run-{name}-{r}")))
        summary = {}
        for name in sizes:
            p, t = results[name]["probe"], results[name]["train"]
            summary[name] = {key: float(np.median([x[key] for x in p])) for key in p[0]}
            summary[name].update({key: float(np.median([x[key] for x in t])) for key in (t[0] if t else ())})
        print(json.dumps(summary, indent=1))
        for key in ("open_and_first_batch_s", "rss_bytes", "wall_s", "peak_mem_bytes"):
            if key in summary["big"]:
                print(f"{key}: big / small = {summary['big'][key] / summary['small'][key]:.3f}")
        if not args.probe_only:
            print(f"loader tokens/s on the big set: {summary['big']['tokens_per_s']:,.0f}; training consumes "
                  f"{summary['big']['train_tokens_per_s']:,.0f} tokens/s "
              f"({summary['big']['tokens_per_s'] / summary['big']['train_tokens_per_s']:,.0f}x headroom)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
