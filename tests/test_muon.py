"""`--optimizer muon` (parallel/muon.py): Newton-Schulz against torch's and a plain reference, the matrices it
takes, the owner-rank exchange at dp 2 under ZeRO 0, 1 and 2 against one rank, an exact resume, the refusals."""

from __future__ import annotations

import pytest
import torch

from large_model_training.config import build_config, model_from_preset
from large_model_training.errors import ConfigError
from large_model_training.layout import validate
from large_model_training.models.transformer import Transformer
from large_model_training.parallel.muon import NS_COEFFICIENTS, muon_parameters, newton_schulz
from tests.helpers import Runs, assert_close_curves, losses

MODEL = [
    "--model.hidden_size",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.ffn_hidden_size",
    "128",
    "--seq-len",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--eval-every",
    "0",
    "--steps",
    "8",
    "--bucket-mb",
    "0.02",
    "--train.grad_clip",
    "0",
]


def _reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration written out in float64: X <- a X + b (X X^T) X + c (X X^T)^2 X on the wide side."""
    a, b, c = NS_COEFFICIENTS
    x = g.double()
    x = x.T if g.shape[0] > g.shape[1] else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (16, 16)])
def test_newton_schulz_matches_torchs_and_a_plain_reference(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(newton_schulz(g), _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7))
    ours = newton_schulz(g, dtype=torch.float32)
    assert torch.allclose(ours.double(), _reference(g), atol=1e-5)
    singular = torch.linalg.svdvals(ours)  # near-orthogonal: singular values pushed into about [0.5, 1.5]
    assert singular.min() > 0.3 and singular.max() < 1.5


def test_muon_takes_the_blocks_matrices_and_leaves_the_rest_to_adamw():
    with torch.device("meta"):
        model = Transformer(model_from_preset("tiny"))
    named = list(model.named_parameters())
    chosen = muon_parameters(named)
    assert chosen and all(dict(named)[n].ndim == 2 for n in chosen)
    assert not any("embeddings" in n or n.startswith("output") or "norm" in n for n in chosen)
    assert any(n.endswith("wqkv.weight") for n in chosen)


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"parallel.zero": 3}, "composes with --zero 0, 1 or 2"),
        ({"train.compression_target": "update"}, "does not apply"),
        ({"train.optimizer": "lion"}, "train.optimizer"),
    ],
)
def test_bad_muon_settings_are_one_line_errors(overrides, words):
    base = {"train.optimizer": "muon", "parallel.dp": 2}
    with pytest.raises(ConfigError, match=words):
        validate(build_config(overrides={**base, **overrides}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    root = tmp_path_factory.mktemp("muon")
    common = [*MODEL, "--data", small_corpus, "--optimizer", "muon"]
    args = {
        "one": common,
        "adamw": [*MODEL, "--data", small_corpus],
        "z0": [*common, "--dp", "2"],
        "z1": [*common, "--dp", "2", "--zero", "1"],
        "z2": [*common, "--dp", "2", "--zero", "2"],
        "full": [*common, "--dp", "2", "--zero", "1", "--save-every", "4"],
    }
    args["one-resumed"] = [*common, "--resume", str(root / "full" / "checkpoints" / "step_4")]
    args["tp2"] = [*common, "--tp", "2", "--sequence-parallel", "--save-every", "4"]
    args["tp2-to-one"] = [*common, "--resume", str(root / "tp2" / "checkpoints" / "step_4")]
    args["resumed"] = [
        *common,
        "--dp",
        "2",
        "--zero",
        "2",
        "--save-every",
        "4",
        "--resume",
        str(root / "full" / "checkpoints" / "step_4"),
    ]
    return Runs(root, args)


@pytest.mark.slow
def test_owner_ranks_at_dp2_give_one_ranks_result_under_zero_0_1_2(runs):
    one = losses(runs["one"])
    assert losses(runs["adamw"])[1:] != one[1:]  # Muon is what ran
    z0, z1, z2 = (losses(runs[k]) for k in ("z0", "z1", "z2"))
    assert z0 == z1  # the same matrices orthogonalised the same way, whoever owns them
    # ZeRO-2 reduces each micro-batch's gradients and sums the averages: the same gradient, summed in another order
    assert_close_curves(z2, z1, rtol=1e-5, what="muon zero 2 vs 1")
    assert_close_curves(z0, one, rtol=1e-5, what="muon dp2 vs one rank")


@pytest.mark.slow
def test_resume_is_exact_and_reshards_zero_1_to_2(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert [r["step"] for r in resumed] == list(range(5, 9))
    # The full run is ZeRO-1, the resumed one ZeRO-2, whose per-micro-batch reductions sum in another order.
    assert_close_curves(losses(resumed), losses(full)[4:], rtol=1e-5, what="zero 1 resumed as zero 2")


@pytest.mark.slow
def test_a_dp2_checkpoint_resumes_on_one_rank(runs):
    """The momentum is saved by name (from its owners): one rank, owning every matrix, takes all of it."""
    assert_close_curves(losses(runs["one-resumed"]), losses(runs["full"])[4:], rtol=1e-5, what="dp2 -> dp1")


@pytest.mark.slow
def test_tp2_orthogonalises_whole_matrices(runs):
    """Each tp pair gathers the shards (fused rows in shard order: a row permutation NS commutes with), so tp 2
    follows one rank's curve; per-shard orthogonalisation would not (bf16 NS: not bit for bit)."""
    assert_close_curves(losses(runs["tp2"]), losses(runs["one"]), rtol=2e-5, what="muon tp2 vs tp1")


@pytest.mark.slow
def test_a_tp2_checkpoint_resumes_at_tp1(runs):
    """The momentum of tp-split matrices is saved at its logical shape (a DTensor per name), as Adam's moments."""
    assert_close_curves(losses(runs["tp2-to-one"]), losses(runs["tp2"])[4:], rtol=2e-5, what="muon tp2 -> tp1")


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.dp": 2, "parallel.pp": 2, "parallel.zero": 1},
        {"parallel.dp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True, "train.precision": "bf16"},
        {"parallel.dp": 2, "parallel.zero": 2, "train.optimizer_states": "bf16"},
    ],
)
def test_muon_holds_the_optimizer_bytes_the_estimate_counts(layout):
    """Muon keeps its momentum (on each matrix's owner) and Adam's moments only for the other parameters; a
    rehearsed rank's optimizer-state bytes are the planner's (within 5%), at every kind of rank."""
    from large_model_training.mesh import RankGrid
    from large_model_training.train.rehearse import rank_kinds, rehearse_rank, with_estimates

    overrides = {
        "model.hidden_size": 64,
        "model.n_layers": 4,
        "model.n_heads": 4,
        "model.ffn_hidden_size": 128,
        "train.seq_len": 32,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 2,
        "train.optimizer": "muon",
        **layout,
    }
    cfg = validate(build_config(overrides=overrides))
    p = cfg.parallel
    kinds = rank_kinds(RankGrid(p.pp, p.dp, p.tp), p.zero)
    for report in with_estimates(cfg, [rehearse_rank(cfg, kind) for kind in kinds]):
        measured, estimate = report["optimizer_bytes"], report["estimate_optimizer_bytes"]
        assert measured == pytest.approx(estimate, rel=0.05), (report["kind"], measured, estimate)
