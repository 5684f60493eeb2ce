"""Compression inside training: only the dp reduction is compressed (tp and pp untouched), bytes fall, it learns."""

from __future__ import annotations

from tests.helpers import assert_close_curves, losses, train

MODEL = ["--model.hidden_size", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.ffn_hidden_size",
         "128", "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-every", "0",
         "--steps", "12", "--bucket-mb", "0.1"]


def test_compressed_runs_learn_with_fewer_dp_bytes(tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus]
    dense = train(str(tmp_path / "dense"), *common, "--dp", "2", "--tp", "2")
    int8 = train(str(tmp_path / "int8"), *common, "--dp", "2", "--tp", "2", "--compression", "int8")
    assert [r["comm_bytes_tp"] for r in int8] == [r["comm_bytes_tp"] for r in dense]  # tp traffic untouched
    assert int8[-1]["comm_bytes_dp"] < 0.3 * dense[-1]["comm_bytes_dp"]
    assert abs(losses(int8)[-1] - losses(dense)[-1]) < 0.01 * losses(dense)[-1]
    psgd = train(str(tmp_path / "psgd"), *common, "--dp", "2", "--pp", "2", "--zero", "1",
                 "--compression", "powersgd:2")
    assert losses(psgd)[-1] < losses(psgd)[0] - 0.3
    assert psgd[-1]["comm_bytes_pp"] > 0 and psgd[-1]["comm_bytes_dp"] > 0


def test_compression_warmup_is_dense_then_compressed(tmp_path, small_corpus):
    common = [*MODEL, "--data", small_corpus, "--dp", "2"]
    dense = train(str(tmp_path / "dense"), *common)
    warm = train(str(tmp_path / "warm"), *common, "--compression", "topk:0.05", "--compression-warmup", "4")
    assert [r["comm_bytes_dp"] for r in warm[:4]] == [r["comm_bytes_dp"] for r in dense[:4]]
    assert all(r["comm_bytes_dp"] < 0.2 * dense[0]["comm_bytes_dp"] for r in warm[4:])
    # Step 5's loss is the first that sees a compressed update (step k's loss precedes its update).
    assert_close_curves(losses(warm)[:5], losses(dense)[:5], rtol=1e-6, what="dense warm-up")
    assert losses(warm)[5] != losses(dense)[5]


def test_resume_continues_compression_exactly(tmp_path, small_corpus):
    """Residuals, PowerSGD's warm start and the step counter (random-k's seed, the warm-up's end) are training
    state: a resumed compressed run repeats the uninterrupted one; in another layout only the counter carries."""
    for spec in ("powersgd:2", "randomk:0.1"):
        common = [*MODEL, "--data", small_corpus, "--dp", "2", "--compression", spec, "--compression-warmup", "2"]
        full = train(str(tmp_path / spec / "full"), *common, "--save-every", "6")
        ckpt = str(tmp_path / spec / "full" / "checkpoints" / "step_6")
        resumed = train(str(tmp_path / spec / "resumed"), *common, "--resume", ckpt)
        assert losses(resumed) == losses(full)[6:], spec
        assert all(r["comm_bytes_dp"] == full[-1]["comm_bytes_dp"] for r in resumed)  # still compressed
    other = train(str(tmp_path / "dp4"), *common, "--dp", "4", "--micro-batch-size", "1", "--resume", ckpt)
    assert all(r["comm_bytes_dp"] == other[-1]["comm_bytes_dp"] for r in other)  # no dense warm-up again
    assert_close_curves(losses(other)[:1], losses(full)[6:7], rtol=1e-6, what="dp4 resume")  # before any update
