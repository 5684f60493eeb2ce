"""Ring attention (issue 19): the zig-zag layout, the balanced causal work, the local kernels and their merge (fast,
one process), and the ring itself on 2 and 4 gloo ranks against plain SDPA on the whole sequence and against
PyTorch's private `_templated_ring_attention` on the same shards (slow)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from large_model_training.kernels import math_attention, math_attention_backward
from large_model_training.parallel.ring_attention import (
    block_calls,
    merge_block,
    ring_attention,
    zigzag_chunks,
    zigzag_flops,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from tests.dist import run_ranks

aten = torch.ops.aten


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_shard_then_unshard_is_the_identity(cp):
    x = torch.randn(2, 3, 16 * cp, 5)
    for dim in (1, 2):
        x = x.transpose(1, 2)
        parts = [zigzag_shard(x, dim, r, cp) for r in range(cp)]
        assert torch.equal(zigzag_unshard(parts, dim), x)
    positions = torch.arange(16 * cp)
    assert all(torch.equal(zigzag_shard(positions, 0, r, cp), zigzag_positions(16 * cp, r, cp)) for r in range(cp))


def test_rank_holds_an_early_chunk_and_its_mirror():
    assert zigzag_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_chunks(1, 4) == (1, 6)


@pytest.mark.parametrize("seq, cp", [(30, 4), (6, 2), (7, 1)])
def test_sizes_that_do_not_divide_raise_a_clear_error(seq, cp):
    with pytest.raises(ValueError, match=f"not divisible by {2 * cp}"):
        zigzag_positions(seq, 0, cp)
    with pytest.raises(ValueError, match=f"not divisible by {2 * cp}"):
        zigzag_shard(torch.zeros(1, seq), 1, 0, cp)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8, 16])
def test_every_rank_does_the_same_causal_work_and_all_of_it(cp):
    """Weights full = 2, causal = 1 (half a chunk pair): equal per rank within 1%, and summed over the ranks the
    whole causal triangle of 2cp chunks, (2cp)^2 half-pairs, once."""
    work = [zigzag_flops(r, cp) for r in range(cp)]
    assert max(work) <= 1.01 * min(work)
    assert sum(work) == (2 * cp) ** 2


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_block_calls_cover_exactly_the_global_causal_pairs(cp):
    """Every (query, key) position pair the kernel calls of a rank's ring compute, causal mask applied inside a
    call, is exactly {key <= query} over the global sequence, each pair once."""
    chunk, seq = 3, 6 * cp
    for rank in range(cp):
        q_pos = zigzag_positions(seq, rank, cp)
        seen = torch.zeros(2 * chunk, seq, dtype=torch.int64)
        for source in range(cp):
            k_pos = zigzag_positions(seq, source, cp)
            for rows, cols, causal in block_calls(rank, source, cp, chunk):
                n_q, n_k = rows.stop - rows.start, cols.stop - cols.start
                visible = torch.ones(n_q, n_k, dtype=torch.int64)
                if causal:
                    visible = visible.tril()
                seen[rows.start : rows.stop].index_add_(1, k_pos[cols], visible)
        assert torch.equal(seen, (torch.arange(seq)[None, :] <= q_pos[:, None]).long())


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_math_kernel_matches_the_cpu_flash_kernel(kv_heads):
    """The fallback kernel (for devices without a wired flash kernel) gives the CPU flash kernel's out, lse and
    gradients, GQA included."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, generator=g) for h in (4, kv_heads, kv_heads))
    dout = torch.randn(2, 4, 12, 8, generator=g)
    for causal, kq in ((True, k), (False, k[:, :, :7])):
        vq = v[:, :, : kq.shape[2]]
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, kq, vq, 0.0, causal)
        ours_out, ours_lse = math_attention(q, kq, vq, causal)
        torch.testing.assert_close(ours_out, out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours_lse, lse, atol=1e-5, rtol=1e-5)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, kq, vq, out, lse, 0.0, causal)
        for ours, ref in zip(math_attention_backward(dout, q, kq, vq, out, lse, causal), grads):
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_merging_blocks_is_attention_over_their_union_and_nan_free():
    """Keys split into two blocks and merged with their lse give attention over all keys; a block that no row
    saw (lse -inf) leaves the accumulators as they were, with no NaN."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    out = torch.zeros(1, 2, 6, 4)
    lse = torch.full((1, 2, 6), float("-inf"))
    merge_block(out, lse, slice(0, 6), torch.zeros(1, 2, 6, 4), torch.full((1, 2, 6), float("-inf")))
    assert not out.isnan().any() and torch.equal(out, torch.zeros(1, 2, 6, 4))
    for cols in (slice(0, 2), slice(2, 6)):
        merge_block(out, lse, slice(0, 6), *math_attention(q, k[:, :, cols], v[:, :, cols], False))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) / 2.0, -1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_one_rank_ring_is_plain_causal_attention(dtype, tol):
    """cp = 1 (no process group: nothing is sent) is causal SDPA, values and gradients, in the input's dtype."""
    from large_model_training.mesh import AxisGroup

    q, k, v, dout = (t[:, :, :24].to(dtype) for t in _full_tensors(32, 2))
    ours, ref = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
    cp = AxisGroup.single()
    out = ring_attention(*ours, cp)
    out.backward(dout)
    expected = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    expected.backward(dout)
    assert out.dtype == dtype and cp.bytes == 0.0
    for a, b in zip([out, *(t.grad for t in ours)], [expected, *(t.grad for t in ref)]):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def _full_tensors(seq: int, kv_heads: int):
    g = torch.Generator().manual_seed(seq + kv_heads)
    q, k, v = (torch.randn(2, h, seq, 16, generator=g) for h in (4, kv_heads, kv_heads))
    return q, k, v, torch.randn(2, 4, seq, 16, generator=g)


