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
