"""planner/eager_ops.py: elementwise kernels op by op, the host's time per op, and the sac policy's time."""

from __future__ import annotations

from dataclasses import replace

from large_model_training.choices import RecomputePolicy
from large_model_training.config import model_from_preset
from large_model_training.layout import Job, Layout
from large_model_training.planner import eager_ops
from large_model_training.planner.hardware import CATALOGUE
from large_model_training.planner.timing import _block_times


def _times(preset: str, tokens: int, hw, recompute: str = "none"):
    job = Job(model_from_preset(preset), tokens, tokens, "bf16")
    lay = Layout(1, 1, 1, 1, recompute=RecomputePolicy.parse(recompute))
    return _block_times(job, lay, hw, 8)


def test_a_small_model_is_host_bound_and_a_large_one_is_not():
    hw = CATALOGUE["h200"]
    small = _times("small", 1024, hw)
    ops_f, ops_b = eager_ops.BLOCK_OPS
    assert small.forward == ops_f * eager_ops.HOST_OP_S and small.backward == ops_b * eager_ops.HOST_OP_S
    big = _times("llama3-8b", 8192, hw)
    assert big.forward > 10 * ops_f * eager_ops.HOST_OP_S


def test_a_cpu_entry_keeps_its_calibrated_one_pass_count():
    """The CPU's calibration ratio was taken with the one-pass count and holds its host time: unchanged."""
    cpu = replace(CATALOGUE["h200"], fused_kernels=False)
    cfg = model_from_preset("small")
    f, b, ops_f, ops_b = eager_ops.block_elementwise(cfg, 1024, 1, 2, (cfg.n_heads, cfg.kv_heads, 1280), cpu)
    assert (ops_f, ops_b) == (0, 0) and b == 2 * f
    assert eager_ops.host_bound(1e-6, 1000, cpu) == 1e-6


def test_eager_passes_move_more_than_one_fused_pass():
    """Rope in fp32 and the swiglu's backward are several kernels each: more bytes than the one-pass count."""
    hw = CATALOGUE["h100-sxm"]
    cfg = model_from_preset("llama-1b")
    per_rank = (cfg.n_heads, cfg.kv_heads, cfg.ffn_hidden_size)
    eager = eager_ops.block_cost(cfg, 16384, 1, 2, per_rank)
    one_pass = eager_ops.block_elementwise(cfg, 16384, 1, 2, per_rank, replace(hw, fused_kernels=False))
    assert eager.bytes_f / hw.stream_bandwidth > 1.3 * (one_pass[0] - 12 * hw.kernel_launch_s)
    assert eager.bytes_b > eager.bytes_f


def test_the_fused_loss_d_weight_sums_grow_with_the_chunks():
    few = eager_ops.fused_loss_cost(16384, 128256, 2048, 2, chunk=16384 // 8)
    many = eager_ops.fused_loss_cost(16384, 128256, 2048, 2, chunk=16384 // 64)
    assert many.bytes_f - few.bytes_f == (64 - 8) * (2 + 8) * 128256 * 2048
    assert many.ops_f > few.ops_f


def test_sac_recomputes_less_than_full_and_more_than_none():
    hw = CATALOGUE["h100-sxm"]
    none, sac, full = (_times("llama3-8b", 8192, hw, p).backward for p in ("none", "sac", "full"))
    assert none < sac < full


def test_a_collective_beside_compute_takes_its_blocks_share_of_the_sms():
    from large_model_training.planner.overlap import COLLECTIVE_BLOCKS, overlapped, sm_share

    h100 = CATALOGUE["h100-sxm"]
    share = COLLECTIVE_BLOCKS / h100.compute_units
    assert sm_share(h100) == share
    assert overlapped(10.0, 2.0, h100) == 10.0 + 2.0 * share  # compute longer: slowed while the collective runs
    assert overlapped(1.0, 5.0, h100) == 5.0  # the collective longer: it decides
    assert sm_share(CATALOGUE["ascend-910b"]) == 0.0  # HCCL moves data on SDMA engines
    assert sm_share(replace(h100, fused_kernels=False)) == 0.0  # a CPU entry's calibration holds it


def test_the_block_op_counts_are_what_a_block_dispatches():
    """BLOCK_OPS against the aten ops one rope/swiglu/GQA block dispatches forward and backward (bf16, counted by a
    dispatch mode on the CPU), less what the CPU's composite RMSNorm dispatches beyond the accelerator's one fused
    op (counted the same way on the norm alone): within 10%."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from large_model_training.assembly import build_model
    from large_model_training.config import ModelConfig
    from large_model_training.models.transformer import RMSNorm, StageSpec, rope_tables

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def count(module, *inputs):
        x = inputs[0]
        with Count() as f:
            y = module(*inputs)
        with Count() as b:
            y.backward(torch.ones_like(y))
        assert x.grad is not None
        return f.ops, b.ops

    cfg = ModelConfig(vocab_size=256, hidden_size=256, n_layers=1, n_heads=8, n_kv_heads=2, ffn_hidden_size=512)
    model = build_model(cfg, None, seed=3, stage=StageSpec(0, 1, False, False)).train().to(torch.bfloat16)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    block_f, block_b = count(model.layers["0"], x, rope_tables(64, 32, cfg.rope_theta, x.device))
    norm = RMSNorm(256).to(torch.bfloat16)
    norm_f, norm_b = count(norm, torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True))
    accelerator = (block_f - 2 * (norm_f - 1), block_b - 2 * (norm_b - 1))
    for counted, written in zip(accelerator, eager_ops.BLOCK_OPS):
        assert abs(written / counted - 1) < 0.10, (accelerator, eager_ops.BLOCK_OPS)


def test_materialised_attention_is_one_batched_gemm_per_product():
    """Megatron's baddbmm / bmm over every (sequence, head): one kernel each, its tiles in waves over all heads, so
    a micro-batch of 32 costs far less than 32 of one (one launch, full waves), where per-head kernels would not."""
    hw = CATALOGUE["a100-80gb"]
    cfg = model_from_preset("megatron-18b")

    def attention_share(mb: int) -> float:
        job = Job(cfg, 2048, mb, "bf16", flash_attention=False)
        flash = _block_times(replace(job, flash_attention=True), Layout(8, 1, 1, mb), hw, 8).forward
        return _block_times(job, Layout(8, 1, 1, mb), hw, 8).forward - flash

    assert attention_share(32) < 32 * attention_share(1)
    assert attention_share(32) > 16 * attention_share(1)  # the work itself scales
