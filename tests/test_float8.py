"""FP8 linear GEMMs (models/float8.py): against torchao's Float8Linear on the same weights and inputs, and against
the bf16 GEMMs within each recipe's expected error; through the paired and held (zero-bubble) paths."""

from __future__ import annotations

import pytest
import torch

from large_model_training.models.float8 import Float8Cast, Float8Gemms, Float8Recipe, to_float8
from large_model_training.models.linear import WeightGradStore, linear

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


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
    for ours, ref, tol in (
        (y, yr, 0.06),
        (dx, xr.grad, 0.12 if recipe == "tensorwise" else 0.06),
        (dw, wr.grad, 0.12 if recipe == "tensorwise" else 0.01 if recipe == "rowwise_with_gw_hp" else 0.06),
    ):
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


@pytest.mark.parametrize("paired", [False, True])
def test_a_weight_gathered_in_float8_gives_the_gemms_of_the_weight_it_was_cast_from(paired):
    """ZeRO-3's float8 all-gather (parallel/fsdp_float8.py) hands the linear torchao's Float8TrainingTensor, cast
    from the fp32 master with the whole weight's scale: the tensorwise GEMMs are those of the plain weight."""
    ao = pytest.importorskip("torchao.float8.float8_scaling_utils")
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    x, w, dy = _inputs(seed=3)
    gathered = ao.hp_tensor_to_float8_dynamic(
        w, torch.float8_e4m3fn, LinearMMConfig(), gemm_input_role=GemmInputRole.WEIGHT
    ).requires_grad_()
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yg = linear(xg, gathered, fp8=Float8Gemms(Float8Recipe.named("tensorwise")), paired=paired)
    yg.backward(dy.to(yg.dtype))
    y, dx, dw = _ours("tensorwise", x, w, dy, paired=paired)
    assert torch.equal(yg.float(), y) and torch.equal(xg.grad.float(), dx)
    assert torch.equal(gathered.grad.float(), dw)


def test_the_rowwise_recipe_refuses_a_weight_gathered_in_float8():
    bits, inverse = to_float8(torch.randn(32, 16), torch.float8_e4m3fn, None, False)
    with pytest.raises(ValueError, match="rowwise"):
        Float8Gemms(Float8Recipe.named("rowwise")).forward(
            torch.randn(16, 16), Float8Cast(bits, inverse), torch.bfloat16
        )


@pytest.mark.parametrize("paired", [False, True])
def test_a_tensorwise_input_kept_in_float8_gives_the_same_gemms_at_half_the_saved_bytes(paired):
    """Keeping the input as forward's float8 cast (`keep_float8_input`) changes what is saved, not the numbers."""
    from large_model_training.memory.accounting import ActivationCounter

    x, w, dy = _inputs(seed=5)
    results, saved = {}, {}
    for keep in (False, True):
        xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
        counter = ActivationCounter()
        with counter.counting(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = (xk * 1.0).to(torch.bfloat16)  # a bf16 input only the linear saves
            y = linear(h, wk, fp8=Float8Gemms(Float8Recipe.named("tensorwise"), keep_float8_input=keep), paired=paired)
        saved[keep] = counter.current
        y.backward(dy.to(y.dtype))
        results[keep] = (y.float(), xk.grad, wk.grad)
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
    assert saved[False] - saved[True] == x.numel()  # 2 bytes per value -> 1
    with pytest.raises(ValueError, match="tensorwise"):
        Float8Gemms(Float8Recipe.named("rowwise"), keep_float8_input=True)


def test_bf16_first_last_blocks_are_counted_in_the_models_indices_not_the_chunks():
    """Under pp a chunk holds blocks 2 and 3 of 4: with K = 1, block 3 (the model's last) stays bf16, block 2 not."""
    from large_model_training.assembly import build_model
    from large_model_training.config import ModelConfig
    from large_model_training.models.float8 import apply_float8, bf16_blocks

    model = build_model(ModelConfig(hidden_size=64, n_layers=4, n_heads=4, ffn_hidden_size=128), None, seed=0)
    chunk = torch.nn.Module()
    chunk.layers = torch.nn.ModuleDict({k: model.layers[k] for k in ("2", "3")})
    assert bf16_blocks(4, 1) == {0, 3} and bf16_blocks(4, 0) == set() and bf16_blocks(3, 2) == {0, 1, 2}
    assert apply_float8(chunk, "rowwise", keep_bf16=bf16_blocks(4, 1)) == 4  # block 2's four linears
    kinds = {k: any(getattr(m, "fp8", None) is not None for m in b.modules()) for k, b in chunk.layers.items()}
    assert kinds == {"2": True, "3": False}
