"""Zero-bubble compute orders (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward is split
into B (the input gradient, which the upstream stage waits for) and W (the weight gradient, which nobody
waits for), and the W's are placed where 1F1B idles.

Both orders are the paper's handcrafted schedules, which are optimal when F, B and W take the same time;
ours are lists of actions like every other kind, so the simulator, the checks and the runtime use them
unchanged. A (stage, micro-batch) holds its activations from its F until its W (W still reads the layer
inputs), which is what `schedules.in_flight` counts for these kinds.
"""

from __future__ import annotations

from large_model_training.parallel.pipeline.actions import Action, Op


def zb_h1_order(rank: int, p: int, m: int) -> list[Action]:
    """ZB-H1 (section 3.1): 1F1B's order with B and W split, rank r running each W r micro-batches late.

    1F1B idles rank r for p-1-r slots at the end while the last gradients climb back to rank 0; those are
    the slots where ZB-H1's r deferred W's run, so only the warm-up bubble is left: (p-1)(F+B-W) per rank
    instead of (p-1)(F+B+W). Rank r holds p-1-r warm-up activations plus r deferred W's plus one in
    steady state: p, which is 1F1B's bound on rank 0, on every rank.
    """
    warmup = min(p - rank - 1, m)
    order = [Action(Op.FORWARD, rank, i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            order.append(Action(Op.FORWARD, rank, warmup + i))
        order.append(Action(Op.BACKWARD, rank, i))
        if i >= rank:
            order.append(Action(Op.WEIGHT, rank, i - rank))
    return order + [Action(Op.WEIGHT, rank, i) for i in range(max(m - rank, 0), m)]


def zbv_full_micro_batches(p: int) -> int:
    """Micro-batches the handcrafted ZB-V needs to reach its steady state: 2p-1 (rank 0's warm-up
    forwards). With fewer, `zbv_order` builds the 2p-1 schedule and leaves the missing ones out."""
    return 2 * p - 1


def zbv_order(rank: int, p: int, m: int) -> list[Action]:
    """ZB-V (section 6, figure 8): two half-size chunks per rank in a V ("v" placement), F, B and W each
    one slot of a chunk.

    Rank r holds stage r (chunk 0, on the way down) and stage 2p-1-r (chunk 1, on the way up). Warm-up:
    2(p-r)-1 forwards of chunk 0, then r pairs (chunk 1, chunk 0), then p-r rounds F, B, W of chunk 1:
    the first gradient is back (it turned at rank 0, the last stage) exactly when a rank runs out of
    forwards. Steady state: F, B, W of chunk 0, then of chunk 1. Cool-down: the B's first (r pairs, then
    p-r chunk-0 B's, each with a W that fills the wait for the next gradient), then the remaining W's.
    Every rank holds at most 2p chunk activations, i.e. p stages' worth: 1F1B's bound on rank 0.

    For m < 2p-1 (`zbv_full_micro_batches`) the order is the one for 2p-1 micro-batches with the others
    left out: dropping every action of a micro-batch keeps each remaining dependency, so the order stays
    valid (the bubble then grows, as for any pipeline with fewer micro-batches than it needs to fill).
    """
    n = max(m, zbv_full_micro_batches(p))
    stages = (rank, 2 * p - 1 - rank)
    issued = {op: [0, 0] for op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)}  # per op, per chunk: next micro-batch
    order: list[Action] = []

    def run(op: Op, chunk: int) -> None:
        order.append(Action(op, stages[chunk], issued[op][chunk]))
        issued[op][chunk] += 1

    def forward_backward_weight(chunk: int) -> None:
        run(Op.FORWARD, chunk)
        run(Op.BACKWARD, chunk)
        run(Op.WEIGHT, chunk)

    for _ in range(2 * (p - rank) - 1):
        run(Op.FORWARD, 0)
    for _ in range(rank):
        run(Op.FORWARD, 1)
        run(Op.FORWARD, 0)
    for _ in range(p - rank):
        forward_backward_weight(1)
    while issued[Op.FORWARD][0] < n or issued[Op.FORWARD][1] < n:
        if issued[Op.FORWARD][0] < n:
            run(Op.FORWARD, 0)
        run(Op.BACKWARD, 0)
        run(Op.WEIGHT, 0)
        forward_backward_weight(1)
    for _ in range(rank):
        run(Op.BACKWARD, 0)
        run(Op.BACKWARD, 1)
    for _ in range(p - rank):
        run(Op.BACKWARD, 0)
        run(Op.WEIGHT, 0)
    for chunk in (1, 0):
        while issued[Op.WEIGHT][chunk] < n:
            run(Op.WEIGHT, chunk)
    return [a for a in order if a.microbatch < m]
