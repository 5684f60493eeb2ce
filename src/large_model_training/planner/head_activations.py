"""Activation bytes outside the blocks (planner/activations.py's other half): the last stage's head and loss,
what the loss has in flight, what a split backward keeps for the head's W, and the first stage's embedding."""

from __future__ import annotations

from large_model_training.config import ModelConfig
from large_model_training.models.fused_loss import chunk_tokens
from large_model_training.parallel.tensor import padded_vocab


def head_activation_bytes(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    dtype_bytes: int,
    fused_kernels: bool = True,
    fused_loss: bool = False,
) -> float:
    """Last stage, one micro-batch: final norm input, head input (its shard under SP) and the fp32 (log-)softmax
    the loss keeps. Not the logits: the head keeps its input and the loss its fp32 softmax, so nothing holds
    them (measured: llama-1b on an H200 held exactly this, 3.9 GiB less than with the logits counted).
    `fused_loss` (models/fused_loss.py): instead of the head input and the softmax, the gradients the fused
    loss computed in its forward: d hidden (the whole sequence, n h B, also under SP: it is the gathered
    input's) and d weight (this rank's V/t x h, in the weight's dtype, B)."""
    n, h, r = seq_len * micro_batch, cfg.hidden_size, (tp if sp else 1)
    vocab = padded_vocab(cfg.vocab_size, tp) // tp
    norm = (n * h * 8 if cfg.norm == "rmsnorm" and not fused_kernels else n * h * dtype_bytes) / r
    if fused_loss:
        return norm + n * h * dtype_bytes + vocab * h * dtype_bytes
    return norm + n * h * dtype_bytes / r + n * vocab * 4


def loss_transient_bytes(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    dtype_bytes: int,
    fused_loss: bool = False,
    fused_kernels: bool = True,
) -> float:
    """Last stage: the most the loss has in flight beyond the fp32 softmax it keeps (`head_activation_bytes`):
    the logits themselves while it runs forward, and their B-byte gradient cast from that softmax in backward
    (models/loss.py works one fp32 buffer in place). F.cross_entropy's backward held 8 bytes per logit instead,
    15.7 GiB for llama-1b at 8 x 2,048 tokens in bf16 on an H200: the allocator's peak less the rest of the
    estimate, to within 0.06 GiB. `fused_loss`: `fused_loss_transient_bytes`."""
    if fused_loss:
        return fused_loss_transient_bytes(cfg, seq_len, micro_batch, tp, dtype_bytes, fused_kernels)
    return float(seq_len * micro_batch * (padded_vocab(cfg.vocab_size, tp) // tp) * dtype_bytes)


def fused_loss_transient_bytes(
    cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, dtype_bytes: int, fused_kernels: bool = True
) -> float:
    """The fused loss's forward beyond what it keeps (models/fused_loss.py), c tokens a chunk (`chunk_tokens`),
    v = V/t: one chunk's fp32 logits, c v 4, worked in place into their gradient; below fp32 also their copy in
    the compute dtype (c v B, before or after the fp32 one), or instead that copy and the chunk's d weight term
    (v h B), and the fp32 sum of d weight (v h 4, rounded to the kept B-byte one at the end); in fp32 the term
    is added in place (addmm_); the chunk's d hidden rows (c h B) and the per-token losses (n 4). Backward
    scales the kept gradients in place. Not fused_kernels (the CPU, measured): the d weight GEMM copies its
    transposed operand (c v B) and addmm_ computes into a temporary (v h 4); cuBLAS does neither (not measured
    on an accelerator yet)."""
    n, h, B = seq_len * micro_batch, cfg.hidden_size, dtype_bytes
    v = padded_vocab(cfg.vocab_size, tp) // tp
    c = min(n, chunk_tokens(n, v, h))
    cpu = 0 if fused_kernels else c * v * B + (v * h * 4 if B >= 4 else 0)
    if B >= 4:
        return float(c * v * 4 + c * h * B + n * 4 + cpu)
    return float(max(c * v * (4 + B), c * v * B + v * h * B) + v * h * 4 + c * h * B + n * 4 + cpu)


def head_pending_bytes(
    cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, dtype_bytes: int, fused_loss: bool = False
) -> float:
    """Last stage, split backward: the head's input (shard under SP) and the logits' gradient, B to W. The fused
    loss keeps nothing for W: its weight gradient is complete in B."""
    if fused_loss:
        return 0.0
    n, r = seq_len * micro_batch, (tp if sp else 1)
    return n * cfg.hidden_size * dtype_bytes / r + n * padded_vocab(cfg.vocab_size, tp) // tp * dtype_bytes


def embedding_activation_bytes(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sp: bool,
    fused_kernels: bool = True,
    dtype_bytes: int = 2,
) -> float:
    """First stage, one micro-batch: the embedding dropout mask (the token ids are negligible)."""
    if cfg.dropout <= 0:
        return 0.0
    return seq_len * micro_batch * cfg.hidden_size / (tp if sp else 1) * (1 if fused_kernels else dtype_bytes)
