"""Kernels chosen by device type, in one place: attention, the ring's local attention with its log-sum-exp, RMS
norm, rope, swiglu and the experts' grouped GEMM.

Why a registry: the model is written once for one device (models/transformer.py, models/moe.py) and the ring
(parallel/ring_attention.py) merges blocks the same way on any device; what differs per device is only which
kernel computes the same function. With every such choice here, next to mesh.py (the other module that knows
device types), model code never asks what it runs on, and a new backend is one table. `kernels_for(device)` is a
pure lookup by device type; modules call it with their input's device at each forward rather than caching a table,
because a module changes device after it is built (meta -> device at assembly) and cached state would need
invalidating. The lookup is one dict access by a short string (about 0.1 us in eager mode; torch.compile resolves
it at trace time, the device being static), against several microseconds per kernel launch.

The tables (each a frozen `Kernels`):
  cpu, and any device type without a table of its own (meta, mps, ...): the PyTorch ops the model has always used,
      call for call (bit-identical): SDPA, F.rms_norm, rope on interleaved pairs in fp32, silu(gate) * up,
      F.grouped_mm (fp32 / bf16), and for the ring the CPU flash kernel, which returns the log-sum-exp.
  cuda: the same model ops (SDPA picks flash, cuDNN or memory-efficient itself); F.grouped_mm in bf16 on Hopper and
      later. The ring's local kernel is the flash kernel with its log-sum-exp
      (aten._scaled_dot_product_flash_attention and its backward, GQA native) for fp16 / bf16 with head_dim a
      multiple of 8 up to 256 on sm80+; anything else (fp32) keeps the fp32 math path, which builds each block's
      score matrix.
  npu (Ascend, when torch_npu imports): torch_npu's fused ops in their documented argument layouts:
      npu_fusion_attention (BNSD, GQA native, boolean mask True = masked, leftUpCausal sparse mode with the
      2048 x 2048 compressed mask), npu_rms_norm (y, rstd), npu_rotary_mul (rotate-half convention: our
      interleaved pairs are permuted to halves and back, which every torch_npu version with the op supports),
      npu_swiglu on [gate | up] (it splits the last dimension in halves, silu on the first),
      npu_grouped_matmul (forward and both gradients as grouped GEMMs in an autograd Function; fp16 / bf16,
      at most 128 experts). The ring's local kernel stays the math path. THE NPU PATH HAS NOT RUN ON AN NPU: no
      Ascend device was available; tests/npu_standin.py checks every call against torch_npu's documented
      signatures and computes the reference with PyTorch ops (tests/test_kernels.py).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class Kernels:
    """The kernels of one device type. Shapes: q (b, h, s, d), k and v (b, kv_h, s_k, d), GQA when h > kv_h.
    attention(q, k, v, mask, dropout, is_causal): mask None, boolean (True = attend) or additive;
    attention_with_lse(q, k, v, causal) -> (out in q's dtype, lse (b, h, s) fp32), causal top-left aligned;
    attention_with_lse_backward(dout, q, k, v, out, lse, causal) -> (dq, dk, dv), given the merged out and lse;
    rms_norm(x, weight, eps); rope(x (b, s, heads, d), cos, sin (s or b x s, d / 2)) on interleaved pairs;
    swiglu(gate, up) = silu(gate) * up; swiglu_packed(gate_up) the same on [gate | up] along the last dimension;
    grouped_mm(x (N, in), w (E, in, out), ends (E,) cumulative rows) and grouped_mm_fits(x, w): whether it runs."""

    name: str
    attention: Callable[..., torch.Tensor]
    attention_with_lse: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    attention_with_lse_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    rms_norm: Callable[..., torch.Tensor]
    rope: Callable[..., torch.Tensor]
    swiglu: Callable[..., torch.Tensor]
    swiglu_packed: Callable[..., torch.Tensor]
    grouped_mm: Callable[..., torch.Tensor]
    grouped_mm_fits: Callable[..., bool]


# --- PyTorch ops: the CPU table, and CUDA's model ops ---------------------------------------------------------


def sdpa(q, k, v, mask=None, dropout=0.0, is_causal=False):
    """A float mask is cast to q's dtype (one additive mask serves every layer); a boolean one passes as is."""
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
    )


def rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_interleaved(x, cos, sin):
    """Rotate pairs (x[2i], x[2i+1]) in fp32, as in Meta's Llama; cos, sin broadcast over heads."""
    x_pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def swiglu(gate, up):
    return F.silu(gate) * up


def swiglu_packed(gate_up):
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def grouped_mm(x, w, ends):
    return F.grouped_mm(x, w, offs=ends.to(torch.int32))


def _rows_fit(x, w) -> bool:
    """F.grouped_mm checks every row stride (K and M) is a multiple of 16 bytes."""
    size = x.element_size()
    return (
        hasattr(F, "grouped_mm")
        and x.dtype == w.dtype
        and (w.shape[1] * size) % 16 == 0
        and (w.shape[2] * size) % 16 == 0
    )


def cpu_grouped_mm_fits(x, w) -> bool:
    return _rows_fit(x, w) and x.dtype in (torch.float32, torch.bfloat16)


def cuda_grouped_mm_fits(x, w) -> bool:
    return _rows_fit(x, w) and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9


# --- attention with its log-sum-exp (the ring's local kernel) ---------------------------------------------------


def math_attention(q, k, v, causal):
    """Plain-math attention in fp32 returning (out, lse): the kernel where no flash kernel is wired."""
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = (q.float() @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(_future(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - finite(lse).unsqueeze(-1))
    return (probs @ vf).to(q.dtype), lse


def math_attention_backward(dout, q, k, v, out, lse, causal):
    """Gradients of `math_attention` given the (merged) output and log-sum-exp, as flash backward kernels take."""
    group, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_future(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), float("inf")).unsqueeze(-1))
    dout = dout.float()
    dprobs = dout @ vf.transpose(-1, -2)
    dscores = probs * (dprobs - (dout * out.float()).sum(-1, keepdim=True)) * scale
    dq = dscores @ kf
    dk = (dscores.transpose(-1, -2) @ q.float()).unflatten(1, (k.shape[1], group)).sum(2)
    dv = (probs.transpose(-1, -2) @ dout).unflatten(1, (k.shape[1], group)).sum(2)
    return dq, dk, dv


def _future(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).triu(1)


def finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that saw no key) replaced by 0, so exp(x - lse) gives 0 rather than NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def cpu_flash(q, k, v, causal):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def cpu_flash_backward(dout, q, k, v, out, lse, causal):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def cuda_flash_fits(q) -> bool:
    """What the flash kernel takes: fp16 / bf16, head_dim a multiple of 8 up to 256, Ampere or later."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )


def cuda_flash(q, k, v, causal):
    """The flash kernel's output and log-sum-exp ((b, h, s) fp32, as the ring merges it); math path otherwise."""
    if not cuda_flash_fits(q):
        return math_attention(q, k, v, causal)
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    return out, lse


def cuda_flash_backward(dout, q, k, v, out, lse, causal):
    """Flash backward on the merged out and lse: the kernel recomputes P = exp(S - lse) and D = rowsum(dO * O),
    so with the merged values each block's gradients are its share of the whole sequence's. The kernel reads
    lse densely (a sliced row range is copied); no sequence offsets (None: the dense, not varlen, kernel) and,
    without dropout, the philox seed and offset are not read."""
    if not cuda_flash_fits(q):
        return math_attention_backward(dout, q, k, v, out, lse, causal)
    unused = torch.empty(0, dtype=torch.long, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, unused, unused
    )[:3]


# --- Ascend: torch_npu's fused ops (not run on an NPU; see the module docstring) --------------------------------

NPU_CAUSAL_MASK = 2048  # npu_fusion_attention's compressed causal mask is 2048 x 2048 for sparse modes 2 and 3