def _ring_on_this_rank(seq: int, kv_heads: int, dtype: torch.dtype = torch.float32):
    """Our ring and PyTorch's on this rank's zig-zag shards of the same full tensors (PyTorch's default
    load balancer holds chunks r and 2cp-1-r too); the results in local order, and the bytes we sent."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    from large_model_training.mesh import AxisGroup

    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (zigzag_shard(t, 2, rank, size).to(dtype) for t in _full_tensors(seq, kv_heads))
    cp = AxisGroup(group=dist.group.WORLD, size=size, rank=rank)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, cp)
    out.backward(dout)
    ours = [out.detach(), *(t.grad for t in leaves)]
    ref_out, ref_lse = _templated_ring_attention(
        dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True
    )
    ref_grads = _templated_ring_attention_backward(
        dist.group.WORLD,
        2,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        dout,
        "grad_out",
        q,
        k,
        v,
        ref_out,
        ref_lse,
        is_causal=True,
        dropout_p=0.0,
    )
    return ours, [ref_out, *ref_grads[:3]], cp.bytes


@pytest.mark.slow
@pytest.mark.parametrize("cp, kv_heads, seq", [(2, 2, 32), (2, 4, 64), (4, 2, 64), (4, 4, 32)])
def test_ring_equals_sdpa_and_pytorchs_ring(cp, kv_heads, seq):
    """Output and dq, dk, dv (unsharded) equal plain causal SDPA on the whole sequence and PyTorch's private
    ring on the same shards, fp32, GQA and not. The bytes a rank sends: k and v to the next rank cp - 1 times in
    the forward and again in the backward, and the fp32 dK/dV cp times (the last trip brings them home)."""
    results = run_ranks(_ring_on_this_rank, cp, seq, kv_heads)
    q, k, v, dout = _full_tensors(seq, kv_heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=kv_heads != 4)
    out.backward(dout)
    expected = [out.detach(), *(t.grad for t in leaves)]
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        ours = zigzag_unshard([r[0][i] for r in results], 2)
        torch_ring = zigzag_unshard([r[1][i] for r in results], 2)
        torch.testing.assert_close(ours, expected[i], atol=1e-5, rtol=1e-5, msg=f"{name} against SDPA")
        torch.testing.assert_close(ours, torch_ring, atol=1e-5, rtol=1e-5, msg=f"{name} against torch's ring")
    kv_bytes = 2 * k.numel() // cp * 4
    assert all(r[2] == 2 * (cp - 1) * kv_bytes + cp * kv_bytes for r in results)


@pytest.mark.slow
def test_bf16_ring_at_cp4_is_causal_attention_to_bf16_precision():
    """bf16 in and out (merge and travelling dK/dV in fp32, so the key/value and gradient messages differ in
    size): against fp32 SDPA to bf16 precision, and against PyTorch's ring, which also accumulates in fp32."""
    results = run_ranks(_ring_on_this_rank, 4, 64, 2, torch.bfloat16)
    q, k, v, dout = _full_tensors(64, 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(dout)
    for i, expected in enumerate([out.detach(), *(t.grad for t in leaves)]):
        ours = zigzag_unshard([r[0][i] for r in results], 2)
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), expected, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(ours, zigzag_unshard([r[1][i] for r in results], 2), atol=2e-2, rtol=2e-2)
    local = k.numel() // 4  # elements of one of k, v on a rank
    assert all(r[2] == 2 * 3 * (2 * local * 2) + 4 * (2 * local * 4) for r in results)  # bf16 k, v; fp32 dk, dv
