"""Initialisation in O(shard): a rank's region, drawn tile by tile, equals the same region of the full tensor;
every tp layout (padding, replicated kv heads, tied embeddings, pipeline stages) starts from the tp=1 weights.

Every layout is built here in one process, rank by rank, with a stand-in mesh: initialisation needs only the tp
rank and size (`tests/test_tensor_parallel.py` checks the same property on real ranks, through gradients)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from large_model_training.assembly import build_model
from large_model_training.mesh import AxisGroup
from large_model_training.models import init
from large_model_training.models.init import draw_full, full_shape, init_parameters, local_shard
from large_model_training.models.transformer import StageSpec
from large_model_training.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tests.helpers import model_config

CFG = model_config(vocab_size=250)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 5 x 7 and 7-element blocks: every small shard below cuts through tiles."""
    monkeypatch.setattr(init, "tile_shape", lambda shape: (7,) if len(shape) == 1 else (5, 7))


def _mesh(tp: int, rank: int) -> SimpleNamespace:
    """What `build_model` reads of a mesh, for one rank of a tp group that is never communicated over."""
    return SimpleNamespace(tp_size=tp, tp=AxisGroup(None, tp, rank), device=torch.device("cpu"))


def _initialised(layer: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = nn.ModuleDict({"w": layer}).to(dtype)
    init_parameters(model, CFG, seed=7)
    return model


def _old_cut(layer: nn.Module, full: torch.Tensor) -> torch.Tensor:
    """The shard as the pre-region code cut it (pad rows with zeros, chunk): loading must still cut the same."""
    t, r = layer.tp.size, layer.tp.rank
    if isinstance(layer, RowParallelLinear):
        return full.chunk(t, dim=1)[r]
    rows = layer.padded_out if isinstance(layer, ColumnParallelLinear) else layer.per_rank * t
    return F.pad(full, (0, 0, 0, rows - full.shape[0])).chunk(t, dim=0)[r]


LAYERS = {  # name: layer for tp rank r
    "column tp3": lambda r: ColumnParallelLinear(17, 33, AxisGroup(None, 3, r)),
    "column padded tp4": lambda r: ColumnParallelLinear(9, 250, AxisGroup(None, 4, r), padded_out=252),
    "row tp3": lambda r: RowParallelLinear(33, 17, AxisGroup(None, 3, r), sequence_parallel=False),
    "vocab tp4": lambda r: VocabParallelEmbedding(250, 9, AxisGroup(None, 4, r)),
    "vocab all padding on rank 3": lambda r: VocabParallelEmbedding(5, 9, AxisGroup(None, 4, r)),
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_each_ranks_region_is_the_full_tensors_region(small_tiles, kind):
    ranks = 3 if "tp3" in kind else 4
    for r in range(ranks):
        layer = LAYERS[kind](r)
        full = draw_full(CFG, "w.weight", full_shape(layer, "weight", layer.weight), seed=7)
        shard = _initialised(layer).w.weight
        assert torch.equal(local_shard(layer, "weight", full), _old_cut(layer, full)), (kind, r)
        assert torch.equal(shard, _old_cut(layer, full)), (kind, r)


@pytest.mark.parametrize(
    "shape,region",
    [
        ((2100, 1030), ((700, 1400), (0, 1030))),  # tp=3 rows
        ((1030, 2100), ((0, 1030), (1400, 2100))),  # tp=3 columns
        ((3_000_001,), ((1_000_000, 2_100_000),)),  # a vector
        ((3, 5), ((1, 2), (2, 5))),
    ],
)  # one partial tile
def test_regions_at_the_real_tile_size(shape, region):
    full = draw_full(CFG, "layers.0.attn.wq.weight", shape, seed=3)
    part = torch.empty([b - a for a, b in region])
    init.fill_region(part, CFG, "layers.0.attn.wq.weight", shape, region, seed=3)
    assert torch.equal(part, full[tuple(slice(a, b) for a, b in region)])


def test_a_rank_draws_only_the_tiles_it_overlaps(monkeypatch):
    monkeypatch.setattr(init, "tile_shape", lambda shape: (10, 10))
    drawn = []
    seed_of = init.tile_seed
    monkeypatch.setattr(init, "tile_seed", lambda seed, name, tile: drawn.append(tile) or seed_of(seed, name, tile))
    _initialised(ColumnParallelLinear(30, 40, AxisGroup(None, 4, 1)))  # rows 10-20 of a 4 x 3 grid of tiles
    assert drawn == [(1, 0), (1, 1), (1, 2)]


def test_tiles_and_seeds_are_independent():
    full = draw_full(CFG, "layers.0.mlp.w_up.weight", (2048, 2048), seed=1)
    assert not torch.equal(full[:1024, :1024], full[:1024, 1024:])
    assert not torch.equal(full, draw_full(CFG, "layers.0.mlp.w_up.weight", (2048, 2048), seed=2))
    assert not torch.equal(full, draw_full(CFG, "layers.1.mlp.w_up.weight", (2048, 2048), seed=1))
    assert abs(full.std().item() - CFG.init_std) < 0.01 * CFG.init_std


def test_bf16_shards_hold_the_rounded_fp32_full_tensor(small_tiles):
    for r in range(4):
        layer = ColumnParallelLinear(9, 250, AxisGroup(None, 4, r), padded_out=252)
        full = draw_full(CFG, "w.weight", (250, 9), seed=7)
        shard = _initialised(layer, torch.bfloat16).w.weight
        assert shard.dtype == torch.bfloat16
        assert torch.equal(shard, _old_cut(layer, full.to(torch.bfloat16)))


MODELS = {  # name: (model config changes, tp sizes, sequence parallel)
    "gqa": (dict(n_kv_heads=2, vocab_size=256), (2, 4), False),  # tp=4 over 2 kv heads: replicated
    "gqa-sp": (dict(n_kv_heads=2, vocab_size=256), (2,), True),
    "gelu-layernorm-learned-tied": (
        dict(mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True),
        (2, 4),
        False,
    ),
    "odd-vocab": (dict(), (4,), False),  # 250 padded to 252
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_tp_layout_starts_from_the_tp1_weights(small_tiles, name):
    changes, tp_sizes, sp = MODELS[name]
    cfg = replace(CFG, **changes)
    whole = build_model(cfg, None, seed=5)
    whole_modules = dict(whole.named_modules())
    for tp in tp_sizes:
        for r in range(tp):
            model = build_model(cfg, _mesh(tp, r), seed=5, sequence_parallel=sp)
            for mod_name, module in model.named_modules():
                for p_name, p in module.named_parameters(recurse=False):
                    expected = local_shard(module, p_name, getattr(whole_modules[mod_name], p_name))
                    assert torch.equal(p, expected), f"{name} tp={tp} rank {r}: {mod_name}.{p_name}"


def test_a_tied_last_stage_at_tp2_starts_from_the_embedding(small_tiles):
    cfg = replace(CFG, tie_embeddings=True)
    embedding = build_model(cfg, None, seed=5).tok_embeddings.weight
    for r in range(2):
        stage = build_model(cfg, _mesh(2, r), seed=5, stage=StageSpec(1, 2, has_embedding=False, has_head=True))
        assert torch.equal(stage.output.weight, local_shard(stage.output, "weight", embedding))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_regions_drawn_on_cuda_equal_the_cuda_full_tensor():
    shape, region = (2100, 3000), ((700, 1400), (1000, 2500))
    full = draw_full(CFG, "layers.0.attn.wq.weight", shape, seed=3, device="cuda")
    part = torch.empty([b - a for a, b in region], device="cuda", dtype=torch.bfloat16)
    init.fill_region(part, CFG, "layers.0.attn.wq.weight", shape, region, seed=3)
    assert torch.equal(part, full[700:1400, 1000:2500].to(torch.bfloat16))


def test_fake_tensors_are_not_drawn(monkeypatch):
    """`lmt rehearse` materialises in FakeTensorMode: no values to draw, so no tile is (nor a device generator)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(init, "tile_seed", lambda *a: pytest.fail("a tile was drawn for a fake tensor"))
    with torch.device("meta"):
        model = nn.ModuleDict({"w": ColumnParallelLinear(30, 40, AxisGroup(None, 4, 1))})
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        init_parameters(model, CFG, seed=7)
