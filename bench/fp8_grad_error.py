"""How far each precision's weight gradients are from fp32's on one batch, per kind of layer (issue 33's
convergence question: which part of an fp8 recipe costs).

    python bench/fp8_grad_error.py RUN/checkpoints/step_300 [--recipes bf16,tensorwise,tensorwise-e4m3,rowwise]
    python bench/fp8_grad_error.py RUN/checkpoints/step_300 --recipes bf16,rowwise,rowwise_with_gw_hp,rowwise-first-last

Loads a checkpoint of a one-rank run, takes one batch of the embedded corpus (8 x 256 tokens), and computes the
gradients in fp32 (the reference) and under each precision: bf16 autocast, and the fp8 recipes on top of it
(models/float8.py, as `--precision fp8` applies them). `tensorwise-e4m3` is tensorwise with e4m3 output gradients
instead of e5m2 (the one difference between a Transformer Engine "HYBRID" and "E4M3" format), to see whether the
gradients' 2 mantissa bits are what costs; `<recipe>-first-last` leaves the first and the last block in bf16
(`--train.fp8_bf16_first_last 1`). Prints, per layer kind, the mean and max over layers of
||g - g_fp32|| / ||g_fp32||. Late in training per-token gradient terms largely cancel, so even bf16's relative
errors are tens of percent: compare the recipes to each other and to bf16, not to zero.
"""

from __future__ import annotations

import argparse
import collections
import warnings

import numpy as np
import torch

from large_model_training.assembly import build_model
from large_model_training.config import DataConfig, ModelConfig
from large_model_training.data.dataset import load_training_data
from large_model_training.models import float8
from large_model_training.train import checkpoint


def batch(seq: int = 256, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    split = load_training_data(DataConfig()).train[0]
    x = torch.stack([torch.from_numpy(split.read(i * 9973, seq + 1).astype(np.int64)) for i in range(rows)])
    return x[:, :-1], x[:, 1:]


def gradients(ckpt: str, precision: str, inputs, targets) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(ModelConfig(**checkpoint.read_meta(ckpt)["model"]), None, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint.load_checkpoint(ckpt, model)
    if precision == "tensorwise-e4m3":
        float8.apply_float8(model, "tensorwise")
        e4m3 = float8.Float8Recipe("tensorwise", torch.float8_e4m3fn, rowwise=False, power_of_2=False)
        for block in model.layers.values():
            for module in block.modules():
                if isinstance(getattr(module, "fp8", None), float8.Float8Gemms):
                    module.fp8.recipe = e4m3
    elif precision.endswith("-first-last"):  # --train.fp8_bf16_first_last 1: the first and last block in bf16
        ends = float8.bf16_blocks(len(model.layers), 1)
        float8.apply_float8(model, precision.removesuffix("-first-last"), keep_bf16=ends)
    elif precision not in ("fp32", "bf16"):
        float8.apply_float8(model, precision)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
        loss = model(inputs, targets=targets)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--recipes", default="bf16,tensorwise,tensorwise-e4m3,rowwise")
    args = ap.parse_args()
    torch.manual_seed(0)
    inputs, targets = batch()
    ref_loss, ref = gradients(args.checkpoint, "fp32", inputs, targets)
    rows = {}
    for precision in args.recipes.split(","):
        loss, grads = gradients(args.checkpoint, precision, inputs, targets)
        kinds = collections.defaultdict(list)
        for name, g in grads.items():
            kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
            kinds[kind].append(((g - ref[name]).norm() / ref[name].norm()).item())
        rows[precision] = (loss, {k: (np.mean(v), np.max(v)) for k, v in kinds.items()})
    kinds = sorted(next(iter(rows.values()))[1])
    print(f"\nloss fp32 {ref_loss:.5f}; per layer kind, mean / max over layers of ||g - g_fp32|| / ||g_fp32||")
    print("| layer | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{r[1][k][0]:.3f} / {r[1][k][1]:.3f}" for r in rows.values()) + " |")
    print("| loss | " + " | ".join(f"{r[0]:.5f}" for r in rows.values()) + " |")


if __name__ == "__main__":
    main()
