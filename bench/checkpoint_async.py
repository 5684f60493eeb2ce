"""How long a checkpoint save blocks the training loop: synchronous against `--async-save`, `small` model.

    python bench/checkpoint_async.py                # 1 rank; --dp 2 for two ranks

Both runs train the same steps and save every `--save-every` steps. Blocking time is what the training loop
spends inside `Trainer.save` (for async: snapshot + hand-off, plus waiting at the next save or the end for the
previous write to finish), measured on every rank and reported for rank 0, in one run of this script.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from large_model_training.config import build_config
from large_model_training.layout import validate
from large_model_training.launch import run_in_process, run_on_ranks
from large_model_training.mesh import ParallelMesh
from large_model_training.train.trainer import Trainer


def timed_run(cfg, run_dir: str) -> dict:
    trainer = Trainer(cfg, ParallelMesh.for_this_rank(1, cfg.parallel.dp, 1), run_dir)
    blocked, waits = [], []
    save, wait = trainer.save, trainer.writer.wait

    def timed_save(step: int) -> str:
        started = time.perf_counter()
        out = save(step)
        blocked.append(time.perf_counter() - started)
        return out

    def timed_wait() -> None:
        started = time.perf_counter()
        wait()
        waits.append(time.perf_counter() - started)

    trainer.save, trainer.writer.wait = timed_save, timed_wait
    started = time.perf_counter()
    result = trainer.fit()
    return {"total": time.perf_counter() - started, "blocked": sum(blocked) + waits[-1] if waits else sum(blocked),
            "per_save": statistics.mean(blocked), "loss": result.losses[-1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    args = ap.parse_args()
    rows = {}
    for mode in ("sync", "async"):
        cfg = validate(build_config(overrides={
            "model.preset": "small", "parallel.dp": args.dp, "train.steps": args.steps, "train.seq_len": 128,
            "train.micro_batch_size": 2, "train.eval_every": 0, "run.save_every": args.save_every,
            "run.async_save": mode == "async"}))
        with tempfile.TemporaryDirectory() as tmp:
            run = (run_in_process(timed_run, (cfg, tmp)) if args.dp == 1
                   else run_on_ranks(timed_run, args.dp, (cfg, tmp))[0])
        rows[mode] = run
        print(mode, run, flush=True)
    s, a = rows["sync"], rows["async"]
    print(f"\nsmall model, dp={args.dp}, {args.steps} steps, save every {args.save_every}:")
    print(f"blocking per save: sync {s['per_save']:.3f} s, async {a['per_save']:.3f} s "
          f"({a['per_save'] / s['per_save']:.2f}x); whole run {s['total']:.1f} s vs {a['total']:.1f} s; "
          f"same final loss: {s['loss'] == a['loss']}")


if __name__ == "__main__":
    main()
