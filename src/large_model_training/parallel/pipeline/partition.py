"""Cutting the model into pipeline stages: which blocks, and whether the embedding or the head, each stage holds.

The model is cut into p*v chunks (virtual stages) in order; `chunk_ranks` says which pipeline rank runs each,
by the schedule's placement: chunk j on rank j % p (the loop, Megatron-LM's interleaving), or zbv's V (chunk
j < p on rank j, j >= p on rank 2p-1-j). Without an explicit `--pp-layers` blocks are balanced by FLOPs
(`models/flops.py`), counting the embedding on the first chunk and the output head and loss on the last:
  - v = 1 (gpipe, 1f1b), `balanced_split`: every stage >= 1 block, the most expensive stage minimised.
  - v >= 2 (interleaved, zbv), `chunk_split`: minimises first the most loaded rank (a rank runs all its chunks:
    that load sets the step), then the most expensive chunk (a chunk's time paces the pipeline's fill and
    drain). A chunk that holds the embedding or the head may hold 0 blocks (Megatron-LM's "account for
    embedding/loss", Llama 3's "one Transformer layer less on the first and the last stage"); every other chunk
    holds >= 1, so any L >= p*v - 2 splits. Llama 3 405B at pp=16 v=8 (126 blocks, 128 chunks) leaves exactly
    one split, [0, 1, ..., 1, 0], and it is the best of any: 126 blocks on 16 ranks put 8 on some rank, while
    the head (6Vh = 0.61 of a block's FLOPs) on the last rank's 7 blocks stays under 8.
An explicit `--pp-layers` may give 0 blocks to the first and the last chunk, never to an inner one.
"""

from __future__ import annotations

import functools
import heapq
import math

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.flops import training_flops_per_token
from large_model_training.models.transformer import StageSpec
from large_model_training.parallel.pipeline.schedules import placement_of, stage_to_rank


def stage_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """(block, embedding, head) forward+backward FLOPs per token."""
    head = 6.0 * cfg.vocab_size * cfg.hidden_size  # the head's matmul; the loss is small next to it
    block = (training_flops_per_token(cfg, seq_len) - head) / cfg.n_layers
    embedding = 0.0  # a table lookup (and a scatter-add backward): no matmul FLOPs
    return block, embedding, head


def balanced_split(cfg: ModelConfig, stages: int, seq_len: int) -> list[int]:
    """Blocks per stage (each >= 1) minimising the most expensive stage; ties keep earlier stages larger."""
    n = cfg.n_layers
    block, embedding, head = stage_costs(cfg, seq_len)

    def cost(stage: int, layers: int) -> float:
        extra = (embedding if stage == 0 else 0.0) + (head if stage == stages - 1 else 0.0)
        return layers * block + extra

    # best[s][k]: least max-cost placing the first k blocks into the first s stages (each stage >= 1 block).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for k in range(s, n - (stages - s) + 1):
            for last in range(1, k - (s - 1) + 1):
                value = max(best[s - 1][k - last], cost(s - 1, last))
                if value < best[s][k] - 1e-9:
                    best[s][k], choice[s][k] = value, last
    split, k = [], n
    for s in range(stages, 0, -1):
        split.append(choice[s][k])
        k -= choice[s][k]
    return split[::-1]


def chunk_ranks(kind: str, p: int, v: int) -> tuple[int, ...]:
    """The pipeline rank of every chunk, in model order, by the schedule's own placement (`schedules.py`)."""
    placement = placement_of(kind)
    return tuple(stage_to_rank(j, p, placement) for j in range(p * v))


def _fit(limit: float, extra: float, block: float) -> int:
    """Blocks a rank with `extra` cost (embedding, head) can take within `limit` (-1: not even none); the
    epsilon absorbs rounding where limit was computed as k*block + extra."""
    return math.floor((limit - extra) / block + 1e-9) if limit >= extra - 1e-9 * block else -1


def _least_limit(candidates: set[float], feasible) -> float:
    """The smallest candidate limit that `feasible` accepts, by bisection (feasibility grows with the limit;
    the largest candidate always fits)."""
    ordered = sorted(candidates)
    lo, hi = 0, len(ordered) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(ordered[mid]) else (mid + 1, hi)
    return ordered[lo]


