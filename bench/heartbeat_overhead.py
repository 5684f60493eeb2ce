"""What stall detection and the straggler report cost a training step: on against off, dp=2, in one run.

    python bench/heartbeat_overhead.py                    # tiny preset, 2 gloo ranks, beats every 0.2 s
    python bench/heartbeat_overhead.py --hidden-size 64 --seq-len 64 --per-round 40   # short steps: worst case

Each rank builds two Trainers on the same mesh from the same config: `on` with a heartbeat publishing every
`--interval` seconds (the shortest interval lmt ever uses, i.e. the worst case; the default stall timeout of
60 s beats every 2 s) and the straggler report (one all-gather of a float per step), `off` with neither.
Rounds alternate between them, each starting at a barrier; the heartbeat thread runs only during `on` rounds.
Prints the ratio of median step times on/off (target <= 1.02) and the losses of both, which must agree:
neither feature may change the numbers.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch.distributed as dist

from large_model_training.config import build_config
from large_model_training.launch import run_on_ranks
from large_model_training.layout import validate
from large_model_training.mesh import ParallelMesh
from large_model_training.reliability.heartbeat import FileBoard, Heartbeat
from large_model_training.train.trainer import Trainer


def bench_rank(cfg, run_dir: str, rounds: int, per_round: int, interval: float) -> dict:
    mesh = ParallelMesh.for_this_rank(1, cfg.parallel.dp, 1)
    off_cfg = copy.deepcopy(cfg)
    off_cfg.run.straggler_report = False
    trainers = {"on": Trainer(cfg, mesh, os.path.join(run_dir, "on")),
                "off": Trainer(off_cfg, mesh, os.path.join(run_dir, "off"))}
    groups = {"world": dist.group.WORLD, "dp": mesh.grad_group}
    step = {"on": 0, "off": 0}
    times = {"on": [], "off": []}
    losses = {"on": [], "off": []}

    def run(name: str, n: int) -> float:
        trainer = trainers[name]
        dist.barrier()
        started = time.perf_counter()
        for _ in range(n):
            record = trainer.train_step(step[name], trainer.loader.next())
            losses[name].append(record["loss"])
            step[name] += 1
        return (time.perf_counter() - started) / n

    for name in trainers:  # warm-up
        run(name, 2)
    for r in range(rounds):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            heartbeat = None
            if name == "on":
                heartbeat = Heartbeat(FileBoard(os.path.join(run_dir, "heartbeat")), mesh.rank, interval)
                heartbeat.watch(groups)
                trainers["on"].heartbeat = heartbeat.start()
            times[name].append(run(name, per_round))
            if heartbeat is not None:
                heartbeat.stop()
    return {"times": times, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--hidden-size", type=int, default=128, help="tiny's width; 64 makes steps ~10x shorter")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    cfg = build_config(None, {"parallel.dp": 2, "train.micro_batch_size": 4, "train.seq_len": args.seq_len,
                              "model.hidden_size": args.hidden_size, "model.ffn_hidden_size": 4 * args.hidden_size,
                              "train.steps": 10_000, "train.eval_every": 0})
    validate(cfg, None)
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_on_ranks(bench_rank, 2, (cfg, run_dir, args.rounds, args.per_round, args.interval))
    on = statistics.mean(statistics.median(r["times"]["on"]) for r in results)
    off = statistics.mean(statistics.median(r["times"]["off"]) for r in results)
    same = results[0]["losses"]["on"] == results[0]["losses"]["off"]
    print(f"step time on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms: ratio on/off {on / off:.3f} (target <= 1.02); "
          f"losses identical: {same} ({len(results[0]['losses']['on'])} steps each)")


if __name__ == "__main__":
    main()
