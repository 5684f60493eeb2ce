"""Compression inside training: only the dp reduction is compressed (tp and pp untouched), bytes fall, it learns."""

from __future__ import annotations

from tests.dist import run_ranks
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
    for spec, target in (("powersgd:2", "gradient"), ("topk:0.05", "update"), ("randomk:0.1", "gradient")):
        common = [*MODEL, "--data", small_corpus, "--dp", "2", "--compression", spec, "--compression-warmup", "2",
                  "--compression-target", target]
        full = train(str(tmp_path / spec / "full"), *common, "--save-every", "6")
        ckpt = str(tmp_path / spec / "full" / "checkpoints" / "step_6")
        resumed = train(str(tmp_path / spec / "resumed"), *common, "--resume", ckpt)
        assert losses(resumed) == losses(full)[6:], spec  # update: each rank's own AdamW moments came back too
        assert all(r["comm_bytes_dp"] == full[-1]["comm_bytes_dp"] for r in resumed)  # still compressed
    other = train(str(tmp_path / "dp4"), *common, "--dp", "4", "--micro-batch-size", "1", "--resume", ckpt)
    assert all(r["comm_bytes_dp"] == other[-1]["comm_bytes_dp"] for r in other)  # no dense warm-up again
    assert_close_curves(losses(other)[:1], losses(full)[6:7], rtol=1e-6, what="dp4 resume")  # before any update


def test_update_target_is_adamw_on_one_rank_and_learns_compressed_on_two(tmp_path, small_corpus):
    """On one rank the update path is AdamW itself; on two, top-k of the update learns with far fewer bytes."""
    common = [*MODEL, "--data", small_corpus]
    plain = train(str(tmp_path / "plain"), *common)
    update = train(str(tmp_path / "update"), *common, "--compression-target", "update")
    assert_close_curves(losses(update), losses(plain), rtol=1e-5, what="update path on one rank")
    dense = train(str(tmp_path / "dense2"), *common, "--dp", "2")
    topk = train(str(tmp_path / "topk2"), *common, "--dp", "2", "--compression", "topk:0.05",
                 "--compression-target", "update")
    assert topk[-1]["comm_bytes_dp"] < 0.15 * dense[-1]["comm_bytes_dp"]
    assert losses(topk)[-1] < losses(topk)[0] - 0.3


def _replicas_after_compressed_training(run_dir: str, corpus: str, spec: str, target: str) -> float:
    """Train tp=2 x dp=2 with compression; the largest difference of a tp-replicated parameter between tp peers."""
    import os

    import torch
    import torch.distributed as dist

    from large_model_training.config import build_config, validate
    from large_model_training.mesh import ParallelMesh
    from large_model_training.parallel.tensor import tp_layouts
    from large_model_training.train.trainer import Trainer

    overrides = {"model.hidden_size": 64, "model.n_layers": 2, "model.n_heads": 4, "model.ffn_hidden_size": 128,
                 "train.seq_len": 32, "train.micro_batch_size": 2, "train.global_batch_size": 8, "train.steps": 3,
                 "train.eval_every": 0, "parallel.tp": 2, "parallel.dp": 2, "parallel.bucket_mb": 0.1,
                 "data.path": corpus, "train.compression": spec, "train.compression_target": target}
    cfg = validate(build_config(overrides=overrides))
    mesh = ParallelMesh.for_this_rank(1, 2, 2)
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, mesh, run_dir)
    trainer.fit()
    worst = 0.0
    for name, layout in sorted(tp_layouts(trainer.model).items()):
        if layout.replicated:
            mine = dict(trainer.model.named_parameters())[name].detach().clone()
            peers = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(peers, mine, group=mesh.tp_group)
            worst = max(worst, float((peers[0] - peers[1]).abs().max()))
    return worst


def test_tp_replicated_parameters_stay_identical_under_compression(tmp_path, small_corpus):
    """A bucket mixing tp-sharded and tp-replicated parameters would make top-k (or int8's chunk scales) pick
    differently on tp peers and drift their copies of the replicated ones apart."""
    for spec, target in (("topk:0.05", "gradient"), ("int8", "gradient"), ("topk:0.05", "update")):
        out = str(tmp_path / f"{spec}-{target}".replace(":", "_"))
        assert run_ranks(_replicas_after_compressed_training, 4, out, small_corpus, spec, target) == [0.0] * 4, spec
