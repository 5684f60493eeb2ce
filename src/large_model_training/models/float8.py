"""FP8 GEMMs for the linear layers (`--precision fp8`): the three GEMMs of a linear (forward, input gradient,
weight gradient) in float8 with dynamic scaling, as torchao's `Float8Linear` computes them.

Recipes (torchao's names and numerics, `Float8LinearConfig.from_recipe_name`):
  - `tensorwise`: one scale per tensor; e4m3 for inputs and weights, e5m2 for output gradients (range over
    precision: gradients span more orders of magnitude).
  - `rowwise`: one scale per row along each GEMM's reduction dimension (a token's row of x, an output row of W
    in forward; per token of dY and per input column of W for dX; per output and per input column over the
    tokens for dW), all e4m3, scales rounded down to a power of two (exact to apply).
  - `rowwise_with_gw_hp`: rowwise's forward; dX from dY rowwise (e4m3) and W with one scale; dW in bf16 (torchao's
    "most accurate option": the weight gradient sums over every token, where fp8's per-token errors add up,
    and its GEMM is a third of a linear's FLOPs).
A scale maps the tensor's (or row's) absolute maximum to the format's largest finite value; values are cast
saturated. `torch._scaled_mm` multiplies the fp8 operands and applies the inverse scales.

Why lmt computes this itself rather than wrapping torchao's `Float8Linear`: our linear function (`models/linear.py`)
already carries what tp, lean SP's regather and zero-bubble's held weight-gradient GEMMs need, and a module
swap would lose it; and an amax over a tensor-parallel shard must be reduced over the tp group to be the whole
tensor's (below), which torchao does through DTensor and lmt does through its explicit groups. The arithmetic
is torchao's, step for step (amax in fp32, scale in fp64 then fp32, saturated cast), and tests hold the two equal
(tests/test_float8.py). Unlike torchao's, a tensorwise layer keeps its input for the weight gradient as the
float8 bits forward cast (one scale over the whole tensor serves both GEMMs, as Transformer Engine keeps it): 1
byte per value instead of 2, the same arithmetic, except where another op saves that input anyway
(`INPUT_SAVED_ELSEWHERE`) or lean SP keeps only its shard; rowwise scales the weight gradient's input along the
tokens, so it keeps the bf16 input and casts again in backward, as torchao does.

Layout faithfulness: a scale is computed from the amax of the *whole* tensor (tensorwise) or row (rowwise). Under
tensor parallelism one dimension of the layer is sharded ("out" for a column-parallel layer, "in" for a
row-parallel one), so an amax that spans that dimension is MAX-reduced over the tp group (one small all-reduce,
counted in the tp bytes). Tokens are never tp-sharded at the GEMMs (SP gathers them before a column-parallel
layer; a row-parallel layer sees every token); data, context and micro-batch splits of the tokens are not
reduced: each micro-batch is scaled on its own, as in torchao, so dp / cp / gradient accumulation change the
scales (fp8 rounding, within the curve tolerance) but never the arithmetic of the layer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from large_model_training.choices import FP8_RECIPES
from large_model_training.mesh import AxisGroup
from large_model_training.parallel.collectives import all_reduce_

EPS = 1e-12  # torchao's floor under an amax (an all-zero tensor gets a finite scale)


@dataclass(frozen=True)
class Float8Recipe:
    name: str
    grad_dtype: torch.dtype  # the output gradient's format
    rowwise: bool  # a scale per row of the reduction dimension, else one per tensor
    power_of_2: bool  # scales rounded down to a power of two
    weight_grad_hp: bool = False  # dW in the autocast dtype (bf16), and W one scale for dX (rowwise_with_gw_hp)

    @staticmethod
    def named(name: str) -> Float8Recipe:
        if name == "tensorwise":
            return Float8Recipe(name, torch.float8_e5m2, rowwise=False, power_of_2=False)
        if name == "rowwise":
            return Float8Recipe(name, torch.float8_e4m3fn, rowwise=True, power_of_2=True)
        if name == "rowwise_with_gw_hp":
            return Float8Recipe(name, torch.float8_e4m3fn, rowwise=True, power_of_2=True, weight_grad_hp=True)
        raise ValueError(f"unknown fp8 recipe {name!r}; one of {', '.join(FP8_RECIPES)}")


def to_float8(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool, tp: AxisGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """t (2-D) cast to `dtype` with a dynamic scale; returns (fp8 tensor, inverse scale in fp32). `dim`: the
    dimension each row's amax spans (rowwise; the scale keeps it as size 1), None for one scale per tensor.
    `tp`: MAX-reduce the amax over this group (it spans a tp-sharded dimension)."""
    magnitude = t.abs()
    amax = (magnitude.amax(dim=dim, keepdim=True) if dim is not None else magnitude.max()).float()
    if tp is not None:
        all_reduce_(amax, tp, op=dist.ReduceOp.MAX)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    if power_of_2:  # rounded down, as torchao rounds
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    top = torch.finfo(dtype).max
    bits = (t.float() * scale).clamp(-top, top).to(dtype)
    return bits, scale.reciprocal()


class Float8Cast(NamedTuple):
    """A tensor already in float8 with one scale (tensorwise): a weight gathered in float8, or a layer input kept
    in float8 for the weight gradient. Its bits and the inverse of its scale."""

    bits: torch.Tensor
    inverse_scale: torch.Tensor


def float8_weight(weight: torch.Tensor) -> Float8Cast | None:
    """The float8 form of a weight that arrives already cast: under ZeRO-3 with the tensorwise recipe FSDP2
    all-gathers the block weights in float8 (`parallel/fsdp_float8.py`), and the gathered parameter is torchao's
    `Float8TrainingTensor`; None for an ordinary weight. (torchao is only imported where it is in use.)"""
    module = sys.modules.get("torchao.float8.float8_training_tensor")
    if module is None or not isinstance(weight, module.Float8TrainingTensor):
        return None
    return Float8Cast(weight._data, weight._scale.reciprocal())


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (what `_scaled_mm` wants as its second operand)."""
    return t.t().contiguous().t()


