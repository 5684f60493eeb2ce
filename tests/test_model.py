"""The model: every architecture choice runs and learns; initialisation does not depend on the layout."""

from __future__ import annotations

import pytest
import torch

from large_model_training.assembly import build_model
from large_model_training.config import Config, ModelConfig, model_from_preset
from large_model_training.layout import validate
from large_model_training.models.init import init_parameters
from large_model_training.models.loss import cross_entropy
from large_model_training.models.presets import PRESETS
from large_model_training.models.transformer import StageSpec, Transformer
from tests.helpers import model_config


def _cfg(**kw) -> ModelConfig:
    return model_config(**{"n_layers": 3, "max_seq_len": 32, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True),
        dict(n_kv_heads=2),
        dict(n_kv_heads=1, mlp="gelu"),
    ],
)
def test_variants_run_and_overfit_one_batch(kw):
    cfg = _cfg(**kw)
    model = build_model(cfg, None, seed=0)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(tokens[:, :-1]).shape == (2, 16, 64)
    assert loss.item() < 0.5 * first


def test_backward_under_a_users_autocast():
    """Our model inside torch.autocast (bf16): the backward GEMMs run in the forward's dtype and the gradients
    land in fp32, close to an fp32 step's (found on an H200 by bench/throughput.py --precision bf16)."""
    model = build_model(_cfg(), None, seed=0)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    reference = torch.autograd.grad(cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]), params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    for grad, ref in zip(torch.autograd.grad(loss, params), reference):
        assert grad.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(grad.flatten(), ref.flatten(), dim=0) > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_matches_torch_and_keeps_one_fp32_buffer(dtype):
    """cross_entropy equals F.cross_entropy in fp32 (value and gradient), and its backward hands back the fp32
    softmax it kept, worked in place: no further logits-sized fp32 tensor (planner's loss_transient_bytes)."""
    logits = torch.randn(3, 5, 1000, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    targets = torch.randint(0, 1000, (3, 5), generator=torch.Generator().manual_seed(1))
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    (expected,) = torch.autograd.grad(reference, logits)
    loss = cross_entropy(logits, targets)
    kept = loss.grad_fn.saved_tensors[0]
    assert kept.dtype == torch.float32 and kept.shape == (15, 1000)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.equal(kept.to(dtype).view_as(grad), grad)  # the kept softmax became the gradient, in place
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_stage_slices_start_from_the_whole_models_weights():
    cfg = _cfg()
    whole = build_model(cfg, None, seed=3)
    stage = Transformer(cfg, StageSpec(1, 3, has_embedding=False, has_head=True))
    init_parameters(stage, cfg, seed=3)
    whole_params = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, whole_params[name]), name
    other_seed = build_model(cfg, None, seed=4)
    assert not torch.equal(other_seed.layers["0"].attn.wqkv.weight, whole.layers["0"].attn.wqkv.weight)


def test_tied_embeddings_share_one_tensor():
    model = build_model(_cfg(tie_embeddings=True), None, seed=0)
    assert model.output.weight is model.tok_embeddings.weight


def _params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.parametrize(
    "name,billions",
    [
        ("llama3-8b", 8.03),
        ("llama3-70b", 70.6),
        ("llama3-405b", 405.9),
        ("gpt3-175b", 174.6),
        ("llama-100b", 100.4),
        ("llama-1b", 1.24),
    ],
)
def test_published_presets_have_their_published_sizes(name, billions):
    assert abs(_params(model_from_preset(name)) / 1e9 - billions) / billions < 0.01


def test_every_preset_is_valid():
    for name in PRESETS:
        validate(Config(model=model_from_preset(name)))
    assert 25e6 < _params(model_from_preset("small")) < 35e6


@pytest.mark.parametrize("name", ["tiny", "small", "llama-1b", "gpt3-175b"])
def test_analytic_parameter_count_matches_the_module(name):
    from large_model_training.models.flops import parameter_count

    assert parameter_count(model_from_preset(name)) == _params(model_from_preset(name))
