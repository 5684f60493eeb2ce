"""A stand-in for `torch_npu`'s five fused ops that kernels.py calls, for machines without an Ascend device.

Each function checks its arguments against torch_npu's documented signature and constraints (the Ascend PyTorch
API reference: npu_fusion_attention, npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_grouped_matmul) and computes
the documented result with PyTorch ops, so tests can run our NPU kernels on CPU tensors. A violated rule raises
ValueError naming it. It only implements the modes our kernels use (BNSD; sparse modes 0 and 2; no dropout;
the grouped GEMM's M-split and K-split forms) and refuses the rest, rather than guessing them.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _require(ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"torch_npu stand-in: {rule}")


def make_standin() -> types.ModuleType:
    """A fresh module named torch_npu; `calls` lists the ops called, in order."""
    npu = types.ModuleType("torch_npu")
    npu.calls = []

    def npu_fusion_attention(
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        inner_precise=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
    ):
        npu.calls.append("npu_fusion_attention")
        _require(input_layout in ("BSH", "SBH", "BSND", "BNSD", "TND"), f"unknown input_layout {input_layout}")
        _require(input_layout == "BNSD", "the stand-in implements BNSD only")
        _require(query.dim() == key.dim() == value.dim() == 4, "BNSD inputs are 4-D")
        _require(query.dtype == key.dtype == value.dtype and query.dtype in FLOATS, "q, k, v one float dtype")
        b, n1, sq, d = query.shape
        _require(key.shape == value.shape and key.shape[0] == b and key.shape[3] == d, "k, v (B, N2, Skv, D)")
        n2, skv = key.shape[1], key.shape[2]
        _require(isinstance(head_num, int) and head_num == n1, "head_num is the query's head count N1")
        _require(n1 % n2 == 0, "N2 divides N1 (GQA)")
        _require(isinstance(scale, float) and 0.0 < keep_prob <= 1.0, "scale a float, keep_prob in (0, 1]")
        _require(keep_prob == 1.0, "the stand-in does not reproduce dropout")
        _require(pse is None and padding_mask is None and prefix is None, "no pse / padding_mask / prefix")
        _require(sparse_mode in (0, 1, 2, 3, 4), f"unknown sparse_mode {sparse_mode}")
        _require(sparse_mode in (0, 2), "the stand-in implements sparse modes 0 and 2")
        if atten_mask is not None:
            _require(atten_mask.dtype in (torch.bool, torch.uint8), "atten_mask is BOOL or UINT8 (1 = masked)")
        if sparse_mode == 2:
            _require(
                atten_mask is not None
                and atten_mask.shape == (2048, 2048)
                and torch.equal(atten_mask.bool(), torch.ones(2048, 2048, dtype=torch.bool).triu(1)),
                "leftUpCausal takes the 2048 x 2048 upper-triangular compressed mask",
            )
            masked = torch.ones(sq, skv, dtype=torch.bool).triu(1)
        elif atten_mask is not None:
            _require(
                tuple(atten_mask.shape) in ((b, n1, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)),
                "atten_mask is BNSS, B1SS, 11SS or SS",
            )
            masked = atten_mask.bool()
        else:
            masked = None
        group = n1 // n2
        scores = query.float() @ key.float().repeat_interleave(group, 1).transpose(-1, -2) * scale
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        row_sum = torch.exp(scores - row_max).sum(-1, keepdim=True)
        out = (scores.softmax(-1) @ value.float().repeat_interleave(group, 1)).to(query.dtype)
        empty = torch.empty(0)
        return out, row_max.expand(b, n1, sq, 8), row_sum.expand(b, n1, sq, 8), empty, 0, 0, 0

    def npu_rms_norm(self, gamma, epsilon=1e-6):
        npu.calls.append("npu_rms_norm")
        _require(1 <= self.dim() <= 8 and self.dtype in FLOATS, "self: 1-8 dims, fp16 / bf16 / fp32")
        _require(gamma.dtype == self.dtype, "gamma's dtype is self's")
        _require(
            gamma.dim() <= self.dim() and tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim() :]),
            "gamma's shape is self's last dimensions",
        )
        _require(isinstance(epsilon, float), "epsilon a float")
        dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
        x = self.float()
        rstd = torch.rsqrt(x.square().mean(dims, keepdim=True) + epsilon)
        return (x * rstd * gamma.float()).to(self.dtype), rstd

    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
        npu.calls.append("npu_rotary_mul")
        _require(rotary_mode in ("half", "interleave"), f"unknown rotary_mode {rotary_mode}")
        _require(input.dim() == r1.dim() == r2.dim() == 4, "input, r1, r2 are 4-D")
        _require(input.dtype == r1.dtype == r2.dtype and input.dtype in FLOATS, "one float dtype")
        _require(input.shape[-1] % 2 == 0 and r1.shape == r2.shape, "D even, r1 and r2 one shape")
        a, b, c, d = input.shape  # BNSD (B, N, S), BSND (B, S, N) or SBND (S, B, N)
        layouts = {
            (1, 1, c, d),
            (a, 1, c, d),
            (a, b, c, d),  # BNSD: 11SD, B1SD, BNSD
            (1, b, 1, d),
            (a, b, 1, d),  # BSND: 1S1D, BS1D
            (a, 1, 1, d),
        }  # SBND: S11D (SB1D is BSND's BS1D)
        _require(tuple(r1.shape) in layouts, f"r1 {tuple(r1.shape)} is no documented broadcast of {tuple(input.shape)}")
        if rotary_mode == "half":
            x1, x2 = input.chunk(2, -1)
            turned = torch.cat((-x2, x1), -1)
        else:
            turned = torch.stack((-input[..., 1::2], input[..., ::2]), -1).flatten(-2)
        return r1 * input + r2 * turned

    def npu_swiglu(input, dim=-1):
        npu.calls.append("npu_swiglu")
        _require(1 <= input.dim() <= 8 and input.dtype in FLOATS, "input: 1-8 dims, fp32 / fp16 / bf16")
        _require(input.is_contiguous(), "input is contiguous")
        _require(-input.dim() <= dim < input.dim() and input.shape[dim] % 2 == 0, "dim exists and halves evenly")
        a, b = input.chunk(2, dim)
        return F.silu(a) * b

    def npu_grouped_matmul(
        x,
        weight,
        *,
        bias=None,
        scale=None,
        offset=None,
        antiquant_scale=None,
        antiquant_offset=None,
        group_list=None,
        split_item=0,
        group_type=None,
        group_list_type=0,
        output_dtype=None,
    ):
        npu.calls.append("npu_grouped_matmul")
        _require(isinstance(x, list) and isinstance(weight, list), "x and weight are tensor lists")
        _require(1 <= len(weight) <= 128 and len(x) <= 128, "at most 128 tensors per list")
        _require(
            all(t.dtype in (torch.float16, torch.bfloat16) and t.dtype == x[0].dtype for t in x + weight),
            "x and weight in one of fp16 / bf16 (unquantised)",
        )
        _require(all(t.dim() == 2 for t in x + weight), "2-D tensors when split_item is not 0")
        _require(bias is None and scale is None and offset is None and antiquant_scale is None, "unquantised")
        _require(
            isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1,
            "group_list an int64 1-D tensor",
        )
        _require(group_list_type == 0, "the stand-in implements cumulative group lists (group_list_type 0)")
        ends = group_list.tolist()
        _require(all(a <= b for a, b in zip([0] + ends, ends)), "cumulative group_list is non-decreasing")
        starts = [0] + ends[:-1]
        if group_type == 0 and split_item == 2:  # y = x_g @ w_g, x's rows split by group (M axis)
            _require(len(x) == 1 and len(group_list) == len(weight), "one x, one weight per group")
            _require(ends[-1] == x[0].shape[0] and all(w.shape[0] == x[0].shape[1] for w in weight), "shapes")
            rows = [x[0][s:e].float() @ w.float() for s, e, w in zip(starts, ends, weight)]
            return [torch.cat(rows).to(x[0].dtype)]
        if group_type == 2 and split_item == 3:  # y_g = x[:, g] @ w[g, :], split along the reduced K axis
            _require(len(x) == 1 and len(weight) == 1, "one x, one weight")
            _require(ends[-1] == x[0].shape[1] == weight[0].shape[0], "K of x and weight is group_list's total")
            parts = [x[0][:, s:e].float() @ weight[0][s:e].float() for s, e in zip(starts, ends)]
            return [torch.stack(parts).to(x[0].dtype)]
        raise ValueError(f"torch_npu stand-in: group_type {group_type} with split_item {split_item} not implemented")

    for f in (npu_fusion_attention, npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_grouped_matmul):
        setattr(npu, f.__name__, f)
    return npu