class Float8Gemms:
    """The three GEMMs of one linear layer in fp8. `sharded`: which of the layer's dimensions tp splits
    ("out": column-parallel, "in": row-parallel, None: replicated), so that amaxes spanning it are reduced."""

    def __init__(
        self,
        recipe: Float8Recipe,
        tp: AxisGroup | None = None,
        sharded: str | None = None,
        keep_float8_input: bool = False,
    ):
        if sharded not in (None, "in", "out"):
            raise ValueError(f"sharded must be None, 'in' or 'out', not {sharded!r}")
        if keep_float8_input and recipe.rowwise:
            raise ValueError(
                "only the tensorwise recipe can keep its input in float8: rowwise scales the weight "
                "gradient's input along the tokens, not along the features as in forward"
            )
        self.recipe, self.tp = recipe, tp if tp is not None and tp.size > 1 else None
        self.sharded = sharded if self.tp is not None else None
        self.keep_float8_input = keep_float8_input

    def cast_input(self, x: torch.Tensor) -> Float8Cast:
        """x (tokens, in) in float8 as forward casts it: tensorwise, the same bits and scale serve the weight
        gradient, so keeping them for backward costs 1 byte per value instead of bf16's 2, and no second cast."""
        return Float8Cast(*self._cast(x, torch.float8_e4m3fn, ("tokens", "in"), "in"))

    def _cast(
        self,
        t: torch.Tensor | Float8Cast,
        dtype: torch.dtype,
        dims: tuple[str, str],
        reduce_over: str | None,
        rowwise: bool | None = None,
    ):
        """Cast a 2-D tensor whose dimensions are named `dims` (of "tokens", "in", "out"); rowwise (the recipe's
        unless `rowwise` says), its amax runs along `reduce_over` (the GEMM's reduction dimension), tensorwise along
        everything. A weight gathered in float8 is already cast (tensorwise: one scale serves both of its GEMMs)."""
        r = self.recipe
        rowwise = r.rowwise if rowwise is None else rowwise
        if isinstance(t, Float8Cast):
            if rowwise:
                raise ValueError("a tensor cast to float8 has one scale: the rowwise recipe cannot use it")
            return t
        dim = dims.index(reduce_over) if rowwise else None
        spans = dims if dim is None else (dims[dim],)
        group = self.tp if self.sharded in spans else None
        return to_float8(t, dtype, dim, r.power_of_2, group)

    def forward(
        self, x: torch.Tensor | Float8Cast, weight: torch.Tensor | Float8Cast, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """y = x W^T: x (tokens, in), W (out, in)."""
        e4m3 = torch.float8_e4m3fn
        xb, xs = self._cast(x, e4m3, ("tokens", "in"), "in")
        wb, ws = self._cast(weight, e4m3, ("out", "in"), "in")
        return torch._scaled_mm(xb, wb.t(), scale_a=xs, scale_b=ws.t(), out_dtype=out_dtype, use_fast_accum=True)

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor | Float8Cast, out_dtype: torch.dtype) -> torch.Tensor:
        """dX = dY W: dY (tokens, out), W (out, in)."""
        gb, gs = self._cast(grad, self.recipe.grad_dtype, ("tokens", "out"), "out")
        per_row = False if self.recipe.weight_grad_hp else None  # rowwise_with_gw_hp: W with one scale, as torchao
        wb, ws = self._cast(weight, torch.float8_e4m3fn, ("out", "in"), "out", per_row)
        if per_row is False:  # `_scaled_mm` takes rowwise with rowwise only: W's one scale repeated, as torchao does
            ws = ws.reshape(1, 1).repeat(1, wb.shape[1])
        return torch._scaled_mm(gb, _column_major(wb), scale_a=gs, scale_b=ws, out_dtype=out_dtype)

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor | Float8Cast, out_dtype: torch.dtype) -> torch.Tensor:
        """dW = dY^T X: dY (tokens, out), X (tokens, in)."""
        if self.recipe.weight_grad_hp:  # in the dtype forward computed in (x arrives as the kept bf16 input)
            if isinstance(x, Float8Cast):
                raise ValueError("rowwise_with_gw_hp computes dW from the high-precision input, not a float8 copy")
            return grad.t().mm(x.to(grad.dtype)).to(out_dtype)
        gb, gs = self._cast(grad, self.recipe.grad_dtype, ("tokens", "out"), "tokens")
        xb, xs = self._cast(x, torch.float8_e4m3fn, ("tokens", "in"), "tokens")
        per_out = gs.reshape(-1, 1) if gs.ndim else gs  # rowwise: (1, out) -> (out, 1), contiguous
        return torch._scaled_mm(
            gb.t().contiguous(), _column_major(xb), scale_a=per_out, scale_b=xs, out_dtype=out_dtype
        )