def npu_kernels(npu: ModuleType) -> Kernels:
    """The Ascend table over a torch_npu module (the real one, or the tests' stand-in)."""

    def attention(q, k, v, mask=None, dropout=0.0, is_causal=False):
        sparse_mode, masked = 0, None
        if mask is not None:  # ours: True / 0 = attend; torch_npu's: True = masked out
            masked = ~mask if mask.dtype == torch.bool else mask < 0
            if is_causal:
                masked = masked | _future(q.shape[2], k.shape[2], q.device)
        elif is_causal:
            sparse_mode, masked = 2, _future(NPU_CAUSAL_MASK, NPU_CAUSAL_MASK, q.device)  # leftUpCausal
        return npu.npu_fusion_attention(
            q,
            k,
            v,
            q.shape[1],
            "BNSD",
            atten_mask=masked,
            scale=q.shape[-1] ** -0.5,
            keep_prob=1.0 - dropout,
            sparse_mode=sparse_mode,
        )[0]

    def norm(x, weight, eps):
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        return npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]

    def rope(x, cos, sin):
        """npu_rotary_mul rotates halves (x1, x2) -> (-x2, x1): the pairs (x[2i], x[2i+1]) are gathered into
        halves (x[0::2] | x[1::2]), rotated with cos, sin repeated over both halves, and scattered back. In fp32,
        as the CPU rope."""
        halves = x.float().unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        cos, sin = (torch.cat((t, t), -1).unsqueeze(-2) for t in (cos, sin))  # (.., s, 1, d)
        if cos.dim() == 3:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)  # (1, s, 1, d): BSND's 1S1D
        rotated = npu.npu_rotary_mul(halves, cos, sin)
        return rotated.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2).type_as(x)

    def glu(gate, up):
        """npu_swiglu takes [gate | up]: a copy here; `swiglu_packed` avoids it for a fused gate/up GEMM."""
        return npu.npu_swiglu(torch.cat((gate, up), -1), dim=-1)

    def glu_packed(gate_up):
        return npu.npu_swiglu(gate_up.contiguous(), dim=-1)

    def fits(x, w):
        return x.dtype == w.dtype and x.dtype in (torch.float16, torch.bfloat16) and w.shape[0] <= 128

    def gmm(x, w, ends):
        return _NpuGroupedMatmul.apply(x, w, ends, npu)

    return Kernels("npu", attention, math_attention, math_attention_backward, norm, rope, glu, glu_packed, gmm, fits)


class _NpuGroupedMatmul(torch.autograd.Function):
    """x (N, K) @ w_e (K, M) per expert's rows, as npu_grouped_matmul: x one tensor split along M by cumulative
    row ends (group_list_type 0), the weights as a list of E 2-D matrices, one output (split_item 2). Backward:
    dx the same with w_e transposed; dw_e = x_e^T dy_e, split along the reduced axis (group_type 2, split_item 3)."""

    @staticmethod
    def forward(ctx, x, w, ends, npu):
        group_list = ends.to(torch.int64)
        ctx.save_for_backward(x, w, group_list)
        ctx.npu = npu
        return npu.npu_grouped_matmul(
            [x], list(w.unbind(0)), group_list=group_list, split_item=2, group_type=0, group_list_type=0
        )[0]

    @staticmethod
    def backward(ctx, dy):
        x, w, group_list = ctx.saved_tensors
        npu, dy = ctx.npu, dy.contiguous()
        dx = npu.npu_grouped_matmul(
            [dy], [w_e.t() for w_e in w.unbind(0)], group_list=group_list, split_item=2, group_type=0, group_list_type=0
        )[0]
        dw = npu.npu_grouped_matmul(
            [x.t()], [dy], group_list=group_list, split_item=3, group_type=2, group_list_type=0
        )[0]
        return dx, dw, None, None


# --- the tables ------------------------------------------------------------------------------------------------

CPU = Kernels(
    "cpu",
    sdpa,
    cpu_flash,
    cpu_flash_backward,
    rms_norm,
    rope_interleaved,
    swiglu,
    swiglu_packed,
    grouped_mm,
    cpu_grouped_mm_fits,
)
CUDA = Kernels(
    "cuda",
    sdpa,
    cuda_flash,
    cuda_flash_backward,
    rms_norm,
    rope_interleaved,
    swiglu,
    swiglu_packed,
    grouped_mm,
    cuda_grouped_mm_fits,
)
TABLES = {"cpu": CPU, "cuda": CUDA}


@functools.cache
def _npu_table() -> Kernels:
    """Built on first use: importing torch_npu is what registers the 'npu' device type (mesh.select_device)."""
    return npu_kernels(importlib.import_module("torch_npu"))


def kernels_for(device: torch.device | str) -> Kernels:
    """The kernels for a device (or device type). Types without a table of their own get the CPU's PyTorch ops."""
    kind = device if isinstance(device, str) else device.type
    table = TABLES.get(kind)
    if table is not None:
        return table
    return _npu_table() if kind == "npu" else CPU
