"""Expert parallelism (`--ep`): the dispatch and combine around the experts, experts initialised as the full
model's, the layout rules, and (slow) training at ep > 1 reproducing the ep = 1 loss curve alone and with
tp (SP), pp and ZeRO, the expert bias, the aux loss, and checkpoints resumed across ep sizes."""

from __future__ import annotations

import math

import pytest
import torch

from large_model_training.config import build_config
from large_model_training.errors import ConfigError
from large_model_training.layout import validate
from large_model_training.mesh import AxisGroup
from large_model_training.models.init import draw_full, init_parameters
from large_model_training.models.transformer import Transformer
from tests.dist import run_ranks
from tests.helpers import Runs, assert_close_curves, losses, model_flags


def _dispatch_round_trip(case: str, overlapped: bool = False) -> dict:
    """On 2 ranks, 4 experts (2 per rank): every copy's output must be its row times (its global expert + 1),
    with `compute` reading the local expert from `ends`; gradients come back the same way."""
    import torch.distributed as dist

    from large_model_training.models.moe import Experts
    from large_model_training.parallel.expert import dispatch_compute_combine, dispatch_overlapped

    rank = dist.get_rank()
    ep = AxisGroup(dist.group.WORLD, 2, rank)
    counts = {
        "uneven": [[3, 0, 2, 1], [1, 4, 0, 0]],  # expert 1 gets nothing from rank 0; rank 1 sends none to 1
        "one_rank_idle": [[2, 3, 0, 0], [0, 1, 0, 0]],  # rank 1's experts receive no token at all
        "rank_sends_none": [[1, 1, 1, 1], [0, 0, 0, 0]],
    }[case][rank]
    counts = torch.tensor(counts)
    torch.manual_seed(rank)
    x = torch.randn(int(counts.sum()), 8, requires_grad=True)
    expert = torch.arange(4).repeat_interleave(counts)

    def compute(rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        local = torch.bucketize(torch.arange(rows.shape[0]), ends, right=True)
        return rows * (local + 2 * rank + 1).unsqueeze(-1).to(rows)

    out = (dispatch_overlapped if overlapped else dispatch_compute_combine)(x, counts, compute, ep)
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weight).sum().backward()
    factor = (expert + 1).unsqueeze(-1).float()
    # the loop and grouped GEMMs run empty groups and empty inputs
    experts = Experts(
        build_config(
            overrides={
                "model.preset": "tiny-moe",
                "model.moe_experts": "4",
                "model.hidden_size": "8",
                "model.moe_ffn_hidden_size": "8",
            }
        ).model
    )
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    empty = {}
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        rows = torch.zeros(0, 8, requires_grad=True)
        y = experts.compute(rows, torch.zeros(4, dtype=torch.long))
        y.sum().backward()
        empty[grouped] = tuple(y.shape)
    return {
        "value": float((out - x * factor).abs().max()) if x.numel() else 0.0,
        "grad": float((x.grad - weight * factor).abs().max()) if x.numel() else 0.0,
        "bytes": ep.bytes,
        "empty": empty,
    }


@pytest.mark.slow
@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("case", ["uneven", "one_rank_idle", "rank_sends_none"])
def test_dispatch_then_combine_is_the_identity_in_values_and_gradients(case, overlapped):
    for r in run_ranks(_dispatch_round_trip, 2, case, overlapped):
        assert r["value"] == 0.0 and r["grad"] == 0.0, r
        assert r["empty"] == {True: (0, 8), False: (0, 8)}


