"""Pipeline parallelism: stage splits, every schedule on the pp=1 loss curve, activation memory per stage."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch

from large_model_training.api import PipelineParallelism
from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig, build_config, model_from_preset
from large_model_training.errors import ConfigError
from large_model_training.memory.recompute import apply_recompute
from large_model_training.mesh import ParallelMesh
from large_model_training.models.transformer import StageSpec, Transformer
from large_model_training.parallel.pipeline import partition
from large_model_training.parallel.pipeline.partition import (
    balanced_split,
    chunk_ranks,
    chunk_split,
    stage_costs,
    stage_layers,
)
from tests.dist import run_ranks, world_size
from tests.helpers import Runs, assert_close_curves, losses, model_config, model_flags, val_losses


def test_balanced_split_gives_the_heavy_head_fewer_blocks():
    cfg = model_from_preset("llama3-8b")  # a 128k vocabulary: the head costs about 2 blocks
    split = balanced_split(cfg, 4, 8192)
    assert sum(split) == 32 and split[-1] < split[0]
    tiny = model_from_preset("tiny")
    assert balanced_split(tiny, 2, 256) == [2, 2]
    # An odd block goes to the stage without the head.
    assert balanced_split(tiny.__class__(**{**tiny.__dict__, "n_layers": 5}), 2, 256) == [3, 2]


@pytest.mark.parametrize(
    "args,message",
    [
        ((4, 2, "1f1b", "1,1,1,2"), "lists 4 stages but"),
        ((2, 1, "1f1b", "1,2"), "adds up to 3"),
        ((2, 1, "1f1b", "11,-1"), "counts >= 0"),
        ((4, 1, "1f1b", "4,0,3,3"), "gives stage 1 no layer: only the first and the last"),
        ((2, 2, "interleaved", "0,5,0,5"), "gives stage 2 no layer"),
        ((16, 1, "1f1b", ""), "more than the 10 layers"),
        ((2, 8, "interleaved", ""), "16 chunks need at least 14 layers"),
    ],
)
def test_splits_that_cannot_add_up_are_refused(args, message):
    pp, v, kind, explicit = args
    with pytest.raises(ConfigError, match=message):
        stage_layers(model_from_preset("small"), pp, v, kind, 256, explicit)


def test_first_and_last_stage_may_hold_only_the_embedding_or_the_head():
    small = model_from_preset("small")  # 10 layers
    assert stage_layers(small, 2, 1, "1f1b", 256, "10,0") == [10, 0]
    assert stage_layers(small, 2, 2, "interleaved", 256, "0,5,5,0") == [0, 5, 5, 0]
    # 12 chunks, 10 of them needing a block: any L >= p*v - 2 splits, no divisibility asked.
    assert stage_layers(small, 2, 6, "interleaved", 256) == [0] + [1] * 10 + [0]


def _loads(cfg: ModelConfig, split: list[int], ranks: tuple[int, ...], seq_len: int) -> tuple[list[float], float]:
    """Per-rank FLOPs (its chunks' blocks, embedding and head) in blocks, and the most expensive chunk."""
    block, embedding, head = stage_costs(cfg, seq_len)
    cost = [
        k * block + (embedding if j == 0 else 0) + (head if j == len(split) - 1 else 0) for j, k in enumerate(split)
    ]
    ranks_load = [0.0] * (max(ranks) + 1)
    for c, r in zip(cost, ranks):
        ranks_load[r] += c / block
    return ranks_load, max(cost) / block


def test_llama3_405b_interleaved_is_metas_split_found_by_bisection(monkeypatch):
    """The split is computed, not searched: per call, one rank-capacity check (p calls of `_fit`) per bisection
    step over the <= 3 x 127 candidate limits, plus the final one. Counted, not timed, so load cannot fail it."""
    cfg = model_from_preset("llama3-405b")  # 126 blocks; the head is 0.61 of a block's FLOPs
    chunk_split.cache_clear()
    fits = []
    monkeypatch.setattr(partition, "_fit", lambda *args, fit=partition._fit: fits.append(args) or fit(*args))
    split = stage_layers(cfg, 16, 8, "interleaved", 8192)
    zbv = stage_layers(cfg, 16, 2, "zbv", 8192)
    assert 0 < len(fits) <= 2 * 16 * (math.ceil(math.log2(3 * 127)) + 1)
    # "One Transformer layer less on the first and the last stage": chunk 0 holds the embedding only, chunk 127
    # the head only. Ranks 1-14 run 8 blocks, rank 0 7, rank 15 7 and the head.
    assert split == [0] + [1] * 126 + [0]
    loads, _ = _loads(cfg, split, chunk_ranks("interleaved", 16, 8), 8192)
    assert max(loads) == 8.0 and loads[0] == 7.0 and 7.5 < loads[15] < 8.0
    # zbv: rank 0 holds the first and the last chunk, so both ends lose a block to carry embedding and head.
    assert zbv == [3] + [4] * 30 + [3]
    loads, worst_chunk = _loads(cfg, zbv, chunk_ranks("zbv", 16, 2), 8192)
    assert max(loads) == 8.0 and loads[0] < 7.0 and worst_chunk == 4.0


def test_interleaved_splits_balance_ranks_then_chunks():
    # PP_MODEL's model: the head is 2/3 of a block's FLOPs.
    cfg = dataclasses.replace(model_from_preset("tiny"), hidden_size=32, n_layers=8, n_heads=4, ffn_hidden_size=64)

    def split(n_layers: int, v: int) -> list[int]:
        return stage_layers(dataclasses.replace(cfg, n_layers=n_layers), 2, v, "interleaved", 32)

    assert split(6, 2) == [1, 2, 2, 1]  # ranks 3 blocks each; chunks of 2 would leave one with 0
    assert split(3, 2) == [1, 1, 1, 0]  # the third block on rank 0 (3 blocks) beats rank 1 at 2 + head
    assert split(2, 2) == [0, 1, 1, 0]
    assert split(8, 2) == [2, 2, 2, 2]
    assert split(8, 5) == [0] + [1] * 8 + [0]  # the "pp2-interleaved-v5-uneven" run below
    assert stage_layers(model_from_preset("llama3-8b"), 2, 2, "interleaved", 8192) == [8, 8, 9, 7]


def _compositions(n: int, parts: int):
    """Every split of n blocks into `parts` chunks whose inner chunks hold >= 1."""
    for cuts in itertools.combinations(range(n + parts - 1), parts - 1):
        split = [b - a - 1 for a, b in zip((-1, *cuts), (*cuts, n + parts - 1))]
        if all(k >= 1 for k in split[1:-1]):
            yield split


@pytest.mark.parametrize("kind", ["interleaved", "zbv"])
def test_chunk_split_is_the_optimum_of_every_split(kind):
    """Against brute force: the least (most loaded rank, most expensive chunk), for cheap and heavy heads."""
    for p, v in ((2, 2), (2, 3), (3, 2)):
        ranks = chunk_ranks(kind, p, v)
        for n in range(p * v - 2, p * v + 3):
            for embedding, head in ((0.0, 0.3), (0.0, 1.5), (0.4, 3.2)):

                def objective(split, embedding=embedding, head=head, ranks=ranks, p=p):
                    cost = [
                        k + (embedding if j == 0 else 0) + (head if j == len(split) - 1 else 0)
                        for j, k in enumerate(split)
                    ]
                    loads = [sum(c for c, r in zip(cost, ranks) if r == rank) for rank in range(p)]
                    return round(max(loads), 9), round(max(cost), 9)

                best = min(objective(s) for s in _compositions(n, p * v))
                assert objective(chunk_split(n, ranks, 1.0, embedding, head)) == best, (kind, p, v, n, head)


def test_chunks_with_no_block_run_the_embedding_or_the_head():
    """An embedding-only first chunk returns hidden states, a head-only last chunk the logits: together with the
    blocks between they are the whole model, gradients included, also under recomputation."""
    cfg = model_config()
    torch.manual_seed(0)
    whole = Transformer(cfg)
    parts = [
        Transformer(cfg, StageSpec(0, 0, True, False)),
        Transformer(cfg, StageSpec(0, 2, False, False)),
        Transformer(cfg, StageSpec(2, 2, False, True)),
    ]
    for part in parts:
        part.load_state_dict({k: v for k, v in whole.state_dict().items() if k in part.state_dict()})
        apply_recompute(part, "full")
    assert [len(part.layers) for part in parts] == [0, 2, 0]
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    hidden = parts[0](tokens)
    assert hidden.shape == (2, 16, 32)
    logits = parts[2](parts[1](hidden))
    assert torch.equal(logits, whole(tokens))
    logits.square().mean().backward()
    whole(tokens).square().mean().backward()
    grads = {n: p.grad for part in parts for n, p in part.named_parameters()}
    assert grads.keys() == {n for n, _ in whole.named_parameters()}
    assert all(torch.allclose(grads[n], p.grad, atol=1e-7) for n, p in whole.named_parameters())


# 8 micro-batches a step and a validation (4 at dp=2)
PP_MODEL = [
    *model_flags(hidden_size=32, n_layers=8, ffn_hidden_size=64),
    "--seq-len",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--eval-every",
    "2",
    "--train.eval_batches",
    "1",
    "--steps",
    "4",
]
TIED = ["--model.tie_embeddings", "true"]
LAYOUTS = {
    "pp2-gpipe": ["--pp", "2", "--schedule", "gpipe"],
    "pp2-1f1b": ["--pp", "2", "--schedule", "1f1b"],
    "pp2-interleaved": ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"],
    # The partitioner's own [0, 1 x 8, 0]: an embedding-only and a head-only chunk, as Llama 3 405B's.
    "pp2-interleaved-v5-uneven": ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "5"],
    "pp4-gpipe": ["--pp", "4", "--schedule", "gpipe"],
    "pp4-1f1b-uneven": ["--pp", "4", "--schedule", "1f1b", "--pp-layers", "1,3,3,1"],
    "pp4-interleaved": ["--pp", "4", "--schedule", "interleaved", "--virtual-stages", "2"],
    "tp2-pp2-dp2-tied": ["--tp", "2", "--pp", "2", "--dp", "2", *TIED],
}
M = 8  # micro-batches of a step of pp2-gpipe and pp2-1f1b, whose activation bytes the memory test reads
MEMORY_RUNS = {"memory-m1": ["--pp", "2", "--steps", "2", "--eval-every", "0", "--global-batch-size", "1"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    """The pp=1 references and every pipeline run of this module, each trained once, when first read."""
    common = [*PP_MODEL, "--data", small_corpus]
    return Runs(
        tmp_path_factory.mktemp("pp"),
        {
            "ref": common,
            "ref-tied": [*common, *TIED],
            **{name: [*common, *extra] for name, extra in LAYOUTS.items()},
            **{name: [*common, *extra] for name, extra in MEMORY_RUNS.items()},
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_reproduces_the_pp1_curve(runs, name):
    rows, expected = runs[name], runs["ref-tied" if "tied" in name else "ref"]
    assert_close_curves(losses(rows), losses(expected), rtol=1e-4, what=name)
    assert len(val_losses(rows)) == 2
    assert_close_curves(val_losses(rows), val_losses(expected), rtol=1e-4, what=f"{name} val")
    assert all(0.0 <= r["bubble_fraction"] < 1.0 and r["comm_bytes_pp"] > 0 for r in rows)
    trace = json.load(open(runs.folder(name) / "timeline.json"))
    assert {e["tid"] for e in trace["traceEvents"]} == set(range(world_size(LAYOUTS[name])))
    assert (runs.folder(name) / "timeline.png").stat().st_size > 1000


@pytest.mark.slow
def test_the_uneven_run_got_its_empty_chunks_from_the_partitioner(runs):
    cfg = build_config(str(runs.folder("pp2-interleaved-v5-uneven") / "config.toml"))
    assert cfg.parallel.pp_layers == ""
    assert stage_layers(cfg.model, 2, 5, cfg.parallel.schedule, cfg.train.seq_len) == [0] + [1] * 8 + [0]


@pytest.mark.slow
def test_activation_memory_per_stage_follows_the_schedule(runs):
    """gpipe holds all m micro-batches on every stage; 1f1b at most p - stage (saved-tensor bytes, by hooks)."""
    one = runs["memory-m1"][-1]["activation_bytes_per_stage"]
    for kind in ("gpipe", "1f1b"):
        row = runs[f"pp2-{kind}"][-1]
        for stage, (held, per_microbatch) in enumerate(zip(row["activation_bytes_per_stage"], one)):
            expected = M if kind == "gpipe" else min(M, 2 - stage)
            assert row["in_flight_per_stage"][stage] == expected
            assert abs(held / per_microbatch - expected) < 0.05 * expected, (kind, stage, held / per_microbatch)


def _seed_flow(schedule: str):
    mesh = ParallelMesh.for_this_rank(2, 1, 1)
    cfg = model_config(n_layers=4)
    tokens = torch.randint(0, 64, (4, 2, 17), generator=torch.Generator().manual_seed(0))
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens]
    full = build_model(cfg, None, seed=2)
    ref = sum(full.loss_fn(full(x), y) for x, y in micro) / 4
    ref.backward()
    pipe = PipelineParallelism(mesh, schedule=schedule)
    stage = pipe.split_model(cfg, seed=2)
    if schedule == "gpipe":
        loss = pipe.forward(micro)
        pipe.backward()
    else:
        loss = pipe.train_step(micro)
    full_params = dict(full.named_parameters())
    worst = max(float((p.grad - full_params[n].grad).abs().max()) for n, p in stage.named_parameters())
    return float(loss), float(ref), worst


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_seed_api_split_forward_backward(schedule):
    for loss, ref, worst_grad_error in run_ranks(_seed_flow, 2, schedule):
        assert abs(loss - ref) < 1e-5 * abs(ref) and worst_grad_error < 1e-6
    assert PipelineParallelism.grid("1f1b", 2, 3)[0][:2] == ["0F0", "0F1"]
