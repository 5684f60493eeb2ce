"""Peak memory of the loss, today's (head GEMM, then the in-place fp32 cross-entropy of models/loss.py) against
the fused head + loss (models/fused_loss.py), forward and backward, at 8K-32K tokens and 32K-128K vocabularies.

Measured, not computed: the repository's AllocationTracker (memory/tracker.py) counts every storage the two paths
allocate, from the inputs (hidden states and head weight, already live) to the end of backward, the gradients of
both inputs included (in training they land in the engine's gradient buffers). The large shapes run under
FakeTensorMode as `lmt rehearse` does (25 GB of real bf16 logits do not fit this machine, and the GEMMs would take
hours): every allocation is made with its real size and no kernel runs. `--check` runs a small shape both ways:
the fake run allocates exactly what the real CPU run does (the same decompositions, temporaries included).
The planner's terms for the same parts are checked against such measurements in tests/test_fused_loss.py.

    python bench/fused_loss_memory.py                       # hidden 2048, bf16, 8K/16K/32K tokens x 32K/128K vocab
    python bench/fused_loss_memory.py --check               # plus one small shape on real CPU tensors, fake vs real
"""

from __future__ import annotations

import argparse

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from large_model_training.memory.tracker import AllocationTracker
from large_model_training.models.fused_loss import fused_cross_entropy
from large_model_training.models.loss import cross_entropy

GiB = 2**30


def _plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(torch.nn.functional.linear(hidden, weight), targets)  # the logits die with this frame


def peak_bytes(loss_fn, tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype, fake: bool) -> int:
    """Most bytes live beyond the inputs during loss_fn's forward and backward (gradients included)."""
    tracker = AllocationTracker()
    mode = FakeTensorMode() if fake else None
    if mode is not None:
        mode.__enter__()
    try:
        hidden = torch.randn(tokens, hidden_size, dtype=dtype).requires_grad_()
        weight = (torch.randn(vocab, hidden_size, dtype=dtype) * 0.02).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,))
        with tracker:
            base = tracker.current
            loss_fn(hidden, weight, targets).backward()
        return tracker.peak - base
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--tokens", default="8192,16384,32768")
    ap.add_argument("--vocab", default="32768,128256")
    ap.add_argument("--check", action="store_true", help="one small shape on real CPU tensors too")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"hidden {args.hidden}, {args.dtype}, forward + backward, one rank (tp1); GiB\n")
    print("| tokens | vocab | today's loss | fused | fused / today |")
    print("|---|---|---|---|---|")
    shapes = [(int(n), int(v)) for n in args.tokens.split(",") for v in args.vocab.split(",")]
    for n, v in shapes:
        plain = peak_bytes(_plain, n, v, args.hidden, dtype, fake=True)
        fused = peak_bytes(fused_cross_entropy, n, v, args.hidden, dtype, fake=True)
        print(f"| {n:,} | {v:,} | {plain / GiB:.2f} | {fused / GiB:.2f} | {fused / plain:.3f} |")
    if args.check:
        n, v, h = 1024, 8192, 256
        print(f"\ncheck, {n} tokens x {v} vocab x {h} hidden, {args.dtype}, MiB: fake | real CPU")
        for name, fn in (("today's", _plain), ("fused", fused_cross_entropy)):
            fake = peak_bytes(fn, n, v, h, dtype, fake=True)
            real = peak_bytes(fn, n, v, h, dtype, fake=False)
            print(f"{name}: {fake / 2**20:.2f} | {real / 2**20:.2f}")


if __name__ == "__main__":
    main()
