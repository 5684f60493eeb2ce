"""Cutting the model into pipeline stages: which blocks, and whether the embedding or the head, each stage holds.

The model is cut into p*v virtual stages in order (stage j on pipeline rank j % p). Without an explicit split,
blocks are distributed to minimise the most expensive stage, counting the embedding on the first stage and
the output head and loss on the last (by FLOPs from `models/flops.py`): with a large vocabulary the last stage
then gets fewer blocks. Interleaved schedules use an even split (every chunk the same size, as Megatron-LM
requires), so L must divide by p*v unless `--pp-layers` says otherwise.
"""

from __future__ import annotations

from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.flops import training_flops_per_token
from large_model_training.models.transformer import StageSpec


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
        if any(c < 1 for c in counts):
            return [f"--pp-layers needs at least 1 layer per stage, got {explicit}"]
        if sum(counts) != n_layers:
            return [f"--pp-layers adds up to {sum(counts)} layers but the model has {n_layers}"]
        return []
    if stages > n_layers:
        return [f"pp x virtual_stages = {stages} stages is more than the {n_layers} layers"]
    if schedule == "interleaved" and n_layers % stages:
        return [f"interleaved needs n_layers ({n_layers}) divisible by pp x virtual_stages ({pp} x {v}), or an "
                f"explicit --pp-layers"]
    return []


def stage_layers(cfg: ModelConfig, pp: int, v: int, schedule: str, seq_len: int, explicit: str = "") -> list[int]:
    """Blocks per virtual stage; ConfigError when a split cannot add up."""
    problems = split_problems(cfg.n_layers, pp, v, schedule, explicit)
    if problems:
        raise ConfigError(problems[0])
    stages = pp * v
    if explicit:
        return parse_layers(explicit)
    if schedule == "interleaved":
        return [cfg.n_layers // stages] * stages
    return balanced_split(cfg, stages, seq_len)


def stage_specs(layers: list[int]) -> list[StageSpec]:
    """The StageSpec of every virtual stage, from its block count."""
    specs, first = [], 0
    for j, count in enumerate(layers):
        specs.append(StageSpec(first, first + count, has_embedding=j == 0, has_head=j == len(layers) - 1))
        first += count
    return specs
