"""Recomputation, offload and activation accounting: loss curves equal `none`, measured bytes equal the formula."""

from __future__ import annotations

import pytest
import torch

from large_model_training.api import GradientCheckpointing
from large_model_training.assembly import build_model
from large_model_training.choices import RecomputePolicy
from large_model_training.cli import main
from large_model_training.config import ModelConfig, build_config
from large_model_training.errors import ConfigError
from large_model_training.launch import run_in_process
from large_model_training.layout import validate
from large_model_training.memory.accounting import ActivationCounter, measure_layer_activation_bytes
from large_model_training.memory.offload import HostOffload, activation_context, offload_note
from large_model_training.memory.recompute import apply_recompute
from large_model_training.mesh import ParallelMesh
from large_model_training.models.transformer import StageSpec
from large_model_training.planner import memory as mem
from tests.dist import run_ranks
from tests.helpers import SMALL_MODEL, assert_close_curves, losses, train

POLICIES = ["none", "full", "every:2", "every:3", "selective", "sac"]  # every:3 of 4 blocks: segments of 3 and 1
SHAPES = {  # rmsnorm/swiglu/rope with GQA on the flash kernel; GPT-style on the math kernel (dropout)
    "llama-gqa": dict(n_kv_heads=2),
    "gpt-dropout": dict(mlp="gelu", norm="layernorm", position="learned", dropout=0.1),
    "llama-mha-dropout": dict(dropout=0.1),
}
S, B, LAYERS = 32, 2, 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(
        **{**dict(vocab_size=256, hidden_size=64, n_layers=LAYERS, n_heads=4, ffn_hidden_size=128, max_seq_len=S), **kw}
    )


# ---- bytes: measured by saved-tensor hooks against planner/memory.py --------------------------------------------


