"""The fused head + cross-entropy (models/fused_loss.py): the plain loss's value and gradients (fp32: 1e-6
relative) at any chunking, with padding, tp1 and tp2; under a quarter of its memory; the planner's terms against
the measured bytes; and training curves equal to the unfused loss's."""

from __future__ import annotations

import pytest
import torch

from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig
from large_model_training.memory.accounting import ActivationCounter
from large_model_training.memory.tracker import AllocationTracker
from large_model_training.mesh import AxisGroup, ParallelMesh
from large_model_training.models.fused_loss import chunk_tokens, fused_cross_entropy
from large_model_training.models.loss import vocab_parallel_cross_entropy
from large_model_training.planner.activations import head_activation_bytes, loss_transient_bytes
from tests.dist import run_ranks
from tests.helpers import Runs, assert_close_curves, losses, model_config, model_flags


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp64."""
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _inputs(n: int, h: int, rows: int, vocab: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(rows, h, generator=g) * 0.5).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (n,), generator=g)


def _plain(hidden, weight, targets, tp, vocab, scale=0.25):
    loss = vocab_parallel_cross_entropy(hidden @ weight.t(), targets, tp, vocab)
    return (loss, *torch.autograd.grad(loss * scale, (hidden, weight)))


def _fused(hidden, weight, targets, tp, vocab, chunk, scale=0.25):
    loss = fused_cross_entropy(hidden, weight, targets, tp, vocab, chunk)
    return (loss, *torch.autograd.grad(loss * scale, (hidden, weight)))


def _assert_equal(fused, plain, tol=1e-6, what=""):
    for name, got, expected in zip(("loss", "d hidden", "d weight"), fused, plain):
        assert _relative(got, expected) <= tol, (what, name, _relative(got, expected))


@pytest.mark.parametrize("chunk", [1, 7, 30, None, 1000])  # 7: a ragged last chunk of 2
@pytest.mark.parametrize("padding", [0, 3])
def test_loss_and_gradients_equal_the_plain_loss(chunk, padding):
    """fp32, one rank: any chunking gives the plain loss and both gradients to 1e-6; padding rows of the weight
    (past the vocabulary) are never predicted and get a zero gradient, as in the plain loss."""
    vocab = 50
    hidden, weight, targets = _inputs(30, 16, vocab + padding, vocab)
    fused = _fused(hidden, weight, targets, AxisGroup.single(), vocab, chunk)
    _assert_equal(fused, _plain(hidden, weight, targets, AxisGroup.single(), vocab), what=(chunk, padding))
    assert not fused[2][vocab:].any()


def test_chunk_rule_bounds_a_chunks_logits_by_the_input():
    assert chunk_tokens(32768, 128256, 2048) * 128256 <= 1.02 * 32768 * 2048
    assert chunk_tokens(100, 64, 128) == 100 and chunk_tokens(1, 10**6, 8) == 1


def test_the_model_forward_with_targets_is_the_loss_of_its_logits():
    """`model(x, None, y)`: fused (default) and unfused equal the loss of `model(x)` and every parameter's
    gradient, untied and tied (the head's weight gradient adds to the embedding's through autograd)."""
    for tied in (False, True):
        cfg = model_config(vocab_size=96, tie_embeddings=tied)
        model = build_model(cfg, None, seed=2)
        tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(3))
        x, y = tokens[:, :-1], tokens[:, 1:]
        params = [p for p in model.parameters()]
        reference = model.loss_fn(model(x), y)
        expected = torch.autograd.grad(reference, params)
        for fused in (True, False):
            model.fused_loss = fused
            loss = model(x, None, y)
            assert _relative(loss, reference) <= 1e-6, (tied, fused)
            for p, g, e in zip(model.parameters(), torch.autograd.grad(loss, params), expected):
                assert _relative(g, e) <= 1e-6, (tied, fused, p.shape)


def test_bf16_weights_and_autocast_follow_the_plain_loss():
    """bf16 (weights, or fp32 weights under autocast): the same bf16 logits and loss; gradients within bf16
    rounding (the plain path rounds d weight once, the fused one sums chunks in fp32, then rounds)."""
    vocab = 50
    hidden, weight, targets = _inputs(30, 16, vocab, vocab, dtype=torch.bfloat16)
    fused = _fused(hidden, weight, targets, AxisGroup.single(), vocab, 7)
    plain = _plain(hidden, weight, targets, AxisGroup.single(), vocab)
    assert fused[1].dtype == fused[2].dtype == torch.bfloat16
    _assert_equal(fused, plain, tol=1e-2)
    hidden, weight, targets = _inputs(30, 16, vocab, vocab)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _fused(hidden, weight, targets, AxisGroup.single(), vocab, 7)
        plain = _plain(hidden, weight, targets, AxisGroup.single(), vocab)
    assert fused[1].dtype == fused[2].dtype == torch.float32
    _assert_equal(fused, plain, tol=1e-2)
    assert fused[0] == plain[0]


def test_without_gradients_nothing_is_computed_or_held():
    hidden, weight, targets = _inputs(30, 16, 50, 50)
    with torch.no_grad():
        loss = fused_cross_entropy(hidden, weight, targets, chunk=7)
    assert loss.grad_fn is None
    assert loss == vocab_parallel_cross_entropy((hidden @ weight.t()).detach(), targets, AxisGroup.single(), 50)


def _peak(fn, *args) -> int:
    """Bytes the allocation tracker sees at most beyond what was live before, forward and backward."""
    tracker = AllocationTracker()
    with tracker:
        base = tracker.current
        loss = fn(*args)
        loss.backward()
        del loss
    return tracker.peak - base


def test_fused_loss_holds_under_a_quarter_of_the_plain_ones_memory():
    """2,048 tokens, 8,192 vocabulary, hidden 128, fp32, the head GEMM included in both: measured peak bytes
    (gradients of hidden and weight included) of the fused loss under a quarter of the plain one's."""
    hidden, weight, targets = _inputs(2048, 128, 8192, 8192)
    plain = _peak(
        lambda h, w, t: vocab_parallel_cross_entropy(h @ w.t(), t, AxisGroup.single(), 8192), hidden, weight, targets
    )
    hidden.grad = weight.grad = None
    fused = _peak(fused_cross_entropy, hidden, weight, targets)
    assert plain >= 2 * 2048 * 8192 * 4  # the logits and their fp32 softmax
    assert fused < plain / 4, (fused, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planner_terms_equal_what_the_fused_loss_holds(dtype):
    """What the fused loss keeps from F to B (counted by the activation counter) is the planner's head term
    less the final norm's input; its forward's peak beyond that (the allocation tracker) is
    `loss_transient_bytes` (the CPU's: its GEMMs copy a transposed operand, addmm_ uses a temporary).
    Held is what the counter sees exactly; the transient within 2%."""
    cfg = ModelConfig(vocab_size=4000, hidden_size=64, max_seq_len=512)
    s, b, B = 512, 2, (2 if dtype == torch.bfloat16 else 4)
    hidden, weight, targets = _inputs(s * b, 64, 4000, 4000, dtype=dtype)
    counter, tracker = ActivationCounter().exclude_parameters(torch.nn.Linear(1, 1)), AllocationTracker()
    with tracker, counter.counting():
        base = tracker.current
        loss = fused_cross_entropy(hidden, weight, targets)
    held = counter.current
    norm = s * b * 64 * B  # the final norm's input (fused kernels), the rest of the planner's head term
    assert held == head_activation_bytes(cfg, s, b, 1, False, B, fused_loss=True) - norm
    transient = tracker.peak - base - held
    expected = loss_transient_bytes(cfg, s, b, 1, B, fused_loss=True, fused_kernels=False)  # the CPU's GEMMs
    assert transient == pytest.approx(expected, rel=0.02)
    loss.backward()


def _tp_errors(tp_size: int) -> dict[str, float]:
    """On each rank: the fused vocab-parallel loss against the plain one on the same shards, and the tp model's
    fused loss and gradients against its plain loss's (vocabulary 250: padded), with and without SP."""
    mesh = ParallelMesh.for_this_rank(1, 1, tp_size)
    tp, vocab, errors = mesh.tp, 250, {}
    per_rank = -(-vocab // tp_size)
    hidden, full, targets = _inputs(40, 16, per_rank * tp_size, vocab)
    weight = full.detach()[tp.rank * per_rank : (tp.rank + 1) * per_rank].clone().requires_grad_()
    plain = _plain(hidden, weight, targets, tp, vocab)
    for chunk in (1, 7, None):
        fused = _fused(hidden, weight, targets, tp, vocab, chunk)
        errors[f"function chunk={chunk}"] = max(_relative(f, p) for f, p in zip(fused, plain))
    # the tp1 plain loss of the whole weight: the vocab-parallel one sums the slices' d hidden over tp
    whole = _plain(hidden, full, targets, AxisGroup.single(), vocab)
    torch.distributed.all_reduce(plain[1], group=tp.group)
    errors["d hidden summed vs tp1"] = _relative(plain[1], whole[1])
    cfg = model_config(vocab_size=vocab, tie_embeddings=True)
    tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(1))
    for sp in (False, True):
        model = build_model(cfg, mesh, seed=5, sequence_parallel=sp)
        params = list(model.parameters())
        results = []
        for fused in (False, True):
            model.fused_loss = fused
            loss = model(tokens[:, :-1], None, tokens[:, 1:])
            results.append((loss, *torch.autograd.grad(loss, params)))
        errors[f"model sp={sp}"] = max(_relative(f, p) for f, p in zip(results[1], results[0]))
    return errors


@pytest.mark.slow
def test_tp2_fused_loss_equals_the_vocab_parallel_loss():
    for rank_errors in run_ranks(_tp_errors, 2, 2):
        for case, err in rank_errors.items():
            assert err <= 1e-6, (case, err)


MODEL = [
    *model_flags(n_layers=4, vocab_size=257, tie_embeddings=True),
    "--seq-len",
    "32",
    "--steps",
    "4",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "1",
    "--eval-every",
    "2",
    "--train.eval_batches",
    "1",
    "--train.warmup_steps",
    "1",
]
LAYOUTS = {
    "one-rank": [],
    "tp2-sp-pp2-zbh1": ["--tp", "2", "--sequence-parallel", "--pp", "2", "--schedule", "zb-h1"],
    "cp2-dp2-zero3-recompute": ["--cp", "2", "--dp", "2", "--zero", "3", "--recompute", "full"],
}
UNFUSED = ["--train.fused_loss", "false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    common = [*MODEL, "--data", small_corpus]
    return Runs(
        tmp_path_factory.mktemp("fused"),
        {
            **{name: [*common, *layout] for name, layout in LAYOUTS.items()},
            **{f"{name}-unfused": [*common, *layout, *UNFUSED] for name, layout in LAYOUTS.items()},
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_curve_equals_the_unfused_losss(runs, name):
    """fp32: the loss and validation curves of the fused loss equal the unfused one's (vocabulary 257, tied,
    padded under tp), at one rank, tp2 + SP x pp2 under zb-h1, and cp2 x dp2 ZeRO-3 with full recompute."""
    fused, unfused = runs[name], runs[f"{name}-unfused"]
    assert_close_curves(losses(fused), losses(unfused), rtol=1e-6, what=name)
    val = [r["val_loss"] for r in fused if "val_loss" in r]
    assert val and val == pytest.approx([r["val_loss"] for r in unfused if "val_loss" in r], rel=1e-6)
