"""DeepSeek-V3 against the real `transformers` (models/hf_deepseek.py): a DeepseekV3ForCausalLM (MLA, a dense
first block, group-limited sigmoid routing with a nonzero e_score_correction_bias, shared experts) imports to
the same logits; ours exports to a folder transformers loads with the same logits and imports back bit for bit;
what lmt cannot run is refused in one line. Offline; tiny random shapes, fp32."""

from __future__ import annotations

import json

import pytest
import torch

from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.hf import hf_config, hf_family, import_hf, shape_differences, to_hf_state
from tests.helpers import imported_logits, perturb_norms, save_hf_folder

TOKENS = torch.randint(0, 99, (2, 20), generator=torch.Generator().manual_seed(2))
SHAPE = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    tie_word_embeddings=False,
    rope_scaling=None,
    rope_interleave=True,
)
OURS = ModelConfig(
    vocab_size=99,
    hidden_size=32,
    n_layers=3,
    n_heads=4,
    ffn_hidden_size=48,
    max_seq_len=32,
    norm_eps=1e-6,
    init_std=0.2,
    attention="mla",
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    moe_experts=8,
    moe_top_k=2,
    moe_ffn_hidden_size=16,
    moe_shared_experts=1,
    moe_first_dense=1,
    moe_router="sigmoid",
    moe_norm_topk=True,
    moe_groups=4,
    moe_topk_groups=2,
    moe_routed_scale=2.5,
)


def _deepseek(transformers):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).eval()
    with torch.no_grad():
        for name, t in hf.named_parameters():
            if "experts" in name or "gate" in name:
                t.normal_(0.0, 0.2)  # transformers initialises the router and experts to zero-ish values
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    perturb_norms(hf)
    return hf


def test_transformers_deepseek_v3_imports_to_the_same_logits(tmp_path, transformers):
    hf = _deepseek(transformers)
    hf.save_pretrained(tmp_path / "saved")
    with torch.no_grad():
        expected = hf(TOKENS).logits
    cfg = import_hf(str(tmp_path / "saved"))[0]
    assert shape_differences(cfg, OURS) == []
    assert (cfg.attention, cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_routed_scale) == ("mla", 4, 2, 2.5)
    got = imported_logits(str(tmp_path / "saved"), TOKENS)
    assert (got - expected).abs().max() < 1e-5
    assert expected.std() > 0.3  # not a near-uniform output: the comparison means something
    # transformers 5's in-memory (fused) expert tensors read the same
    fused = save_hf_folder(tmp_path / "fused", hf.state_dict(), json.load(open(tmp_path / "saved" / "config.json")))
    assert (imported_logits(fused, TOKENS) - expected).abs().max() < 1e-5


def test_our_deepseek_model_exports_to_transformers_and_back_exactly(tmp_path, transformers):
    model = build_model(OURS, None, seed=3).eval()
    perturb_norms(model)
    with torch.no_grad():
        for layer in list(model.layers.values())[1:]:
            layer.mlp.router.expert_bias.copy_(torch.linspace(0.2, -0.2, 8))  # the bias chooses: it must travel
        expected = model(TOKENS)
    state = model.state_dict()
    assert hf_family(OURS) == "deepseek_v3"
    out = save_hf_folder(tmp_path / "hf", to_hf_state(OURS, state), hf_config(OURS))
    theirs, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        got = theirs.eval()(TOKENS).logits
    assert (got - expected).abs().max() < 1e-5 and expected.std() > 0.3
    cfg, weights = import_hf(out)
    assert shape_differences(cfg, OURS) == []
    assert all(torch.equal(weights[name], state[name]) for name in weights)
    assert all(
        torch.equal(weights[f"layers.{i}.mlp.router.expert_bias"], state[f"layers.{i}.mlp.router.expert_bias"])
        for i in (1, 2)
    )


@pytest.mark.parametrize(
    "change, says",
    [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}},
            "is not plain rope",
        ),
        ({"rope_interleave": False}, "rope_interleave is false"),
        ({"q_lora_rank": None}, "q_lora_rank is null"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
    ],
)
def test_deepseek_folders_lmt_cannot_run_are_refused(tmp_path, change, says):
    doc = {"model_type": "deepseek_v3", "hidden_act": "silu", **SHAPE, **change}
    doc["rope_parameters"] = change.get("rope_scaling") or {"rope_type": "default", "rope_theta": 10000.0}
    path = save_hf_folder(tmp_path / "bad", {}, doc)
    with pytest.raises(ConfigError, match=None) as info:
        import_hf(path)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_mla_models_deepseek_v3_cannot_run_are_refused():
    import dataclasses

    with pytest.raises(ConfigError, match="transformers normalises MLA's latents"):
        hf_config(dataclasses.replace(OURS, norm_eps=1e-5))
    with pytest.raises(ConfigError, match="not DeepSeek-V3's"):
        hf_config(dataclasses.replace(OURS, moe_router="softmax"))
