"""Hugging Face interop against the real `transformers`: export gives the same logits, import loads at any tp x pp,
bad folders are refused naming the file. Offline: nothing is ever downloaded."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from large_model_training.assembly import build_model
from large_model_training.cli import main
from large_model_training.config import ModelConfig, build_config
from large_model_training.errors import ConfigError
from large_model_training.launch import run_in_process
from large_model_training.layout import validate
from large_model_training.models.hf import hf_family, import_hf, load_hf_into_model, to_hf_state
from large_model_training.train import checkpoint
from large_model_training.train.hf_cli import export_hf
from large_model_training.train.trainer import train_rank
from tests.dist import run_ranks, train_together
from tests.helpers import model_config

GPT_FAMILY = {"model.mlp": "gelu", "model.norm": "layernorm", "model.position": "learned", "model.tie_embeddings": True}
FAMILIES = {"llama": ({"model.n_kv_heads": 2}, "LlamaForCausalLM"), "gpt2": (GPT_FAMILY, "GPT2LMHeadModel")}


def _trained_run(run_dir: str, corpus: str, family: dict) -> str:
    cfg = validate(
        build_config(
            overrides={
                "data.path": corpus,
                "model.hidden_size": 64,
                "model.n_layers": 2,
                "model.n_heads": 4,
                "model.ffn_hidden_size": 128,
                "train.seq_len": 32,
                "train.micro_batch_size": 4,
                "train.steps": 3,
                "train.eval_every": 0,
                "train.lr": 1e-2,
                **family,
            }
        )
    )
    os.makedirs(run_dir, exist_ok=True)
    run_in_process(train_rank, (cfg, run_dir))
    return checkpoint.resolve_checkpoint(run_dir)


def _our_model(ckpt: str) -> torch.nn.Module:
    model = build_model(ModelConfig(**checkpoint.read_meta(ckpt)["model"]), None, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        checkpoint.load_checkpoint(ckpt, model)
    return model.eval()


def _from_pretrained(transformers, cls_name: str, path: str) -> torch.nn.Module:
    model, info = getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_model_exports_to_the_same_transformers_logits(tmp_path, small_corpus, family, transformers):
    overrides, cls_name = FAMILIES[family]
    ckpt = _trained_run(str(tmp_path / "run"), small_corpus, overrides)
    out = export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [cls_name]
    ours, theirs = _our_model(ckpt), _from_pretrained(transformers, cls_name, out)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    assert (got - expected).abs().max() < 1e-4
    assert expected.std() > 0.1  # trained weights, not a near-uniform start: the comparison means something
    # And back: importing the export gives the checkpoint's model and weights, bit for bit.
    cfg, weights = import_hf(out)
    assert cfg == ours.cfg
    state = ours.state_dict()
    assert all(torch.equal(weights[name], state[name]) for name in weights)


def _hf_llama(transformers, path: str, **kw) -> torch.Tensor:
    """Save a random transformers Llama to path; return its logits on fixed tokens."""
    shape = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=20000.0,
        initializer_range=0.2,
    )
    config = transformers.LlamaConfig(**{**shape, **kw})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at one: move them so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    assert not any(f.endswith(".bin") for f in os.listdir(path))
    with torch.no_grad():
        return model(_TOKENS).logits


_TOKENS = torch.randint(0, 99, (2, 24), generator=torch.Generator().manual_seed(1))


def _load_at_tp2_and_pp2(paths: list[str]) -> list[tuple[torch.Tensor, float]]:
    """On each of 2 ranks, per folder: logits of the tp=2 model (vocab shards gathered), and the worst
    difference between a pp=2 stage's parameters and the imported full tensors."""
    import torch.distributed as dist

    from large_model_training.mesh import ParallelMesh
    from large_model_training.models.transformer import StageSpec

    tp_mesh, pp_mesh = ParallelMesh.for_this_rank(1, 1, 2), ParallelMesh.for_this_rank(2, 1, 1)
    results = []
    for path in paths:
        cfg, weights = import_hf(path)
        model = build_model(cfg, tp_mesh, seed=1)
        load_hf_into_model(model, weights)
        with torch.no_grad():
            local = model(_TOKENS)
        shards = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(shards, local, group=tp_mesh.tp_group)
        logits = torch.cat(shards, dim=-1)[..., : cfg.vocab_size]
        stage = StageSpec(0, 1, True, False) if pp_mesh.pp_rank == 0 else StageSpec(1, 2, False, True)
        part = build_model(cfg, pp_mesh, seed=1, stage=stage)
        load_hf_into_model(part, weights)
        worst = 0.0
        for name, p in part.named_parameters():
            full = weights["tok_embeddings.weight" if cfg.tie_embeddings and name == "output.weight" else name]
            worst = max(worst, float((p - full).abs().max()))
        results.append((logits, worst))
    return results


