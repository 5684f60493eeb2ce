"""`--optimizer onebit-adam`: the sign compressor and its error feedback, the warm-up that is AdamW, the compressed
path that is AdamW's momentum at compression 'none', one result at ZeRO 0, 1 and 2 with sharded state, the bytes
on the wire, an exact resume, and the one-line refusals."""

from __future__ import annotations

import math

import pytest
import torch

from large_model_training.compression.sign import SIGN_CHUNK, Codec, sign_compress, sign_nbytes
from large_model_training.config import build_config
from large_model_training.errors import ConfigError
from large_model_training.layout import validate
from large_model_training.parallel.onebit_adam import variance_updates
from tests.helpers import Runs, assert_close_curves, losses, model_flags, tp2_dp2_replica_divergence

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
    "10",
    "--bucket-mb",
    "0.1",
    "--dp",
    "2",
]
ONEBIT = ["--optimizer", "onebit-adam", "--train.onebit_warmup", "3"]


# ---- the compressor and the math, in one process -------------------------------------------------------------
def test_sign_compression_keeps_signs_and_chunk_mean_magnitudes():
    x = torch.randn(2 * SIGN_CHUNK + 100, generator=torch.Generator().manual_seed(0))
    payload = sign_compress(x)
    y = payload.decompress()
    assert torch.equal(y > 0, x >= 0)
    for lo in (0, SIGN_CHUNK, 2 * SIGN_CHUNK):  # the last chunk's mean is over its 100 real elements
        chunk = slice(lo, lo + SIGN_CHUNK)
        assert torch.allclose(y[chunk].abs(), x[chunk].abs().mean().expand_as(y[chunk]))
    assert payload.nbytes == sign_nbytes(x.numel()) == math.ceil(x.numel() / 8) + 4 * 3


@pytest.mark.parametrize("kind", ["sign", "int8", "int4", "none"])
def test_codec_messages_have_the_documented_size_and_decode_to_what_was_sent(kind):
    codec, x = Codec(kind), torch.randn(5000)
    message, sent = codec.encode(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.nbytes(x.numel())
    assert torch.equal(codec.decode(torch.stack([message, message]), x.numel())[1], sent)
    assert kind != "none" or torch.equal(sent, x)


@pytest.mark.parametrize("kind", ["sign", "int8", "int4"])
def test_error_feedback_is_exact_bookkeeping(kind):
    """Over many steps: what was sent plus the last error is what went in."""
    codec, gen = Codec(kind), torch.Generator().manual_seed(1)
    error, inputs, sent_sum = torch.zeros(3000, dtype=torch.float64), 0, 0
    for _ in range(30):
        g = torch.randn(3000, generator=gen) * 0.1
        x = g + error.float()
        _, sent = codec.encode(x)
        error = x.double() - sent.double()
        inputs, sent_sum = inputs + g.double(), sent_sum + sent.double()
    assert torch.allclose(sent_sum + error, inputs, atol=1e-5)
    assert error.abs().max() < 1.0  # the error stays bounded: it is fed back, not accumulated


def test_the_seed_api_compresses_by_sign_with_error_feedback():
    import large_model_training as lmt

    gc, g = lmt.GradientCompression(), torch.randn(3000)
    payload = gc.compress_gradients(g, "sign", name="w")
    assert payload.nbytes == sign_nbytes(3000)
    assert torch.allclose(payload.decompress() + gc.residual("w"), g, atol=1e-6)


def test_variance_updates_count_the_warm_up_and_the_refreshes():
    assert [variance_updates(t, 3, 0) for t in range(1, 7)] == [1, 2, 3, 3, 3, 3]
    assert [variance_updates(t, 3, 2) for t in range(1, 8)] == [1, 2, 3, 3, 4, 4, 5]
    assert [variance_updates(t, 3, 1) for t in range(1, 7)] == list(range(1, 7))  # AdamW's


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"parallel.zero": 3}, "composes with --zero 0, 1 or 2"),
        ({"train.compression": "int8"}, "compresses the momentum itself"),
        ({"train.compression_target": "update"}, "compresses the momentum itself"),
        ({"train.onebit_compression": "int4"}, "train.onebit_compression must be one of"),
        ({"train.onebit_warmup": 0}, "train.onebit_warmup must be positive"),
        ({"train.onebit_variance_refresh": -1}, "train.onebit_variance_refresh must be >= 0"),
    ],
)
def test_bad_onebit_settings_are_one_line_errors(overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        validate(build_config(overrides={"train.optimizer": "onebit-adam", "parallel.dp": 2, **overrides}))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="train.optimizer must be one of"):
        validate(build_config(overrides={"train.optimizer": "lamb"}))


def test_onebit_composes_with_zero_0_1_2():
    for zero in (0, 1, 2):
        validate(build_config(overrides={"train.optimizer": "onebit-adam", "parallel.dp": 2, "parallel.zero": zero}))


