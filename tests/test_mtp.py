"""Multi-token prediction (models/transformer.py's TokenPredictor, `model.mtp_depth`): the loss and gradients
against a reference written from DeepSeek-V3's equations, what is logged, parameter counts, dp faithful, resume,
and the layouts refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from large_model_training.config import ModelConfig, build_config
from large_model_training.errors import ConfigError
from large_model_training.layout import validate
from large_model_training.models.flops import parameter_count
from large_model_training.models.init import init_parameters
from large_model_training.models.transformer import Transformer, rope_tables
from tests.helpers import RUN_FLAGS, Runs, assert_close_curves, losses, model_flags


def mtp_model(depth: int = 2, **changes) -> Transformer:
    cfg = ModelConfig(
        **{
            **dict(
                vocab_size=64,
                hidden_size=32,
                n_layers=2,
                n_heads=4,
                ffn_hidden_size=64,
                max_seq_len=32,
                mtp_depth=depth,
            ),
            **changes,
        }
    )
    model = Transformer(cfg)
    init_parameters(model, cfg, seed=4)
    model.fused_loss, model.mtp_weight = False, 0.3
    return model.train()


def reference_losses(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """DeepSeek-V3 (eq. 21-25): h^k_i = TRM_k(M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]) for i <= T - k,
    P^k_{i+k+1} = OutHead(h^k_i), L^k = cross-entropy against t_{i+k+1}; depth 0 is the model itself."""
    seq = tokens.shape[1]
    rope = rope_tables(seq, model.cfg.rope_dim, model.cfg.rope_theta, tokens.device)
    h = model.run_blocks(model.embed(tokens), rope)
    out = [F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), targets.flatten())]
    for k in range(1, model.cfg.mtp_depth + 1):
        m = model.mtp[str(k)]
        merged = m.proj(
            torch.cat((m.hidden_norm(h[:, : seq - k]), m.embed_norm(model.tok_embeddings(tokens[:, k:]))), -1)
        )
        h = m.block(merged, (rope[0][: seq - k], rope[1][: seq - k]))
        out.append(F.cross_entropy(model.output(m.norm(h)).flatten(0, 1), targets[:, k:].flatten()))
    return out


def test_mtp_logs_the_next_token_loss_and_trains_on_all_depths_as_the_reference():
    model = mtp_model()
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 64, (3, 17), generator=g)
    tokens, targets = sequences[:, :-1], sequences[:, 1:]  # as the loader gives them: t_{i+k} = targets[i+k-1]
    logged = model(tokens, targets=targets)
    grads = torch.autograd.grad(logged, list(model.parameters()))
    main, *depths = reference_losses(model, tokens, targets)
    assert torch.allclose(logged, main, rtol=1e-6)
    expected = torch.autograd.grad(main + 0.3 * torch.stack(depths).mean(), list(model.parameters()))
    for (name, _), got, want in zip(model.named_parameters(), grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
    assert torch.allclose(model.mtp_losses, torch.stack(depths).detach(), rtol=1e-6)
    assert any(g.abs().sum() > 0 for n, g in zip(dict(model.named_parameters()), grads) if n.startswith("mtp.2."))
    model.eval()
    assert model(tokens, targets=targets).item() == pytest.approx(main.item(), rel=1e-6)  # evaluation: no MTP


@pytest.mark.slow
def test_an_moe_model_with_mtp_trains_and_reports_the_prediction_blocks_experts(tmp_path):
    from tests.helpers import train

    rows = train(
        str(tmp_path),
        "--model",
        "tiny-mla-moe",
        "--model.mtp_depth",
        "1",
        "--model.n_layers",
        "2",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--steps",
        "3",
        "--eval-every",
        "0",
    )
    assert len(rows[-1]["moe_load_imbalance_per_layer"]) == 2  # block 1 and the prediction module's block
    assert len(rows[-1]["mtp_loss_per_depth"]) == 1


def test_parameter_count_includes_the_prediction_modules():
    model = mtp_model(depth=2)
    assert parameter_count(model.cfg) == sum(p.numel() for p in model.parameters())
    moe = mtp_model(depth=1, moe_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
    assert parameter_count(moe.cfg) == sum(p.numel() for p in moe.parameters())


def test_mtp_with_the_zbv_schedule_is_a_one_line_error():
    cfg = build_config(
        overrides={"model.mtp_depth": 1, "model.n_layers": 4, "parallel.pp": 2, "parallel.schedule": "zbv"}
    )
    with pytest.raises(ConfigError, match="model.mtp_depth does not compose with the zbv schedule") as info:
        validate(cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("depth", [1, 3])
def test_future_targets_are_the_targets_rolled_with_no_label_past_the_end(depth):
    from large_model_training.models.transformer import future_targets

    targets = torch.arange(12).view(2, 6)
    out = future_targets(targets, depth)
    assert out.shape == (depth + 1, 2, 6)
    for j in range(depth + 1):
        assert torch.equal(out[j, :, : 6 - j], targets[:, j:]) and bool((out[j, :, 6 - j :] == -1).all())


COMMON = [*model_flags(mtp_depth=2), "--seq-len", "32", *RUN_FLAGS]
LAYOUTS = {  # name: (flags, reference run)
    "tp2": ["--tp", "2"],
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2"],
    "pp2-tied": ["--pp", "2", "--model.tie_embeddings", "true"],
    "pp2-zero3": ["--pp", "2", "--dp", "2", "--zero", "3"],
    "cp2": ["--cp", "2"],
    "cp2-allgather-tp2-sp": ["--cp", "2", "--cp-attention", "allgather", "--tp", "2", "--sequence-parallel"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    root = tmp_path_factory.mktemp("mtp")
    common = [*COMMON, "--data", small_corpus]
    return Runs(
        root,
        {
            "ref": [*common, "--save-every", "3"],
            "dp2": [*common, "--dp", "2"],
            "dp2-zero3": [*common, "--dp", "2", "--zero", "3"],
            # the prediction modules under every axis that splits what they read: tp (its head vocab-parallel,
            # the merge projection replicated), SP (the rolled tokens embedded and split like the inputs), pp (on
            # the last stage with a copy of the embedding, summed with stage 0's), cp (labels gathered over cp)
            **{name: [*common, *flags] for name, flags in LAYOUTS.items()},
            "ref-tied": [*common, "--model.tie_embeddings", "true"],
            "resumed": [*common, "--resume", str(root / "ref" / "checkpoints" / "step_3")],
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2", "dp2-zero3"])
def test_dp_trains_the_one_rank_mtp_curve_and_depth_losses(runs, name):
    assert_close_curves(losses(runs[name]), losses(runs["ref"]), rtol=1e-5, what=f"mtp {name}")
    for a, b in zip(runs[name], runs["ref"]):
        assert a["mtp_loss_per_depth"] == pytest.approx(b["mtp_loss_per_depth"], rel=1e-5)
        assert len(a["mtp_loss_per_depth"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tp_pp_and_cp_train_the_one_rank_mtp_curve_and_depth_losses(runs, name):
    ref = runs["ref-tied" if "tied" in name else "ref"]
    assert_close_curves(losses(runs[name]), losses(ref), rtol=1e-5, what=f"mtp {name}")
    for a, b in zip(runs[name], ref):
        assert a["mtp_loss_per_depth"] == pytest.approx(b["mtp_loss_per_depth"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_an_mtp_checkpoint_resumes_exactly(runs):
    assert losses(runs["resumed"]) == losses(runs["ref"])[3:]


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_ranks_labelled_positions_are_the_prefix_its_zigzag_positions_give(cp):
    from large_model_training.mesh import AxisGroup
    from large_model_training.parallel.context import ContextAttention

    seq = 32
    for rank in range(cp):
        context = ContextAttention(AxisGroup(None, cp, rank), "ring")
        positions = context.positions(seq // cp, torch.device("cpu"))
        for shift in (1, 2, 3):
            keep = context.labelled(seq // cp, shift)
            assert bool((positions[:keep] + shift < seq).all()) and bool((positions[keep:] + shift >= seq).all())


def test_mtp_deeper_than_a_zigzag_chunk_is_a_one_line_error():
    cfg = build_config(overrides={"model.mtp_depth": 2, "parallel.cp": 4, "train.seq_len": 16})
    with pytest.raises(ConfigError, match="needs sequences longer than it") as info:
        validate(cfg)
    assert "\n" not in str(info.value)
