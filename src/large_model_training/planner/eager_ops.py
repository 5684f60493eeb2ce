"""What eager PyTorch runs besides GEMMs and attention: each elementwise kernel's bytes, and the host's time per op.

Issue 35, part 1. Two costs a GEMM-and-attention roofline leaves out:

Elementwise kernels at bandwidth, op by op. A block's norms, rope, swiglu, copies and residual adds are each a
kernel that reads and writes whole tensors; eager PyTorch runs them unfused, so a composite such as our fp32 rope
(kernels.rope_interleaved: a cast, four products, a difference, a sum, a stack, a cast back) moves about four
times what one fused pass would. The bytes below are counted from the ops models/transformer.py and kernels.py
run on an accelerator (F.rms_norm's fused kernel, SDPA's flash kernel), per token of one tp rank, forward and
backward (autograd's backward of each op, and the sums where a tensor feeds two ops). The loss is counted the
same way: the fused loss's chunks (models/fused_loss.py: the fp32 copy, max, sub_, exp_, sum, div_, mul_, cast
back: 44 bytes per logit beyond the GEMM's, and each chunk's d weight term summed into an fp32 buffer: 10 bytes
per weight element per chunk, which at a 128K vocabulary is the largest elementwise term of a 1B model), and
the plain path (models/loss.py's one in-place fp32 buffer).

Host time per op. The host issues every op (dispatch, autograd's bookkeeping, the launch) while the device runs
the ones before it; when the device's work per op is shorter than the host's, the step waits on the host: a
small model is launch-bound. A block's time is therefore max(device time, ops x HOST_OP_S), forward and backward
each (the host runs ahead within a block, so the larger of the two sums decides). HOST_OP_S = 10 us per aten
op: PyTorch eager's per-op overhead with autograd on a server CPU (the `small` run on the H200: 29.5 ms per step
for 2,823 aten ops, 10.4 us per op, with its device time well under that). The op counts are the aten ops the
block's code calls (views included: they cost host time, not device time); a CPU entry's calibrated step ratio
already holds both costs (planner/calibrate.py), so none of this applies to it (`hw.fused_kernels` False).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from large_model_training.config import ModelConfig
from large_model_training.planner.hardware import Hardware

HOST_OP_S = 10e-6
"""Host seconds per aten op in eager PyTorch with autograd (see the module docstring)."""

# aten ops per block, forward and backward (views, casts, autograd's sums included): what a rope/swiglu/GQA block
# dispatches in bf16, counted by a dispatch mode on the CPU less the CPU's composite RMSNorm beyond one fused op
# (tests/test_planner_eager.py counts them again); gelu, learned positions and qk_norm change them slightly.
BLOCK_OPS = (72, 94)
ROPE_OPS = (17, 24)  # of the above, per rope call (two per block)
LOSS_CHUNK_OPS = 24  # one fused-loss chunk: its GEMMs, the softmax passes, the slices and the d weight sum


@dataclass(frozen=True)
class EagerCost:
    """Bytes moved by the elementwise kernels, their count, and the aten ops the host issues: forward and
    backward of one block (or one head) and one micro-batch."""

    bytes_f: float
    bytes_b: float
    kernels_f: int
    kernels_b: int
    ops_f: int
    ops_b: int

    def device_time(self, hw: Hardware) -> tuple[float, float]:
        """Forward and backward seconds of these kernels at the entry's streaming bandwidth plus their launches."""
        bw, launch = hw.stream_bandwidth, hw.kernel_launch_s
        return self.bytes_f / bw + self.kernels_f * launch, self.bytes_b / bw + self.kernels_b * launch


def block_cost(cfg: ModelConfig, n: int, r: int, B: int, per_rank: tuple[int, int, int]) -> EagerCost:
    """One dense block's elementwise kernels for n tokens on one tp rank; per_rank = (query heads, kv heads,
    MLP width) per tp rank, r = t under sequence parallelism (norms and residuals on n / t tokens)."""
    a_r, k_r, f_r = per_rank
    h, d = cfg.hidden_size, cfg.head_dim
    qd, kd = a_r * d, k_r * d
    norm_tokens = n / r
    # forward: two fused RMSNorms (read, write) and two residual adds (2 reads, 1 write), on the SP shard
    fwd = (2 * 2 + 2 * 3) * norm_tokens * h * B
    # backward: the norms' fused backward (x and dy read, dx written) and the residual gradient sums
    bwd = (2 * 3 + 2 * 3) * norm_tokens * h * B
    kf, kb = 4, 4
    if cfg.dropout > 0:  # mask written (1 byte), the product read and written; backward the product again
        fwd += 2 * (2 * B + 1) * norm_tokens * h
        bwd += 2 * (2 * B + 1) * norm_tokens * h
        kf, kb = kf + 2, kb + 2
    # q, k, v out of the one qkv output: v's copy; q's when its group has several heads (the reshape copies);
    # backward: split's cat of dq, dk, dv, and the core's output gradient made contiguous for the flash kernel
    fwd += 2 * kd * B * n + (2 * qd * B * n if a_r > k_r else 0)
    bwd += 2 * (qd + 2 * kd) * B * n + 2 * qd * B * n
    kf, kb = kf + 2, kb + 2
    if cfg.position == "rope":
        # kernels.rope_interleaved per element of q and k: the fp32 cast (B + 4), four products on the halves
        # (16), the difference and the sum (12), the stack (8), the cast back (4 + B); backward: the casts, the
        # four products' gradients, the halves' sums and their scatter into pairs
        fwd += (2 * B + 44) * (qd + kd) * n
        bwd += (2 * B + 64) * (qd + kd) * n
        kf, kb = kf + 2 * 9, kb + 2 * 12
    if cfg.qk_norm or cfg.position != "rope":  # q and k made contiguous (q copied already when grouped)
        fwd += 2 * (kd + (0 if a_r > k_r else qd)) * B * n
        kf += 2
    if cfg.qk_norm:
        fwd += 2 * (qd + kd) * B * n
        bwd += 3 * (qd + kd) * B * n
        kf, kb = kf + 2, kb + 2
    mlp_f, mlp_b = mlp_bytes(cfg.mlp, n, f_r, h, B)
    fwd, bwd = fwd + mlp_f, bwd + mlp_b
    kf, kb = (kf + 3, kb + 6) if cfg.mlp == "swiglu" else (kf + 1, kb + 1)
    ops_f, ops_b = BLOCK_OPS
    if cfg.position != "rope":
        ops_f, ops_b = ops_f - 2 * ROPE_OPS[0], ops_b - 2 * ROPE_OPS[1]
    return EagerCost(fwd, bwd, kf, kb, ops_f, ops_b)


