"""Multi-token prediction and MLA against their ablations on the embedded corpus (issue 36), same seed and batches.

    python bench/mtp_convergence.py                      # tiny-mla-moe, 1,000 steps of 16 x 128 tokens, 1 thread

Rows: `tiny-mla-moe` with one prediction module (model.mtp_depth 1, DeepSeek-V3's depth, weight 0.3); the same
without it; and a grouped-query variant (2 kv heads of 32: 49,152 attention weights per block against MLA's
51,200, so equal active parameters within 4%) without it. Each row is a real `lmt train` run at one rank with the
defaults; the table is the validation (next-token) loss at every evaluation and the final one against the MLA row
without prediction. MTP's modules are dropped at evaluation, as DeepSeek-V3 drops them at inference.

Why one thread and 128-token sequences: on the shared 2-core machine the runs took 3-36 s per step (median ~14)
at torch's default two threads, because OpenMP's threads wait for each other at every operator's barrier and
one of them is always descheduled by the other processes; one thread took 1.5 s where two took 8.8 s for the
same forward and backward under the same load. 16 x 128 tokens per step then halves the work again (0.86 s under
that load), so the three rows of 1,000 steps fit in about half an hour.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from convergence import print_table, train_rows

ROWS = {"mla + mtp 1": ["--model.mtp_depth", "1"], "mla": [],
        "gqa (2 kv heads)": ["--model.attention", "gqa", "--model.n_kv_heads", "2"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-mla-moe")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the runs train in this process)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = args.out or tempfile.mkdtemp(prefix="lmt-mtp-")
    common = ["--model", args.model, "--steps", str(args.steps), "--eval-every", str(args.eval_every),
              "--seq-len", str(args.seq_len)]
    title = f"{args.model}, {args.steps} steps of 16 x {args.seq_len} tokens, validation loss (nats per token); runs in {root}"
    print_table(train_rows(ROWS, common, root), "mla", title)


if __name__ == "__main__":
    main()
