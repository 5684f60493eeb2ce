"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

`apply_tensor_parallel(model, tp, sequence_parallel)` swaps the layers of an unchanged `Transformer` (built on
the meta device) for parallel ones; weights are then materialised shard by shard (`models/init.py` asks each
parallel layer for `full_shape` and `local_region`, and each rank draws only its region), so a model at tp=N
starts from the tp=1 weights.

Per block: attention heads and the MLP's inner width are split over the tp ranks. The region entry ("f":
identity forward / all-reduce backward; with SP: all-gather along the sequence) runs once before the
column-parallel projections (the fused wqkv, or w_gate_up), and the row-parallel output projection (wo or
w_down) ends the region ("g": all-reduce; with SP: reduce-scatter). That is 2 all-reduces forward and 2
backward per layer, as in the paper. The fused projections' rows are laid out so that a rank's contiguous shard
holds its heads together (models/fused.py): wqkv's n_kv_heads / tp whole groups (its query heads with the
key/value heads they read, GQA included; tp must divide n_kv_heads, `layout.py`), w_gate_up's matching gate and
up rows. qk_norm's per-head norms are replicated and their gradients summed over tp (`parallel/grad_sync.py`).

The embedding and the output head are split over the vocabulary, padded to a multiple of tp (the padding rows
start at zero and the padded logits are masked to -inf, so a padding id is never predicted). The loss is a
vocab-parallel cross-entropy that never gathers the full logits on one rank; fused with the head (the default in
training) it never holds this rank's logits whole either.

Why by hand rather than DTensor's `parallelize_module`: one code path over gloo, NCCL and HCCL with exact
control of which collective runs where (and its byte count), and no per-op dispatch overhead; the benchmark
`bench/tp_vs_dtensor.py` keeps that choice honest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from large_model_training.config import ModelConfig
from large_model_training.models.float8 import Float8Gemms
from large_model_training.models.linear import WeightGradStore, linear
from large_model_training.models.loss import CrossEntropy
from large_model_training.models.moe import MoE
from large_model_training.parallel.collectives import (
    AxisGroup,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    scatter_to_sequence,
    split_to_sequence,
)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp, so every rank holds an equal slice."""
    return math.ceil(vocab_size / tp) * tp


def _real_rows(rank: int, per_rank: int, real: int) -> tuple[int, int]:
    """The rows of rank's equal slice of a padded dim that exist in the full tensor (may be empty)."""
    return min(rank * per_rank, real), min((rank + 1) * per_rank, real)


class RegionEntry(nn.Module):
    """Start of a tensor-parallel region: f (copy, all-reduce backward) or, with SP, all-gather the sequence."""

    def __init__(self, tp: AxisGroup, sequence_parallel: bool):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)


class SequenceSplit(nn.Module):
    """Enter the sequence-parallel residual stream: keep this rank's sequence chunk."""

    def __init__(self, tp: AxisGroup):
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_to_sequence(x, self.tp)


@dataclass(frozen=True)
class TPLayout:
    """How one parameter lies over the tp ranks (read by clipping, gradient sync and checkpoints)."""

    shard_dim: int | None = None
    """The tensor dim split over tp; None if every rank holds the whole tensor."""
    replicated: bool = False
    """Every tp rank holds the same value: count it once in the gradient norm."""
    partial_grad: bool = False
    """Each rank's gradient is a partial sum: all-reduce it over tp after backward."""
    full_size: int | None = None
    """Logical size along shard_dim when the shards carry padding (the vocabulary), else None."""


def _set_layout(module: nn.Module, param_name: str, layout: TPLayout) -> None:
    # Kept on the module, not the Parameter: materialising (to_empty) replaces Parameter objects.
    module.tp_layout = {**getattr(module, "tp_layout", {}), param_name: layout}


def tp_layouts(model: nn.Module) -> dict[str, TPLayout]:
    """Parameter name -> its tp layout, for every parameter of a tensor-parallel model that has one."""
    return {
        f"{mod_name}.{p_name}" if mod_name else p_name: layout
        for mod_name, module in model.named_modules()
        for p_name, layout in getattr(module, "tp_layout", {}).items()
    }


