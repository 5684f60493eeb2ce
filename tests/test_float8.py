"""FP8 linear GEMMs (models/float8.py): against torchao's Float8Linear on the same weights and inputs, and against
the bf16 GEMMs within each recipe's expected error; through the paired and held (zero-bubble) paths."""

from __future__ import annotations

import pytest
import torch

from large_model_training.models.float8 import Float8Gemms, Float8Recipe, to_float8
from large_model_training.models.linear import WeightGradStore, linear

RECIPES = ["tensorwise", "rowwise"]


def _inputs(seed=0, tokens=64, n_in=96, n_out=80):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) * 0.05
    dy = torch.randn(2, tokens // 2, n_out, generator=g)
    return x, w, dy


def _ours(recipe, x, w, dy, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, w, fp8=Float8Gemms(Float8Recipe.named(recipe)), **kw)
    y.backward(dy.to(y.dtype))
    return y.float(), x.grad.float(), w.grad.float()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_equals_torchao_float8linear(recipe):
    ao = pytest.importorskip("torchao.float8")
    x, w, dy = _inputs()
    module = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
    with torch.no_grad():
        module[0].weight.copy_(w)
    ao.convert_to_float8_training(module, config=ao.Float8LinearConfig.from_recipe_name(recipe))
    xa = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torchao casts the input to bf16 under CUDA's autocast only
        ya = module(xa.to(torch.bfloat16))
    ya.backward(dy.to(ya.dtype))
    y, dx, dw = _ours(recipe, x, w, dy)
    assert torch.equal(y, ya.float())
    assert torch.equal(dx, xa.grad.float())
    assert torch.equal(dw, module[0].weight.grad.float())


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_gemms_are_within_the_formats_error_of_bf16(recipe):
    x, w, dy = _inputs(1)
    y, dx, dw = _ours(recipe, x, w, dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = torch.nn.functional.linear(xr, wr)
    yr.backward(dy)
    # e4m3 keeps 3 mantissa bits (relative step 1/16), e5m2 2: a dot product of n such terms errs by ~step/sqrt(3)
    for ours, ref, tol in ((y, yr, 0.06), (dx, xr.grad, 0.12 if recipe == "tensorwise" else 0.06),
                           (dw, wr.grad, 0.12 if recipe == "tensorwise" else 0.06)):
        rel = (ours - ref).norm() / ref.norm()
        assert 0 < rel < tol, (recipe, float(rel))


def test_scales_map_the_amax_to_the_formats_largest_value_and_saturate():
    t = torch.tensor([[1.0, -3.0], [0.5, 2.0]])
    bits, inv = to_float8(t, torch.float8_e4m3fn, None, False)
    assert inv.item() == pytest.approx(3.0 / 448.0)
    assert bits.float().abs().max().item() == 448.0
    rows, inv_rows = to_float8(t, torch.float8_e4m3fn, 1, True)
    assert inv_rows.shape == (2, 1)
    assert all(float(s).is_integer() or (1 / float(s)).is_integer() for s in inv_rows.flatten())  # powers of 2
    zero, inv_zero = to_float8(torch.zeros(2, 2), torch.float8_e4m3fn, None, False)
    assert torch.isfinite(inv_zero) and zero.float().abs().max() == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_through_the_paired_and_held_paths_equals_the_plain_fp8_path(recipe):
    """The zero-bubble store and the paired (gate/up) reorder change when and where the GEMMs run, not what."""
    x, w, dy = _inputs(2)
    y, dx, dw = _ours(recipe, x, w, dy)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    store = WeightGradStore()
    with store.input_gradients_only((0, 0)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys = linear(xs, ws, store, fp8=Float8Gemms(Float8Recipe.named(recipe)))
        ys.backward(dy.to(ys.dtype))
    assert ws.grad is None
    store.run_weight_gradients((0, 0))
    assert torch.equal(ys.float(), y) and torch.equal(xs.grad.float(), dx) and torch.equal(ws.grad.float(), dw)
    from large_model_training.models.linear import halves_to_pairs, pairs_to_halves
    xp, wp = x.clone().requires_grad_(), halves_to_pairs(w).clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yp = linear(xp, wp, paired=True, fp8=Float8Gemms(Float8Recipe.named(recipe)))
    yp.backward(dy.to(yp.dtype))
    assert torch.equal(yp.float(), y) and torch.equal(xp.grad.float(), dx)
    assert torch.equal(pairs_to_halves(wp.grad).float(), dw)
