"""`lmt prepare` throughput against a plain loop over `tokenizers`' `encode_batch` on the same files, in one run.

Input: the Python standard library's source as JSON Lines (one document per module, `--copies` times over),
tokenized with a byte-level BPE of 8,192 ids trained on it first (not timed). The plain loop reads each file,
encodes its documents in batches of 1,024 with `Tokenizer.encode_batch` (its own threads), appends the EOD id
and writes uint16 ids: the least a tokenizing job does. A second plain loop uses `encode_batch_fast` (no
offsets), which is what `lmt prepare` calls. `lmt prepare` also writes the document index, checksums, the
validation split and the manifest. Rounds alternate between the variants so machine noise hits all alike.

    python bench/prepare_throughput.py                  # workers 1 and 2 (this machine has 2 cores)
    python bench/prepare_throughput.py --workers 1 2 4 8 --copies 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from large_model_training.data.prepare import PrepareRequest, prepare
from large_model_training.data.sources import stdlib_files
from large_model_training.data.tokenizer import train_bpe_tokenizer


def write_inputs(folder: str, copies: int) -> int:
    os.makedirs(folder, exist_ok=True)
    texts = [open(f, "rb").read().decode("utf-8", errors="replace") for f in stdlib_files()]
    total = 0
    for c in range(copies):
        with open(os.path.join(folder, f"part{c}.jsonl"), "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        total += os.path.getsize(os.path.join(folder, f"part{c}.jsonl"))
    return total


def plain_loop(folder: str, tokenizer_path: str, out: str, fast: bool) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    eod = tok.token_to_id("<|endoftext|>")
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    tokens = 0
    with open(out, "wb") as sink:
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name)) as f:
                docs = [json.loads(line)["text"] for line in f]
            for i in range(0, len(docs), 1024):
                for enc in encode(docs[i:i + 1024]):
                    ids = np.asarray(enc.ids + [eod], dtype=np.uint16)
                    sink.write(ids.tobytes())
                    tokens += len(ids)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="lmt-prepare-bench-")
    try:
        inputs = os.path.join(root, "inputs")
        size = write_inputs(inputs, args.copies)
        tokenizer = os.path.join(root, "tokenizer.json")
        train_bpe_tokenizer((open(f, encoding="utf-8", errors="replace").read() for f in stdlib_files()), 8192,
                            tokenizer)
        variants = {"plain encode_batch": lambda out: plain_loop(inputs, tokenizer, out, fast=False),
                    "plain encode_batch_fast": lambda out: plain_loop(inputs, tokenizer, out, fast=True)}
        for w in args.workers:
            variants[f"lmt prepare --workers {w}"] = (
                lambda out, w=w: prepare(PrepareRequest(inputs=[inputs], tokenizer=tokenizer), out, workers=w,
                                         progress=False)["tokens"])
        times: dict[str, list[float]] = {k: [] for k in variants}
        tokens: dict[str, int] = {}
        for r in range(args.rounds):
            for name, run in variants.items():
                out = os.path.join(root, f"out-{r}-{len(times[name])}")
                started = time.perf_counter()
                tokens[name] = run(out)
                times[name].append(time.perf_counter() - started)
                shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else os.remove(out)
        base = statistics.median(times["plain encode_batch"])
        print(f"input: {size / 1e6:.1f} MB of JSON Lines, {os.cpu_count()} CPUs, medians of {args.rounds} rounds")
        print(f"{'variant':28s} {'seconds':>8s} {'MB/s':>7s} {'tokens':>11s} {'vs encode_batch':>16s}")
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"{name:28s} {t:8.2f} {size / 1e6 / t:7.1f} {tokens[name]:11,d} {base / t:16.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
