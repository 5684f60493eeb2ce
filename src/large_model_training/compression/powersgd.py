"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019): each gradient matrix M (n x m) travels as two thin factors.

One step of subspace (power) iteration per training step: P = M Q, orthonormalise P, Q = M^T P, and M is
approximated by P Q^T. Both products are linear in M, so summing P over the dp ranks and then Q gives the
approximation of the summed gradient: the wire carries (n + m) r numbers per matrix instead of n m, with
plain all-reduces. Warm start keeps the averaged Q for the next step, so the iteration keeps refining the
same subspace while gradients drift slowly: one iteration per step is enough. Only P is orthonormalised
(as in the paper, by QR): P = M Q spans the same columns whatever basis Q is in.

Applied per parameter (`bucket.param_shapes`): a tensor of 2 or more dims is the matrix shape[0] x rest.
1-D tensors (norm weights, biases) and matrices whose factors would not be smaller ((n + m) r >= n m) are
all-reduced densely, batched into one message, as in PyTorch's powerSGD_hook.

Error feedback uses this rank's own approximation P Q_rank^T (Q before the all-reduce), so the residual is
exactly what this rank failed to send; PyTorch's hook subtracts the averaged approximation instead, which mixes
the other ranks' gradients into this rank's residual.

Factors are computed and sent in fp32 at least (promote(dtype, fp32)): orthonormalisation in bf16 loses
orthogonality, and the factors are small enough that the width costs little. The average is written into the
bucket's own buffer and the residual computed in place (`BucketLowRank.error_`): no bucket-sized temporaries,
which is what brought the hook to parity with PyTorch's (docs/benchmarks.md).
    sent = received = e x (dense numel) + f x sum over compressed matrices of (n + m) r,  f = 4 for bf16/fp32
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from large_model_training.compression.spec import seeded_generator
from large_model_training.compression.wire import CountingState, all_reduce, completed

POWERSGD_STREAM = 2
"""Key mixed into the seed of the first Q, so it differs from other seeded draws with the same seed."""
EPS = 1e-8
"""Added to column norms so an all-zero column (a parameter with no gradient) stays zero instead of NaN."""


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def matrix_rank(shape: torch.Size | tuple[int, ...], rank: int) -> int:
    """The rank used for a tensor of this shape, or 0 when it is sent densely (1-D, or factors not smaller)."""
    if len(shape) < 2:
        return 0
    n = shape[0]
    m = math.prod(shape[1:])
    r = min(n, m, rank)
    return r if (n + m) * r < n * m else 0


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """Replace the columns of p (n x r) by an orthonormal basis of their span, in place (reduced QR).

    LAPACK's Householder QR: 5-10x faster than a Python Gram-Schmidt loop over the r columns (one kernel
    instead of 3r), and an all-zero p (a parameter with no gradient) gives unit columns rather than 0/0; the
    product with it, Q = M^T P, is then zero as it should be."""
    q, _ = torch.linalg.qr(p)
    return p.copy_(q)


def orthonormalize_all_(ps: list[torch.Tensor]) -> None:
    """orthonormalize_ every matrix, one batched QR per distinct shape (a bucket repeats a few shapes)."""
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for p in ps:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    for same in by_shape.values():
        if len(same) == 1:
            orthonormalize_(same[0])
            continue
        q, _ = torch.linalg.qr(torch.stack(same))
        for p, qi in zip(same, q):
            p.copy_(qi)


@dataclass
class LowRankPayload:
    """One matrix as factors: `decompress()` = p q^T in the original shape and dtype."""

    p: torch.Tensor
    q: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return (self.p.numel() + self.q.numel()) * self.p.element_size()

    def decompress(self) -> torch.Tensor:
        return (self.p @ self.q.T).to(self.dtype).view(self.shape)


def initial_q(m: int, r: int, dtype: torch.dtype, device: torch.device, *keys: int) -> torch.Tensor:
    """A seeded standard-normal m x r start, identical on every rank (the P all-reduce needs a shared Q)."""
    gen = seeded_generator(device, *keys, POWERSGD_STREAM)
    return torch.randn((m, r), generator=gen, dtype=dtype, device=device)


def compress_matrix(matrix: torch.Tensor, q: torch.Tensor) -> LowRankPayload:
    """One single-process PowerSGD step on matrix (n x m) from q (m x r); the payload's q is the next warm start."""
    m = matrix.reshape(matrix.shape[0], -1).to(q.dtype)
    p = orthonormalize_(m @ q)
    return LowRankPayload(p, m.T @ p, matrix.shape, matrix.dtype)


@dataclass
class BucketLowRank:
    """This rank's contribution for a bucket: dense parts as they are, matrices as this rank's P Q^T."""

    x: torch.Tensor
    matrices: list[tuple[int, torch.Size]]
    """(offset in the bucket, shape) of each compressed matrix."""
    ps: list[torch.Tensor]
    qs: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        factors = sum(p.numel() + q.numel() for p, q in zip(self.ps, self.qs))
        dense = self.x.numel() - sum(shape.numel() for _, shape in self.matrices)
        return dense * self.x.element_size() + factors * factor_dtype(self.x.dtype).itemsize

    def decompress(self) -> torch.Tensor:
        out = self.x.clone()
        for (offset, shape), p, q in zip(self.matrices, self.ps, self.qs):
            out[offset : offset + shape.numel()] = (p @ q.T).reshape(-1).to(out.dtype)
        return out

    def error_(self, x: torch.Tensor) -> torch.Tensor:
        """x - decompress(), computed in x's own storage: dense parts were sent exactly (zero error), each
        matrix loses this rank's P Q^T (one fused multiply-subtract per matrix, no bucket-sized temporaries)."""
        end = 0  # matrices are in bucket order; the gaps between them are the dense parts
        for (offset, shape), p, q in zip(self.matrices, self.ps, self.qs):
            x[end:offset].zero_()
            view = x[offset : offset + shape.numel()].view(shape[0], -1)
            if view.dtype == p.dtype:
                view.addmm_(p, q.T, alpha=-1)
            else:
                view.sub_((p @ q.T).to(view.dtype))
            end = offset + shape.numel()
        x[end:].zero_()
        return x