def mlp_bytes(kind: str, n: int, f: int, h: int, B: int) -> tuple[float, float]:
    """The MLP activation's elementwise bytes, forward and backward, for n tokens of width f. swiglu: silu(gate) *
    up on [gate | up] halves: silu (read, write), product (two reads, a write); backward the two products'
    gradients, silu's backward and the halves' gradients concatenated into one tensor; the paired GEMM's weight
    reordered to halves, forward and backward (and its gradient back). gelu: one kernel each way."""
    if kind == "swiglu":
        return 5.0 * f * B * n + 2 * 2 * f * h * B, 13.0 * f * B * n + 2 * 2 * 2 * f * h * B
    return 2.0 * f * B * n, 3.0 * f * B * n


def fused_loss_cost(n: int, vocab: int, h: int, B: int, chunk: int) -> EagerCost:
    """The fused head + loss (models/fused_loss.py) beyond its three GEMMs, all in the forward: per logit the fp32
    copy (B + 4), max (4), sub_ and exp_ (8 each), sum (4), div_ (8), mul_ (8), the cast back (4 + B); per chunk
    d weight's term summed into the fp32 buffer (read both, write: B + 8 per weight element) and d hidden's rows
    copied in (2 B per element); then d weight cast to the weight's dtype once. Backward scales the two."""
    chunks = math.ceil(n / chunk)
    per_logit = (B + 4) + 4 + 8 + 8 + 4 + 8 + 8 + (4 + B)
    fwd = per_logit * n * vocab + chunks * (B + 8) * vocab * h + 2 * B * n * h + (4 + B) * vocab * h
    bwd = 2 * B * (n + vocab) * h
    return EagerCost(fwd, bwd, 9 * chunks + 2, 2, LOSS_CHUNK_OPS * chunks + 8, 6)


def plain_loss_cost(n: int, vocab: int, B: int) -> EagerCost:
    """models/loss.py on the logits (the head's GEMMs are timed apart): forward the fp32 copy, max, sub_, exp_,
    sum, div_ (38 bytes per logit); backward the target's index, mul_ and autograd's cast of the fp32 gradient to
    the logits' dtype (8 + 4 + B)."""
    return EagerCost(38.0 * n * vocab, (12 + B) * n * vocab, 7, 3, 20, 10)


def block_elementwise(cfg: ModelConfig, n: int, r: int, B: int, per_rank: tuple[int, int, int], hw: Hardware):
    """(forward s, backward s, forward ops, backward ops) of a block's elementwise kernels. A CPU entry keeps the
    one-pass count its calibration was made with (norms, residual adds, dropout, rope, the MLP's activation; twice
    that backward) and no host term."""
    if hw.fused_kernels:
        cost = block_cost(cfg, n, r, B, per_rank)
        return (*cost.device_time(hw), cost.ops_f, cost.ops_b)
    a_r, k_r, f_r = per_rank
    moved = (2 * 2 + 2 * 3 + (2 * 3 if cfg.dropout > 0 else 0)) * n * cfg.hidden_size * B / r
    moved += 2 * n * cfg.head_dim * (a_r + k_r) * (B + 4) if cfg.position == "rope" else 0  # fp32 rotation
    moved += (5 if cfg.mlp == "swiglu" else 2) * n * f_r * B
    once = moved / hw.stream_bandwidth + 12 * hw.kernel_launch_s
    return once, 2 * once, 0, 0


def loss_elementwise(hw: Hardware, n: int, vocab: int, h: int, B: int, chunk: int | None):
    """(forward s, backward s, forward ops, backward ops) of the loss beyond the head's GEMMs: the fused loss
    (chunk tokens per chunk) or the plain one (chunk None); on a CPU entry the one-pass count of its calibration."""
    if hw.fused_kernels:
        cost = fused_loss_cost(n, vocab, h, B, chunk) if chunk else plain_loss_cost(n, vocab, B)
        return (*cost.device_time(hw), cost.ops_f, cost.ops_b)
    if chunk:
        return n * vocab * (2 * B + 4) / hw.stream_bandwidth, 2 * (n + vocab) * h * B / hw.stream_bandwidth, 0, 0
    once = n * vocab * (B + 4) / hw.stream_bandwidth
    return once, once, 0, 0


def host_bound(device: float, ops: int, hw: Hardware) -> float:
    """The longer of the device's work and the host's issuing of `ops` aten ops (accelerators only: a CPU
    entry's calibration holds its host time already)."""
    return max(device, ops * HOST_OP_S) if hw.fused_kernels else device