def _measure_all(tp_size: int, sps: tuple[bool, ...]) -> list[dict]:
    """Every shape x policy x sp on this rank: measured per-block and peak bytes, the formula's, gradients."""
    mesh = ParallelMesh.for_this_rank(1, 1, tp_size) if tp_size > 1 else None
    rows = []
    for shape, kw in SHAPES.items():
        cfg = _cfg(**kw)
        for sp in sps:
            r = tp_size if sp else 1
            hidden = torch.randn(B, S, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
            hidden = hidden.chunk(r, dim=1)[mesh.tp_rank if sp else 0].contiguous()
            grads = None
            for policy in POLICIES:
                tp = mesh.tp if mesh else None
                if tp:
                    tp.bytes = 0.0
                model = build_model(
                    cfg, mesh, seed=3, sequence_parallel=sp, stage=StageSpec(0, LAYERS, False, False)
                ).train()
                apply_recompute(model, policy)
                torch.manual_seed(11)  # the same dropout masks for every policy
                per_block, m = measure_layer_activation_bytes(model, hidden)
                got = {n: p.grad for n, p in model.named_parameters()}
                grads = grads or got
                args = (cfg, S, B, tp_size, sp)
                rows.append(
                    dict(
                        shape=shape,
                        policy=policy,
                        sp=sp,
                        per_block=per_block,
                        peak=m.peak,
                        tp_bytes=tp.bytes if tp else 0.0,
                        formula_per_block=mem.activation_bytes_per_layer(
                            *args, policy, 4, fused_kernels=False, layers=LAYERS
                        ),
                        formula_peak=mem.stage_activation_bytes(
                            *args, RecomputePolicy.parse(policy), 4, LAYERS, 1, fused_kernels=False
                        ),
                        grad_error=max(float((got[n] - grads[n]).abs().max()) for n in got),
                    )
                )
    return rows


def _check_rows(rows: list[dict]) -> None:
    for row in rows:
        what = f"{row['shape']} {row['policy']} sp={row['sp']}"
        assert abs(row["per_block"] / row["formula_per_block"] - 1) < 0.05, (what, row)
        assert abs(row["peak"] / row["formula_peak"] - 1) < 0.05, (what, row)
        assert row["grad_error"] == 0.0, what  # recomputation replays the same ops and dropout masks
    by = {(r["shape"], r["policy"], r["sp"]): r for r in rows}
    for (shape, policy, sp), row in by.items():
        if policy != "none":
            assert row["peak"] < by[(shape, "none", sp)]["peak"], (shape, policy, sp)


def test_measured_bytes_match_the_formula_for_every_policy_tp1():
    _check_rows(_measure_all(1, (False,)))


@pytest.mark.slow
def test_measured_bytes_match_the_formula_for_every_policy_tp2_with_and_without_sp():
    rank0, rank1 = run_ranks(_measure_all, 2, 2, (False, True))
    for rows in (rank0, rank1):
        _check_rows(rows)
    # The tp collectives of a recomputed block run again in backward (Megatron does the same).
    by = {(r["shape"], r["policy"], r["sp"]): r["tp_bytes"] for r in rank0}
    for shape in SHAPES:
        for sp in (False, True):
            assert by[(shape, "full", sp)] > by[(shape, "none", sp)] == by[(shape, "selective", sp)]


def test_selective_on_the_math_kernel_drops_the_score_term():
    """CPU SDPA with dropout runs the math kernel, which saves the s x s tensors: selective removes them."""
    cfg = _cfg(dropout=0.1)
    t = mem.layer_activation_terms(cfg, S, B, 1, False, 4, fused_kernels=False)
    none = mem.activation_bytes_per_layer(cfg, S, B, 1, False, "none", 4, fused_kernels=False)
    selective = mem.activation_bytes_per_layer(cfg, S, B, 1, False, "selective", 4, fused_kernels=False)
    assert t.attention_scores == 3 * cfg.n_heads * S * (S * B) * 4  # probabilities, mask, dropped probabilities
    assert none - selective == t.attention_scores  # fp32, no GQA: the kernel's q, k, v copies = the kept q, k, v
    model = build_model(cfg, None, seed=3, stage=StageSpec(0, LAYERS, False, False)).train()
    hidden = torch.randn(B, S, cfg.hidden_size)
    measured_none, _ = measure_layer_activation_bytes(model, hidden)
    apply_recompute(model, "selective")
    measured_selective, _ = measure_layer_activation_bytes(model, hidden)
    assert abs((measured_none - measured_selective) / t.attention_scores - 1) < 0.05


# ---- loss curves: the trainer with each policy, dropout on --------------------------------------------------------


def _train_with_policy(cfg, policy: str) -> list[tuple[float, int]]:
    """(loss, activation_bytes) of each step of the trainer's own train_step, with `policy` applied."""
    from large_model_training.train.trainer import Trainer

    mesh = ParallelMesh.for_this_rank(cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp)
    trainer = Trainer(cfg, mesh, run_dir="")
    apply_recompute(trainer.model, policy)  # recompute changes no parameter, so the optimizer is unaffected
    rows = [trainer.train_step(step, trainer.loader.next()) for step in range(cfg.train.steps)]
    return [(row["loss"], row["activation_bytes"]) for row in rows]


def _all_policies(cfg, policies: list[str]) -> dict[str, list[tuple[float, int]]]:
    return {policy: _train_with_policy(cfg, policy) for policy in policies}


def _train_cfg(corpus: str, **extra):
    return validate(
        build_config(
            overrides={
                "data.path": corpus,
                "model.hidden_size": 64,
                "model.n_layers": LAYERS,
                "model.n_heads": 4,
                "model.ffn_hidden_size": 128,
                "model.dropout": 0.1,
                "train.seq_len": 64,
                "train.steps": 3,
                "train.micro_batch_size": 2,
                "train.global_batch_size": 4,
                "train.eval_every": 0,
                **extra,
            }
        )
    )


def _check_curves(runs: dict[str, list[tuple[float, int]]], what: str) -> None:
    none = [loss for loss, _ in runs["none"]]
    for policy, rows in runs.items():
        assert_close_curves([loss for loss, _ in rows], none, rtol=1e-6, what=f"{what} {policy}")
        if policy != "none":  # activation_bytes: the trainer's per-step peak, recompute transients included
            assert rows[-1][1] < runs["none"][-1][1], (what, policy, rows[-1][1], runs["none"][-1][1])


@pytest.mark.slow
def test_every_policy_gives_the_loss_curve_of_none_with_dropout(small_corpus):
    _check_curves(run_in_process(_all_policies, (_train_cfg(small_corpus), POLICIES)), "pp=1")


@pytest.mark.slow
def test_policies_work_inside_pipeline_stages(small_corpus):
    cfg = _train_cfg(small_corpus, **{"parallel.pp": 2, "parallel.schedule": "1f1b"})
    # Two blocks per stage: every:2 is one segment per stage, full two; every:3 would equal every:2 here.
    runs = run_ranks(_all_policies, 2, cfg, ["none", "full", "every:2", "selective", "sac"])
    _check_curves(runs[1], "pp=2")  # the last stage: its losses (the trainer sums them over pp) and its bytes


# ---- API, names, offload, bad input ---------------------------------------------------------------------------------


def test_parameter_names_are_unchanged_and_none_restores():
    cfg = _cfg()
    model = build_model(cfg, None, seed=1)
    names = [n for n, _ in model.named_parameters()]
    for policy in POLICIES:
        apply_recompute(model, policy)
        assert [n for n, _ in model.named_parameters()] == names
        assert "layers.3.attn.wqkv.weight" in model.state_dict()
    apply_recompute(model, "none")
    assert "run_blocks" not in vars(model) and not any("core" in vars(b.attn) for b in model.layers.values())


def test_seed_name_gradient_checkpointing():
    import large_model_training as lmt

    cfg = _cfg(dropout=0.1)
    tokens = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
    grads = []
    for policy in ("none", "every:2"):
        model = lmt.build_model(cfg, None, seed=1).train()
        gc = lmt.GradientCheckpointing(policy=policy)
        torch.manual_seed(5)
        logits = gc.forward_with_checkpoint(model, tokens[:, :-1])
        gc.backward_with_checkpoint(model.loss_fn(logits, tokens[:, 1:]))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert str(GradientCheckpointing().policy) == "every:10"  # the seed's "every 10 layers"


def test_offload_is_a_noted_no_op_on_cpu_and_exact_when_forced():
    cpu = torch.device("cpu")
    assert "no effect on the CPU" in offload_note(cpu, True) and offload_note(cpu, False) is None
    counter = ActivationCounter()
    with activation_context(cpu, True, counter):
        (torch.randn(4, 4, requires_grad=True).exp() * 2).sum().backward()
    assert counter.offloaded_peak == 0 and counter.peak > 0  # nothing moved on the CPU
    # The mechanism itself, forced onto CPU tensors: same gradients, same bytes, all of them on the "host".
    cfg = _cfg(dropout=0.1)
    hidden = torch.randn(B, S, cfg.hidden_size)
    results = []
    for offload in (None, HostOffload(cpu, force=True)):
        model = build_model(cfg, None, seed=1, stage=StageSpec(0, LAYERS, False, False)).train()
        apply_recompute(model, "every:2")
        counter = ActivationCounter().exclude_parameters(model)
        torch.manual_seed(2)
        with counter.counting(offload=offload):
            model(hidden.clone().requires_grad_()).sum().backward()
        results.append((counter, {n: p.grad for n, p in model.named_parameters()}))
    (plain, g0), (offloaded, g1) = results
    assert all(torch.equal(g0[n], g1[n]) for n in g0)
    assert offloaded.peak == plain.peak and offloaded.offloaded_peak > 0 and offloaded.current == 0


@pytest.mark.parametrize("policy", ["bogus", "every:0", "every:-2", "every:x", f"every:{LAYERS + 1}"])
def test_bad_policy_is_one_line_and_exit_2(policy, tmp_path, capsys):
    code = main(["train", "--out", str(tmp_path / "run"), "--model.n_layers", str(LAYERS), "--recompute", policy])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("lmt: error: "), err
    assert "recompute" in err and "Traceback" not in err
    with pytest.raises(ConfigError):
        apply_recompute(build_model(_cfg(), None, seed=1), policy)


@pytest.mark.slow
def test_cli_recompute_runs(tmp_path, small_corpus):
    common = [*SMALL_MODEL, "--data", small_corpus, "--steps", "2", "--model.dropout", "0.1"]
    ref = train(str(tmp_path / "none"), *common)
    rows = train(str(tmp_path / "full"), *common, "--recompute", "full")
    assert_close_curves(losses(rows), losses(ref), rtol=1e-6)
    assert rows[-1]["activation_bytes"] < ref[-1]["activation_bytes"]
