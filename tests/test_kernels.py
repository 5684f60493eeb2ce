"""Kernels by device type (kernels.py): the CPU table is the PyTorch ops the model always called (bit-identical);
the Ascend table, run through a stand-in torch_npu (tests/npu_standin.py) that checks each call against the
documented signature, gives the CPU table's results, rope convention included, alone and inside the model; the
lookup; and, marked `cuda` (skipped without a GPU), the CUDA ring kernel (flash with its log-sum-exp) against the
math path."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from large_model_training import kernels
from large_model_training.kernels import CPU, CUDA, kernels_for, math_attention, math_attention_backward, npu_kernels
from large_model_training.models.moe import expert_matmul
from large_model_training.models.transformer import RMSNorm, Transformer, additive_mask, document_layout, rope_tables
from tests.helpers import model_config
from tests.npu_standin import make_standin

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _qkv(kv_heads=2, seq=12, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, seq, 16, generator=g) for h in (4, kv_heads, kv_heads))
    return [t.to(device, dtype) for t in (q, k, v)]


def test_cpu_table_is_the_pytorch_ops_bit_for_bit():
    q, k, v = _qkv()
    allowed = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed |= torch.eye(12, dtype=torch.bool)
    mask = additive_mask(allowed, torch.float32)
    assert torch.equal(
        CPU.attention(q, k, v, None, 0.0, True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    )
    assert torch.equal(
        CPU.attention(q, k, v, mask, 0.0, False),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
    )
    assert torch.equal(
        CPU.attention(q, k, v, allowed, 0.0, False),  # a boolean mask is not cast
        F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True),
    )
    x, norm = torch.randn(3, 5, 32), nn.RMSNorm(32, eps=1e-5)
    nn.init.normal_(norm.weight)
    assert torch.equal(CPU.rms_norm(x, norm.weight, 1e-5), norm(x))
    gate, up = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    assert torch.equal(CPU.swiglu(gate, up), F.silu(gate) * up)
    # a new op (for a fused gate/up GEMM): silu over a strided half may take another vector path, so not bitwise
    torch.testing.assert_close(CPU.swiglu_packed(torch.cat((gate, up), -1)), F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    rows, w, ends = torch.randn(10, 16), torch.randn(3, 16, 32), torch.tensor([3, 3, 10])
    assert torch.equal(CPU.grouped_mm(rows, w, ends), F.grouped_mm(rows, w, offs=ends.to(torch.int32)))


@pytest.mark.parametrize("per_sequence", [False, True])
def test_rope_rotates_interleaved_pairs(per_sequence):
    """Pair (x[2i], x[2i+1]) is the complex number x[2i] + i x[2i+1], turned by the angle of position p."""
    x = torch.randn(2, 6, 3, 8)
    cos, sin = rope_tables(6, 8, 10000.0, x.device)
    if per_sequence:
        positions = torch.tensor([[0, 1, 2, 0, 1, 2], [5, 4, 3, 2, 1, 0]])
        cos, sin = cos[positions], sin[positions]
    turn = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos)).unsqueeze(-2)
    want = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn).flatten(-2)
    torch.testing.assert_close(CPU.rope(x, cos, sin), want, atol=1e-6, rtol=1e-6)


def test_rmsnorm_module_keeps_the_parameter_and_state_dict():
    ours, plain = RMSNorm(16, eps=1e-6), nn.RMSNorm(16, eps=1e-6)
    assert isinstance(ours, nn.RMSNorm) and list(ours.state_dict()) == list(plain.state_dict()) == ["weight"]
    nn.init.normal_(plain.weight)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(4, 16)
    assert torch.equal(ours(x), plain(x))


def test_lookup_by_device_type(monkeypatch):
    assert kernels_for(torch.device("cpu")) is CPU and kernels_for("cuda") is CUDA
    assert kernels_for("meta") is CPU and kernels_for("mps") is CPU  # no table of their own: PyTorch's ops
    standin = make_standin()
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    kernels._npu_table.cache_clear()
    try:
        table = kernels_for("npu")
        assert table.name == "npu" and kernels_for("npu") is table  # built once
        table.swiglu(torch.randn(2, 4), torch.randn(2, 4))
        assert standin.calls == ["npu_swiglu"]
    finally:
        kernels._npu_table.cache_clear()


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_npu_attention_equals_sdpa_causal_and_masked(kv_heads):
    npu = make_standin()
    table = npu_kernels(npu)
    q, k, v = _qkv(kv_heads)
    allowed = document_layout(torch.tensor([[1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 9, 0]] * 2), 0)[1]
    for mask, causal in ((None, True), (additive_mask(allowed, q.dtype), False), (allowed, False)):
        torch.testing.assert_close(
            table.attention(q, k, v, mask, 0.0, causal), CPU.attention(q, k, v, mask, 0.0, causal), atol=1e-5, rtol=1e-5
        )
    keys = torch.cat([k, k[:, :, :4]], 2)  # more keys than queries (the all-gather variant), a boolean mask
    wide = torch.rand(12, 16, generator=torch.Generator().manual_seed(2)) > 0.5
    wide[:, 0] = True
    torch.testing.assert_close(
        table.attention(q, keys, torch.cat([v, v[:, :, :4]], 2), wide, 0.0, False),
        CPU.attention(q, keys, torch.cat([v, v[:, :, :4]], 2), wide, 0.0, False),
        atol=1e-5,
        rtol=1e-5,
    )
    assert npu.calls == ["npu_fusion_attention"] * 4


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_npu_norm_rope_swiglu_equal_the_cpu_ops(dtype, tol):
    npu = make_standin()
    table = npu_kernels(npu)
    x, w = torch.randn(2, 6, 4, 16, dtype=dtype), torch.randn(16).to(dtype)
    torch.testing.assert_close(table.rms_norm(x, w, 1e-6), CPU.rms_norm(x, w, 1e-6), atol=tol, rtol=tol)
    cos, sin = rope_tables(6, 16, 10000.0, x.device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)  # per-sequence tables (document masking)
    for c, s in ((cos, sin), (cos[positions], sin[positions])):
        torch.testing.assert_close(table.rope(x, c, s), CPU.rope(x, c, s), atol=tol, rtol=tol)
    gate, up = torch.randn(3, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
    torch.testing.assert_close(table.swiglu(gate, up), CPU.swiglu(gate, up), atol=tol, rtol=tol)
    torch.testing.assert_close(table.swiglu_packed(torch.cat((gate, up), -1)), CPU.swiglu(gate, up), atol=tol, rtol=tol)
    assert npu.calls == ["npu_rms_norm", "npu_rotary_mul", "npu_rotary_mul", "npu_swiglu", "npu_swiglu"]


def test_npu_grouped_matmul_forward_and_gradients_equal_the_loop():
    npu = make_standin()
    table = npu_kernels(npu)
    g = torch.Generator().manual_seed(3)
    x0, weight0 = torch.randn(9, 16, generator=g), torch.randn(4, 8, 16, generator=g)  # (E, out, in)
    ends = torch.tensor([2, 2, 6, 9])  # expert 1 gets no row
    dy = torch.randn(9, 8, generator=g)
    results = []
    for grouped in (True, False):
        x, weight = (t.bfloat16().requires_grad_() for t in (x0, weight0))
        w = weight.transpose(1, 2)
        y = table.grouped_mm(x, w, ends) if grouped else expert_matmul(x, weight, ends, grouped=False)
        y.backward(dy.bfloat16())
        results.append([y.float(), x.grad.float(), weight.grad.float()])
    for ours, loop in zip(*results):
        torch.testing.assert_close(ours, loop, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(results[0][2][1]) == 0
    assert npu.calls == ["npu_grouped_matmul"] * 3
    assert table.grouped_mm_fits(x0.bfloat16(), weight0.bfloat16()) and not table.grouped_mm_fits(x0, weight0)


def test_the_standin_refuses_undocumented_layouts():
    """Its checks are real: each of these calls breaks a documented rule."""
    npu = make_standin()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head_num"):
        npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.25)
    with pytest.raises(ValueError, match="compressed mask"):
        npu.npu_fusion_attention(
            q, k, v, 4, "BNSD", scale=0.25, sparse_mode=2, atten_mask=torch.ones(12, 12, dtype=torch.bool).triu(1)
        )
    x = torch.randn(2, 6, 4, 16)
    with pytest.raises(ValueError, match="4-D"):
        npu.npu_rotary_mul(x, torch.randn(6, 16), torch.randn(6, 16))
    with pytest.raises(ValueError, match="documented broadcast"):
        npu.npu_rotary_mul(x, torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16))  # S where BSND has N
    with pytest.raises(ValueError, match="contiguous"):
        npu.npu_swiglu(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="gamma's dtype"):
        npu.npu_rms_norm(x, torch.randn(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="128"):
        npu.npu_grouped_matmul(
            [torch.randn(4, 8).bfloat16()],
            [torch.randn(8, 8).bfloat16()] * 129,
            group_list=torch.arange(129),
            split_item=2,
            group_type=0,
        )


@pytest.mark.parametrize(
    "extra", [{}, {"qk_norm": True}, {"moe_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32}]
)
def test_the_model_through_the_npu_table_equals_the_cpu_run(monkeypatch, extra):
    """The whole model (GQA, rope, RMSNorm, swiglu, qk_norm, MoE; causal and document-masked) with the Ascend table
    in place of the CPU one: the same logits and gradients, fp32."""
    cfg = model_config(vocab_size=96, n_kv_heads=2, **extra)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    runs = []
    for table in (CPU, npu_kernels(make_standin())):
        monkeypatch.setitem(kernels.TABLES, "cpu", table)
        for eod in (None, 7):
            torch.manual_seed(0)
            model = Transformer(cfg)
            for p in model.parameters():
                nn.init.normal_(p, std=0.2)
            model.document_eod = eod
            logits = model(tokens)
            logits.square().mean().backward()
            runs.append([logits.detach()] + [p.grad for p in model.parameters()])
    for ours, ref in zip(runs[2:], runs[:2]):
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cuda_table_keeps_the_math_path_where_flash_does_not_fit():
    """fp32 (flash takes fp16 / bf16 only): CUDA's ring kernel is the math path, decided before any device query."""
    q, k, v = _qkv()
    out, lse = CUDA.attention_with_lse(q, k, v, True)
    ref_out, ref_lse = math_attention(q, k, v, True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(q)
    for a, b in zip(
        CUDA.attention_with_lse_backward(dout, q, k, v, out, lse, True),
        math_attention_backward(dout, q, k, v, out, lse, True),
    ):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_with_lse_equals_the_math_path(kv_heads, causal):
    """bf16 on the GPU: the flash kernel's out, lse (the ring merges by it) and the gradients given out and lse
    against the fp32 math path; causal over a square block, or a slice of query rows against every key (as the
    ring's calls are), the lse a non-contiguous slice (as the ring passes it)."""
    q, k, v = _qkv(kv_heads, seq=64, dtype=torch.bfloat16, device="cuda")
    q = q if causal else q[:, :, 32:]
    out, lse = CUDA.attention_with_lse(q, k, v, causal)
    ref_out, ref_lse = math_attention(q, k, v, causal)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
    dout = torch.randn_like(q)
    sliced_lse = torch.cat([lse, lse], 2)[:, :, : q.shape[2]]
    grads = CUDA.attention_with_lse_backward(dout, q, k, v, out, sliced_lse, causal)
    for a, b in zip(grads, math_attention_backward(dout, q, k, v, out, lse, causal)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_cuda_one_rank_ring_is_causal_sdpa(kv_heads):
    """The ring at cp = 1 on the GPU, through the flash kernel: causal SDPA's values and gradients in bf16."""
    from large_model_training.mesh import AxisGroup
    from large_model_training.parallel.ring_attention import ring_attention

    q, k, v = _qkv(kv_heads, seq=128, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    ours, ref = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
    out = ring_attention(*ours, AxisGroup.single())
    out.backward(dout)
    expected = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=kv_heads != 4)
    expected.backward(dout)
    for a, b in zip([out, *(t.grad for t in ours)], [expected, *(t.grad for t in ref)]):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
