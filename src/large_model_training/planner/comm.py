"""Bytes each rank moves per collective pattern, under ring algorithms: one formula per pattern, used by
the planner's time model and checked against the counts the running code records (`comm_bytes_tp`, ...).

Ring costs per rank for a full tensor of n bytes over t ranks: all-reduce 2(t-1)/t * n; all-gather and
reduce-scatter (t-1)/t * n each.
"""

from __future__ import annotations

from large_model_training.config import ModelConfig


def ring_all_reduce(n_bytes: float, t: int) -> float:
    return 2 * (t - 1) / t * n_bytes


def ring_all_gather(n_bytes: float, t: int) -> float:
    return (t - 1) / t * n_bytes


def tp_bytes_per_microbatch(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    tp: int,
    sequence_parallel: bool,
    act_bytes: int = 4,
    layers: int | None = None,
    embedding: bool = True,
    head: bool = True,
    fused_loss: bool = False,
) -> float:
    """Tensor-parallel bytes one rank moves for one micro-batch, forward and backward.

    Per layer (Shoeybi et al. 2019): 2 all-reduces of the (b, s, h) activation forward and 2 backward; with
    sequence parallelism (Korthikanti et al. 2022) each becomes an all-gather + reduce-scatter pair: the same
    volume, plus lean SP's re-gather in backward of each column-parallel region's input (2 per layer, 1 for
    the head: the layers keep only their shard of it). The vocab-parallel embedding all-reduces its output (SP: then
    splits, all-gather backward); the head enters its region with f (all-reduce backward; SP: all-gather forward,
    reduce-scatter backward); the vocab-parallel cross-entropy all-reduces 3 fp32 numbers per token. The fused head +
    loss (`fused_loss`, models/fused_loss.py) moves the same but the head's re-gather: it keeps no input shard.
    """
    if tp == 1:
        return 0.0
    layers = cfg.n_layers if layers is None else layers
    activation = micro_batch * seq_len * cfg.hidden_size * act_bytes
    total = layers * 4 * ring_all_reduce(activation, tp)
    if sequence_parallel:  # backward gathers each region's input again
        total += (2 * layers + (1 if head and not fused_loss else 0)) * ring_all_gather(activation, tp)
    if embedding:
        total += ring_all_reduce(activation, tp) + (ring_all_gather(activation, tp) if sequence_parallel else 0)
    if head:
        total += 2 * ring_all_gather(activation, tp) if sequence_parallel else ring_all_reduce(activation, tp)
        total += 3 * ring_all_reduce(micro_batch * seq_len * 4, tp)
    return total


def tp_gradient_sync_bytes(
    cfg: ModelConfig,
    tp: int,
    sequence_parallel: bool,
    grad_bytes: int = 4,
    layers: int | None = None,
    head: bool = True,
) -> float:
    """Per step: gradients summed over tp because each rank holds only part of them (SP norm weights; qk_norm's
    two head_dim weights, as each rank normalises its heads)."""
    if tp == 1:
        return 0.0
    layers = cfg.n_layers if layers is None else layers
    norm_params = cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1)
    partial = 0
    if sequence_parallel:
        partial += (2 * layers + (1 if head else 0)) * norm_params
    if cfg.qk_norm:
        partial += layers * 2 * cfg.head_dim
    return ring_all_reduce(partial * grad_bytes, tp)


def zero3_bytes_per_step(
    micro_batches: int,
    d: int,
    layers: int,
    block_params: int,
    block_norm_params: int,
    chunk_params: int,
    param_bytes: int,
    grad_bytes: int,
    float8_gather: bool = False,
    sync_per_step: bool = False,
) -> float:
    """comm_bytes_dp of one ZeRO-3 step on a rank (FSDP2 as `parallel/fsdp.py` wraps it, counted there): per
    micro-batch each block's parameters are all-gathered in forward and again in backward (resharded after
    forward) and its gradients reduce-scattered; the chunk's own parameters (embedding, final norm, head: FSDP2's
    root group, not resharded after forward) are gathered and reduce-scattered once. `float8_gather` (fp8,
    tensorwise): a block's linear weights are gathered at 1 byte per value (`parallel/fsdp_float8.py`), and each
    linear's fp32 amax is all-reduced once per step (4 linears per block: qkv, output, the MLP's two).
    `sync_per_step` (parallel.fsdp_sync_per_step): the reduce-scatters run once per step, not per micro-batch."""
    if d == 1:
        return 0.0
    linear = block_params - block_norm_params
    gathered = linear * (1 if float8_gather else param_bytes) + block_norm_params * param_bytes
    gathers = layers * 2 * ring_all_gather(gathered, d) + ring_all_gather(chunk_params * param_bytes, d)
    scatters = ring_all_gather((layers * block_params + chunk_params) * grad_bytes, d)
    amax = ring_all_reduce(4 * layers * 4, d) if float8_gather else 0.0
    return micro_batches * gathers + (1 if sync_per_step else micro_batches) * scatters + amax
