"""An attention head width set apart from the model width (model.attention_head_dim, alias --model.head_dim), as
Qwen3 has it (Qwen3-30B-A3B: hidden 2048, 32 heads of 128): the model's shapes, a training run, the parameter,
FLOP and memory counts, the tensor-parallel split by heads, Hugging Face Qwen3/Llama both ways against the real
`transformers`, and the config errors. Fast and in-process."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from types import SimpleNamespace

import pytest
import torch

from large_model_training.assembly import build_model
from large_model_training.cli import main
from large_model_training.config import ModelConfig, build_config, model_from_preset
from large_model_training.config_checks import check_fields
from large_model_training.errors import ConfigError
from large_model_training.mesh import AxisGroup
from large_model_training.models.flops import (
    attention_core_flops,
    block_gemm_shapes,
    matmul_parameters,
    parameter_count,
    training_flops_per_token,
)
from large_model_training.models.hf import hf_config, import_hf, model_config_from_hf, to_hf_state
from large_model_training.models.init import local_shard
from large_model_training.planner import memory as mem
from large_model_training.planner.shapes import kv_heads_per_rank
from tests.helpers import export_load_and_back, imported_logits, perturb_norms, save_hf_folder, train

# hidden 64, 4 heads of 32 (not 16): queries and the attention output 128 wide, keys and values 2 x 32 = 64
CFG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    attention_head_dim=32,
    ffn_hidden_size=128,
    max_seq_len=32,
)


def test_the_setting_and_its_alias_fill_head_dim():
    assert ModelConfig(hidden_size=64, n_heads=4).head_dim == 16  # 0: derived from the width
    assert CFG.head_dim == 32
    for key in ("model.head_dim", "model.attention_head_dim"):
        cfg = build_config(None, {key: "24", "model.hidden_size": "64"}).model
        assert (cfg.attention_head_dim, cfg.head_dim) == (24, 24)
    assert build_config(None, {"model.hidden_size": "64"}).model.head_dim == 16  # the width changed after the preset


def test_the_model_projects_to_heads_times_head_dim():
    model = build_model(CFG, None, seed=0)
    attn = model.layers["0"].attn
    assert tuple(attn.wqkv.weight.shape) == ((4 + 2 * 2) * 32, 64)  # q, k and v: one GEMM
    assert tuple(attn.wo.weight.shape) == (64, 4 * 32)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    assert logits.shape == (2, 16, 96)
    loss = model.loss_fn(logits, tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(qk_norm=True),
        dict(n_kv_heads=0, tie_embeddings=True),
        dict(qk_norm=True, moe_experts=4, moe_top_k=2, moe_ffn_hidden_size=32),
    ],
)
def test_parameter_and_flop_counts_follow_the_shapes(kw):
    cfg = dataclasses.replace(CFG, **kw)
    model = build_model(cfg, None, seed=0)
    params = dict(model.named_parameters())
    assert parameter_count(cfg) == sum(p.numel() for p in params.values())
    # the planner's per-rank count (tp 1, one stage holding everything) is the same number
    assert mem.stage_parameters(cfg, 1, cfg.n_layers, True, True) == sum(p.numel() for p in params.values())
    # model FLOPs: 6 per matmul parameter (each 2-D weight but the embedding lookup) + the attention square
    if not cfg.moe_experts:
        matmul = sum(p.numel() for n, p in params.items() if p.ndim == 2 and n != "tok_embeddings.weight")
        matmul += cfg.vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0  # the tied head still multiplies
        assert matmul_parameters(cfg) == matmul
        s = 16
        square = 2 * 2 * s * (cfg.n_heads * 32) * cfg.n_layers  # QK^T and AV over a*d = 128, not h = 64
        assert training_flops_per_token(cfg, s) == 6 * matmul + 3 * square
        assert attention_core_flops(cfg, s, 3, 1) == 0.5 * 2 * 2 * s * s * 4 * 32 * 3


def _tp_rank_model(cfg: ModelConfig, rank: int) -> torch.nn.Module:
    """Rank `rank` of tp=2, built and initialised in this process (no collectives are needed for that)."""
    mesh = SimpleNamespace(
        device=torch.device("cpu"), tp_size=2, tp=AxisGroup(group=None, size=2, rank=rank), ep_size=1
    )
    return build_model(cfg, mesh, seed=0)


@pytest.mark.parametrize("kv_heads", [2, 4])  # one or two whole kv groups per rank (tp > n_kv_heads: refused)
def test_tensor_parallelism_splits_heads_of_head_dim(kv_heads):
    cfg = dataclasses.replace(CFG, n_kv_heads=kv_heads, qk_norm=True)
    full = dict(build_model(cfg, None, seed=0).named_parameters())
    for rank in range(2):
        model = _tp_rank_model(cfg, rank)
        attn = model.layers["1"].attn
        kv = kv_heads // 2  # this rank's kv heads, with the query heads that read them
        assert tuple(attn.wqkv.weight.shape) == ((2 + 2 * kv) * 32, 64) and tuple(attn.wo.weight.shape) == (64, 2 * 32)
        assert attn.n_heads == 2 and attn.head_dim == 32
        modules = dict(model.named_modules())
        for name, p in model.named_parameters():  # every shard is the tp=1 model's slice (same initialisation)
            module_name, _, p_name = name.rpartition(".")
            assert torch.equal(p, local_shard(modules[module_name], p_name, full[name])), name
        # the planner's count of what one rank holds
        assert mem.stage_parameters(cfg, 2, cfg.n_layers, True, True) == sum(p.numel() for p in model.parameters())
        # and the time model's GEMMs (M tokens, N out, K in) are this rank's linears
        assert block_gemm_shapes(cfg, 10, 2, kv_heads_per_rank(cfg, 2))[:2] == [
            (10, *lin.weight.shape) for lin in (attn.wqkv, attn.wo)
        ]


def test_planner_activation_formula_matches_saved_tensor_bytes():
    from large_model_training.models.transformer import Block, rope_tables

    cfg = dataclasses.replace(
        CFG, hidden_size=128, n_heads=8, n_kv_heads=2, attention_head_dim=32, ffn_hidden_size=256
    )  # attention 256 wide at width 128
    s, b = 40, 2
    block = Block(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, rope_tables(s, cfg.head_dim, cfg.rope_theta, x.device))
    measured = sum(saved.values())
    del out
    predicted = mem.activation_bytes_per_layer(cfg, s, b, 1, False, "none", 4, fused_kernels=False)
    assert abs(measured - predicted) / measured < 0.05, (measured, predicted)


def test_a_run_with_head_dim_trains_and_the_estimate_matches_it(tmp_path, one_thread):
    from large_model_training.planner.estimate import estimate_memory
    from large_model_training.train.checkpoint import check_compatible

    # tiny (width 128, 4 heads) with heads of 64: attention 256 wide; the shape tests/test_planner.py holds the
    # estimate to with the derived width
    flags = [
        "--model",
        "tiny",
        "--model.head_dim",
        "64",
        "--model.n_kv_heads",
        "2",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "4",
        "--seq-len",
        "128",
    ]
    rows = train(str(tmp_path), *flags, "--steps", "2", "--eval-every", "0")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    with open(tmp_path / "config.toml", "rb") as f:
        written = tomllib.load(f)
    assert written["model"]["attention_head_dim"] == 64
    cfg = build_config(str(tmp_path / "config.toml"))
    assert cfg.model.head_dim == 64
    predicted = estimate_memory(cfg)
    assert predicted.model_states == pytest.approx(rows[-1]["model_state_bytes"], rel=1e-6)
    assert predicted.activations == pytest.approx(rows[-1]["activation_bytes"], rel=0.05)
    # resuming checks the width; a checkpoint saved before the setting existed holds the derived one
    ckpt = str(tmp_path / "checkpoints" / "step_2")
    check_compatible(ckpt, cfg.model)
    derived = dataclasses.replace(cfg.model, attention_head_dim=0)
    with pytest.raises(ConfigError, match="attention_head_dim: checkpoint 64 vs run 0"):
        check_compatible(ckpt, derived)
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    del meta["model"]["attention_head_dim"]
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)
    check_compatible(ckpt, derived)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--model.head_dim", "-2"], "model.attention_head_dim must be >= 0, got -2"),
        (["--model.head_dim", "7"], "rope needs an even head_dim, got 7 (model.attention_head_dim)"),
        (["--model.attention_head_dim", "x"], "model.attention_head_dim must be an integer"),
        (["--model.hidden_size", "66"], "must be divisible by model.n_heads (4), or model.attention_head_dim set"),
    ],
)
def test_a_bad_head_dim_is_one_config_error_line(flags, words, capsys, tmp_path):
    code = main(["train", "--out", str(tmp_path), *flags, "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("lmt: error: "), err


def test_a_width_that_heads_do_not_divide_is_fine_with_head_dim():
    cfg = build_config(None, {"model.hidden_size": "66", "model.head_dim": "16"})
    check_fields(cfg)
    model = build_model(cfg.model, None, seed=0)
    assert parameter_count(cfg.model) == sum(p.numel() for p in model.parameters())


# ---- Hugging Face ----------------------------------------------------------------------------------------------

TOKENS = torch.randint(0, 99, (2, 24), generator=torch.Generator().manual_seed(1))
# 4 heads of 16 at width 32: twice hidden_size / num_attention_heads
SHAPE = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)
OURS = ModelConfig(
    vocab_size=99,
    hidden_size=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    attention_head_dim=16,
    ffn_hidden_size=48,
    max_seq_len=32,
    init_std=0.2,
    rope_theta=20000.0,
    norm_eps=1e-6,
    qk_norm=True,
)


@pytest.mark.parametrize("family", ["Qwen3", "Llama"])
def test_transformers_models_with_wide_heads_import_to_the_same_logits(tmp_path, transformers, family):
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, f"{family}Config")(**SHAPE, num_hidden_layers=2)
    hf = getattr(transformers, f"{family}ForCausalLM")(hf_cfg).eval()
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (64, 32)
    perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        want = hf(TOKENS).logits
    cfg = import_hf(str(tmp_path))[0]
    assert (cfg.attention_head_dim, cfg.head_dim, cfg.qk_norm) == (16, 16, family == "Qwen3")
    assert (imported_logits(str(tmp_path), TOKENS) - want).abs().max() < 1e-5
    assert want.std() > 0.3


@pytest.mark.parametrize("moe", [False, True])
def test_our_wide_head_qwen3_exports_to_transformers_and_back_exactly(tmp_path, transformers, moe):
    cfg = dataclasses.replace(OURS, moe_experts=4, moe_top_k=2, moe_ffn_hidden_size=16) if moe else OURS
    cls = "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"
    doc = export_load_and_back(tmp_path / "hf", transformers, cfg, cls, TOKENS)
    assert doc["head_dim"] == 16 and doc["model_type"] == ("qwen3_moe" if moe else "qwen3")


def test_import_reads_the_head_dim_the_folder_has(tmp_path):
    good = save_hf_folder(
        tmp_path / "good", to_hf_state(OURS, build_model(OURS, None, seed=0).state_dict()), hf_config(OURS)
    )
    doc = json.load(open(os.path.join(good, "config.json")))
    derived = {**doc, "head_dim": 8}  # hidden_size / heads: stored as 0, the derived width
    assert model_config_from_hf(derived, "config.json").attention_head_dim == 0
    assert model_config_from_hf({k: v for k, v in doc.items() if k != "head_dim"}, "c").head_dim == 128  # Qwen3's
    llama = {**doc, "model_type": "llama"}
    assert model_config_from_hf({k: v for k, v in llama.items() if k != "head_dim"}, "c").head_dim == 8
    for change, words in (
        (
            {"head_dim": 8},
            r"self_attn.q_proj.weight has shape \[64, 32\], config.json implies "
            r"\[32, 32\]",
        ),
        ({"head_dim": 15}, "head_dim 15 is odd"),
        ({"head_dim": -16}, "'head_dim' is missing or not a positive integer"),
    ):
        path = tmp_path / str(change["head_dim"])
        path.mkdir()
        os.link(os.path.join(good, "model.safetensors"), path / "model.safetensors")
        (path / "config.json").write_text(json.dumps({**doc, **change}))
        with pytest.raises(ConfigError, match=words):
            import_hf(str(path))
    gpt2 = ModelConfig(mlp="gelu", norm="layernorm", position="learned", attention_head_dim=64)  # 4 x 64 at 128
    with pytest.raises(ConfigError, match="GPT-2's heads are hidden_size / n_heads wide: cannot export head_dim 64"):
        hf_config(gpt2)


def test_the_qwen3_30b_a3b_preset_is_the_hub_config():
    from tests.test_hf_qwen3 import QWEN3_30B_A3B

    hub = model_config_from_hf(QWEN3_30B_A3B, "config.json")
    preset = model_from_preset("qwen3-30b-a3b")
    assert hub.head_dim == preset.head_dim == 128
    assert parameter_count(hub) == parameter_count(preset)
    assert round(parameter_count(preset) / 1e9, 1) == 30.5 and 3.3 < parameter_count(preset, True) / 1e9 < 3.4
