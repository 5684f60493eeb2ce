"""Ring attention for context parallelism (issue 19): each cp rank holds 1/cp of the sequence, and the key/value
blocks travel around the cp ring while every rank attends its own queries to each block in turn.

The sequence is laid out zig-zag: cut into 2 x cp chunks, rank r holds chunks r and 2cp-1-r (in that order). Under a
causal mask a rank holding only early chunks would skip most blocks while the last rank computes nearly all of
them; pairing an early chunk with a late one gives every rank the same share of the causal triangle.

Partial results are merged with their log-sum-exp in fp32, so the output equals attention over the whole sequence;
the backward pass is a ring too: dK/dV accumulate on whichever rank holds that block and travel home. The local
kernel (forward with its log-sum-exp, and the backward given the merged output and log-sum-exp) is the device's
(kernels.py): the flash kernel on CPU and, for fp16 / bf16, on CUDA; the fp32 math path elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from large_model_training.kernels import finite, kernels_for

# One kernel call of a ring step: (query rows, key/value rows) as slices of the local sequence, and whether the
# causal mask applies (top-left aligned, so only for a block against itself).
BlockCall = tuple[slice, slice, bool]


def _chunk_len(seq_len: int, cp: int) -> int:
    """The zig-zag chunk length; sizes that do not divide would silently unbalance the ranks, so they are refused."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism cp={cp} cuts the sequence into 2 x cp = {2 * cp} equal chunks: "
            f"sequence length {seq_len} is not divisible by {2 * cp}"
        )
    return seq_len // (2 * cp)


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The global chunk indices rank `rank` holds, in local order: an early chunk and its mirror image."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions (int64) of this rank's tokens in local order (rope tables and masks index them)."""
    c = _chunk_len(seq_len, cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in zigzag_chunks(rank, cp)])


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (`dim` is the sequence dimension)."""
    c = _chunk_len(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in zigzag_chunks(rank, cp)], dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every rank's part, in rank order: the inverse of `zigzag_shard`."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim)
        a, b = zigzag_chunks(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim)


def chunk_pair(q_chunk: int, kv_chunk: int) -> str | None:
    """What causal attention needs of one (query chunk, key chunk) pair of global chunk indices."""
    if kv_chunk < q_chunk:
        return "full"
    return "causal" if kv_chunk == q_chunk else None


def zigzag_flops(rank: int, cp: int) -> int:
    """Attention work of a rank over a whole ring, in units of half a chunk pair (full = 2, causal = 1)."""
    weight = {"full": 2, "causal": 1, None: 0}
    return sum(
        weight[chunk_pair(qc, kc)]
        for source in range(cp)
        for qc in zigzag_chunks(rank, cp)
        for kc in zigzag_chunks(source, cp)
    )


def block_calls(rank: int, source: int, cp: int, chunk: int) -> list[BlockCall]:
    """The kernel calls that attend this rank's queries to the key/value block of `source`: the visible chunk
    pairs, merged into as few (and as large) calls as the pair rule allows."""
    q_chunks, kv_chunks = zigzag_chunks(rank, cp), zigzag_chunks(source, cp)
    if source == rank:  # the local order is increasing, so one causal call over both chunks is exactly right
        return [(slice(0, 2 * chunk), slice(0, 2 * chunk), True)]
    visible = [tuple(m for m, kc in enumerate(kv_chunks) if chunk_pair(qc, kc)) for qc in q_chunks]
    rows = [j for j in range(2) if visible[j]]
    spans = [(0, 2)] if len(rows) == 2 and visible[0] == visible[1] else [(j, j + 1) for j in rows]
    calls = []
    for j0, j1 in spans:
        cols = visible[j0]
        calls.append((slice(j0 * chunk, j1 * chunk), slice(cols[0] * chunk, (cols[-1] + 1) * chunk), False))
    return calls


def merge_block(
    out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's partial attention into the fp32 accumulators, in place:
    lse = logaddexp(lse, lse_b), out = exp(lse_old - lse) out + exp(lse_b - lse) out_b (NaN-free for -inf rows)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse.float())
    shift = finite(new)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - shift).unsqueeze(-1) + block_out.float() * torch.exp(
        block_lse.float() - shift
    ).unsqueeze(-1)
    lse[:, :, rows] = new


def _pass_on(cp: Any, tensors: list[torch.Tensor]) -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
    """Send `tensors` to the next cp rank and receive their counterparts from the previous one, asynchronously;
    (requests, received, sent): the sent tensors (contiguous copies if need be) must live until the requests end."""
    tensors = [t.contiguous() for t in tensors]
    nxt = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
    prv = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, cp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, cp.group) for t in received]
    cp.bytes += float(sum(t.numel() * t.element_size() for t in tensors))
    return dist.batch_isend_irecv(ops), received, tensors


def _arrived(pending: tuple[list, list[torch.Tensor], list[torch.Tensor]]) -> list[torch.Tensor]:
    for request in pending[0]:
        request.wait()
    return pending[1]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"ring attention takes q (b, h, s, d) and k, v (b, kv_h, s, d) of one local length: "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} key/value heads")
    if q.shape[2] % 2:
        raise ValueError(f"a zig-zag shard holds two equal chunks: local length {q.shape[2]} is odd")
    return q.shape[2] // 2


class RingAttention(torch.autograd.Function):
    """Causal attention over the global zig-zag sequence, the key/value blocks passed around the cp ring."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Any) -> torch.Tensor:
        chunk = _check(q, k, v)
        attend = kernels_for(q.device).attention_with_lse
        kv, out, lse = [k.contiguous(), v.contiguous()], None, None
        for step in range(cp.size):
            # post the next block's transfer before computing this one, so the two overlap
            pending = _pass_on(cp, kv) if step < cp.size - 1 else None
            for rows, cols, causal in block_calls(cp.rank, (cp.rank - step) % cp.size, cp.size, chunk):
                block_out, block_lse = attend(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal)
                if out is None:  # step 0 is one causal call over every row: it starts the fp32 accumulators
                    out, lse = block_out.float(), block_lse.float()
                else:
                    merge_block(out, lse, rows, block_out, block_lse)
            if pending is not None:
                kv = _arrived(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cp, chunk = ctx.cp, q.shape[2] // 2
        attend_backward = kernels_for(q.device).attention_with_lse_backward
        dout = dout.contiguous()
        kv, dq, travelling, pending_dkv = [k.contiguous(), v.contiguous()], None, None, None
        every_row = slice(0, 2 * chunk)
        for step in range(cp.size):
            pending_kv = _pass_on(cp, kv) if step < cp.size - 1 else None
            block_dkv = None
            for rows, cols, causal in block_calls(cp.rank, (cp.rank - step) % cp.size, cp.size, chunk):
                gq, gk, gv = attend_backward(
                    dout[:, :, rows],
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows],
                    causal,
                )
                if dq is None:  # step 0 is one call over every row
                    dq = gq.float()
                else:
                    dq[:, :, rows] += gq
                if block_dkv is None and cols == every_row:  # no zero-filled copy when the call covers the block
                    block_dkv = [gk.float(), gv.float()]
                    continue
                if block_dkv is None:
                    block_dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
                block_dkv[0][:, :, cols] += gk
                block_dkv[1][:, :, cols] += gv
            # the block's owner's running dK/dV arrived while we computed; add ours and pass it on (home, at the end)
            travelling = block_dkv if pending_dkv is None else [a + b for a, b in zip(_arrived(pending_dkv), block_dkv)]
            pending_dkv = _pass_on(cp, travelling) if cp.size > 1 else None
            if pending_kv is not None:
                kv = _arrived(pending_kv)
        dk, dv = travelling if pending_dkv is None else _arrived(pending_dkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Any) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard against the whole sequence. q: (b, h, s_local, d);
    k, v: (b, kv_h, s_local, d) (only the kv heads travel); `cp` has .group, .size, .rank and .bytes (this rank's
    sent bytes are added to it). Returns (b, h, s_local, d) in q's dtype."""
    return RingAttention.apply(q, k, v, cp)