class ColumnParallelLinear(nn.Module):
    """y_r = x A_r: this rank holds rows [r*out/t, (r+1)*out/t) of the weight. No communication here; under SP
    the input is the region's gathered sequence, of which `linear` keeps only this rank's shard for backward."""

    weight_grads: WeightGradStore | None = None
    fp8: Float8Gemms | None = None  # --precision fp8 (models/float8.py)
    tp_sharded = "out"  # the dimension tp splits: fp8 amaxes spanning it are reduced over tp

    def __init__(
        self, in_features: int, out_features: int, tp: AxisGroup, padded_out: int | None = None, paired: bool = False
    ):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.paired = paired  # rows interleaved in pairs (w_gate_up), output as halves (models/linear.py)
        self.padded_out = padded_out or out_features
        if self.padded_out % tp.size:
            raise ValueError(f"{self.padded_out} output features do not split over tp={tp.size}")
        self.weight = nn.Parameter(torch.empty(self.padded_out // tp.size, in_features))
        padded = self.padded_out > out_features
        _set_layout(self, "weight", TPLayout(shard_dim=0, full_size=out_features if padded else None))

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features)

    def local_region(self, name: str) -> tuple[tuple[int, int], ...]:
        """This rank's rows of the full weight; rows past out_features (padding) are not in it, so start at zero."""
        return (_real_rows(self.tp.rank, self.padded_out // self.tp.size, self.out_features), (0, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_grads, paired=self.paired, fp8=self.fp8)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r A_r: this rank holds columns of the weight; ends the region with g (or SP reduce-scatter)."""

    weight_grads: WeightGradStore | None = None
    fp8: Float8Gemms | None = None
    tp_sharded = "in"

    def __init__(self, in_features: int, out_features: int, tp: AxisGroup, sequence_parallel: bool):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        _set_layout(self, "weight", TPLayout(shard_dim=1))

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features)

    def local_region(self, name: str) -> tuple[tuple[int, int], ...]:
        cols = self.in_features // self.tp.size
        return ((0, self.out_features), (self.tp.rank * cols, (self.tp.rank + 1) * cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.weight, self.weight_grads, fp8=self.fp8)
        return scatter_to_sequence(partial, self.tp) if self.sequence_parallel else reduce_from_tp(partial, self.tp)


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the (padded) vocabulary; ids outside this rank's slice look up zeros, then g."""

    def __init__(self, vocab_size: int, hidden: int, tp: AxisGroup):
        super().__init__()
        self.vocab_size, self.hidden, self.tp = vocab_size, hidden, tp
        self.per_rank = padded_vocab(vocab_size, tp.size) // tp.size
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))
        padded = self.per_rank * tp.size > vocab_size
        _set_layout(self, "weight", TPLayout(shard_dim=0, full_size=vocab_size if padded else None))

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden)

    def local_region(self, name: str) -> tuple[tuple[int, int], ...]:
        """This rank's rows of the vocabulary; padding rows past vocab_size are not in it, so start at zero."""
        return (_real_rows(self.tp.rank, self.per_rank, self.vocab_size), (0, self.hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.tp.rank * self.per_rank
        outside = (local < 0) | (local >= self.per_rank)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(h.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


class VocabParallelLoss(CrossEntropy):
    """The model's loss under tp: callable like `cross_entropy(logits, targets)` on this rank's logits, or
    `fused(hidden, weight, targets)` on the head's input (the region entry's output: the whole sequence) and
    this rank's vocabulary slice of the head weight (`models/fused_loss.py`)."""

    def __init__(self, tp: AxisGroup, vocab_size: int):
        super().__init__(vocab_size, tp)


def _parallelize_latent_attention(attn: nn.Module, cfg: ModelConfig, tp: AxisGroup, sp: bool) -> None:
    """MLA by heads, as Megatron splits it: the down-projections and their norms run on every rank (on its
    sequence shard under SP: then their gradients are partial), the region starts on the latents (narrower than
    x: a cheaper all-gather under SP), the up-projections are column-parallel by heads, wo row-parallel."""
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    attn.enter_q, attn.enter_kv = RegionEntry(tp, sp), RegionEntry(tp, sp)
    attn.wq_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * qk, tp)
    attn.wkv_b = ColumnParallelLinear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + v), tp)
    attn.wo = RowParallelLinear(cfg.n_heads * v, cfg.hidden_size, tp, sp)
    attn.n_heads = cfg.n_heads // tp.size
    for replicated in (attn.wq_a, attn.q_norm, attn.wkv_a, attn.kv_norm):
        _mark_norm(replicated, sp)


