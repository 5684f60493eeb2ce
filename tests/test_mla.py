"""Multi-head latent attention (models/transformer.py's LatentAttention, DeepSeek-V2/V3) against a
straightforward implementation of the paper's equations (values and gradients, fp32), its parameter and FLOP
counts, a short training run and the config's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from large_model_training.config import ModelConfig, build_config
from large_model_training.config_checks import check_fields
from large_model_training.errors import ConfigError
from large_model_training.models.flops import attention_parameters, parameter_count
from large_model_training.models.init import init_parameters
from large_model_training.models.transformer import LatentAttention, Transformer, rope_tables
from large_model_training.planner.estimate import estimate_memory
from tests.helpers import RUN_FLAGS, model_flags

MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def mla_config(**changes) -> ModelConfig:
    return ModelConfig(
        **{
            **dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, ffn_hidden_size=64, max_seq_len=64),
            **MLA,
            **changes,
        }
    )


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex rotations of the pairs (x[2i], x[2i+1]) by position p times theta^(-2i/d)."""
    seq, d = x.shape[1], x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(seq, d // 2, dtype=torch.float64), torch.arange(seq)[:, None] * freq)
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * turn[None, :, None, :]).flatten(-2).to(x.dtype)


def reference(attn: LatentAttention, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """The DeepSeek-V2 report's equations, head by head, from the module's weights sliced into W^DQ, W^UQ, W^QR,
    W^DKV, W^KR, W^UK, W^UV, W^O."""
    a, dn, dr, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    batch, seq, _ = x.shape
    c_q = rms(x @ attn.wq_a.weight.t(), attn.q_norm.weight, cfg.norm_eps)
    w_q = attn.wq_b.weight.view(a, dn + dr, -1)
    w_uq, w_qr = w_q[:, :dn], w_q[:, dn:]
    down = attn.wkv_a.weight
    w_dkv, w_kr = down[: cfg.kv_lora_rank], down[cfg.kv_lora_rank :]
    c_kv = rms(x @ w_dkv.t(), attn.kv_norm.weight, cfg.norm_eps)
    k_r = rotate((x @ w_kr.t()).unsqueeze(2), cfg.rope_theta)  # (b, s, 1, dr): one rotary key for all heads
    w_kv = attn.wkv_b.weight.view(a, dn + dv, -1)
    w_uk, w_uv = w_kv[:, :dn], w_kv[:, dn:]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    heads = []
    for i in range(a):
        q_c, q_r = c_q @ w_uq[i].t(), rotate((c_q @ w_qr[i].t()).unsqueeze(2), cfg.rope_theta).squeeze(2)
        k_c, v_c = c_kv @ w_uk[i].t(), c_kv @ w_uv[i].t()
        q, k = torch.cat((q_c, q_r), -1), torch.cat((k_c, k_r.squeeze(2)), -1)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(dn + dr)
        heads.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v_c)
    return torch.cat(heads, -1) @ attn.wo.weight.t()


def test_latent_attention_equals_the_papers_equations_in_values_and_gradients():
    cfg = mla_config()
    torch.manual_seed(0)
    attn = LatentAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 10, 32, requires_grad=True)
    ours = attn(x, rope_tables(10, cfg.rope_dim, cfg.rope_theta, x.device))
    weight = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weight).sum(), [x, *attn.parameters()])
    x_ref = x.detach().clone().requires_grad_()
    expected = reference(attn, cfg, x_ref)
    expected_grads = torch.autograd.grad((expected * weight).sum(), [x_ref, *attn.parameters()])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    for (name, _), got, want in zip([("x", None), *attn.named_parameters()], grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_parameter_counts_match_the_modules_and_deepseek_v3s_attention():
    cfg = mla_config()
    model = Transformer(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    v3 = ModelConfig(
        hidden_size=7168,
        n_heads=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )
    # DeepSeek-V3's attention per layer (its safetensors): q_a 7168x1536, q_b 1536x(128x192), kv_a 7168x576,
    # kv_b 512x(128x256), o (128x128)x7168: 187,105,280 weights
    assert attention_parameters(v3) == 187_105_280


@pytest.mark.slow
def test_a_small_mla_model_trains(tmp_path):
    from tests.helpers import train

    flags = [f"--model.{k}={v}" for k, v in MLA.items()]
    rows = train(
        str(tmp_path),
        "--model",
        "tiny",
        *flags,
        "--steps",
        "12",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "4",
        "--eval-every",
        "0",
    )
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    cfg = build_config(str(tmp_path / "config.toml"))  # lmt estimate's figures for this very run
    predicted = estimate_memory(cfg)
    assert predicted.model_states == pytest.approx(rows[-1]["model_state_bytes"], rel=1e-6)
    assert predicted.activations == pytest.approx(rows[-1]["activation_bytes"], rel=0.05)


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"model.attention": "mha"}, "model.attention must be one of"),
        (
            {**{f"model.{k}": v for k, v in MLA.items()}, "model.kv_lora_rank": 0},
            "model.kv_lora_rank (with model.attention mla) must be positive",
        ),
        ({**{f"model.{k}": v for k, v in MLA.items()}, "model.qk_rope_head_dim": 5}, "must be even"),
        ({**{f"model.{k}": v for k, v in MLA.items()}, "model.position": "learned"}, "needs model.position rope"),
    ],
)
def test_bad_mla_fields_are_one_line_errors(changes, says):
    with pytest.raises(ConfigError) as info:
        check_fields(build_config(overrides=changes))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_init_draws_every_mla_weight_and_sets_the_latent_norms_to_one():
    cfg = mla_config()
    model = Transformer(cfg)
    init_parameters(model, cfg, seed=3)
    attn = model.layers["0"].attn
    assert torch.equal(attn.q_norm.weight, torch.ones(24)) and torch.equal(attn.kv_norm.weight, torch.ones(16))
    assert all(0.01 < float(w.detach().std()) < 0.03 for w in (attn.wq_a.weight, attn.wq_b.weight, attn.wkv_b.weight))