# ---- real ranks --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    root = tmp_path_factory.mktemp("onebit")
    common = [*MODEL, "--data", small_corpus]
    exact = ["--train.grad_clip", "0"]  # clipping after the warm-up uses the ranks' RMS norm: not AdamW's
    args = {
        "adamw": [*common, *exact],
        "none-refresh": [
            *common,
            *exact,
            *ONEBIT,
            "--train.onebit_compression",
            "none",
            "--train.onebit_variance_refresh",
            "1",
        ],
        "sign-z0": [*common, *ONEBIT],
        "sign-z1": [*common, *ONEBIT, "--zero", "1"],
        "sign-z2": [*common, *ONEBIT, "--zero", "2"],
        "int8-z1": [*common, *ONEBIT, "--zero", "1", "--train.onebit_compression", "int8"],
        "adamw-clipped": common,
        "sign-full": [*common, *ONEBIT, "--zero", "1", "--save-every", "5"],
    }
    args["sign-resumed"] = [*args["sign-full"], "--resume", str(root / "sign-full" / "checkpoints" / "step_5")]
    return Runs(root, args)


@pytest.mark.slow
def test_warm_up_is_adamw_and_compression_none_is_adamw_after_it(runs):
    adamw, onebit = runs["adamw"], runs["none-refresh"]
    # Steps 1-4 see only warm-up updates (step k's loss precedes its update): bit for bit AdamW's.
    assert losses(onebit)[:4] == losses(adamw)[:4]
    assert [r["comm_bytes_dp"] for r in onebit[:3]] == [r["comm_bytes_dp"] for r in adamw[:3]]
    # After it, the averaged momentum increments at compression none with v refreshed every step: AdamW.
    assert_close_curves(losses(onebit), losses(adamw), rtol=1e-5, what="onebit none vs adamw")


@pytest.mark.slow
def test_zero_1_and_2_give_zero_0s_result_and_sign_learns_with_fewer_bytes(runs):
    z0 = runs["sign-z0"]
    for zero in ("sign-z1", "sign-z2"):
        assert_close_curves(losses(runs[zero]), losses(z0), rtol=1e-5, what=zero)
    assert abs(losses(z0)[3] - losses(runs["adamw-clipped"])[3]) == 0  # the warm-up
    assert abs(losses(z0)[-1] - losses(runs["adamw-clipped"])[-1]) < 0.05 * losses(runs["adamw-clipped"])[-1]
    dense = runs["adamw-clipped"][-1]["comm_bytes_dp"]
    assert z0[-1]["comm_bytes_dp"] < dense / 15  # 1/8 byte per element and a shard's return trip
    assert losses(runs["int8-z1"])[-1] < losses(runs["int8-z1"])[0] - 0.3


@pytest.mark.slow
def test_resume_after_the_warm_up_is_exact(runs):
    full, resumed = runs["sign-full"], runs["sign-resumed"]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == losses(full)[5:]
    assert [r["comm_bytes_dp"] for r in resumed] == [r["comm_bytes_dp"] for r in full[5:]]


def _engine_after_training(run_dir: str, corpus: str, zero: int, kind: str) -> dict:
    """Train 5 steps (3 warm-up) at dp = 2 and report the engine's state sizes and its last step's bytes."""
    import os

    from large_model_training.mesh import ParallelMesh
    from large_model_training.train.trainer import Trainer

    overrides = {
        "model.hidden_size": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.ffn_hidden_size": 128,
        "train.seq_len": 32,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "train.steps": 5,
        "train.eval_every": 0,
        "parallel.dp": 2,
        "parallel.zero": zero,
        "parallel.bucket_mb": 0.1,
        "data.path": corpus,
        "train.optimizer": "onebit-adam",
        "train.onebit_warmup": 3,
        "train.onebit_compression": kind,
    }
    cfg = validate(build_config(overrides=overrides))
    mesh = ParallelMesh.for_this_rank(1, 2, 1)
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, mesh, run_dir)
    trainer.fit()
    engine = trainer.engine
    rule = engine.rule
    codec = rule.codec
    shards = [b.numel // 2 for b in engine.buckets]
    expected = sum(2 * codec.nbytes(s) for s in shards)  # the all-to-all: every shard's message
    expected += sum(codec.nbytes(s) for s in shards) if zero == 0 else 4 * sum(shards)  # compressed or params
    return {
        "m": [m.numel() for m in rule.adamw.exp_avg],
        "v": [v.numel() for v in rule.adamw.exp_avg_sq],
        "server": [rule.server_error[b.index].numel() for b in engine.buckets],
        "worker": [rule.worker_error[b.index].numel() for b in engine.buckets],
        "buckets": [b.numel for b in engine.buckets],
        "bytes": engine.comm_bytes(),
        "expected": expected,
    }


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_state_is_sharded_and_bytes_are_the_packed_sizes(tmp_path, small_corpus, zero):
    from tests.dist import run_ranks

    for rank in run_ranks(_engine_after_training, 2, str(tmp_path / "run"), small_corpus, zero, "sign"):
        shards = [n // 2 for n in rank["buckets"]]
        assert rank["m"] == rank["v"] == (shards if zero else rank["buckets"])
        assert rank["server"] == shards  # served shard only, at every ZeRO stage
        assert rank["worker"] == rank["buckets"]  # the worker error is full size (as DeepSpeed's)
        assert rank["bytes"] == rank["expected"]


@pytest.mark.slow
def test_tp_replicated_parameters_stay_identical(tmp_path, small_corpus):
    """tp peers compress their identical copies of replicated parameters identically (buckets of their own)."""
    from tests.dist import run_ranks

    onebit = {"parallel.zero": 1, "train.optimizer": "onebit-adam", "train.onebit_warmup": 2}  # 2 warm-up steps
    assert run_ranks(tp2_dp2_replica_divergence, 4, str(tmp_path / "run"), small_corpus, 5, onebit) == [0.0] * 4