@pytest.mark.slow
def test_transformers_llama_imports_at_tp2_and_pp2(tmp_path, transformers):
    # (one kv head at tp2 is refused: the fused wqkv keeps each rank's kv heads whole, models/fused.py)
    folders = {"gqa": dict(num_key_value_heads=2), "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True)}
    expected = {name: _hf_llama(transformers, str(tmp_path / name), **kw) for name, kw in folders.items()}
    ranks = run_ranks(_load_at_tp2_and_pp2, 2, [str(tmp_path / name) for name in folders])
    for rank in ranks:
        for (logits, worst), name in zip(rank, folders):
            assert (logits - expected[name]).abs().max() < 1e-4, name
            assert worst == 0.0, name


def test_refuses_models_no_transformers_architecture_runs_exactly():
    assert hf_family(model_config(n_layers=1)) == "llama"
    for bad, words in (
        (dict(mlp="gelu"), "no Hugging Face architecture"),
        (dict(mlp="gelu", norm="layernorm", position="learned", n_kv_heads=2), "grouped-query"),
    ):
        with pytest.raises(ConfigError, match=words):
            hf_family(model_config(n_layers=1, **bad))


def _write_llama(path, cfg: ModelConfig) -> None:
    from safetensors.torch import save_file

    from large_model_training.models.hf import hf_config

    os.makedirs(path, exist_ok=True)
    save_file(to_hf_state(cfg, build_model(cfg, None, seed=0).state_dict()), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f)


def test_bad_folders_are_refused_naming_the_file(tmp_path):
    cfg = model_config(n_layers=1)
    good = tmp_path / "good"
    _write_llama(good, cfg)
    assert import_hf(str(good))[0] == cfg

    truncated = tmp_path / "truncated"
    _write_llama(truncated, cfg)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=f"unreadable safetensors file {weights}"):
        import_hf(str(truncated))

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((good / "config.json").read_text())
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin: only safetensors weights are accepted"):
        import_hf(str(pickled))

    wrong = tmp_path / "wrong"
    _write_llama(wrong, cfg)
    doc = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**doc, "intermediate_size": 32}))
    with pytest.raises(
        ConfigError,
        match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.gate_proj\.weight has "
        r"shape \[64, 32\], config\.json implies \[32, 32\]",
    ):
        import_hf(str(wrong))
    (wrong / "config.json").write_text(json.dumps({**doc, "model_type": "mistral"}))
    with pytest.raises(ConfigError, match="model_type 'mistral' is not supported"):
        import_hf(str(wrong))

    model = build_model(ModelConfig(**{**cfg.__dict__, "n_layers": 2}), None, seed=0)
    with pytest.raises(ConfigError, match="different model"):
        load_hf_into_model(model, import_hf(str(good))[1])


@pytest.mark.slow
def test_export_and_import_commands(tmp_path, small_corpus, capsys):
    from large_model_training.cli import Parser
    from large_model_training.train import hf_cli

    _trained_run(str(tmp_path / "run"), small_corpus, {})
    parser = Parser(prog="lmt")
    hf_cli.add_subcommands(parser.add_subparsers(dest="command", parser_class=Parser))

    def run(*argv: str) -> int:
        args = parser.parse_args(list(argv))
        return hf_cli.COMMANDS[args.command](args)

    assert run("export", "--hf", str(tmp_path / "hf"), str(tmp_path / "run"), "--dtype", "bfloat16") == 0
    assert run("import", str(tmp_path / "hf"), "--write-config", str(tmp_path / "model.toml")) == 0
    assert "llama model" in capsys.readouterr().out
    cfg = build_config(str(tmp_path / "model.toml"))
    assert cfg.model == import_hf(str(tmp_path / "hf"))[0]
    with pytest.raises(ConfigError, match="no checkpoint found"):
        run("export", "--hf", str(tmp_path / "x"), str(tmp_path))


@pytest.mark.slow
def test_train_init_from_hf(tmp_path, small_corpus, transformers, capsys):
    """lmt train --init-from-hf at tp=2 starts from the folder's weights: after one step at a negligible learning
    rate, exporting the run gives the folder's tensors back."""
    from safetensors.torch import load_file

    hf_dir = str(tmp_path / "hf")
    _hf_llama(transformers, hf_dir, vocab_size=256, num_key_value_heads=2, tie_word_embeddings=True)
    common = [
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
        "--init-from-hf",
        hf_dir,
    ]
    train_together(2, {str(tmp_path / "run"): [*common, "--tp", "2", "--lr", "1e-9"]})  # on the pooled ranks
    back = export_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    start = load_file(os.path.join(hf_dir, "model.safetensors"))
    end = load_file(os.path.join(back, "model.safetensors"))
    assert sorted(start) == sorted(end)
    assert all((start[k] - end[k]).abs().max() < 1e-6 for k in start)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "bad"), *common, "--model.hidden_size", "64"]) == 2
    assert "--model.hidden_size 64 contradicts" in capsys.readouterr().err
