"""Fused projections (models/fused.py): 4 GEMMs per dense block, the same projections as separate weights, exact
conversions both ways, and checkpoints written before the fusion still resume (tests/data/pre_fused: two steps of
the pre-fusion code at tp=1 and tp=2, whose own continuation gave the losses below)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig
from large_model_training.models.fused import fuse_gate_up, fuse_qkv, fuse_state, split_gate_up, split_qkv, split_state
from large_model_training.models.transformer import rope_tables
from tests.helpers import Runs, assert_close_curves, losses

CFG = ModelConfig(
    vocab_size=64, hidden_size=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden_size=96, max_seq_len=32
)
GEMMS = {"mm", "addmm", "bmm", "matmul", "linear"}


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.gemms += func.overloadpacket.__name__ in GEMMS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_a_dense_block_runs_four_gemms_forward(mlp):
    cfg = ModelConfig(**{**CFG.__dict__, "mlp": mlp})
    block = build_model(cfg, None, seed=0).layers["0"]
    x = torch.randn(2, 16, cfg.hidden_size)
    with _CountGemms() as count, torch.no_grad():
        block(x, rope_tables(16, cfg.head_dim, cfg.rope_theta, x.device))
    assert count.gemms == 4  # qkv, o, gate_up (gelu: up), down; was 7 with swiglu


def test_fused_projections_equal_the_separate_ones():
    torch.manual_seed(0)
    q, k, v = torch.randn(8 * 8, 64), torch.randn(2 * 8, 64), torch.randn(2 * 8, 64)
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    x = torch.randn(3, 5, 64, dtype=torch.float64).float()
    block = build_model(CFG, None, seed=0).layers["0"]
    with torch.no_grad():
        block.attn.wqkv.weight.copy_(fuse_qkv(q, k, v, 2))
        block.mlp.w_gate_up.weight.copy_(fuse_gate_up(gate, up))
    qkv = block.attn.wqkv(x).view(3, 5, 2, -1, 8)  # as Attention.forward splits it
    assert torch.allclose(qkv[:, :, :, :4].reshape(3, 5, -1), F.linear(x, q), rtol=1e-6, atol=1e-6)
    assert torch.allclose(qkv[:, :, :, 4].reshape(3, 5, -1), F.linear(x, k), rtol=1e-6, atol=1e-6)
    assert torch.allclose(qkv[:, :, :, 5].reshape(3, 5, -1), F.linear(x, v), rtol=1e-6, atol=1e-6)
    gate_out, up_out = block.mlp.w_gate_up(x).chunk(2, -1)  # paired rows, output as halves (models/linear.py)
    assert torch.allclose(gate_out, F.linear(x, gate), rtol=1e-6, atol=1e-6)
    assert torch.allclose(up_out, F.linear(x, up), rtol=1e-6, atol=1e-6)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), block.mlp.w_down.weight)
    assert torch.allclose(block.mlp(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_store", [False, True])
def test_paired_linear_gives_the_separate_gradients(with_store):
    """The paired path (weight reordered in forward and backward, its gradient reordered back) against two
    separate linears, directly and through the zero-bubble store's held weight gradient."""
    from large_model_training.models.linear import WeightGradStore, linear

    torch.manual_seed(0)
    gate, up = torch.randn(6, 5, requires_grad=True), torch.randn(6, 5, requires_grad=True)
    fused = fuse_gate_up(gate.detach(), up.detach()).requires_grad_()
    x, x_ref = torch.randn(3, 4, 5, requires_grad=True), None
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(3, 4, 12)
    store = WeightGradStore() if with_store else None
    if store is not None:
        with store.input_gradients_only((0, 0)):
            linear(x, fused, store, paired=True).backward(dy)
        assert fused.grad is None
        store.run_weight_gradients((0, 0))
    else:
        linear(x, fused, paired=True).backward(dy)
    torch.cat((F.linear(x_ref, gate), F.linear(x_ref, up)), -1).backward(dy)
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fused.grad, fuse_gate_up(gate.grad, up.grad), rtol=1e-6, atol=1e-6)


def test_fuse_and_split_are_exact_inverses():
    state = build_model(CFG, None, seed=3).state_dict()
    separate = split_state(state, CFG)
    assert "layers.1.attn.wk.weight" in separate and "layers.1.mlp.w_up.weight" in separate
    assert not any(name.endswith(("wqkv.weight", "w_gate_up.weight")) for name in separate)
    back = fuse_state(separate, CFG)
    assert back.keys() == state.keys() and all(torch.equal(back[n], state[n]) for n in state)
    w = state["layers.0.attn.wqkv.weight"]
    assert torch.equal(fuse_qkv(*split_qkv(w, 8, 2), 2), w)
    assert torch.equal(
        fuse_gate_up(*split_gate_up(state["layers.0.mlp.w_gate_up.weight"])), state["layers.0.mlp.w_gate_up.weight"]
    )


# The pre-fusion code's own run (tests/data/pre_fused/README.md): steps 1-2 saved at tp=1 and tp=2, then resumed
# by that code to step 4.
PRE_FUSED_ARGS = [
    "--model.hidden_size",
    "32",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.ffn_hidden_size",
    "64",
    "--seq-len",
    "32",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-every",
    "0",
    "--lr",
    "1e-2",
    "--steps",
    "4",
]
PRE_FUSED_CONTINUATION = [5.484791278839111, 5.397279739379883]  # steps 3 and 4
FIXTURES = __file__.rsplit("/", 1)[0] + "/data/pre_fused"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre_fused")
    for layout in ("tp1", "tp2"):  # DCP writes beside a checkpoint it reads nothing: a copy keeps the repo clean
        shutil.copytree(f"{FIXTURES}/{layout}", root / f"ckpt-{layout}")
    return Runs(
        root / "runs",
        {
            "tp1-at-tp1": [*PRE_FUSED_ARGS, "--resume", str(root / "ckpt-tp1")],
            "tp1-at-tp2": [*PRE_FUSED_ARGS, "--resume", str(root / "ckpt-tp1"), "--tp", "2", "--sequence-parallel"],
            "tp2-at-tp1-dp2": [*PRE_FUSED_ARGS, "--resume", str(root / "ckpt-tp2"), "--dp", "2", "--zero", "1"],
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("run", ["tp1-at-tp1", "tp1-at-tp2", "tp2-at-tp1-dp2"])
def test_a_checkpoint_written_before_the_fusion_resumes_on_its_curve(resumed, run):
    assert_close_curves(losses(resumed[run]), PRE_FUSED_CONTINUATION, rtol=2e-6, what=run)


def test_zero3_refuses_to_convert_a_pre_fusion_checkpoint_in_one_line():
    from large_model_training.errors import ConfigError
    from large_model_training.train.checkpoint_fused import request_separate, written_before_fusion

    assert written_before_fusion(f"{FIXTURES}/tp1")
    with pytest.raises(ConfigError, match="resume it once with --zero 0, 1 or 2"):
        request_separate({"model": {}}, CFG, f"{FIXTURES}/tp1", zero=3)
