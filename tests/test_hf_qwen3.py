"""Hugging Face interop of Qwen3 and Qwen3-MoE (qk_norm) against the real `transformers`: their models import to
the same logits, ours export to folders they load with the same logits and import back bit for bit, and what lmt
cannot run is refused in one line. Offline; tiny random shapes."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.hf import hf_config, hf_family, import_hf, to_hf_state
from tests.helpers import export_load_and_back, imported_logits, perturb_norms, save_hf_folder

TOKENS = torch.randint(0, 99, (2, 24), generator=torch.Generator().manual_seed(1))
# head_dim 8 = hidden_size / heads (tests/test_head_dim.py: heads wider than that, as the hub's Qwen3 have them).
SHAPE = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
OURS = ModelConfig(
    vocab_size=99,
    hidden_size=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden_size=48,
    max_seq_len=32,
    init_std=0.2,
    rope_theta=20000.0,
    norm_eps=1e-6,
    qk_norm=True,
    moe_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=16,
    moe_first_dense=1,
    moe_every=2,
)


@pytest.mark.parametrize(
    "layers, expected",
    [
        (dict(num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=False), (1, 1, False)),
        (dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=True), (1, 2, True)),
    ],
)
def test_transformers_qwen3_moe_imports_to_the_same_logits(tmp_path, transformers, layers, expected):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE, **MOE, **layers)).eval()
    perturb_norms(hf)
    hf.save_pretrained(tmp_path / "saved")
    with torch.no_grad():
        want = hf(TOKENS).logits
    doc = json.load(open(tmp_path / "saved" / "config.json"))
    folders = {"saved": str(tmp_path / "saved"), "fused": save_hf_folder(tmp_path / "fused", hf.state_dict(), doc)}
    cfg = import_hf(folders["saved"])[0]
    assert (cfg.moe_first_dense, cfg.moe_every, cfg.moe_norm_topk) == expected
    assert cfg.qk_norm and (cfg.moe_experts, cfg.moe_top_k, cfg.expert_ffn, cfg.ffn_hidden_size) == (4, 2, 16, 48)
    for name, path in folders.items():
        assert (imported_logits(path, TOKENS) - want).abs().max() < 1e-5, name
    assert want.std() > 0.3  # not a near-uniform output: the comparison means something


def test_our_qwen3_moe_model_exports_to_transformers_and_back_exactly(tmp_path, transformers):
    assert hf_family(OURS) == "qwen3_moe"
    export_load_and_back(tmp_path / "hf", transformers, OURS, "Qwen3MoeForCausalLM", TOKENS)


def test_our_dense_qk_norm_model_is_a_qwen3_both_ways(tmp_path, transformers):
    dense = dataclasses.replace(
        OURS, n_layers=2, moe_experts=0, moe_ffn_hidden_size=0, moe_first_dense=0, moe_every=1, tie_embeddings=True
    )
    assert hf_family(dense) == "qwen3"
    export_load_and_back(tmp_path / "out" / "hf", transformers, dense, "Qwen3ForCausalLM", TOKENS)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, num_hidden_layers=2)).eval()
    perturb_norms(hf)
    hf.save_pretrained(tmp_path / "in")
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert (imported_logits(str(tmp_path / "in"), TOKENS) - want).abs().max() < 1e-5


def test_qwen3_folders_lmt_cannot_run_are_refused(tmp_path):
    state = build_model(OURS, None, seed=0).state_dict()
    good = save_hf_folder(tmp_path / "good", to_hf_state(OURS, state), hf_config(OURS))
    doc = json.load(open(os.path.join(good, "config.json")))
    for name, change, words in (
        ("window", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window 16 < max_position"),
        ("head-dim", {"head_dim": 16}, r"q_proj.weight has shape \[32, 32\], config.json implies \[64, 32\]"),
        ("no-experts", {"decoder_sparse_step": 5, "mlp_only_layers": []}, "no block has experts"),
        ("pattern", {"mlp_only_layers": [2]}, r"MoE blocks \[0, 1, 3\] are not every k-th"),
        ("bad-dense-list", {"mlp_only_layers": 2}, "'mlp_only_layers' is not a list of block indices"),
        ("bad-window", {"use_sliding_window": True, "sliding_window": "16"}, "'sliding_window' is not an int"),
        (
            "bad-window-layers",
            {"model_type": "qwen3", "use_sliding_window": True, "max_window_layers": None, "sliding_window": 16},
            "'max_window_layers' is not an integer",
        ),
    ):
        path = tmp_path / name
        path.mkdir()
        os.link(os.path.join(good, "model.safetensors"), path / "model.safetensors")
        (path / "config.json").write_text(
            json.dumps({k: v for k, v in {**doc, **change}.items() if v is not None or k == "max_window_layers"})
        )
        with pytest.raises(ConfigError, match=words):
            import_hf(str(path))
    assert import_hf(good)[0] == OURS


# Qwen/Qwen3-30B-A3B's config.json: head_dim 128 at width 2048 and 32 heads.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_the_hub_qwen3_30b_a3b_imports_with_its_heads_of_128():
    """Its 32 heads of 128 at width 2048 (attention 4096 wide) are model.attention_head_dim; the rest as before."""
    from large_model_training.models.hf import model_config_from_hf

    cfg = model_config_from_hf(QWEN3_30B_A3B, "config.json")
    assert (cfg.attention_head_dim, cfg.head_dim, cfg.n_heads, cfg.kv_heads) == (128, 128, 32, 4)
    assert cfg.qk_norm and cfg.moe_norm_topk and (cfg.moe_experts, cfg.moe_top_k, cfg.moe_layers) == (128, 8, 48)
    assert hf_config(cfg)["head_dim"] == 128


def test_qk_norm_outside_the_llama_family_is_not_exported():
    gpt = ModelConfig(mlp="gelu", norm="layernorm", position="learned", qk_norm=True)
    with pytest.raises(ConfigError, match="qk_norm runs in Hugging Face's Qwen3 only"):
        hf_config(gpt)
    with pytest.raises(ConfigError, match="MoE model exactly: its router is sigmoid"):
        hf_config(dataclasses.replace(OURS, moe_router="sigmoid"))


@pytest.mark.slow
def test_transformers_qwen3_moe_imports_at_tp2_and_pp2(tmp_path, transformers):
    from tests.dist import run_ranks
    from tests.test_hf import _TOKENS, _load_at_tp2_and_pp2

    assert torch.equal(_TOKENS, TOKENS)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SHAPE, **MOE, num_hidden_layers=2, mlp_only_layers=[0])
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    perturb_norms(hf)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
    for rank in run_ranks(_load_at_tp2_and_pp2, 2, [str(tmp_path / "hf")]):
        ((logits, worst),) = rank
        assert (logits - want).abs().max() < 1e-5
        assert worst == 0.0


def test_an_expert_stack_opens_its_shard_once(tmp_path, monkeypatch):
    """Reading one MoE parameter (E experts' tensors, one file) opens that safetensors file once, not E times."""
    import safetensors

    state = build_model(OURS, None, seed=0).state_dict()
    out = save_hf_folder(tmp_path / "hf", to_hf_state(OURS, state), hf_config(OURS))
    _, weights = import_hf(out)
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    assert torch.equal(weights["layers.1.mlp.experts.w_gate"], state["layers.1.mlp.experts.w_gate"])
    assert len(opened) == 1
