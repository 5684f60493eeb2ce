"""The passes over memory the planner counts for code it does not see as GEMMs: the ring's merges
(planner/ring_merge.py) and the optimizer step (planner/optimizer_step.py), each held to the bytes the runtime's
own code moves, counted op by op by a dispatch mode on the CPU (the same aten ops run on an accelerator)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from large_model_training.choices import RecomputePolicy
from large_model_training.config import model_from_preset
from large_model_training.layout import Job, Layout
from large_model_training.planner import optimizer_step, ring_merge
from large_model_training.planner.hardware import CATALOGUE

NOT_READ = {"copy_", "fill_", "zero_", "empty_like", "zeros_like", "empty", "randint", "random_"}


def _stored(t: torch.Tensor) -> int:
    """Bytes a kernel reads of `t`: a broadcast (stride-0) dimension is read once."""
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


class Bytes(TorchDispatchMode):
    """Bytes read and written by every kernel dispatched (views move nothing)."""

    moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket.__name__ in ("view", "_unsafe_view", "detach", "alias"):
            return out
        name = func.overloadpacket.__name__
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if name in NOT_READ:  # the destination is written, not read
            inputs = inputs[1:]
        outputs = out if isinstance(out, (tuple, list)) else [out]
        self.moved += sum(_stored(t) for t in inputs)
        self.moved += sum(_stored(t) for t in outputs if isinstance(t, torch.Tensor))
        return out


def test_one_merge_moves_what_the_planner_counts():
    """merge_block (parallel/ring_attention.py) on 16 heads x 256 rows x 128: its bytes are the model's
    (MERGE_BYTES + B) per output element and MERGE_LSE_BYTES per log-sum-exp row, within 1%."""
    from large_model_training.parallel.ring_attention import merge_block

    b, heads, s, d = 1, 16, 512, 128
    out, lse = torch.randn(b, heads, s, d), torch.randn(b, heads, s)
    rows = slice(256, 512)
    block_out, block_lse = torch.randn(b, heads, 256, d, dtype=torch.bfloat16), torch.randn(b, heads, 256)
    with Bytes() as counted:
        merge_block(out, lse, rows, block_out, block_lse)
    elements, lse_rows = b * heads * 256 * d, b * heads * 256
    modelled = (ring_merge.MERGE_BYTES + 2) * elements + ring_merge.MERGE_LSE_BYTES * lse_rows
    assert counted.moved == pytest.approx(modelled, rel=0.01)


def _long(cp: int, attention: str = "ring", hw: str = "h100-sxm"):
    model = dataclasses.replace(model_from_preset("llama3-405b"), max_seq_len=131072)
    job = Job(model, 131072, 128, "bf16")
    lay = Layout(8, 16, 8, 1, cp=cp, cp_attention=attention, recompute=RecomputePolicy.parse("sac"))
    return job, lay, CATALOGUE[hw]


def test_the_rank_that_attends_every_row_at_every_step_paces_the_ring():
    job, lay, hw = _long(16)
    first, last = (ring_merge.rank_merge_bytes(job, lay, 2, r) for r in (0, 15))
    assert last[0] > 1.9 * first[0]  # rank 15 merges all its rows at each step, rank 0 half of them
    f, b = ring_merge.ring_merge_time(job, lay, hw, 2)
    assert f == pytest.approx(last[0] / hw.stream_bandwidth + last[2] * hw.kernel_launch_s)
    # 15 merges of 16 heads x 8,192 rows x 128 (42 bytes each, 82 per lse row), the start and the cast back: 11 GB
    elements, rows = 16 * 8192 * 128, 16 * 8192
    assert last[0] == pytest.approx(15 * (42 * elements + 82 * rows) + 6 * (2 * elements + rows), rel=0.01)
    assert ring_merge.ring_merge_time(*_long(16, "allgather")[:3], 2) == (0.0, 0.0)
    cpu = dataclasses.replace(hw, fused_kernels=False)
    assert ring_merge.ring_merge_time(job, lay, cpu, 2) == (0.0, 0.0)
    assert ring_merge.ring_merge_time(job, dataclasses.replace(lay, cp=1), hw, 2) == (0.0, 0.0)


def test_the_block_at_128k_carries_the_merges(monkeypatch):
    """Forward gains the merges; backward its own and, under sac, the rebuilt forward's again."""
    from large_model_training.planner import timing

    job, lay, hw = _long(16)
    f, b = ring_merge.ring_merge_time(job, lay, hw, 2)
    with_merge = timing._block_times(job, lay, hw, 8)
    monkeypatch.setattr(timing, "ring_merge_time", lambda *args: (0.0, 0.0))
    without = timing._block_times(job, lay, hw, 8)
    assert with_merge.forward - without.forward == pytest.approx(f)
    assert with_merge.backward - without.backward == pytest.approx(b + f)
    assert f > 0.1 * without.forward  # a tenth of the rest of the block or more at 128K, cp 16