def test_expert_shards_initialise_as_the_full_model():
    cfg = build_config(overrides={"model.preset": "tiny-moe"}).model
    for ep_rank in range(2):
        with torch.device("meta"):
            model = Transformer(cfg)
        for layer in model.layers.values():
            layer.mlp.experts.shard(2, ep_rank, dispatch=None)
        model.to_empty(device="cpu")
        init_parameters(model, cfg, seed=5)
        for name in ("w_gate", "w_up", "w_down"):
            local = getattr(model.layers["1"].mlp.experts, name)
            full = draw_full(cfg, f"layers.1.mlp.experts.{name}", (8, *local.shape[1:]), seed=5)
            assert local.shape[0] == 4 and torch.equal(local, full[4 * ep_rank : 4 * ep_rank + 4])


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"parallel.dp": "4", "parallel.ep": "3"}, "must divide dp"),
        ({"parallel.dp": "4", "parallel.ep": "4", "model.moe_experts": "6"}, "must divide model.moe_experts"),
        ({"parallel.tp": "2"}, "need --sequence-parallel"),
        ({"parallel.dp": "2", "parallel.ep": "2", "train.compression": "topk:0.01"}, "compression"),
    ],
)
def test_bad_expert_layouts_are_one_line_errors(overrides, words):
    cfg = build_config(overrides={"model.preset": "tiny-moe", **overrides})
    with pytest.raises(ConfigError, match=words) as error:
        validate(cfg)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "flags",
    [
        ["--tp", "2"],
        ["--dp", "4", "--ep", "3"],
        ["--dp", "2", "--ep", "2", "--compression", "topk:0.01"],
    ],
)
def test_lmt_train_refuses_bad_expert_layouts_in_one_line(flags, tmp_path, capsys):
    from large_model_training.cli import main

    code = main(["train", "--out", str(tmp_path / "run"), "--model", "tiny-moe", *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("lmt: error: "), err


def test_rehearse_refuses_the_overlapped_dispatch_in_one_line():
    from large_model_training.train.rehearse import rehearse

    overrides = {"model.preset": "tiny-moe", "parallel.dp": "2", "parallel.ep": "2", "parallel.ep_overlap": "true"}
    with pytest.raises(ConfigError, match="synchronous dispatch only") as error:
        rehearse(validate(build_config(overrides=overrides)))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("zero, mtp", [(1, 0), (3, 0), (1, 1)])
def test_rehearse_runs_ep_with_balanced_routing_and_the_planned_model_states(zero, mtp):
    """dp 4, ep 2, pp 2 on fake ranks: each rank's experts are E / ep, their states sharded over edp as the
    planner counts them (with MTP: the last stage's prediction block, routed, and its copy of the embedding);
    the dispatch moves (ep - 1) / ep of the T k copies of each exchange (balanced)."""
    from large_model_training.train.rehearse import rehearse

    cfg = validate(
        build_config(
            overrides={
                "model.preset": "tiny-moe",
                "model.n_layers": "4",
                "parallel.pp": "2",
                "parallel.dp": "4",
                "parallel.ep": "2",
                "parallel.zero": str(zero),
                "model.mtp_depth": str(mtp),
                "train.seq_len": "32",
                "train.micro_batch_size": "2",
                "train.global_batch_size": "16",
            }
        )
    )
    m = cfg.model
    for row in rehearse(cfg):
        assert row["param_bytes"] == row["estimate_param_bytes"], row
        assert row["optimizer_bytes"] == row["estimate_optimizer_bytes"], row
        blocks = [*range(2 * row["stage"], 2 * row["stage"] + 2), *([4] * mtp if row["stage"] else [])]
        exchanges = 2 * sum(m.is_moe_layer(i) for i in blocks)  # x 2 micro-batches
        copies = 2 * 32 * m.moe_top_k  # a micro-batch's token copies, half of them to the other ep rank
        counts = (m.moe_experts // 2) * 8  # int64 copies per local expert, once per forward
        assert row["comm_bytes_ep"] == exchanges * (4 * copies // 2 * m.hidden_size * 4 + counts), row
        assert any("balanced routing" in s for s in row["stand_ins"])


@pytest.mark.parametrize(
    "extra", [{"parallel.zero": "3"}, {"parallel.cp": "2"}, {"parallel.cp": "2", "parallel.zero": "3"}]
)
def test_zero3_and_cp_are_valid_with_ep(extra):
    validate(build_config(overrides={"model.preset": "tiny-moe", "parallel.dp": "2", "parallel.ep": "2", **extra}))


def test_ep_needs_an_moe_model():
    with pytest.raises(ConfigError, match="needs an MoE model"):
        validate(build_config(overrides={"model.preset": "tiny", "parallel.dp": "2", "parallel.ep": "2"}))


def test_tp_with_sequence_parallel_is_a_valid_moe_layout():
    validate(
        build_config(
            overrides={
                "model.preset": "tiny-moe",
                "parallel.tp": "2",
                "parallel.sequence_parallel": "true",
                "parallel.dp": "2",
                "parallel.ep": "2",
            }
        )
    )


def _expert_groups(tp: int, dp: int, ep: int) -> dict:
    import torch.distributed as dist

    from large_model_training.mesh import ParallelMesh

    mesh = ParallelMesh.for_this_rank(1, dp, tp, 1, ep)
    return {
        "ep": dist.get_process_group_ranks(mesh.ep.group),
        "edp": dist.get_process_group_ranks(mesh.edp_group),
        "ep_rank": mesh.ep.rank,
        "edp_rank": mesh.edp_rank,
        "dp": dist.get_process_group_ranks(mesh.grad_group),
    }


@pytest.mark.slow
def test_ep_groups_are_carved_from_dp_with_adjacent_ep_ranks():
    four = run_ranks(_expert_groups, 4, 1, 4, 2)  # dp coordinate d = edp x 2 + ep
    assert [r["ep"] for r in four] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["edp"] for r in four] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(r["ep_rank"], r["edp_rank"]) for r in four] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(r["dp"] == [0, 1, 2, 3] for r in four)  # the dense gradient group is unchanged
    with_tp = run_ranks(_expert_groups, 4, 2, 2, 2)  # rank = dp x 2 + tp: ep peers share the tp coordinate
    assert [r["ep"] for r in with_tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _zero_shards_and_bias(micro_batches: int) -> dict:
    """dp = 4, ep = 2, ZeRO-2 (edp = 2): the expert engine's moments are 1 / edp of this rank's experts; the
    expert bias moves once, after `micro_batches` accumulated micro-batches, identically on every rank."""
    import torch.distributed as dist

    from large_model_training.assembly import assemble
    from large_model_training.mesh import ParallelMesh
    from large_model_training.train.moe_balance import MoEBalance

    cfg = validate(
        build_config(
            overrides={
                "model.preset": "tiny-moe",
                "model.hidden_size": "32",
                "model.n_layers": "2",
                "model.moe_ffn_hidden_size": "32",
                "model.moe_bias_update_rate": "0.01",
                "parallel.dp": "4",
                "parallel.ep": "2",
                "parallel.zero": "2",
                "train.micro_batch_size": "2",
                "train.global_batch_size": str(8 * micro_batches),
                "train.seq_len": "16",
            }
        )
    )
    mesh = ParallelMesh.for_this_rank(1, 4, 1, 1, 2)
    built = assemble(cfg, mesh, micro_batches)
    model, engine = built.model, built.engine
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    moments = sum(m.numel() for m in engine.expert.rule.exp_avg)
    buckets = sum(b.numel for b in engine.expert.buckets)
    balance = MoEBalance(model, cfg.model, mesh)
    balance.start_step(micro_batches)
    engine.prepare_step(micro_batches)
    model.train()
    routers = [block.mlp.router for block in model.layers.values()]
    torch.manual_seed(100 + dist.get_rank())
    moved = False
    for _ in range(micro_batches):
        model(torch.randint(0, 256, (2, 16))).float().mean().backward()
        moved |= any(bool(torch.count_nonzero(r.expert_bias)) for r in routers)
    engine.finish_grad_sync()
    counts = [block.mlp.counts.clone().double() for block in model.layers.values()]
    for c in counts:
        dist.all_reduce(c)
    balance.finish_step(update_bias=True)
    expected = [0.01 * torch.sign(c.mean() - c) for c in counts]
    return {
        "moments": moments,
        "buckets": buckets,
        "expert_numel": sum(p.numel() for p in experts),
        "edp": mesh.edp_size,
        "moved_early": moved,
        "bias": [r.expert_bias.clone() for r in routers],
        "bias_ok": all(torch.allclose(r.expert_bias, e.to(r.expert_bias)) for r, e in zip(routers, expected)),
    }


@pytest.mark.slow
def test_zero_shards_expert_states_over_edp_and_the_bias_moves_once_per_step():
    results = run_ranks(_zero_shards_and_bias, 4, 3)
    for r in results:
        assert r["edp"] == 2 and r["moments"] * 2 == r["buckets"]
        assert r["expert_numel"] <= r["buckets"] < r["expert_numel"] + 64  # bucket padding to a multiple of edp
        assert not r["moved_early"] and r["bias_ok"]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["bias"], results[0]["bias"]))
    assert any(torch.count_nonzero(b) for b in results[0]["bias"])


MODEL = [
    "--model",
    "tiny-moe",
    *model_flags(hidden_size=32, ffn_hidden_size=64, moe_ffn_hidden_size=32, moe_bias_update_rate=0.001),
    "--seq-len",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--steps",
    "10",
    "--eval-every",
    "0",
    "--precision",
    "fp32",
]
CAPACITY = ["--model.moe_capacity_factor", "1.0"]
DEEPSEEK = [
    "--model.moe_router",
    "sigmoid",
    "--model.moe_groups",
    "4",
    "--model.moe_topk_groups",
    "2",
    "--model.moe_routed_scale",
    "2.5",
    "--model.moe_aux_loss_scope",
    "sequence",
]
LAYOUTS = {  # name: (extra arguments, reference run)
    "ep2": (["--dp", "2", "--ep", "2", "--save-every", "5"], "ref"),
    "ep4": (["--dp", "4", "--ep", "4"], "ref"),
    "tp2-sp": (["--tp", "2", "--sequence-parallel"], "ref"),
    "tp2-sp-ep2": (["--tp", "2", "--sequence-parallel", "--dp", "2", "--ep", "2"], "ref"),
    "pp2-ep2": (["--pp", "2", "--dp", "2", "--ep", "2"], "ref"),
    "pp2-ep2-zb-h1": (["--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "zb-h1"], "ref"),  # expert grads in B
    "dp4-ep2-zero2": (["--dp", "4", "--ep", "2", "--zero", "2"], "ref"),
    "ep2-capacity": (["--dp", "2", "--ep", "2", *CAPACITY], "ref-capacity"),  # dropped before the dispatch
    # the dispatch in two parts, exchanges in flight while the other part computes (forward, and B and W split)
    "ep2-overlap": (["--dp", "2", "--ep", "2", "--parallel.ep_overlap", "true"], "ref"),
    "pp2-ep2-zb-h1-overlap": (
        ["--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "zb-h1", "--parallel.ep_overlap", "true"],
        "ref",
    ),
    # DeepSeek-V3's routing: sigmoid, group-limited, scaled gates, the sequence-wise loss (f_e summed over SP)
    "dsv3-tp2-sp": (["--tp", "2", "--sequence-parallel", *DEEPSEEK], "ref-dsv3"),
    "dsv3-ep2": (["--dp", "2", "--ep", "2", *DEEPSEEK], "ref-dsv3"),
    # cp: each rank routes its zig-zag chunks; f_e summed over cp (and tp), the aux parts' gradients scaled by cp
    "cp2": (["--cp", "2"], "ref"),
    "zero3-dp2": (["--zero", "3", "--dp", "2"], "ref"),  # FSDP2 shards the stacked experts like any weight
    "cp2-tp2-sp": (["--cp", "2", "--tp", "2", "--sequence-parallel"], "ref"),
    # ZeRO-3 with ep: the experts an FSDP2 group over edp (2 ranks here), the rest over dp (4)
    "dp4-ep2-zero3": (["--dp", "4", "--ep", "2", "--zero", "3", "--save-every", "5"], "ref"),
    # cp with ep: each cp rank dispatches its chunks' copies; expert gradients averaged over edp x cp
    "cp2-ep2": (["--cp", "2", "--dp", "2", "--ep", "2"], "ref"),
    "cp2-dp2-ep2-zero3": (["--cp", "2", "--dp", "2", "--ep", "2", "--zero", "3"], "ref"),
    "dsv3-cp2": (["--cp", "2", *DEEPSEEK], "ref-dsv3"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    """The ep = 1 references (one saving at step 5) and every ep run of this module, each trained once."""
    root = tmp_path_factory.mktemp("ep")
    common = [*MODEL, "--data", small_corpus]
    return Runs(
        root,
        {
            "ref": [*common, "--save-every", "5"],
            "ref-capacity": [*common, *CAPACITY],
            "ref-dsv3": [*common, *DEEPSEEK],
            **{name: [*common, *extra] for name, (extra, _) in LAYOUTS.items()},
            "ep2-as-ep1": [*common, "--resume", str(root / "ep2" / "checkpoints" / "step_5")],
            "ep1-as-ep2": [*common, "--dp", "2", "--ep", "2", "--resume", str(root / "ref" / "checkpoints" / "step_5")],
            "ep2-zero3-as-ep1-zero1": [
                *common,
                *("--dp", "2", "--zero", "1", "--resume", str(root / "dp4-ep2-zero3" / "checkpoints" / "step_5")),
            ],
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ep_reproduces_the_ep1_curve_and_aux_loss(runs, name):
    rows, expected = runs[name], runs[LAYOUTS[name][1]]
    assert_close_curves(losses(rows), losses(expected), rtol=1e-5, what=name)
    for a, b in zip(rows, expected):
        assert math.isclose(a["moe_aux_loss"], b["moe_aux_loss"], rel_tol=1e-5), name
        assert a["moe_load_imbalance_per_layer"] == pytest.approx(b["moe_load_imbalance_per_layer"], rel=1e-6)
        assert a["moe_tokens_dropped"] == b["moe_tokens_dropped"]
        if "ep" in name:
            assert a["comm_bytes_ep"] > 0 and a["moe_ep_straggler"] >= 1.0
    assert "comm_bytes_ep" not in expected[0]
    assert (sum(r["moe_tokens_dropped"] for r in rows) > 0) == ("capacity" in name)
    if name in ("ep2", "ep4"):  # 4 exchanges (dispatch, combine, their backward) of T k h fp32 rows per layer,
        ep, tokens = int(name[-1]), 8 * 32 // int(name[-1])  # (ep - 1) / ep of them leaving the rank if balanced
        balanced = 4 * tokens * 2 * 32 * 4 * (ep - 1) / ep * 2
        assert abs(sum(r["comm_bytes_ep"] for r in rows) / len(rows) / balanced - 1) < 0.15


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2-as-ep1", "ep1-as-ep2", "ep2-zero3-as-ep1-zero1"])
def test_a_checkpoint_resumes_exactly_at_another_ep(runs, name):
    resumed, expected = runs[name], runs["ref"]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert_close_curves(losses(resumed), losses(expected)[5:], rtol=1e-5, what=name)
    for a, b in zip(resumed, expected[5:]):  # the expert bias came back: the same routing
        assert a["moe_load_imbalance_per_layer"] == pytest.approx(b["moe_load_imbalance_per_layer"], rel=1e-6)
