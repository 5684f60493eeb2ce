"""Compression inside training: only the dp reduction is compressed (tp and pp untouched), bytes fall, it learns."""

from __future__ import annotations

import pytest

from tests.dist import run_ranks
from tests.helpers import Runs, assert_close_curves, losses, model_flags, tp2_dp2_replica_divergence

pytestmark = pytest.mark.slow  # every test here trains

MODEL = [
    *model_flags(),
    "--seq-len",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--eval-every",
    "0",
    "--steps",
    "12",
    "--bucket-mb",
    "0.1",
]
RESUMED = {
    "powersgd": ("powersgd:2", "gradient"),
    "topk-update": ("topk:0.05", "update"),
    "randomk": ("randomk:0.1", "gradient"),
    "int8-two-stage": ("int8:two-stage", "gradient"),
}  # resumed at step 4 of 8, compressed from step 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    """Every run of this module, each trained once, when first read (a resumed run after its source)."""
    root = tmp_path_factory.mktemp("compression")
    common = [*MODEL, "--data", small_corpus]
    warmup = [*common, "--dp", "2", "--steps", "6"]  # the warm-up test: 4 dense steps, then 2 compressed ones
    one_rank = [*common, "--steps", "4"]
    args = {
        "plain": one_rank,
        "update-1rank": [*one_rank, "--compression-target", "update"],
        "dense-dp2": warmup,
        "warmup-topk": [*warmup, "--compression", "topk:0.05", "--compression-warmup", "4"],
        "update-topk": [*common, "--dp", "2", "--compression", "topk:0.05", "--compression-target", "update"],
        "dense-tp2-dp2": [*common, "--dp", "2", "--tp", "2"],
        "int8-tp2-dp2": [*common, "--dp", "2", "--tp", "2", "--compression", "int8"],
        "powersgd-dp2-pp2": [*common, "--dp", "2", "--pp", "2", "--zero", "1", "--compression", "powersgd:2"],
    }
    for name, (spec, target) in RESUMED.items():
        compressed = [
            *common,
            "--dp",
            "2",
            "--steps",
            "8",
            "--compression",
            spec,
            "--compression-warmup",
            "2",
            "--compression-target",
            target,
        ]
        args[f"{name}-full"] = [*compressed, "--save-every", "4"]
        args[f"{name}-resumed"] = [*compressed, "--resume", str(root / f"{name}-full" / "checkpoints" / "step_4")]
    # Another layout from the last one's checkpoint: dp 4.
    args["randomk-resumed-dp4"] = [*args["randomk-resumed"], "--dp", "4", "--micro-batch-size", "1"]
    return Runs(root, args)


def test_compressed_runs_learn_with_fewer_dp_bytes(runs):
    dense, int8 = runs["dense-tp2-dp2"], runs["int8-tp2-dp2"]
    assert [r["comm_bytes_tp"] for r in int8] == [r["comm_bytes_tp"] for r in dense]  # tp traffic untouched
    assert int8[-1]["comm_bytes_dp"] < 0.3 * dense[-1]["comm_bytes_dp"]
    assert abs(losses(int8)[-1] - losses(dense)[-1]) < 0.01 * losses(dense)[-1]
    psgd = runs["powersgd-dp2-pp2"]
    assert losses(psgd)[-1] < losses(psgd)[0] - 0.3
    assert psgd[-1]["comm_bytes_pp"] > 0 and psgd[-1]["comm_bytes_dp"] > 0


def test_compression_warmup_is_dense_then_compressed(runs):
    dense, warm = runs["dense-dp2"], runs["warmup-topk"]
    assert [r["comm_bytes_dp"] for r in warm[:4]] == [r["comm_bytes_dp"] for r in dense[:4]]
    assert all(r["comm_bytes_dp"] < 0.2 * dense[0]["comm_bytes_dp"] for r in warm[4:])
    # Step 5's loss is the first that sees a compressed update (step k's loss precedes its update).
    assert_close_curves(losses(warm)[:5], losses(dense)[:5], rtol=1e-6, what="dense warm-up")
    # ... and it moves by far more than the 1e-6 any layout may differ by (about 1.5e-3 here).
    assert abs(losses(warm)[5] - losses(dense)[5]) > 1e-4 * losses(dense)[5]


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_continues_compression_exactly(runs, name):
    """Residuals, PowerSGD's warm start and the step counter (random-k's seed, the warm-up's end) are training
    state: a resumed compressed run repeats the uninterrupted one."""
    full, resumed = runs[f"{name}-full"], runs[f"{name}-resumed"]
    assert [r["step"] for r in resumed] == list(range(5, 9))
    assert losses(resumed) == losses(full)[4:]  # update: each rank's own AdamW moments came back too
    assert all(r["comm_bytes_dp"] == full[-1]["comm_bytes_dp"] for r in resumed)  # still compressed


def test_resume_in_another_layout_carries_only_the_step_counter(runs):
    other, full = runs["randomk-resumed-dp4"], runs["randomk-full"]
    assert all(r["comm_bytes_dp"] == other[-1]["comm_bytes_dp"] for r in other)  # no dense warm-up again
    assert_close_curves(losses(other)[:1], losses(full)[4:5], rtol=1e-6, what="dp4 resume")  # before any update


def test_update_target_is_adamw_on_one_rank_and_learns_compressed_on_two(runs):
    """On one rank the update path is AdamW itself; on two, top-k of the update learns with far fewer bytes."""
    assert_close_curves(losses(runs["update-1rank"]), losses(runs["plain"]), rtol=1e-5, what="update path on one rank")
    dense, topk = runs["dense-dp2"], runs["update-topk"]
    assert topk[-1]["comm_bytes_dp"] < 0.15 * dense[-1]["comm_bytes_dp"]
    assert losses(topk)[-1] < losses(topk)[0] - 0.3


def test_tp_replicated_parameters_stay_identical_under_compression(tmp_path, small_corpus):
    """A bucket mixing tp-sharded and tp-replicated parameters would make top-k (or int8's chunk scales) pick
    differently on tp peers and drift their copies of the replicated ones apart."""
    for spec, target in (("topk:0.05", "gradient"), ("int8", "gradient"), ("topk:0.05", "update")):
        out = str(tmp_path / f"{spec}-{target}".replace(":", "_"))
        compression = {"train.compression": spec, "train.compression_target": target}
        assert run_ranks(tp2_dp2_replica_divergence, 4, out, small_corpus, 3, compression) == [0.0] * 4, spec
