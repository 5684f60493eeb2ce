"""What one partner copy costs to send round the ring: gloo's send/recv against lmt's copy stream (copy_ring.py).

    python bench/copy_transport.py                  # 4 ranks, a 0.7 MB copy (the size local_recovery.py's model has)
    python bench/copy_transport.py --mb 64 --copies 20

Every rank sends a copy to rank + 1 while it receives rank - 1's, `--copies` times, three ways:
- `gloo, 3 messages`: sizes, header, payload, each an isend/recv pair (how the copies went before the stream);
- `gloo, 1 message`: the payload alone (a lower bound for any gloo exchange of a copy);
- `stream`: `CopyRing.send` + `wait_for` (a receiving thread per rank files each copy into a kept buffer).
Prints the CPU seconds per copy per rank (every thread of the process, gloo's own included) and the wall time
per copy; CPU is the figure on this machine, where 4 ranks share 2 cores with their threads.
"""

from __future__ import annotations

import argparse
import time


def _rank(nbytes: int, copies: int) -> dict:
    import torch
    import torch.distributed as dist

    from large_model_training.reliability.copy_ring import CopyRing

    rank, world = dist.get_rank(), dist.get_world_size()
    partner, source = (rank + 1) % world, (rank - 1) % world
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    header = torch.zeros(300, dtype=torch.uint8)
    group = dist.new_group(backend="gloo")
    ring = CopyRing(group, partner, source, lambda step, data: None, timeout_s=60)

    def gloo(pairs):
        for mine in pairs:
            theirs = torch.empty_like(mine)
            send = dist.isend(mine, partner, group=group)
            dist.recv(theirs, source, group=group)
            send.wait()

    ways = {
        "gloo, 3 messages": lambda step: gloo([torch.tensor([300, nbytes]), header, payload]),
        "gloo, 1 message": lambda step: gloo([payload]),
        "stream": lambda step: (ring.send(step, [header.numpy(), payload.numpy()]), ring.wait_for(step)),
    }
    out = {}
    step = 0
    for name, way in ways.items():
        way(step := step + 1)  # first use (connections, buffers) not timed
        dist.barrier(group=group)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(copies):
            way(step := step + 1)
        out[name] = ((time.process_time() - cpu) / copies, (time.perf_counter() - wall) / copies)
        dist.barrier(group=group)
    ring.close()
    return out


def main() -> None:
    from large_model_training.launch import run_on_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=float, default=0.7)
    ap.add_argument("--copies", type=int, default=200)
    args = ap.parse_args()
    every = run_on_ranks(_rank, args.ranks, (int(args.mb * 1e6), args.copies))
    print(f"{args.ranks} ranks, a {args.mb} MB copy each, {args.copies} copies: per copy and rank")
    print("| way | CPU ms | wall ms | CPU / stream |")
    print("|---|---|---|---|")
    stream = sum(r["stream"][0] for r in every) / len(every)
    for name in every[0]:
        cpu = sum(r[name][0] for r in every) / len(every)
        wall = max(r[name][1] for r in every)
        print(f"| {name} | {cpu * 1e3:.2f} | {wall * 1e3:.2f} | {cpu / stream:.2f} |")


if __name__ == "__main__":
    main()