def _shards(n: int, dtype: torch.dtype, sr_master: bool = False):
    from large_model_training.parallel.grad_buffer import bucket_layout
    from large_model_training.parallel.pieces import FlatShards

    named = [("w", nn.Parameter(torch.randn(4, n // 4)))]
    layout, _ = bucket_layout(named, set(), set(), bucket_mb=64.0, element_size=4, dp=1)
    one = SimpleNamespace(grad_size=1, grad_rank=0, grad_group=None, device=torch.device("cpu"))
    return layout, FlatShards(layout, one, zero=0, compute_dtype=dtype, sr_master=sr_master)


@pytest.mark.parametrize("states", ["fp32", "bf16", "bf16_sr"])
def test_our_adamw_step_moves_what_the_planner_counts(states):
    """parallel/adamw.py's step on bf16 compute (fp32 masters, bf16 gradients): counted bytes per element equal
    adamw_bytes (within 1%), and the publish into the bf16 parameters 4 + 2 (none: bf16_sr's masters are the
    parameters). Stochastic rounding's one draw per step (a slice of bits, not per element) is taken off."""
    from large_model_training.parallel.adamw import AdamW

    n = 1 << 16
    layout, shards = _shards(n, torch.bfloat16, sr_master=states == "bf16_sr")
    dtype = torch.float32 if states == "fp32" else torch.bfloat16
    opt = AdamW(shards, weight_decay=0.1, betas=(0.9, 0.95), state_dtype=dtype)
    grads = [torch.randn(p.hi - p.lo, dtype=torch.bfloat16) for p in shards.pieces]
    with Bytes() as step:
        opt.step(shards.pieces, grads, 1e-3, 1.0)
    with Bytes() as publish:
        shards.publish()
    draw = opt._rounding.bits.numel() * 4 if opt._rounding is not None else 0
    assert (states == "fp32") == (draw == 0)
    assert (step.moved - draw) / n == pytest.approx(optimizer_step.adamw_bytes(2, states), rel=0.01)
    assert publish.moved / n == pytest.approx(0 if states == "bf16_sr" else 4 + 2, rel=0.01)


def test_fsdps_torch_adamw_moves_what_the_planner_counts():
    """ZeRO-3's torch.optim.AdamW(foreach=False) on fp32 shards: adamw_bytes(fsdp=True) per element."""
    n = 1 << 16
    p = nn.Parameter(torch.randn(4, n // 4))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    opt.step()  # the state's creation is the first step's alone
    with Bytes() as step:
        opt.step()
    assert step.moved / n == pytest.approx(optimizer_step.adamw_bytes(4, fsdp=True), rel=0.02)


def test_the_h200_llama_1b_step_is_predicted_within_ten_percent():
    """The one measured H200 run (docs/benchmarks.md: llama-1b, bf16, one micro-batch of 8 x 2,048, plain loss):
    0.324 s per step. The optimizer's passes are a tenth of the prediction; one fused pass would be 0.277 s."""
    from large_model_training.planner.search import Planner

    job = Job(model_from_preset("llama-1b"), 2048, 8, "bf16", fused_loss=False)
    hw = CATALOGUE["h200"]
    planner = Planner(job, hw, 1, 8)
    t = planner.evaluate(Layout(1, 1, 1, 8)).time
    assert abs(t.step_time_s / 0.324 - 1) < 0.10
    fused = Planner(dataclasses.replace(job, fused_optimizer=True), hw, 1, 8).evaluate(Layout(1, 1, 1, 8)).time
    assert t.optimizer_s > 4 * fused.optimizer_s
