"""The batch loader: the same global batches in every layout, each dp rank reading its own disjoint part.

A source's samples are the non-overlapping windows of seq_len + 1 tokens of its split (a prepared folder's
shards end to end, read by memory map). With several sources, `data/blend.py` says which source global sample
g comes from and which of that source's samples it is; epoch e of a source visits its windows in the order of
a permutation seeded by (seed, source, e). Sample g is therefore a pure function of the seed, and optimizer
step t consumes samples [t*G, (t+1)*G) for global batch size G. dp rank r takes the r-th contiguous G/dp of
those, cut into micro-batches. Because the global batch does not depend on dp or on the micro-batch size, any
layout sees the same data at every step, and the loader's whole state is the next step number (saved in
checkpoints).

The permutation is a keyed Feistel network over the next power of four with cycle walking (as format-preserving
encryption does): any position is computed alone, in O(1) memory, so a corpus of billions of windows costs a
rank no index at start-up (a materialised permutation of 5M windows would be 40 MB per rank and per epoch).

The next step's batch is prepared by a background thread while the current step computes (the seed's data
prefetch); the position advances only when a batch is consumed, so prefetched batches never skew resume.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from large_model_training.data.blend import Blend
from large_model_training.data.prepared import Split

FEISTEL_ROUNDS = 4


@dataclass(frozen=True)
class Shard:
    """Which part of each global batch this rank reads."""

    dp_rank: int
    dp_size: int
    global_batch_size: int
    micro_batch_size: int

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def micro_batches(self) -> int:
        return self.per_rank // self.micro_batch_size


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-mixed uint64 function of a uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A seeded bijection of [0, n), evaluated pointwise (Feistel rounds on 2b bits, cycle-walking below n)."""

    def __init__(self, n: int, seed: list[int]):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(seed).integers(0, 2**63, size=FEISTEL_ROUNDS, dtype=np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, i: np.ndarray) -> np.ndarray:
        x = self._rounds(np.asarray(i, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():  # the domain is < 4n: a few more rounds at most, on a few elements
            x[outside] = self._rounds(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)


class SampleOrder:
    """One source's sample number j -> window index, epoch by epoch (shuffled, or in order for validation)."""

    def __init__(self, num_windows: int, seed: int, shuffle: bool = True, source: int = 0):
        if num_windows < 1:
            raise ValueError("the token stream is shorter than one sample (seq_len + 1 tokens)")
        self.num_windows = num_windows
        self.seed, self.source, self.shuffle = seed, source, shuffle
        self._epoch = -1
        self._perm: Permutation | None = None

    def window(self, j: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(np.asarray(j, dtype=np.int64), self.num_windows)
        if not self.shuffle:
            return offsets
        out = np.empty_like(offsets)
        for epoch in np.unique(epochs):
            if epoch != self._epoch:
                self._perm, self._epoch = Permutation(self.num_windows, [self.seed, self.source, int(epoch)]), epoch
            mask = epochs == epoch
            out[mask] = self._perm(offsets[mask])
        return out


class BatchLoader:
    """Yields, per optimizer step, this rank's list of (inputs, targets) micro-batches as int64 tensors.

    splits: one token stream per source (a `Split`, or an array for tests); weights: the blend's (default one).
    """

    def __init__(
        self,
        splits: list[Split] | list[np.ndarray] | Split | np.ndarray,
        seq_len: int,
        shard: Shard,
        seed: int,
        device: torch.device,
        start_step: int = 0,
        shuffle: bool = True,
        prefetch: bool = True,
        weights: list[float] | None = None,
    ):
        given = splits if isinstance(splits, list) else [splits]
        self.splits = [s if isinstance(s, Split) else Split.from_array(s) for s in given]
        self.blend = Blend(weights or [1.0] * len(self.splits))
        self.orders = [
            SampleOrder((s.num_tokens - 1) // seq_len, seed, shuffle, source=k) for k, s in enumerate(self.splits)
        ]
        self.seq_len = seq_len
        self.shard = shard
        self.device = device
        self.next_step = start_step
        self._prefetch = prefetch
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def sample_numbers(self, step: int) -> np.ndarray:
        """Global sample numbers this rank reads at `step`, in micro-batch order."""
        first = step * self.shard.global_batch_size + self.shard.dp_rank * self.shard.per_rank
        return np.arange(first, first + self.shard.per_rank)

    def samples_per_source(self, steps: int) -> list[int]:
        """How many samples each source gave the first `steps` global batches (all ranks together)."""
        return [self.blend.count(k, steps * self.shard.global_batch_size) for k in range(len(self.splits))]

    def windows(self, first: int, count: int) -> np.ndarray:
        """Global samples first .. first + count - 1 as a (count, seq_len + 1) int64 array."""
        sources, numbers = self.blend.assign(first, count)
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for k in np.unique(sources):
            rows = np.flatnonzero(sources == k)
            starts = self.orders[k].window(numbers[rows]) * self.seq_len
            for row, start in zip(rows, starts):
                out[row] = self.splits[k].read(int(start), self.seq_len + 1)
            self.splits[k].release()
        return out

    def _build(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        first = int(self.sample_numbers(step)[0])
        data = torch.from_numpy(self.windows(first, self.shard.per_rank))
        micro = []
        for chunk in data.split(self.shard.micro_batch_size):
            micro.append((chunk[:, :-1].to(self.device), chunk[:, 1:].to(self.device)))
        return micro

    def _worker(self, first_step: int) -> None:
        step = first_step
        while not self._stop.is_set():
            batch = self._build(step)
            while not self._stop.is_set():  # a put that can notice `close` (a blocked put never would)
                try:
                    self._queue.put((step, batch), timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1

    def close(self) -> None:
        """Stop the prefetch thread (the trainer calls it when a run ends or replaces the loader): a thread left
        blocked on its queue would outlive the run, one per run, in a process that trains many (the tests')."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of the next step; advances the position."""
        if not self._prefetch:
            batch = self._build(self.next_step)
        else:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, args=(self.next_step,), daemon=True)
                self._thread.start()
            step, batch = self._queue.get()
            assert step == self.next_step, "prefetch thread out of step with the loader position"
        self.next_step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"next_step": self.next_step}