@functools.lru_cache(maxsize=1024)
def chunk_split(n: int, ranks: tuple[int, ...], block: float, embedding: float, head: float) -> tuple[int, ...]:
    """Blocks per chunk (`ranks`: each chunk's pipeline rank) minimising the most loaded rank, then the most
    expensive chunk; the first and the last chunk (embedding, head) may hold 0, the others >= 1.

    Why no search over splits: blocks cost the same, so only counts matter. The least rank limit T is found by
    bisection over the loads a rank can have (k*block + its embedding/head); then each remaining block goes to
    the chunk that is cheapest after taking it, among ranks still under T, ties to the later chunk (earlier
    ranks hold more micro-batches in flight). That water-filling takes increments in rising cost, so it also
    gives the least most expensive chunk: a split with cheaper chunks would fit within the increments below the
    last one taken, all of which the fill took or found their rank at T. O((n + chunks) log) per call, and
    cached: the planner asks once per pipeline shape."""
    chunks, p = len(ranks), max(ranks) + 1
    extra = [0.0] * chunks
    extra[0] += embedding
    extra[-1] += head
    low = [0 if j in (0, chunks - 1) else 1 for j in range(chunks)]
    if sum(low) > n:
        raise ConfigError(f"{chunks} chunks need at least {sum(low)} layers, the model has {n}")
    rank_extra, rank_low = [0.0] * p, [0] * p
    for j, r in enumerate(ranks):
        rank_extra[r] += extra[j]
        rank_low[r] += low[j]

    def rank_caps(limit: float) -> list[int]:
        return [min(n, _fit(limit, rank_extra[r], block)) for r in range(p)]

    def rank_ok(limit: float) -> bool:
        caps = rank_caps(limit)
        return all(c >= lo for c, lo in zip(caps, rank_low)) and sum(caps) >= n

    rank_cap = rank_caps(_least_limit({k * block + e for k in range(n + 1) for e in set(rank_extra)}, rank_ok))
    counts, held = list(low), list(rank_low)
    heap = [((counts[j] + 1) * block + extra[j], -j) for j in range(chunks)]
    heapq.heapify(heap)
    for _ in range(n - sum(low)):
        while True:
            _, j = heapq.heappop(heap)
            j = -j
            if held[ranks[j]] < rank_cap[ranks[j]]:
                break  # a full rank stays full: its chunks leave the heap for good
        counts[j] += 1
        held[ranks[j]] += 1
        heapq.heappush(heap, ((counts[j] + 1) * block + extra[j], -j))
    return tuple(counts)


def parse_layers(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-layers must be comma-separated integers, got '{text}'") from None
    return counts


def split_problems(n_layers: int, pp: int, v: int, schedule: str, explicit: str = "") -> list[str]:
    """Why no split of n_layers blocks into pp x v stages exists (empty when one does). Cheap: the layout
    check and the planner's search call it for every candidate, before any balancing is computed."""
    stages = pp * v
    if explicit:
        try:
            counts = parse_layers(explicit)
        except ConfigError as e:
            return [str(e)]
        if len(counts) != stages:
            return [f"--pp-layers lists {len(counts)} stages but pp x virtual_stages = {pp} x {v} = {stages}"]
        if any(c < 0 for c in counts):
            return [f"--pp-layers needs layer counts >= 0, got {explicit}"]
        empty = [j for j, c in enumerate(counts[1:-1], 1) if c == 0]
        if empty:
            return [
                f"--pp-layers gives stage {empty[0]} no layer: only the first and the last stage (embedding, "
                f"head) may hold 0, got {explicit}"
            ]
        if sum(counts) != n_layers:
            return [f"--pp-layers adds up to {sum(counts)} layers but the model has {n_layers}"]
        return []
    if v == 1 and stages > n_layers:
        return [f"pp x virtual_stages = {stages} stages is more than the {n_layers} layers"]
    if v > 1 and stages - 2 > n_layers:
        return [
            f"pp x virtual_stages = {stages} chunks need at least {stages - 2} layers (one in each chunk "
            f"without the embedding or the head), the model has {n_layers}"
        ]
    return []


def stage_layers(cfg: ModelConfig, pp: int, v: int, schedule: str, seq_len: int, explicit: str = "") -> list[int]:
    """Blocks per virtual stage; ConfigError when a split cannot add up."""
    problems = split_problems(cfg.n_layers, pp, v, schedule, explicit)
    if problems:
        raise ConfigError(problems[0])
    if explicit:
        return parse_layers(explicit)
    if v > 1:
        return list(chunk_split(cfg.n_layers, chunk_ranks(schedule, pp, v), *stage_costs(cfg, seq_len)))
    return balanced_split(cfg, pp, seq_len)


def stage_specs(layers: list[int]) -> list[StageSpec]:
    """The StageSpec of every virtual stage, from its block count."""
    specs, first = [], 0
    for j, count in enumerate(layers):
        specs.append(StageSpec(first, first + count, has_embedding=j == 0, has_head=j == len(layers) - 1))
        first += count
    return specs
