"""Document masking: a packed sequence equals its documents run alone, in every recompute policy and layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from large_model_training.assembly import assemble, build_model
from large_model_training.config import ModelConfig, build_config
from large_model_training.layout import validate
from large_model_training.memory.accounting import measure_activations
from large_model_training.memory.recompute import apply_recompute
from large_model_training.mesh import ParallelMesh
from large_model_training.models import transformer
from large_model_training.models.init import local_shard
from large_model_training.models.transformer import StageSpec, document_layout
from tests.dist import run_ranks
from tests.helpers import model_config

EOD = 0  # the byte tokenizer's end-of-document id
LAYOUT_VARIANTS = {  # name: model settings
    "rope-gqa": dict(n_kv_heads=2),
    "learned-gelu-layernorm": dict(mlp="gelu", norm="layernorm", position="learned"),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _cfg(**kw) -> ModelConfig:
    return model_config(**{"max_seq_len": 24, **kw})


def _document(length: int, seed: int) -> torch.Tensor:
    """Token ids without an EOD."""
    return torch.randint(1, 64, (length,), generator=torch.Generator().manual_seed(seed))


def _packed() -> tuple[torch.Tensor, list[slice]]:
    """Two windows of 24 tokens: three documents (the last cut by the window), and one with no EOD at all;
    and the slices of the first window's documents, each EOD included in the document it ends."""
    eod = torch.tensor([EOD])
    first = torch.cat([_document(6, 1), eod, _document(9, 2), eod, _document(7, 3)])
    return torch.stack([first, _document(24, 4)]), [slice(0, 7), slice(7, 17), slice(17, 24)]


def test_positions_restart_after_each_eod_and_the_eod_ends_its_document():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9], [5, 6, 7, 8, 9, 1, 2]])
    positions, allowed = document_layout(tokens, EOD)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]]
    assert allowed.shape == (2, 1, 7, 7)
    assert allowed[0, 0, 4].tolist() == [False, False, True, True, True, False, False]  # an EOD sees its document
    assert allowed[0, 0, 5].tolist() == [False] * 5 + [True, False]  # an empty document: itself
    assert torch.equal(allowed[1, 0], torch.ones(7, 7, dtype=torch.bool).tril())  # no EOD: plain causal


