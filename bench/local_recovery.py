"""What --save-local-every buys and costs: kill-to-next-step against today's restart path, and step-time overhead.

    python bench/local_recovery.py                      # a 2-block toy model, tp2 x dp2 on gloo, one kill per path
    python bench/local_recovery.py --only recovery      # (or overhead): one half
    python bench/local_recovery.py --only overhead --overhead-model small --rounds 3 --per-round 4

1. Recovery: `lmt train --max-restarts 1 --resume auto --save-every 4` (today: every rank restarts and reloads the
   newest durable checkpoint) against the same plus `--save-local-every 1` (ranks restart and restore from the
   in-memory copies) and plus `--save-local-every 1 --spares 1` (rank 3 replaced in place by the spare, the
   survivors keep their processes). Rank 3 is SIGKILLed once step 7 is logged; the clock runs from the kill to
   (a) the next completed step the restarted attempt logs and (b) the attempt's getting back to the step it had
   reached (the redone steps included). Prints both and their ratios new / today (target for (a): <= 0.25).
2. Overhead (`--overhead-model small`: on that preset instead of the toy model): each rank builds two Trainers
   on one mesh, `on` with --save-local-every 1 (a snapshot after every step, copied out by the side thread while
   the next step runs) and `off`; rounds alternate, each starting at a barrier; prints the ratio of median round
   times on / off (target <= 1.03) and checks that the losses agree.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch.distributed as dist

SMALL = ["--model.hidden_size", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.ffn_hidden_size",
         "128", "--seq-len", "64", "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-every", "0",
         "--tp", "2", "--dp", "2"]


def _rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip().endswith("}")]
    except OSError:
        return []


def recovery_seconds(out: str, data: str, steps: int, kill_after: int, extra: list[str]) -> dict:
    """Run, SIGKILL rank 3 once `kill_after` is logged, time the way back. Returns the seconds and the record."""
    cmd = [sys.executable, "-m", "large_model_training.cli", "train", "--out", out, "--data", data, *SMALL,
           "--steps", str(steps), "--save-every", "4", "--max-restarts", "1", "--resume", "auto", *extra]
    metrics = os.path.join(out, "metrics.jsonl")
    with open(os.path.join(os.path.dirname(out), os.path.basename(out) + ".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    while len(_rows(metrics)) < kill_after:
        time.sleep(0.01)
    children = [int(c) for c in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    ranks = sorted(c for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read())
    reached = max(r["step"] for r in _rows(metrics))
    killed, killed_at = time.monotonic(), time.time()
    os.kill(ranks[3], signal.SIGKILL)  # rank 3 (the ranks are spawned first, a spare after them)
    first = back = None
    while proc.poll() is None or first is None:
        rows = _rows(metrics)
        restarted = [r for r in rows if "restart" in r]
        if restarted and first is None:
            first = time.monotonic() - killed
        if restarted and back is None and max(r["step"] for r in rows) >= reached:
            back = time.monotonic() - killed
        if proc.poll() is not None and first is None:
            raise RuntimeError(f"the run ended without a restarted step: {' '.join(cmd)}")
        time.sleep(0.01)
    if proc.returncode != 0:
        raise RuntimeError(f"rc {proc.returncode}: {' '.join(cmd)}")
    restart = restarted[0]["restart"]
    return {"first_step_s": first, "back_s": back, "restart": restart,
            "verdict_s": restart["detected_at"] - killed_at if "detected_at" in restart else None}


def overhead_rank(cfg, run_dir: str, rounds: int, per_round: int) -> dict:
    from large_model_training.mesh import ParallelMesh
    from large_model_training.train.trainer import Trainer

    p = cfg.parallel
    mesh = ParallelMesh.for_this_rank(p.pp, p.dp, p.tp)
    off_cfg = copy.deepcopy(cfg)
    off_cfg.run.save_local_every = 0
    trainers = {"on": Trainer(cfg, mesh, os.path.join(run_dir, "on")),
                "off": Trainer(off_cfg, mesh, os.path.join(run_dir, "off"))}
    step, times, losses = {"on": 0, "off": 0}, {"on": [], "off": []}, {"on": [], "off": []}
    cpu = {"on": 0.0, "off": 0.0}  # this process's CPU seconds (all its threads), less noisy than wall time here
    for i in range(2 * rounds):
        name = ("on", "off")[i % 2] if (i // 2) % 2 == 0 else ("off", "on")[i % 2]  # alternate who goes first
        t = trainers[name]
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(per_round):
            losses[name].append(t.timed_step(step[name])["loss"])
            step[name] += 1
            if t.local is not None:
                t.local.save(step[name], t.engine, t.loader)
        if t.local is not None:
            t.local.copies.wait()  # the round's last copy is part of its cost
        times[name].append(time.perf_counter() - started)
        cpu[name] += time.process_time() - cpu_started
    for t in trainers.values():
        if t.local is not None:
            t.local.close(finished=True)
        t.loader.close()
    return {"times": times, "losses": losses, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="", help="input (default: a small stdlib corpus)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--only", choices=("recovery", "overhead"), default="", help="one half of the bench")
    ap.add_argument("--paths", default="today,copies,in_place", help="which recovery paths to run (comma list)")
    ap.add_argument("--overhead-model", default="", help="the overhead half on a model preset (e.g. small, seq 256) "
                    "instead of the 2-block toy model")
    args = ap.parse_args()
    from large_model_training.data.sources import stdlib_files

    root = tempfile.mkdtemp(prefix="lmt-bench-recovery-")
    data = args.data
    if not data:
        data = os.path.join(root, "corpus")
        os.makedirs(data)
        for f in [f for f in stdlib_files() if os.path.basename(f) in ("argparse.py", "typing.py", "functools.py")]:
            with open(f, "rb") as src, open(os.path.join(data, os.path.basename(f)), "wb") as dst:
                dst.write(src.read())
    if args.only in ("", "recovery"):
        recovery(root, data, args.steps, args.paths.split(","))
    if args.only in ("", "overhead"):
        overhead(root, data, args.rounds, args.per_round, args.overhead_model)


PATHS = {"today": ("today (--max-restarts 1 --resume auto --save-every 4)", []),
         "copies": ("restart from the copies (+ --save-local-every 1)", ["--save-local-every", "1"]),
         "in_place": ("in place (+ --save-local-every 1 --spares 1)", ["--save-local-every", "1", "--spares", "1"])}


def recovery(root: str, data: str, steps: int, which: list[str]) -> None:
    from large_model_training.train.recovery import slowest_phases

    runs = {PATHS[key][0]: recovery_seconds(os.path.join(root, key), data, steps, 7, PATHS[key][1]) for key in which}
    for name, r in runs.items():
        rec = r["restart"]
        print(f"{name}: kill -> next step {r['first_step_s']:.2f} s, kill -> back at the killed step "
              f"{r['back_s']:.2f} s; resumed from step {rec['resumed_from']}"
              + (f"; kill -> launcher's verdict {r['verdict_s']:.3f} s" if r["verdict_s"] is not None else "")
              + (f"; phases {rec['recovery']['phases_s']}" if "recovery" in rec else ""))
        if "rebuild_s" in rec.get("recovery", {}):
            print(f"  verdict -> next step, slowest rank per phase (s): {slowest_phases(rec['recovery']['rebuild_s'])}")
    today = runs.pop(PATHS["today"][0], None)
    for name, r in runs.items() if today else ():
        print(f"ratio {name} / today: next step {r['first_step_s'] / today['first_step_s']:.3f}, back at the "
              f"killed step {r['back_s'] / today['back_s']:.3f} (target <= 0.25)")


def overhead(root: str, data: str, rounds: int, per_round: int, preset: str = "") -> None:
    from large_model_training.config import build_config
    from large_model_training.launch import run_on_ranks
    from large_model_training.layout import validate


    shape = ({"model.preset": preset, "train.seq_len": 256} if preset else  # a preset as it is, else the toy model
             {"model.hidden_size": 64, "model.n_layers": 2, "model.n_heads": 4, "model.ffn_hidden_size": 128,
              "train.seq_len": 64})
    cfg = build_config(None, {**shape, "train.global_batch_size": 8, "train.micro_batch_size": 2,
                              "train.eval_every": 0, "parallel.tp": 2, "parallel.dp": 2, "data.path": data,
                              "train.steps": 10_000, "run.save_local_every": 1})
    validate(cfg, None)
    every = run_on_ranks(overhead_rank, cfg.parallel.world_size, (cfg, root, rounds, per_round))
    res = every[0]
    cpu = {k: sum(r["cpu"][k] for r in every) / (rounds * per_round) for k in ("on", "off")}
    on, off = statistics.median(res["times"]["on"]), statistics.median(res["times"]["off"])
    same = res["losses"]["on"] == res["losses"]["off"]
    print(f"steady state, {per_round} steps per round, median of {rounds} rounds: on {on:.3f} s, off "
          f"{off:.3f} s, ratio {on / off:.3f} (target <= 1.03); losses identical: {same}; CPU per step, all ranks: "
          f"on {cpu['on'] * 1e3:.1f} ms, off {cpu['off'] * 1e3:.1f} ms, ratio {cpu['on'] / cpu['off']:.3f}")


if __name__ == "__main__":
    main()