INPUT_SAVED_ELSEWHERE = (
    "attn.wo",
    "attn.wq_a",
    "attn.wkv_a",
    "attn.wkv_b",
    "mlp.shared.w_gate_up",
    "mlp.shared.w_up",
    "mlp.shared.w_down",
)
"""Block layers whose input another op saves anyway, where a float8 copy would add bytes rather than save them:
the output projection's input is SDPA's saved output; MLA's two down-projections share one input (two float8
copies weigh what one bf16 does) and wkv_b's input is a view of a tensor kept whole; an MoE block's shared
expert sees the input the router and the routed experts save (its output projection left alike, so MoE
blocks' MLPs stay bf16-saved)."""


def bf16_blocks(n_layers: int, first_last: int) -> set[int]:
    """The blocks `--train.fp8_bf16_first_last K` keeps in bf16: the first K and the last K of the model."""
    return set(range(min(first_last, n_layers))) | set(range(max(0, n_layers - first_last), n_layers))


def apply_float8(
    model: torch.nn.Module, recipe: str, tp: AxisGroup | None = None, keep_bf16: frozenset[int] | set[int] = frozenset()
) -> int:
    """Give every linear layer inside the transformer blocks of `model` (a Transformer chunk) its fp8 GEMMs;
    returns how many. The head (vocabulary logits), the MoE router and the routed experts' grouped GEMMs, the
    norms and attention stay in bf16, as in torchao's and Megatron's recipes: the head's and the router's
    outputs feed a softmax over many classes, where fp8's 3 mantissa bits show. `keep_bf16`: the model's block
    indices that stay bf16 (Megatron's --first-last-layers-bf16: the blocks next to the embedding and the head,
    whose inputs and output gradients carry the widest ranges)."""
    chosen, count = Float8Recipe.named(recipe), 0
    for index, block in getattr(model, "layers", {}).items():
        if int(index) in keep_bf16:
            continue
        for name, module in block.named_modules():
            if hasattr(module, "fp8") and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
                keep = not chosen.rowwise and name not in INPUT_SAVED_ELSEWHERE
                module.fp8 = Float8Gemms(chosen, tp, getattr(module, "tp_sharded", None), keep_float8_input=keep)
                count += 1
    return count


def float8_note(model: torch.nn.Module, recipe: str, first_last: int = 0) -> str:
    """The run log's line: what runs in float8 and what stays bf16."""
    layers = sum(1 for m in model.modules() if getattr(m, "fp8", None) is not None)
    ends = f", and the first and last {first_last} block(s)" if first_last else ""
    return (
        f"fp8 ({recipe}): {layers} linear layers of this rank's blocks have float8 GEMMs (forward, input and "
        f"weight gradients); the head, the MoE router and routed experts, norms and attention stay bf16{ends}"
    )
