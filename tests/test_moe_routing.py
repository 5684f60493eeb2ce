"""DeepSeek-V3's routing (models/moe.py): group-limited top-k, the routed scaling factor, the sequence-wise
balance loss; against straightforward per-token and per-sequence references, and the config's refusals."""

from __future__ import annotations

import pytest
import torch

from large_model_training.config import build_config
from large_model_training.config_checks import check_fields
from large_model_training.errors import ConfigError
from tests.test_moe import make_moe

DEEPSEEK = dict(moe_experts=8, moe_top_k=3, moe_router="sigmoid", moe_groups=4, moe_topk_groups=2)


def reference_choice(biased: torch.Tensor, groups: int, topk_groups: int, top_k: int) -> list[set[int]]:
    """Token by token, as the DeepSeek-V3 report describes it: rank the groups by the sum of their two best
    scores, keep the best topk_groups, take the top_k experts among theirs."""
    per_group = biased.shape[1] // groups
    out = []
    for row in biased.tolist():
        group_score = [sum(sorted(row[g * per_group : (g + 1) * per_group])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: group_score[g])[-topk_groups:]
        allowed = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        out.append(set(sorted(allowed, key=lambda e: row[e])[-top_k:]))
    return out


def test_group_limited_routing_picks_only_from_the_best_groups_as_the_reference_does():
    layer = make_moe(**DEEPSEEK)
    layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))  # the bias takes part in choosing groups too
    x = torch.randn(64, 32)
    scores, chosen, _ = layer.router(x)
    expected = reference_choice(scores + layer.router.expert_bias, 4, 2, 3)
    assert [set(row) for row in chosen.tolist()] == expected
    groups_used = [{e // 2 for e in row} for row in chosen.tolist()]
    assert max(len(g) for g in groups_used) <= 2
    ungrouped = make_moe(**{**DEEPSEEK, "moe_groups": 1})
    ungrouped.router.load_state_dict(layer.router.state_dict())
    # without the limit some token picks from 3 groups: the limit did something
    assert max(len({e // 2 for e in row}) for row in ungrouped.router(x)[1].tolist()) == 3


def test_the_routed_scale_multiplies_the_renormalised_gates():
    plain, scaled = make_moe(**DEEPSEEK), make_moe(**DEEPSEEK, moe_routed_scale=2.5)
    x = torch.randn(16, 32)
    _, chosen, gates = plain.router(x)
    _, chosen_scaled, gates_scaled = scaled.router(x)
    assert torch.equal(chosen, chosen_scaled)
    assert torch.allclose(gates_scaled, 2.5 * gates) and torch.allclose(gates.sum(-1), torch.ones(16))


def test_the_sequence_wise_balance_loss_is_the_switch_loss_of_each_sequence_averaged():
    layer = make_moe(**DEEPSEEK, moe_aux_loss_scope="sequence", moe_aux_loss_coef=0.1)
    layer.train()
    x = torch.randn(3, 10, 32)
    layer(x)
    _, aux_sum, _, forwards = layer.take_stats()
    scores, chosen, _ = layer.router(x.reshape(-1, 32))
    per_sequence = []
    for s, c in zip(scores.view(3, 10, 8), chosen.view(3, 10, 3)):
        f = torch.bincount(c.reshape(-1), minlength=8).float() / (10 * 3)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        per_sequence.append(8 * (f * p).sum())
    assert forwards == 1
    assert torch.allclose(aux_sum, torch.stack(per_sequence).mean(), rtol=1e-6)
    batch = make_moe(**DEEPSEEK, moe_aux_loss_coef=0.1)
    batch.train()
    batch(x[:1])
    layer(x[:1])  # one sequence: the two scopes agree
    assert torch.allclose(batch.take_stats()[1], layer.take_stats()[1], rtol=1e-6)


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"model.moe_groups": 3}, "must divide moe_experts"),
        ({"model.moe_groups": 8}, "groups of 2 or more"),
        ({"model.moe_groups": 4, "model.moe_topk_groups": 5}, "moe_topk_groups must be in [1, moe_groups = 4]"),
        ({"model.moe_groups": 4, "model.moe_topk_groups": 1, "model.moe_top_k": 3}, "room for moe_top_k = 3"),
        ({"model.moe_aux_loss_scope": "token"}, "moe_aux_loss_scope"),
        ({"model.moe_routed_scale": 0}, "moe_routed_scale must be positive"),
    ],
)
def test_bad_routing_fields_are_one_line_errors(overrides, says):
    with pytest.raises(ConfigError, match=None) as info:  # (a choice field: refused at build)
        check_fields(build_config(overrides={"model.preset": "tiny-moe", **overrides}))
    assert says in str(info.value) and "\n" not in str(info.value)
