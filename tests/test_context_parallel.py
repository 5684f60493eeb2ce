"""Context parallelism (`--cp`): the zig-zag split, attention across the cp ranks, and training at cp > 1
reproducing the cp = 1 loss curve (fp32) alone and with tp (SP), pp and dp x ZeRO, and a cp checkpoint resumed
at cp = 1."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from large_model_training.config import build_config
from large_model_training.errors import ConfigError
from large_model_training.layout import validate
from large_model_training.mesh import ParallelMesh, RankGrid
from large_model_training.parallel.context import ContextAttention, shard_micro_batches, zigzag_positions, zigzag_shard
from tests.dist import run_ranks
from tests.helpers import Runs, assert_close_curves, losses, model_flags, val_losses

HAS_RING = importlib.util.find_spec("large_model_training.parallel.ring_attention") is not None


def test_zigzag_parts_cover_the_sequence_once_and_balance_causal_work():
    seq, cp = 24, 3
    x = torch.arange(2 * seq).view(2, seq)
    parts = [zigzag_shard(x, 1, r, cp) for r in range(cp)]
    positions = [zigzag_positions(seq, r, cp) for r in range(cp)]
    for part, pos in zip(parts, positions):
        assert torch.equal(part, x[:, pos])
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(seq))
    assert positions[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    work = [int((pos + 1).sum()) for pos in positions]  # keys each rank's queries see under the causal mask
    assert len(set(work)) == 1


def test_micro_batches_keep_inputs_and_targets_aligned():
    class Group:  # the two fields shard_micro_batches reads
        size, rank = 2, 1

    x = torch.arange(16).view(1, 16)
    ((inputs, targets),) = shard_micro_batches([(x, x + 1)], Group())
    assert torch.equal(targets, inputs + 1) and inputs.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.skipif(not HAS_RING, reason="parallel/ring_attention.py not in this build")
def test_grid_puts_cp_between_dp_and_tp_and_keeps_three_axis_calls():
    grid = RankGrid(pp=2, dp=2, tp=2, cp=2)
    assert grid.group_ranks("tp", 0) == [0, 1]
    assert grid.group_ranks("cp", 0) == [0, 2]
    assert grid.group_ranks("dp", 0) == [0, 4]
    assert grid.group_ranks("pp", 0) == [0, 8]
    assert grid.coordinate(7) == {"pp": 0, "dp": 1, "cp": 1, "tp": 1}
    assert all(grid.rank(**grid.coordinate(r)) == r for r in range(16))
    assert RankGrid(2, 2, 2).coordinate(6) == {"pp": 1, "dp": 1, "tp": 0}  # cp = 1: as before


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"parallel.cp": "3", "train.seq_len": "32"}, "divisible by 2 x cp = 6"),
        ({"parallel.cp": "2", "parallel.cp_attention": "rings"}, "ring or allgather"),
        ({"parallel.cp": "2", "model.dropout": "0.1"}, "dropout"),
        ({"parallel.cp": "2", "data.document_mask": "true"}, "document_mask"),
        (
            {"parallel.cp": "2", "parallel.tp": "4", "parallel.sequence_parallel": "true", "train.seq_len": "12"},
            "seq_len / cp (6) divisible by tp (4)",
        ),
    ],
)
def test_layout_refuses_what_cp_cannot_run(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):  # (a choice: at build)
        validate(build_config(None, {"model.preset": "tiny", "parallel.cp_attention": "allgather", **overrides}))


def test_world_size_counts_cp():
    cfg = build_config(
        None,
        {
            "model.preset": "tiny",
            "parallel.cp": "2",
            "parallel.tp": "2",
            "parallel.cp_attention": "allgather",
            "train.seq_len": "32",
        },
    )
    assert validate(cfg, world_size=8).parallel.dp == 2
    with pytest.raises(ConfigError, match="tp x cp x pp"):
        validate(
            build_config(
                None,
                {
                    "model.preset": "tiny",
                    "parallel.cp": "2",
                    "parallel.dp": "2",
                    "parallel.cp_attention": "allgather",
                    "train.seq_len": "32",
                },
            ),
            world_size=6,
        )


def _mesh_groups() -> dict:
    import torch.distributed as dist

    mesh = ParallelMesh.for_this_rank(pp=1, dp=2, tp=2, cp=2)
    facts = {"ranks": (mesh.dp_rank, mesh.cp_rank, mesh.grad_rank, mesh.grad_size, mesh.dp_size)}
    for axis in ("cp", "tp", "dp", "grad"):
        group = mesh.group(axis)
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, torch.tensor([mesh.rank]), group=group)
        facts[axis] = [int(t) for t in gathered]
    return facts


@pytest.mark.slow
def test_mesh_groups_follow_the_grid_and_gradients_span_dp_x_cp():
    grid = RankGrid(pp=1, dp=2, tp=2, cp=2)
    for rank, facts in enumerate(run_ranks(_mesh_groups, 8)):
        c = grid.coordinate(rank)
        assert facts["ranks"] == (c["dp"], c["cp"], 2 * c["dp"] + c["cp"], 4, 2)  # the loader shards by dp alone
        assert facts["cp"] == grid.group_ranks("cp", rank) and facts["tp"] == grid.group_ranks("tp", rank)
        assert facts["grad"] == [r for r in range(8) if r % 2 == c["tp"]]  # the gradient group: dp x cp
        assert facts["dp"] == grid.group_ranks("dp", rank)


def _attention_against_sdpa(variant: str) -> dict:
    """Every rank: its zig-zag part of q, k, v (GQA: 4 query heads, 2 kv heads); output and gradients of
    `variant` against the same parts of plain causal SDPA over the whole sequence."""
    import torch.distributed as dist

    cp_size = dist.get_world_size()
    mesh = ParallelMesh.for_this_rank(1, 1, 1, cp_size)
    g = torch.Generator().manual_seed(0)
    seq = 8 * cp_size
    q, k, v = (torch.randn(2, h, seq, 16, generator=g) for h in (4, 2, 2))
    w = torch.randn(2, 4, seq, 16, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True) * w).sum().backward()
    mine = [zigzag_shard(t, 2, mesh.cp_rank, cp_size).requires_grad_() for t in (q, k, v)]
    out = ContextAttention(mesh.cp, variant)(*mine)
    (out * zigzag_shard(w, 2, mesh.cp_rank, cp_size)).sum().backward()
    expected = zigzag_shard(
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 2, mesh.cp_rank, cp_size
    )
    errors = {"out": float((out - expected).abs().max())}
    for name, a, b in zip("qkv", mine, full):
        errors[f"d{name}"] = float((a.grad - zigzag_shard(b.grad, 2, mesh.cp_rank, cp_size)).abs().max())
    return {"errors": errors, "bytes": mesh.cp.bytes}


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(
    "variant",
    [
        "allgather",
        pytest.param(
            "ring", marks=pytest.mark.skipif(not HAS_RING, reason="parallel/ring_attention.py not in this build")
        ),
    ],
)
def test_cp_attention_equals_causal_sdpa_in_values_and_gradients(cp, variant):
    for rank, r in enumerate(run_ranks(_attention_against_sdpa, cp, variant)):
        assert max(r["errors"].values()) < 1e-5, (rank, r["errors"])  # fp32: the ring merges in fp32
        if variant == "allgather":  # K and V gathered, dK and dV reduce-scattered: 4 x (cp-1)/cp of the whole
            assert r["bytes"] == 4 * (cp - 1) * (2 * 2 * 8 * 16 * 4), r["bytes"]


MODEL = [
    *model_flags(hidden_size=32, n_kv_heads=2, ffn_hidden_size=64),
    "--seq-len",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--steps",
    "10",
    "--eval-every",
    "5",
    "--train.eval_batches",
    "1",
    "--precision",
    "fp32",
]
AG = ["--cp-attention", "allgather"]
LEARNED = ["--model.position", "learned"]
LAYOUTS = {  # name: (extra arguments, reference run)
    "cp2-allgather": (["--cp", "2", *AG], "ref"),
    "cp4-allgather": (["--cp", "4", *AG], "ref"),
    "cp2-learned": (["--cp", "2", *AG, *LEARNED], "ref-learned"),
    "tp2-sp-cp2": (["--tp", "2", "--sequence-parallel", "--cp", "2", *AG], "ref"),
    "pp2-cp2": (["--pp", "2", "--cp", "2", *AG], "ref"),
    "cp2-dp2-zero1": (["--cp", "2", "--dp", "2", "--zero", "1", *AG], "ref"),
    "cp2-zero3-selective": (["--cp", "2", "--zero", "3", "--recompute", "selective", *AG], "ref"),
    **(
        {
            "cp2-ring": (["--cp", "2", "--cp-attention", "ring"], "ref"),
            "cp4-ring": (["--cp", "4", "--cp-attention", "ring"], "ref"),
            "tp2-sp-cp2-ring": (["--tp", "2", "--sequence-parallel", "--cp", "2", "--cp-attention", "ring"], "ref"),
            "pp2-cp2-ring": (["--pp", "2", "--cp", "2", "--cp-attention", "ring"], "ref"),
        }
        if HAS_RING
        else {}
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    """The cp = 1 references and every cp run of this module, each trained once, when first read."""
    root = tmp_path_factory.mktemp("cp")
    common = [*MODEL, "--data", small_corpus]
    return Runs(
        root,
        {
            "ref": common,
            "ref-learned": [*common, *LEARNED],
            **{name: [*common, *extra] for name, (extra, _) in LAYOUTS.items()},
            "cp2-saving": [*common, "--cp", "2", *AG, "--save-every", "5"],
            "cp2-as-cp1": [*common, "--resume", str(root / "cp2-saving" / "checkpoints" / "step_5")],
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_reproduces_the_cp1_curve(runs, name):
    rows, expected = runs[name], runs[LAYOUTS[name][1]]
    assert_close_curves(losses(rows), losses(expected), rtol=1e-5, what=name)
    assert_close_curves(val_losses(rows), val_losses(expected), rtol=1e-5, what=f"{name} val")
    assert len(val_losses(rows)) == 2
    assert all(r["comm_bytes_cp"] > 0 for r in rows)


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_at_cp1(runs):
    resumed, expected = runs["cp2-as-cp1"], runs["ref"]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert_close_curves(losses(resumed), losses(expected)[5:], rtol=1e-5, what="cp2 -> cp1")


REHEARSED = {
    "model.hidden_size": "64",
    "model.n_layers": "4",
    "model.n_heads": "4",
    "model.ffn_hidden_size": "128",
    "train.seq_len": "32",
    "train.global_batch_size": "4",
    "train.micro_batch_size": "2",
    "parallel.tp": "2",
    "parallel.cp": "2",
    "parallel.pp": "2",
    "parallel.zero": "1",
    "parallel.cp_attention": "allgather",
}


def _real_cp_rank(overrides: dict) -> dict:
    from large_model_training.memory.tracker import AllocationTracker
    from large_model_training.train.rehearse import measure_steps

    cfg = validate(build_config(overrides=overrides))
    p = cfg.parallel
    tracker = AllocationTracker()
    return measure_steps(cfg, ParallelMesh.for_this_rank(p.pp, p.dp, p.tp, p.cp), tracker, tracker)


@pytest.mark.slow
def test_lmt_rehearse_at_cp2_counts_what_a_real_gloo_run_does():
    from large_model_training.train.rehearse import rank_kinds, rehearse_rank

    real = run_ranks(_real_cp_rank, 8, REHEARSED)
    cfg = validate(build_config(overrides=REHEARSED))
    kinds = rank_kinds(RankGrid(2, 1, 2, 2), zero=1)
    assert [k.rank for k in kinds] == [0, 2, 4, 6]  # ZeRO's first and last shard of the dp x cp group per stage
    for kind in kinds:
        fake, ours = rehearse_rank(cfg, kind), real[kind.rank]
        for key in (
            "param_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "comm_bytes_tp",
            "comm_bytes_pp",
            "comm_bytes_dp",
            "comm_bytes_cp",
        ):
            assert fake[key] == ours[key], (kind.label, key, fake[key], ours[key])
        assert ours["comm_bytes_cp"] > 0
