"""qk_norm (Qwen3's per-head RMSNorm of queries and keys): what it computes on one device, and that under tensor
parallelism its replicated weights get the tp=1 gradients once their tp-partial sums are added up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from large_model_training.api import TensorParallelism
from large_model_training.assembly import build_model
from large_model_training.mesh import ParallelMesh
from large_model_training.models.fused import fuse_qkv, split_qkv
from large_model_training.models.init import local_shard
from large_model_training.models.transformer import StageSpec
from tests.dist import run_ranks
from tests.helpers import model_config

CFG = model_config(vocab_size=96, n_kv_heads=2, qk_norm=True)


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    model = build_model(dataclasses.replace(CFG, norm_eps=1e-12), None, seed=0).eval()  # eps would show the scale
    assert torch.equal(model.layers["1"].attn.q_norm.weight, torch.ones(CFG.head_dim))  # a norm: starts at one
    with torch.no_grad():
        before = model(tokens)
        for block in model.layers.values():  # the query rows of wqkv x 7, the key rows x 0.1 (models/fused.py)
            q, k, v = split_qkv(block.attn.wqkv.weight, CFG.n_heads, CFG.kv_heads)
            block.attn.wqkv.weight.copy_(fuse_qkv(q * 7.0, k * 0.1, v, CFG.kv_heads))
        after = model(tokens)
    assert (after - before).abs().max() < 1e-4
    plain = build_model(dataclasses.replace(CFG, qk_norm=False), None, seed=0)
    assert {n for n, _ in model.named_parameters()} - {n for n, _ in plain.named_parameters()} == {
        f"layers.{i}.attn.{w}.weight" for i in range(2) for w in ("q_norm", "k_norm")
    }
    last_stage = build_model(CFG, None, seed=0, stage=StageSpec(1, 2, False, True))  # a pipeline stage's names
    assert torch.equal(
        dict(last_stage.named_parameters())["layers.1.attn.k_norm.weight"], model.layers["1"].attn.k_norm.weight
    )


# (model change, sequence parallel): without SP the norms' gradients are tp-partial only because of qk_norm.
VARIANTS = {
    "gqa": ({}, False),
    "mha": (dict(n_kv_heads=4), False),  # one or two kv groups per rank
    "head-dim": (dict(attention_head_dim=16), False),  # heads twice hidden / n_heads: q and o 64 wide
    "moe": (dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_first_dense=1), True),
}  # needs SP


def _qk_norm_gradient_errors() -> dict[str, float]:
    """On each of 2 tp ranks: loss and gradients of the tp model against the full model, worst relative error."""
    mesh = ParallelMesh.for_this_rank(1, 1, 2)
    errors = {}
    for name, (kw, sp) in VARIANTS.items():
        cfg = dataclasses.replace(CFG, **kw)
        tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
        full = build_model(cfg, None, seed=5)
        full_loss = full.loss_fn(full(tokens[:, :-1]), tokens[:, 1:])
        full_loss.backward()
        model = build_model(cfg, mesh, seed=5, sequence_parallel=sp)
        loss = model.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        TensorParallelism(mesh).sync_partial_gradients(model)
        worst = float((loss - full_loss).abs() / full_loss)
        full_modules = dict(full.named_modules())
        for mod_name, module in model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                expected = local_shard(module, p_name, getattr(full_modules[mod_name], p_name).grad)
                worst = max(worst, float((p.grad - expected).abs().max() / expected.abs().max().clamp_min(1e-12)))
        errors[f"{name} sp={sp}"] = worst
    return errors


@pytest.mark.slow
def test_tp2_with_qk_norm_gives_the_tp1_loss_and_gradients():
    for rank_errors in run_ranks(_qk_norm_gradient_errors, 2):
        for case, err in rank_errors.items():
            assert err < 1e-5, f"{case}: relative error {err:.2e}"