def reduce_powersgd(
    state: CountingState,
    x: torch.Tensor,
    shapes: list[torch.Size],
    rank: int,
    memory: dict[int, list[torch.Tensor]],
    seed: int,
    bucket_index: int,
    out: torch.Tensor | None = None,
) -> tuple[BucketLowRank, torch.futures.Future]:
    """Start PowerSGD on 1-D bucket x laid out as `shapes`; returns (this rank's contribution, future of the average).

    `out` (x's shape and dtype, not x itself) receives the average; the comm hook passes the bucket's own
    buffer, so the engine has nothing to copy. A new tensor when None.

    1. Split x into compressed matrices and dense tensors (1-D, or too small to gain).
    2. All-reduce the dense tensors as one message (async, first, so it flies during the matmuls).
    3. P_i = M_i Q_i, with Q_i from the last step (warm start) or seeded at first use.
    4. All-reduce the P_i as one message.
    5. Orthonormalise each summed P_i.
    6. Q_i = M_i^T P_i; all-reduce a copy of the Q_i (async): this rank's Q_i stay for error feedback.
    7. When the dense sum and the Q sum land: dense / w, M_i ~ P_i (Q_i sum / w)^T; keep Q_i mean for step 3.
    """
    world, fdt = state.group_size, factor_dtype(x.dtype)
    # 1. Split.
    if sum(s.numel() for s in shapes) != x.numel():
        shapes = [torch.Size([x.numel()])]  # no usable layout: the whole bucket is one dense vector
    matrices, dense_ranges, offset = [], [], 0
    for shape in shapes:
        r = matrix_rank(shape, rank)
        if r:
            matrices.append((offset, shape, r))
        else:
            dense_ranges.append((offset, shape.numel()))
        offset += shape.numel()
    # 2. Dense tensors.
    futures = []
    if dense_ranges:
        dense = torch.cat([x[o : o + k] for o, k in dense_ranges])
        futures.append(all_reduce(state, dense).get_future())
    if not matrices:
        payload = BucketLowRank(x, [], [], [])
    else:
        # 3. P = M Q.
        ms = [x[o : o + s.numel()].view(s[0], -1).to(fdt) for o, s, _ in matrices]
        qs = memory.get(bucket_index)
        if qs is None or [q.shape for q in qs] != [(m.shape[1], r) for m, (_, _, r) in zip(ms, matrices)]:
            qs = [
                initial_q(m.shape[1], r, fdt, x.device, seed, bucket_index, i)
                for i, (m, (_, _, r)) in enumerate(zip(ms, matrices))
            ]
        p_flat = torch.cat([(m @ q).view(-1) for m, q in zip(ms, qs)])
        # 4. Blocking by necessity: Q = M^T P needs the summed P. Issuing the Q all-reduce from a callback of
        # this one instead would race the next bucket's collectives from another thread, and ranks could
        # then issue them in different orders.
        all_reduce(state, p_flat).wait()
        ps, start = [], 0
        for m, (_, _, r) in zip(ms, matrices):
            ps.append(p_flat[start : start + m.shape[0] * r].view(m.shape[0], r))
            start += m.shape[0] * r
        # 5. Orthonormalise.
        orthonormalize_all_(ps)
        # 6. Q = M^T P, then all-reduce a copy.
        local_qs = [m.T @ p for m, p in zip(ms, ps)]
        q_sum = torch.cat([q.reshape(-1) for q in local_qs])
        futures.append(all_reduce(state, q_sum).get_future())
        payload = BucketLowRank(x, [(o, s) for o, s, _ in matrices], ps, local_qs)

    # 7. Decompress the averages.
    result = torch.empty_like(x) if out is None else out

    def average(_: torch.futures.Future) -> torch.Tensor:
        if dense_ranges:
            dense.div_(world)
            start = 0
            for o, k in dense_ranges:
                result[o : o + k] = dense[start : start + k]
                start += k
        if matrices:
            q_sum.div_(world)
            means, start = [], 0
            for (o, s, _), p, q in zip(matrices, payload.ps, payload.qs):
                mean_q = q_sum[start : start + q.numel()].view(q.shape)
                target = result[o : o + s.numel()].view(s[0], -1)
                if target.dtype == p.dtype:
                    torch.mm(p, mean_q.T, out=target)
                else:
                    target.copy_(p @ mean_q.T)
                means.append(mean_q)
                start += q.numel()
            memory[bucket_index] = means
        return result

    if not futures:  # an empty bucket
        return payload, completed(result.copy_(x))
    return payload, torch.futures.collect_all(futures).then(average)
