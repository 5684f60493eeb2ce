"""Sparse compressors: send some coordinates of a bucket as (index, value) pairs instead of all of them.

- top-k sends the k = max(1, ceil(R n)) largest |g|: the best k-term approximation, but every rank picks its
  own coordinates, so the indices must travel with the values.
- random-k sends k coordinates drawn from a generator seeded by (seed, step, bucket index): every dp rank
  draws the same ones, so the values can be summed by a plain all-reduce of k numbers and the indices never
  travel at all (each rank regenerates them). Unbiased up to the factor n/k, and the cheapest wire format
  here; top-k usually converges better per byte because it sends what matters.
- threshold sends every |g| >= T (the seed's 'sparsification'): the count differs per rank and per step.

Wire formats (one message per rank, see wire.py; e = the gradient's element size, i = 4 bytes for int32
indices, 8 when a bucket has 2**31 elements or more):
    top-k      all-gather of [k indices | k values]                          sent k (i + e), received w k (i + e)
    threshold  all-gather of the counts (int64), then of [m indices | m values], m = the largest count, shorter
               lists padded with (index 0, value 0), which add nothing    sent 8 + m (i + e), received w times that
    random-k   all-reduce of the k values                                    sent k e, received k e
Every rank's pairs are summed into a dense fp32 (or wider) accumulator by index_add and divided by w: the dp
average of what the ranks sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from large_model_training.compression.spec import CompressionSpec, seeded_generator, sparse_count
from large_model_training.compression.wire import CountingState, all_gather, all_reduce, completed, pack, unpack

RANDOMK_STREAM = 1
"""Key mixed into random-k's seed so its stream differs from other seeded draws with the same (seed, step)."""


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices halve their bytes; int64 only for buckets of 2**31 elements or more."""
    return torch.int32 if numel < 2**31 else torch.int64


@dataclass
class SparsePayload:
    """Coordinates of a tensor: `decompress()` puts `values` at `indices` in zeros of `shape`."""

    indices: torch.Tensor
    values: torch.Tensor
    shape: torch.Size
    shared_indices: bool = False
    """random-k: every rank regenerates the indices from the seed, so only the values count as sent."""

    @property
    def nbytes(self) -> int:
        values = self.values.numel() * self.values.element_size()
        return values if self.shared_indices else values + self.indices.numel() * self.indices.element_size()

    def decompress(self) -> torch.Tensor:
        dense = self.values.new_zeros(self.shape.numel())
        return dense.index_put_((self.indices,), self.values).view(self.shape)


def topk_select(x: torch.Tensor, k: int) -> SparsePayload:
    """The k coordinates of largest magnitude (in no particular order)."""
    flat = x.reshape(-1)
    idx = flat.abs().topk(k, sorted=False).indices.to(index_dtype(flat.numel()))
    return SparsePayload(idx, flat[idx], x.shape)


def randomk_indices(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """k distinct coordinates, a function of the generator's seed only (same seed, same indices on every rank)."""
    perm = torch.randperm(numel, generator=generator, device=generator.device)
    return perm[:k].to(index_dtype(numel))


def randomk_select(x: torch.Tensor, k: int, generator: torch.Generator) -> SparsePayload:
    flat = x.reshape(-1)
    idx = randomk_indices(flat.numel(), k, generator)
    return SparsePayload(idx, flat[idx], x.shape, shared_indices=True)


def threshold_select(x: torch.Tensor, threshold: float) -> SparsePayload:
    """Every coordinate with |x| >= threshold (possibly none)."""
    flat = x.reshape(-1)
    idx = torch.nonzero(flat.abs() >= threshold).view(-1).to(index_dtype(flat.numel()))
    return SparsePayload(idx, flat[idx], x.shape)


def select(spec: CompressionSpec, x: torch.Tensor, generator: torch.Generator | None = None) -> SparsePayload:
    """The payload of one tensor for a sparse spec (random-k needs the shared generator)."""
    if spec.kind == "topk":
        return topk_select(x, sparse_count(x.numel(), spec.ratio))
    if spec.kind == "randomk":
        assert generator is not None, "random-k needs the generator shared by the dp ranks"
        return randomk_select(x, sparse_count(x.numel(), spec.ratio), generator)
    return threshold_select(x, spec.threshold)


def _accumulator(x: torch.Tensor) -> torch.Tensor:
    """Dense zeros to sum contributions in: fp32 at least, so bf16 gradients are not summed in bf16."""
    return torch.zeros(x.numel(), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)


def reduce_sparse(
    state: CountingState, spec: CompressionSpec, x: torch.Tensor, seed: int, step: int, bucket_index: int
) -> tuple[SparsePayload, torch.futures.Future]:
    """Compress 1-D x, start its reduction; returns (this rank's payload, future of the dense dp average)."""
    world = state.group_size
    if spec.kind == "randomk":
        payload = select(spec, x, seeded_generator(x.device, seed, RANDOMK_STREAM, step, bucket_index))
        summed = payload.values.clone()  # the payload keeps this rank's own values for error feedback
        work = all_reduce(state, summed)

        def scatter_mean(_: torch.futures.Future) -> torch.Tensor:
            out = _accumulator(x)
            out.index_put_((payload.indices,), summed.to(out.dtype))
            return out.div_(world).to(x.dtype)

        return payload, work.get_future().then(scatter_mean)

    payload = select(spec, x)
    width = payload.values.numel()
    if spec.kind == "threshold":
        # Blocking by necessity: the payload all-gather needs equal message sizes, so every rank must know
        # the largest count before it can pad to it. The wait costs one small collective's latency; issuing
        # the second gather from a future callback instead would let it race the next bucket's collectives
        # from another thread, and ranks could then issue them in different orders.
        counts, work = all_gather(state, torch.tensor([width], dtype=torch.int64, device=x.device))
        work.wait()
        pad = int(counts.max()) - width
        width += pad
        if width == 0:  # no rank selected anything: the average is zero, and there is nothing to gather
            return payload, completed(_accumulator(x).to(x.dtype))
        payload_msg = pack([F.pad(payload.indices, (0, pad)), F.pad(payload.values, (0, pad))])
    else:
        payload_msg = pack([payload.indices, payload.values])
    rows, work = all_gather(state, payload_msg)
    layout = [(payload.indices.dtype, width), (x.dtype, width)]

    def scatter_add_mean(_: torch.futures.Future) -> torch.Tensor:
        indices, values = unpack(rows, layout)
        acc = _accumulator(x)
        acc.index_add_(0, indices.view(-1), values.view(-1).to(acc.dtype))
        return acc.div_(world).to(x.dtype)

    return payload, work.get_future().then(scatter_add_mean)
