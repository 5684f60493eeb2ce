"""Mixture-of-Experts blocks on one device: router, grouped GEMMs against the loop, capacity, the Switch aux loss
and its gradient, the expert bias (once per optimizer step), init, counts, and (slow) training runs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from large_model_training.config import ModelConfig, build_config
from large_model_training.config_checks import check_fields
from large_model_training.errors import ConfigError
from large_model_training.layout import job_and_layout, layout_problems
from large_model_training.models.flops import matmul_parameters, parameter_count
from large_model_training.models.init import draw_full, init_parameters
from large_model_training.models.moe import MoE, expert_matmul, grouped_mm_fits
from large_model_training.models.presets import PRESETS
from large_model_training.models.transformer import MLP, Transformer
from large_model_training.train.moe_balance import MoEBalance
from tests.helpers import assert_close_curves, losses, train


def moe_config(**overrides) -> ModelConfig:
    fields = dict(
        PRESETS["tiny-moe"],
        preset="tiny-moe",
        hidden_size=32,
        n_heads=4,
        moe_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=16,
        moe_norm_topk=False,
    )  # raw gates unless a test asks for renormalised
    fields.update(overrides)
    return ModelConfig(**fields)


def make_moe(seed: int = 0, **overrides) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(moe_config(**overrides), layer=0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_router_takes_the_top_k_scores():
    layer = make_moe()
    x = torch.randn(20, 32)
    scores, chosen, gates = layer.router(x)
    assert torch.allclose(scores, F.linear(x, layer.router.weight).softmax(-1))
    assert torch.equal(chosen.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)
    assert torch.equal(gates, scores.gather(-1, chosen))  # softmax gates are not renormalised


def test_sigmoid_gates_are_renormalised_over_the_chosen():
    layer = make_moe(moe_router="sigmoid")
    scores, chosen, gates = layer.router(torch.randn(20, 32))
    assert torch.allclose(gates.sum(-1), torch.ones(20))
    picked = scores.gather(-1, chosen)
    assert torch.allclose(gates, picked / picked.sum(-1, keepdim=True))


def test_the_expert_bias_chooses_but_does_not_weight():
    layer = make_moe()
    x = torch.randn(20, 32)
    scores, _, _ = layer.router(x)
    layer.router.expert_bias[3] = 10.0
    biased_scores, chosen, gates = layer.router(x)
    assert (chosen == 3).any(-1).all()  # every token now goes to expert 3
    assert torch.equal(biased_scores, scores)
    assert torch.allclose(gates, scores.gather(-1, chosen))  # weighted by the score, not score + bias


def test_grouped_mm_rules_match_the_kernel():
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    x, w = torch.randn(10, 16), torch.randn(4, 16, 32)
    assert grouped_mm_fits(x, w)
    assert F.grouped_mm(x, w, offs=offs).shape == (10, 32)
    with pytest.raises(RuntimeError, match="int32"):
        F.grouped_mm(x, w, offs=offs.long())
    odd_x, odd_w = torch.randn(10, 15), torch.randn(4, 15, 32)  # 60-byte rows: not a multiple of 16
    assert not grouped_mm_fits(odd_x, odd_w)
    with pytest.raises(RuntimeError):
        F.grouped_mm(odd_x, odd_w, offs=offs)
    assert not grouped_mm_fits(x.double(), w.double())


def _run(layer: MoE, x: torch.Tensor, grouped: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    layer.zero_grad()
    layer.experts.use_grouped_mm = grouped
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    grads["input"] = x.grad
    return y.detach(), grads


def test_grouped_mm_equals_the_loop_with_an_idle_expert():
    layer = make_moe(moe_experts=6)
    layer.router.expert_bias[4] = -100.0  # expert 4 gets no token
    x = torch.randn(2, 9, 32)
    y_grouped, g_grouped = _run(layer, x, grouped=True)
    y_loop, g_loop = _run(layer, x, grouped=False)
    assert torch.allclose(y_grouped, y_loop, atol=1e-5)
    for name in g_loop:
        assert torch.allclose(g_grouped[name], g_loop[name], atol=1e-5), name
    for grads in (g_grouped, g_loop):
        assert all(torch.isfinite(g).all() for g in grads.values())
        for w in ("w_gate", "w_up", "w_down"):
            assert torch.count_nonzero(grads[f"experts.{w}"][4]) == 0
            assert torch.count_nonzero(grads[f"experts.{w}"][3]) > 0


def test_the_loop_runs_each_expert_on_exactly_its_rows():
    x, weight = torch.randn(7, 8), torch.randn(3, 5, 8)
    ends = torch.tensor([2, 2, 7])  # expert 1 has no rows
    want = torch.cat([x[:2] @ weight[0].T, x[2:7] @ weight[2].T])
    assert torch.equal(expert_matmul(x, weight, ends, grouped=False), want)
    assert expert_matmul(x[:0], weight, torch.zeros(3, dtype=torch.long), grouped=False).shape == (0, 5)


def test_capacity_drops_and_counts_what_does_not_fit():
    x = torch.randn(10, 32)
    for factor, dropped in ((0.0, 0), (1.0, 2 * (10 - 5))):  # capacity ceil(1.0 * 10 * 2 / 4) = 5 per expert
        layer = make_moe(moe_capacity_factor=factor)
        layer.router.expert_bias[:2] = 100.0  # every token chooses experts 0 and 1
        layer.train()
        layer(x)
        counts, _, dropped_copies, forwards = layer.take_stats()
        assert counts.tolist() == [10, 10, 0, 0] and forwards == 1
        assert int(dropped_copies) == dropped


def test_the_switch_aux_loss_on_a_hand_made_case():
    layer = make_moe(moe_experts=2, moe_top_k=1)
    scores = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    # f = (1, 0) of the copies, P = (0.7, 0.3) mean scores: 2 * (1 * 0.7 + 0 * 0.3)
    assert math.isclose(float(layer.aux_loss(scores, torch.tensor([2, 0]))), 1.4, rel_tol=1e-6)
    assert math.isclose(float(layer.aux_loss(torch.full((4, 2), 0.5), torch.tensor([3, 5]))), 1.0, rel_tol=1e-6)


def test_the_aux_loss_reaches_the_router_gradient_scaled():
    layer = make_moe(moe_aux_loss_coef=0.5)
    layer.train()
    layer.aux_grad_scale = 0.25
    x = torch.randn(12, 32)
    (layer(x) * 0).sum().backward()  # only the aux term remains
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    scores, chosen, _ = layer.router(x)
    counts = torch.bincount(chosen.reshape(-1), minlength=4)
    (0.5 * 0.25 * layer.aux_loss(scores, counts)).backward()
    assert torch.count_nonzero(got) > 0
    assert torch.allclose(got, layer.router.weight.grad, atol=1e-7)


def test_the_expert_bias_moves_once_per_optimizer_step():
    cfg = moe_config(n_layers=2, moe_bias_update_rate=0.01)
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_parameters(model, cfg, seed=0)
    mesh = SimpleNamespace(pp_size=1, grad_size=1, dp_size=1, device=torch.device("cpu"))
    balance = MoEBalance(model, cfg, mesh)
    balance.start_step(micro_batches=4)
    model.train()
    routers = [layer.mlp.router for layer in model.layers.values()]
    for _ in range(4):  # gradient accumulation: m = 4 micro-batches, the bias must not move between them
        model(torch.randint(0, 256, (2, 16))).sum().backward()
        assert all(torch.count_nonzero(r.expert_bias) == 0 for r in routers)
    counts = [layer.mlp.counts.clone() for layer in model.layers.values()]
    record = balance.finish_step(update_bias=True)
    for router, load in zip(routers, counts):
        assert torch.equal(router.expert_bias, 0.01 * torch.sign(load.float().mean() - load.float()))
        assert load.sum() == 4 * 2 * 16 * cfg.moe_top_k  # every micro-batch's tokens counted, once
    assert record["moe_tokens_dropped"] == 0 and len(record["moe_load_imbalance_per_layer"]) == 2
    assert record["moe_load_imbalance"] == max(record["moe_load_imbalance_per_layer"]) >= 1.0
    before = [r.expert_bias.clone() for r in routers]
    balance.finish_step(update_bias=False)  # a skipped step leaves it
    assert all(torch.equal(r.expert_bias, b) for r, b in zip(routers, before))


def test_blocks_follow_first_dense_and_every():
    cfg = moe_config(n_layers=7, moe_first_dense=2, moe_every=2)
    model = Transformer(cfg)
    assert [isinstance(model.layers[str(i)].mlp, MoE) for i in range(7)] == [
        False,
        False,
        True,
        False,
        True,
        False,
        True,
    ]
    assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg)


def test_expert_weights_initialise_by_name_with_the_residual_rule():
    cfg = moe_config(hidden_size=64, moe_ffn_hidden_size=64, moe_shared_experts=1)
    model = Transformer(cfg)
    init_parameters(model, cfg, seed=3)
    mlp = model.layers["1"].mlp
    assert torch.equal(mlp.experts.w_gate, draw_full(cfg, "layers.1.mlp.experts.w_gate", (4, 64, 64), seed=3))
    residual = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert abs(float(mlp.experts.w_down.detach().std()) - residual) < 0.1 * residual
    assert abs(float(mlp.shared.w_down.weight.detach().std()) - residual) < 0.1 * residual
    assert abs(float(mlp.experts.w_up.detach().std()) - cfg.init_std) < 0.1 * cfg.init_std
    assert not torch.equal(mlp.experts.w_gate[0], mlp.experts.w_gate[1])


def test_dense_presets_build_no_experts():
    cfg = ModelConfig(**PRESETS["tiny"])
    model = Transformer(cfg)
    assert all(type(block.mlp) is MLP for block in model.layers.values())
    assert not any("experts" in name or "router" in name for name, _ in model.named_parameters())


def test_total_and_active_parameters_of_published_shapes():
    mixtral = ModelConfig(preset="mixtral-8x7b", **PRESETS["mixtral-8x7b"])
    assert abs(parameter_count(mixtral) / 46.7e9 - 1) < 0.01
    assert abs(parameter_count(mixtral, active=True) / 12.9e9 - 1) < 0.01
    deepseek = ModelConfig(preset="deepseek-v3", **PRESETS["deepseek-v3"])
    assert abs(parameter_count(deepseek) / 671e9 - 1) < 0.01
    assert 37e9 < parameter_count(deepseek, active=True) < 40e9
    assert matmul_parameters(mixtral) < parameter_count(mixtral, active=True)


def test_bad_moe_fields_and_unsupported_layouts_are_refused():
    cfg = build_config(overrides={"model.preset": "tiny-moe"})
    cfg.model.moe_top_k = 9
    with pytest.raises(ConfigError, match="moe_top_k"):
        check_fields(cfg)
    cfg = build_config(overrides={"model.preset": "tiny-moe"})
    cfg.model.moe_router = "relu"
    with pytest.raises(ConfigError, match="moe_router"):
        check_fields(cfg)
    cfg = build_config(overrides={"model.preset": "tiny-moe"})
    cfg.parallel.tp = 2
    assert any("--sequence-parallel" in problem for problem in layout_problems(*job_and_layout(cfg)))
    cfg.parallel.sequence_parallel = True
    assert not layout_problems(*job_and_layout(cfg))
    cfg.parallel.zero = 3
    assert not layout_problems(*job_and_layout(cfg))  # at ep = 1 FSDP2 shards the stacked experts
    cfg.parallel.dp = cfg.parallel.ep = 2
    assert not layout_problems(*job_and_layout(cfg))  # ep > 1: experts an FSDP2 group over edp (parallel/fsdp.py)


TRAIN = [
    "--model",
    "tiny-moe",
    "--seq-len",
    "64",
    "--micro-batch-size",
    "4",
    "--eval-every",
    "0",
    "--model.moe_bias_update_rate",
    "0.001",
]


@pytest.mark.slow
def test_tiny_moe_trains_and_reports(tmp_path, small_corpus):
    rows = train(str(tmp_path), *TRAIN, "--data", small_corpus, "--steps", "20", "--global-batch-size", "8")
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(r["moe_tokens_dropped"] == 0 and r["moe_load_imbalance"] >= 1.0 for r in rows)
    assert all(len(r["moe_aux_loss_per_layer"]) == 4 and r["moe_aux_loss"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp", "2"], ["--pp", "2"]])
def test_moe_layouts_reproduce_the_one_rank_curve(tmp_path, small_corpus, layout):
    from tests.dist import train_together

    common = [*TRAIN, "--data", small_corpus, "--steps", "6", "--global-batch-size", "8"]
    reference = train(str(tmp_path / "ref"), *common)
    train_together(2, {str(tmp_path / "run"): [*common, *layout]})
    from tests.helpers import metrics

    rows = metrics(tmp_path / "run")
    assert_close_curves(losses(rows), losses(reference), rtol=1e-5, what=" ".join(layout))
    for a, b in zip(rows, reference):
        assert math.isclose(a["moe_aux_loss"], b["moe_aux_loss"], rel_tol=1e-5)


def test_init_zeroes_the_expert_bias_left_by_to_empty():
    cfg = moe_config(n_layers=2)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    for layer in model.layers.values():
        layer.mlp.router.expert_bias.fill_(float("nan"))
    init_parameters(model, cfg, seed=0)
    assert all(torch.count_nonzero(layer.mlp.router.expert_bias) == 0 for layer in model.layers.values())


def test_hugging_face_export_refuses_moe_models_mixtral_cannot_run():
    from large_model_training.models.hf import hf_family  # more refusals: tests/test_hf_moe.py

    assert hf_family(moe_config(moe_norm_topk=True)) == "mixtral"
    with pytest.raises(ConfigError, match="MoE model exactly: its top-k gates are not renormalised"):
        hf_family(moe_config())


@pytest.mark.slow
def test_resume_restores_the_expert_bias(tmp_path, small_corpus):
    common = [*TRAIN, "--data", small_corpus, "--steps", "4", "--model.moe_bias_update_rate", "0.05"]
    full = train(str(tmp_path / "full"), *common, "--run.save_every", "2")
    resumed = train(str(tmp_path / "resumed"), *common, "--run.resume", str(tmp_path / "full/checkpoints/step_2"))
    assert losses(resumed) == losses(full)[2:]
    assert [r["moe_load_imbalance_per_layer"] for r in resumed] == [r["moe_load_imbalance_per_layer"] for r in full[2:]]


def test_recompute_counts_routing_once_and_keeps_gradients():
    from large_model_training.memory.recompute import apply_recompute

    cfg = moe_config(n_layers=2)
    tokens = torch.randint(0, 256, (2, 16))
    results = []
    for policy in ("none", "every:2"):  # block 0 re-runs whole (the early stop cuts only the last one)
        model = Transformer(cfg)
        init_parameters(model, cfg, seed=0)
        apply_recompute(model, policy)
        model.train()
        model(tokens).square().mean().backward()
        stats = [layer.mlp.take_stats() for layer in model.layers.values()]
        results.append((stats, {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (recomputed, recomputed_grads) = results
    for (counts, aux, _, forwards), (counts_r, aux_r, _, forwards_r) in zip(plain, recomputed):
        assert forwards == forwards_r == 1 and torch.equal(counts, counts_r) and torch.equal(aux, aux_r)
    for name, grad in plain_grads.items():
        assert torch.allclose(grad, recomputed_grads[name], atol=1e-6), name


def test_estimate_runs_on_moe_presets(capsys):
    from large_model_training.cli import main

    for preset in ("mixtral-8x7b", "deepseek-v3"):
        assert main(["estimate", "--model", preset]) == 0
    assert "GiB" in capsys.readouterr().out
