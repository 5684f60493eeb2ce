"""Hugging Face interop of MoE models against the real `transformers`: a Mixtral imports (in each of the three
expert namings) to the same logits, ours exports to a folder MixtralForCausalLM loads with the same logits and
imports back bit for bit, and what Mixtral cannot run is refused in one line. Offline; tiny random shapes."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch

from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig
from large_model_training.errors import ConfigError
from large_model_training.models.hf import hf_config, hf_family, import_hf, shape_differences, to_hf_state
from tests.helpers import imported_logits, perturb_norms, save_hf_folder

TOKENS = torch.randint(0, 99, (2, 24), generator=torch.Generator().manual_seed(1))
SHAPE = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
)
OURS = ModelConfig(
    vocab_size=99,
    hidden_size=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden_size=64,
    max_seq_len=32,
    init_std=0.2,
    rope_theta=20000.0,
    moe_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=16,
    moe_norm_topk=True,
)


def test_transformers_mixtral_imports_to_the_same_logits_in_every_expert_naming(tmp_path, transformers):
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE, tie_word_embeddings=True)).eval()
    perturb_norms(hf)
    hf.save_pretrained(tmp_path / "saved")  # the hub's per-expert names: block_sparse_moe.experts.{e}.w1|w2|w3
    with torch.no_grad():
        expected = hf(TOKENS).logits
    doc = json.load(open(tmp_path / "saved" / "config.json"))
    fused = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # transformers 5's parameters
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    per_expert = {}
    for name, t in fused.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                per_expert[name.replace("gate_up_proj", f"{e}.w1.weight")] = t[e, :16]
                per_expert[name.replace("gate_up_proj", f"{e}.w3.weight")] = t[e, 16:]
        elif name.endswith("experts.down_proj"):
            per_expert.update((name.replace("down_proj", f"{e}.w2.weight"), t[e]) for e in range(t.shape[0]))
        else:
            per_expert[name] = t
    folders = {
        "saved": str(tmp_path / "saved"),
        "fused": save_hf_folder(tmp_path / "fused", fused, doc),
        "mlp": save_hf_folder(tmp_path / "mlp", per_expert, doc),
    }
    cfg = import_hf(folders["saved"])[0]
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.expert_ffn, cfg.moe_router, cfg.moe_norm_topk) == (
        4,
        2,
        16,
        "softmax",
        True,
    )
    assert cfg.tie_embeddings and cfg.kv_heads == 2 and cfg.moe_capacity_factor == 0
    for name, path in folders.items():
        got = imported_logits(path, TOKENS)
        assert (got - expected).abs().max() < 1e-5, name
    assert expected.std() > 0.3  # not a near-uniform output: the comparison means something


def test_our_moe_model_exports_to_transformers_and_back_exactly(tmp_path, transformers):
    model = build_model(OURS, None, seed=3).eval()
    perturb_norms(model)
    with torch.no_grad():
        expected = model(TOKENS)
    state = model.state_dict()
    out = save_hf_folder(tmp_path / "hf", to_hf_state(OURS, state), hf_config(OURS))
    assert hf_family(OURS) == "mixtral"
    theirs, info = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        got = theirs.eval()(TOKENS).logits
    assert (got - expected).abs().max() < 1e-5
    assert expected.std() > 0.3
    # And back: the same model (the dense width, unused when every block is MoE, aside) and the same tensors.
    cfg, weights = import_hf(out)
    assert shape_differences(cfg, OURS) == []
    assert dataclasses.replace(cfg, ffn_hidden_size=64, moe_ffn_hidden_size=16) == OURS
    assert sorted(weights) == sorted(n for n, _ in model.named_parameters())
    assert all(torch.equal(weights[name], state[name]) for name in weights)


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(moe_router="sigmoid"), "router is sigmoid"),
        (dict(moe_norm_topk=False), "not renormalised"),
        (dict(moe_shared_experts=1), "shared experts"),
        (dict(moe_first_dense=1), "dense too"),
        (dict(moe_every=2), "dense too"),
        (dict(mlp="gelu", norm="layernorm", position="learned"), "mlp=gelu"),
    ],
)
def test_moe_models_mixtral_cannot_run_are_refused(bad, words):
    with pytest.raises(ConfigError, match=f"no Hugging Face architecture runs this MoE model exactly: .*{words}"):
        hf_config(dataclasses.replace(OURS, **bad))


def test_a_nonzero_expert_bias_is_not_exported():
    model = build_model(OURS, None, seed=0)
    assert to_hf_state(OURS, model.state_dict())  # zero bias: fine
    model.layers["1"].mlp.router.expert_bias[2] = 0.5
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.router\.expert_bias is not zero.*route differently"):
        to_hf_state(OURS, model.state_dict())


def test_moe_folders_lmt_cannot_run_are_refused(tmp_path):
    state = build_model(OURS, None, seed=0).state_dict()
    good = save_hf_folder(tmp_path / "good", to_hf_state(OURS, state), hf_config(OURS))
    doc = json.load(open(os.path.join(good, "config.json")))
    for name, change, words in (
        ("qwen2", {"model_type": "qwen2_moe"}, r"'qwen2_moe' is not supported: .*shared_expert_gate"),
        ("window", {"sliding_window": 16}, "sliding_window 16 < max_position_embeddings"),
        ("experts", {"num_local_experts": 0}, "num_local_experts' is missing or not a positive integer"),
        ("top-k", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds num_local_experts 4"),
        (
            "wider",
            {"intermediate_size": 8},
            r"experts\.0\.w1\.weight has shape \[16, 32\], config\.json implies "
            r"\[8, 32\]",
        ),
    ):
        path = tmp_path / name
        path.mkdir()
        os.link(os.path.join(good, "model.safetensors"), path / "model.safetensors")
        (path / "config.json").write_text(json.dumps({**doc, **change}))
        with pytest.raises(ConfigError, match=words):
            import_hf(str(path))
    assert import_hf(good)[0].moe_experts == 4


def test_the_hub_config_of_mixtral_8x7b_is_our_preset():
    """mistralai/Mixtral-8x7B-v0.1's config.json (transformers 4.36's fields: rope_theta at the top level)."""
    from large_model_training.models.hf import model_config_from_hf
    from large_model_training.models.presets import PRESETS

    hub = {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    }
    preset = ModelConfig(**PRESETS["mixtral-8x7b"], preset="mixtral-8x7b")
    assert model_config_from_hf(hub, "config.json", ModelConfig(preset="mixtral-8x7b")) == preset


def test_a_missing_expert_is_named(tmp_path):
    tensors = to_hf_state(OURS, build_model(OURS, None, seed=0).state_dict())
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    path = save_hf_folder(tmp_path / "hf", tensors, hf_config(OURS))
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight missing"):
        import_hf(path)


@pytest.mark.slow
def test_export_import_and_init_from_hf_of_a_trained_moe_run(tmp_path, small_corpus, capsys, transformers):
    """`lmt export` of a trained MoE run loads in transformers with the same logits; `lmt import` reads it back;
    `lmt train --init-from-hf` starts from it (one step at a negligible learning rate exports the same tensors)."""
    from safetensors.torch import load_file

    from large_model_training.cli import Parser
    from large_model_training.config import build_config
    from large_model_training.launch import run_in_process
    from large_model_training.layout import validate
    from large_model_training.train import checkpoint, hf_cli
    from large_model_training.train.trainer import train_rank
    from tests.dist import train_together

    moe = {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_hidden_size": 32, "model.moe_norm_topk": True}
    cfg = validate(
        build_config(
            overrides={
                "data.path": small_corpus,
                "model.hidden_size": 64,
                "model.n_layers": 2,
                "model.n_heads": 4,
                "model.n_kv_heads": 2,
                "train.seq_len": 32,
                "train.micro_batch_size": 4,
                "train.steps": 3,
                "train.eval_every": 0,
                "train.lr": 1e-2,
                **moe,
            }
        )
    )
    os.makedirs(tmp_path / "run")
    run_in_process(train_rank, (cfg, str(tmp_path / "run")))
    parser = Parser(prog="lmt")
    hf_cli.add_subcommands(parser.add_subparsers(dest="command", parser_class=Parser))

    def run(*argv: str) -> int:
        args = parser.parse_args(list(argv))
        return hf_cli.COMMANDS[args.command](args)

    hf_dir = str(tmp_path / "hf")
    assert run("export", "--hf", hf_dir, str(tmp_path / "run")) == 0
    assert run("import", hf_dir, "--write-config", str(tmp_path / "model.toml")) == 0
    assert "mixtral model" in capsys.readouterr().out
    assert build_config(str(tmp_path / "model.toml")).model == import_hf(hf_dir)[0]

    ours = build_model(cfg.model, None, seed=0)
    with warnings.catch_warnings():  # DCP notes that it loads without a process group: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        checkpoint.load_checkpoint(checkpoint.resolve_checkpoint(str(tmp_path / "run")), ours)
    theirs = transformers.MixtralForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours.eval()(tokens), theirs(tokens).logits
    assert (got - expected).abs().max() < 1e-5
    assert expected.std() > 0.1  # trained weights

    train_together(
        1,
        {
            str(tmp_path / "again"): [
                "--data",
                small_corpus,
                "--seq-len",
                "24",
                "--micro-batch-size",
                "2",
                "--steps",
                "1",
                "--eval-every",
                "0",
                "--lr",
                "1e-9",
                "--init-from-hf",
                hf_dir,
            ]
        },
    )
    back = hf_cli.export_hf(str(tmp_path / "again"), str(tmp_path / "back"))
    start = load_file(os.path.join(hf_dir, "model.safetensors"))
    end = load_file(os.path.join(back, "model.safetensors"))
    assert sorted(start) == sorted(end)
    assert all((start[k] - end[k]).abs().max() < 1e-6 for k in start)


@pytest.mark.slow
def test_transformers_mixtral_imports_at_tp2_and_pp2(tmp_path, transformers):
    from tests.dist import run_ranks
    from tests.test_hf import _TOKENS, _load_at_tp2_and_pp2

    assert torch.equal(_TOKENS, TOKENS)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE)).eval()
    perturb_norms(hf)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(TOKENS).logits
    for rank in run_ranks(_load_at_tp2_and_pp2, 2, [str(tmp_path / "hf")]):
        ((logits, worst),) = rank
        assert (logits - expected).abs().max() < 1e-5
        assert worst == 0.0