def _parallelize_block(block: nn.Module, cfg: ModelConfig, tp: AxisGroup, sp: bool) -> None:
    h, hd, t = cfg.hidden_size, cfg.head_dim, tp.size
    attn, mlp = block.attn, block.mlp
    if cfg.attention == "mla":
        _parallelize_latent_attention(attn, cfg, tp, sp)
    else:
        attn.enter = RegionEntry(tp, sp)
        attn.wqkv = ColumnParallelLinear(h, (cfg.n_heads + 2 * cfg.kv_heads) * hd, tp)  # n_kv / t whole groups
        attn.n_kv_heads = cfg.kv_heads // t
        attn.n_heads = cfg.n_heads // t
        attn.wo = RowParallelLinear(cfg.n_heads * hd, h, tp, sp)
    for norm in (block.attn_norm, block.mlp_norm):
        _mark_norm(norm, sp)
    if cfg.qk_norm:  # each rank normalises only its own heads: a partial gradient, with or without SP
        for norm in (attn.q_norm, attn.k_norm):
            _mark_norm(norm, sp=True)
    if isinstance(mlp, MoE):  # under SP (layout.py requires it): runs on this rank's sequence shard, replicated
        mlp.tp = tp
        for module in mlp.modules():
            _mark_norm(module, sp)
        return
    mlp.enter = RegionEntry(tp, sp)
    if cfg.mlp == "swiglu":  # interleaved gate/up rows: a shard holds matching pairs, silu(gate) * up stays local
        mlp.w_gate_up = ColumnParallelLinear(h, 2 * cfg.ffn_hidden_size, tp, paired=True)
    else:
        mlp.w_up = ColumnParallelLinear(h, cfg.ffn_hidden_size, tp)
    mlp.w_down = RowParallelLinear(cfg.ffn_hidden_size, h, tp, sp)


def _mark_norm(norm: nn.Module, sp: bool) -> None:
    # Replicated over tp. Under SP each rank normalises only its sequence chunk, so its gradient is partial
    # (the same for an MoE block's router, experts and shared experts).
    for name, _ in norm.named_parameters(recurse=False):
        _set_layout(norm, name, TPLayout(replicated=True, partial_grad=sp))


def apply_tensor_parallel(model: nn.Module, tp: AxisGroup, sequence_parallel: bool = False) -> nn.Module:
    """Swap a (meta-device) Transformer's layers for tensor-parallel ones in place; returns the model."""
    cfg: ModelConfig = model.cfg
    if tp.size == 1:
        return model
    for block in model.layers.values():
        _parallelize_block(block, cfg, tp, sequence_parallel)
    if hasattr(model, "tok_embeddings"):  # the first stage's, or multi-token prediction's copy on the last
        model.tok_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        if sequence_parallel:
            model.embed_exit = SequenceSplit(tp)
    if model.stage.has_embedding and cfg.position == "learned":
        _set_layout(model.pos_embeddings, "weight", TPLayout(replicated=True))
    if model.stage.has_head:
        _mark_norm(model.norm, sequence_parallel)
        for predictor in getattr(model, "mtp", {}).values():  # a block as any; the merge projection replicated
            _parallelize_block(predictor.block, cfg, tp, sequence_parallel)
            for module in (predictor.hidden_norm, predictor.embed_norm, predictor.proj, predictor.norm):
                _mark_norm(module, sequence_parallel)
        model.head_entry = RegionEntry(tp, sequence_parallel)
        model.output = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, tp, padded_out=padded_vocab(cfg.vocab_size, tp.size)
        )
        model.loss_fn = VocabParallelLoss(tp, cfg.vocab_size)
    model.seq_shards = tp.size if sequence_parallel else 1
    model.tie_weights()
    return model