MLA_FLAGS = [*model_flags(**MLA), "--seq-len", "32", *RUN_FLAGS]
LAYOUTS = {
    "tp2": ["--tp", "2"],
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2"],
    "cp2": ["--cp", "2"],
    "cp2-allgather": ["--cp", "2", "--parallel.cp_attention", "allgather"],
    "dp2-zero3": ["--dp", "2", "--zero", "3"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    from tests.helpers import Runs

    common = [*MLA_FLAGS, "--data", small_corpus]
    return Runs(tmp_path_factory.mktemp("mla"), {"ref": common, **{n: [*common, *a] for n, a in LAYOUTS.items()}})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_trains_the_one_rank_mla_curve(runs, name):
    from tests.helpers import assert_close_curves, losses

    assert_close_curves(losses(runs[name]), losses(runs["ref"]), rtol=1e-5, what=f"mla {name}")


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planners_mla_activation_terms_match_the_saved_tensor_bytes(dtype, recompute):
    """One MLA block on the CPU (composite RMSNorm, SDPA's math path), fp32 and bf16: the bytes autograd saves
    against `layer_activation_terms` (planner/activations.py); selective: the core's checkpoint keeps q, k and v
    as MLA shapes them (nope + rope wide in every head, v v_head_dim wide)."""
    import functools

    from large_model_training.memory.accounting import ActivationCounter
    from large_model_training.memory.recompute import checkpointed
    from large_model_training.models.transformer import Block
    from large_model_training.planner.activations import activation_bytes_per_layer

    cfg = mla_config(hidden_size=64)
    block = Block(cfg).train().to(dtype)  # bf16: the trainer's bf16 compute copy of the weights
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if recompute == "selective":  # as memory/recompute.py's policy wraps each block's core
        block.attn.core = functools.partial(checkpointed, type(block.attn).core.__get__(block.attn))
    s, b = 24, 2
    x = torch.randn(b, s, cfg.hidden_size, requires_grad=True, dtype=dtype)
    counter = ActivationCounter().exclude_parameters(block)
    with counter.counting():
        out = block(x, rope_tables(s, cfg.rope_dim, cfg.rope_theta, x.device))
    measured = counter.current
    del out
    predicted = activation_bytes_per_layer(
        cfg, s, b, 1, False, recompute, 2 if dtype == torch.bfloat16 else 4, fused_kernels=False
    )
    assert abs(measured - predicted) / measured < 0.05, (measured, predicted)


@pytest.mark.slow
def test_fp8_mla_saves_what_the_planner_says(tmp_path):
    """fp8 tensorwise on MLA: of the attention only wq_b keeps a float8 input (models/float8.py)."""
    from large_model_training.planner.activations import float8_input_saving
    from tests.helpers import train

    dims = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}
    flags = [
        "--model",
        "tiny",
        "--model.attention",
        "mla",
        *[f"--model.{k}={v}" for k, v in dims.items()],
        "--model.hidden_size",
        "64",
        "--model.ffn_hidden_size",
        "128",
        "--model.n_layers",
        "2",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--steps",
        "1",
        "--eval-every",
        "0",
    ]
    bf16 = train(str(tmp_path / "bf16"), *flags, "--precision", "bf16")[0]["activation_bytes"]
    fp8 = train(str(tmp_path / "fp8"), *flags, "--precision", "fp8")[0]["activation_bytes"]
    cfg = build_config(str(tmp_path / "fp8" / "config.toml")).model
    assert bf16 - fp8 == cfg.n_layers * float8_input_saving(cfg, 32, 2, 1, False, 2) > 0


def test_hugging_face_export_refuses_an_mla_model_deepseek_v3_cannot_run():
    from large_model_training.models.hf import hf_config

    with pytest.raises(ConfigError, match="norm_eps 1e-05"):  # tests/test_hf_deepseek.py exports the others
        hf_config(mla_config())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_selective_mla_blocks_backward_peaks_at_the_planners_transient(dtype):
    """Selective recompute on the CPU's math path: the core rebuilt in backward, then its backward holds the
    probabilities, their gradient and the scores' (three fp32 s x s per head; MLA without dropout saves one).
    At 256 tokens the s x s terms dominate what else backward allocates (weight gradients, dx)."""
    import functools

    from large_model_training.memory.recompute import checkpointed
    from large_model_training.memory.tracker import AllocationTracker
    from large_model_training.models.transformer import Block
    from large_model_training.planner.activations import recompute_transient_bytes

    cfg, s = mla_config(hidden_size=64), 256
    block = Block(cfg).train().to(dtype)
    block.attn.core = functools.partial(checkpointed, type(block.attn).core.__get__(block.attn))
    x = torch.randn(2, s, cfg.hidden_size, requires_grad=True, dtype=dtype)
    tracker = AllocationTracker()
    with tracker:
        out = block(x, rope_tables(s, cfg.rope_dim, cfg.rope_theta, x.device))
        start = tracker.current
        tracker.reset_peak()
        out.backward(torch.ones_like(out))
        above = tracker.peak - start
    B = 2 if dtype == torch.bfloat16 else 4
    predicted = recompute_transient_bytes(cfg, s, 2, 1, False, "selective", B, fused_kernels=False)
    assert abs(above / predicted - 1) < 0.15, (above, predicted)
