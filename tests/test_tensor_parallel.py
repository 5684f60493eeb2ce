"""Tensor and sequence parallelism: gradients equal the tp=1 slices, loss curves equal tp=1, bytes as analysed."""

from __future__ import annotations


import pytest
import torch

from large_model_training.config import ModelConfig
from large_model_training.mesh import ParallelMesh
from large_model_training.models.build import build_model
from large_model_training.models.init import local_shard
from large_model_training.parallel.collectives import TPGroup
from large_model_training.parallel.tensor import TensorParallelism, sync_partial_gradients
from large_model_training.planner.comm import tp_bytes_per_microbatch, tp_gradient_sync_bytes
from tests.dist import run_ranks
from tests.helpers import assert_close_curves, losses, train

VARIANTS = {
    "swiglu-gqa": dict(n_kv_heads=2),
    "gelu-layernorm-learned-tied": dict(mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True),
    "odd-vocab-mha": dict(vocab_size=250),  # padded to a multiple of tp
}


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, ffn_hidden_size=64, max_seq_len=16)
    return ModelConfig(**{**base, **kw})


def _gradient_errors(tp_size: int) -> dict[str, float]:
    """On each rank: tp model vs the full model on one batch; worst relative error over all parameters."""
    mesh = ParallelMesh.for_this_rank(1, 1, tp_size)
    errors = {}
    for name, kw in VARIANTS.items():
        for sp in (False, True):
            cfg = _cfg(**kw)
            tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
            full = build_model(cfg, None, seed=5)
            full.loss_fn(full(tokens[:, :-1]), tokens[:, 1:]).backward()
            tp = TPGroup(mesh.tp_group, tp_size, mesh.tp_rank)
            model = build_model(cfg, mesh, seed=5, sequence_parallel=sp, tp=tp)
            loss = model.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            sync_partial_gradients(model, tp)
            worst = 0.0
            full_modules = dict(full.named_modules())
            for mod_name, module in model.named_modules():
                for p_name, p in module.named_parameters(recurse=False):
                    ref = getattr(full_modules[mod_name], p_name).grad
                    expected = local_shard(module, p_name, ref)
                    worst = max(worst, float((p.grad - expected).abs().max() / expected.abs().max().clamp_min(1e-12)))
            errors[f"{name} sp={sp}"] = worst
    return errors


@pytest.mark.parametrize("tp_size", [2, 4])
def test_every_gradient_equals_the_tp1_slice(tp_size):
    for rank_errors in run_ranks(_gradient_errors, tp_size, tp_size):
        for case, err in rank_errors.items():
            assert err < 1e-5, f"tp={tp_size} {case}: relative gradient error {err:.2e}"


TP_MODEL = ["--model.hidden_size", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.ffn_hidden_size",
            "128", "--seq-len", "32", "--steps", "20", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--eval-every", "0"]
GQA = ["--model.n_kv_heads", "2"]
GELU = ["--model.mlp", "gelu", "--model.norm", "layernorm", "--model.position", "learned",
        "--model.tie_embeddings", "true"]


def test_tp_loss_curves_match_tp1(tmp_path, small_corpus):
    common = [*TP_MODEL, "--data", small_corpus]
    ref_gqa = losses(train(str(tmp_path / "a1"), *common, *GQA))
    for name, extra in {"tp2": ["--tp", "2"], "tp4-sp (kv heads replicated)": ["--tp", "4", "--sequence-parallel"],
                        "tp2 x dp2": ["--tp", "2", "--dp", "2", "--micro-batch-size", "1"]}.items():
        curve = losses(train(str(tmp_path / name.replace(" ", "_")), *common, *GQA, *extra))
        assert_close_curves(curve, ref_gqa, rtol=1e-4)
    ref_gelu = losses(train(str(tmp_path / "b1"), *common, *GELU))
    for name, extra in {"tp2-sp": ["--tp", "2", "--sequence-parallel"], "tp4": ["--tp", "4"]}.items():
        assert_close_curves(losses(train(str(tmp_path / name), *common, *GELU, *extra)), ref_gelu, rtol=1e-4)
    assert ref_gqa[-1] < ref_gqa[0]


@pytest.mark.parametrize("sp", [False, True])
def test_counted_tp_bytes_equal_the_analytic_count(tmp_path, small_corpus, sp):
    args = [*TP_MODEL, "--data", small_corpus, "--steps", "2", "--tp", "2", *GQA] + (["--sequence-parallel"] if sp else [])
    rows = train(str(tmp_path / "run"), *args)
    cfg = _cfg(hidden_size=64, ffn_hidden_size=128, n_kv_heads=2, max_seq_len=256)
    micro_batches = 2  # global 4 / micro 2 / dp 1
    expected = micro_batches * tp_bytes_per_microbatch(cfg, 2, 32, 2, sp) + tp_gradient_sync_bytes(cfg, 2, sp)
    for r in rows:
        assert abs(r["comm_bytes_tp"] - expected) <= 0.01 * expected, (r["comm_bytes_tp"], expected)
    # The per-layer all-reduces dominate: 2 forward + 2 backward per layer, ring cost 2(t-1)/t * b*s*h*4 each.
    per_layer = micro_batches * 2 * 4 * (2 * 1 / 2) * 2 * 32 * 64 * 4
    assert per_layer > 0.6 * expected


def _seed_api_checks():
    mesh = ParallelMesh.for_this_rank(1, 1, 2)
    tp = TensorParallelism(mesh)
    full = torch.arange(12.0).view(4, 3)
    shard = tp.split_tensor(full, dim=0)
    total = tp.all_reduce(torch.ones(3) * (mesh.tp_rank + 1))
    model = tp.parallelize(_cfg(), seed=0)
    return shard.tolist(), total.tolist(), model.layers["0"].attn.wq.weight.shape[0], tp.num_devices


def test_seed_api_tensor_parallelism():
    (shard0, total, rows, n), (shard1, *_ ) = run_ranks(_seed_api_checks, 2)
    assert shard0 == [[0, 1, 2], [3, 4, 5]] and shard1 == [[6, 7, 8], [9, 10, 11]]
    assert total == [3.0, 3.0, 3.0] and rows == 16 and n == 2