@pytest.mark.parametrize("variant", ["rope-gqa", "learned-gqa"])
def test_a_packed_sequence_gives_each_document_the_logits_and_gradients_it_has_alone(variant):
    cfg = _cfg(n_kv_heads=2, position="rope" if variant == "rope-gqa" else "learned")
    tokens, documents = _packed()
    weights = torch.randn(*tokens.shape, cfg.vocab_size, generator=torch.Generator().manual_seed(9))
    packed, alone = build_model(cfg, None, seed=3), build_model(cfg, None, seed=3)
    packed.document_eod = EOD
    logits = packed(tokens)
    (logits * weights).sum().backward()
    expected = [alone(tokens[:1, doc]) for doc in documents] + [alone(tokens[1:])]  # the EOD-free row: plain causal
    sum((out * w).sum() for out, w in zip(expected, [weights[:1, d] for d in documents] + [weights[1:]])).backward()
    got = [logits[:1, doc] for doc in documents] + [logits[1:]]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    reference = dict(alone.named_parameters())
    for name, p in packed.named_parameters():
        torch.testing.assert_close(p.grad, reference[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_without_document_eod_attention_is_the_causal_kernel_and_tokens_are_ignored(monkeypatch):
    """document_eod None: SDPA's is_causal path, no mask built, rope tables per position only (unchanged)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", recording)
    model = build_model(_cfg(), None, seed=3)
    tokens, _ = _packed()
    out = model(tokens)
    assert all(c.get("is_causal") is True and c.get("attn_mask") is None for c in calls) and len(calls) == 2
    assert torch.equal(model(tokens, tokens), out)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_every_recompute_policy_gives_the_gradients_of_none_with_masking(dropout):
    cfg = _cfg(n_layers=3, n_kv_heads=2, dropout=dropout)  # every:2 of 3 blocks: segments of 2 and 1
    tokens, _ = _packed()
    results = {}
    for policy in ("none", "full", "every:2", "selective"):
        model = build_model(cfg, None, seed=3).train()
        model.document_eod = EOD
        apply_recompute(model, policy)
        torch.manual_seed(11)  # the same dropout masks for every policy
        loss = model.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        results[policy] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    loss_none, grads_none = results["none"]
    for policy, (loss, grads) in results.items():
        assert torch.equal(loss, loss_none), policy
        assert all(torch.equal(grads[n], grads_none[n]) for n in grads), policy


def test_the_mask_is_held_once_per_chunk_not_once_per_block():
    """Every block's attention saves the same additive mask: the bytes held grow by one (b, 1, s, s) mask
    (and the per-sequence rope tables), whatever the number of blocks."""
    cfg, b, s = _cfg(n_layers=4), 2, 24
    tokens, _ = _packed()
    hidden = torch.randn(b, s, cfg.hidden_size, generator=torch.Generator().manual_seed(5), requires_grad=True)
    held = {}
    for eod in (None, EOD):
        stage = build_model(cfg, None, seed=3, stage=StageSpec(0, cfg.n_layers, False, False))
        stage.document_eod = eod
        held[eod] = measure_activations(stage, hidden, tokens).held
    mask_bytes, rope_bytes = b * s * s * 4, 2 * (b - 1) * s * cfg.head_dim // 2 * 4
    assert held[EOD] - held[None] == mask_bytes + rope_bytes


def test_a_later_stage_without_tokens_is_refused():
    stage = build_model(_cfg(), None, seed=3, stage=StageSpec(1, 2, False, True))
    stage.document_eod = EOD
    with pytest.raises(ValueError, match="needs forward"):
        stage(torch.randn(1, 8, 32))


# ---- layouts: tp = 2 with sequence parallelism, pp = 2, on the one-process model -------------------------------


def _layout_errors(variant: str) -> tuple[float, float, float]:
    """On each of 4 ranks (pp 2 x tp 2, sp on): one step through `assemble`'s executor and engine on token
    batches with EODs, against the one-process model with masking; (loss, reference loss, worst grad error)."""
    kw = LAYOUT_VARIANTS[variant]
    cfg = validate(
        build_config(
            overrides={
                "model.vocab_size": 64,
                "model.hidden_size": 32,
                "model.n_layers": 2,
                "model.n_heads": 4,
                "model.ffn_hidden_size": 64,
                "model.max_seq_len": 16,
                **{f"model.{k}": v for k, v in kw.items()},
                "train.seq_len": 16,
                "train.micro_batch_size": 2,
                "train.global_batch_size": 4,
                "parallel.tp": 2,
                "parallel.pp": 2,
                "parallel.sequence_parallel": True,
                "train.recompute": "selective",
            }
        ),
        world_size=4,
    )
    mesh = ParallelMesh.for_this_rank(2, 1, 2)
    batches = torch.randint(1, 64, (2, 2, 17), generator=torch.Generator().manual_seed(0))
    batches[0, 0, [3, 9]] = EOD
    batches[0, 1, [0, 15, 16]] = EOD
    batches[1, 0, [7, 8]] = EOD
    micro = [(t[:, :-1], t[:, 1:]) for t in batches]
    full = build_model(cfg.model, None, seed=cfg.train.seed)
    full.document_eod = EOD
    reference = sum(full.loss_fn(full(x), y) for x, y in micro) / 2
    reference.backward()
    parts = assemble(cfg, mesh, 2, document_eod=EOD)
    parts.engine.prepare_step(2)
    loss = parts.executor.forward_backward(micro, 0.5)
    parts.engine.finish_grad_sync()
    torch.distributed.all_reduce(loss, group=mesh.pp_group)
    modules, full_params = dict(parts.model.named_modules()), dict(full.named_parameters())
    worst = 0.0
    for name, _ in parts.model.named_parameters():
        module_name, _, param_name = name.rpartition(".")
        expected = local_shard(modules[module_name], param_name, full_params[name].grad)
        error = (parts.engine.grad_of(name).view_as(expected) - expected).abs().max() / expected.abs().max()
        worst = max(worst, float(error))
    return float(loss), float(reference), worst


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(LAYOUT_VARIANTS))
def test_tp2_with_sequence_parallelism_and_pp2_equal_one_process(variant):
    for loss, reference, worst_grad_error in run_ranks(_layout_errors, 4, variant):
        assert abs(loss - reference) < 1e-5 * abs(reference)
        assert worst_grad_error < 1e-5
