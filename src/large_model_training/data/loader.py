"""The batch loader: the same global batches in every layout, each dp rank reading its own disjoint part.

Samples are the non-overlapping windows of seq_len + 1 tokens of the train stream. Epoch e visits them in the
order of a permutation seeded by (seed, e). Global sample number g (counting across epochs) is therefore a pure
function of the seed, and optimizer step t consumes samples [t*G, (t+1)*G) for global batch size G. dp rank r
takes the r-th contiguous G/dp of those, cut into micro-batches. Because the global batch does not depend on
dp or on the micro-batch size, any layout sees the same data at every step, and the loader's whole state is
the next step number (saved in checkpoints).

The next step's batch is prepared by a background thread while the current step computes (the seed's data
prefetch); the position advances only when a batch is consumed, so prefetched batches never skew resume.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch


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


class SampleOrder:
    """Global sample number -> window index, epoch by epoch, from a seeded permutation."""

    def __init__(self, num_windows: int, seed: int, shuffle: bool = True):
        if num_windows < 1:
            raise ValueError("the token stream is shorter than one sample (seq_len + 1 tokens)")
        self.num_windows = num_windows
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm = np.arange(num_windows)

    def window(self, g: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(g, self.num_windows)
        out = np.empty_like(g)
        for epoch in np.unique(epochs):
            if self.shuffle and epoch != self._epoch:
                self._perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_windows)
                self._epoch = int(epoch)
            mask = epochs == epoch
            out[mask] = self._perm[offsets[mask]]
        return out


class BatchLoader:
    """Yields, per optimizer step, this rank's list of (inputs, targets) micro-batches as int64 tensors."""

    def __init__(self, tokens: np.ndarray, seq_len: int, shard: Shard, seed: int, device: torch.device,
                 start_step: int = 0, shuffle: bool = True, prefetch: bool = True):
        self.tokens = tokens
        self.seq_len = seq_len
        self.shard = shard
        self.device = device
        self.order = SampleOrder((len(tokens) - 1) // seq_len, seed, shuffle)
        self.next_step = start_step
        self._prefetch = prefetch
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None

    def sample_numbers(self, step: int) -> np.ndarray:
        """Global sample numbers this rank reads at `step`, in micro-batch order."""
        first = step * self.shard.global_batch_size + self.shard.dp_rank * self.shard.per_rank
        return np.arange(first, first + self.shard.per_rank)

    def _build(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        starts = self.order.window(self.sample_numbers(step)) * self.seq_len
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        data = torch.from_numpy(windows)
        micro = []
        for chunk in data.split(self.shard.micro_batch_size):
            micro.append((chunk[:, :-1].to(self.device), chunk[:, 1:].to(self.device)))
        return micro

    def _worker(self, first_step: int) -> None:
        step = first_step
        while True:
            batch = self._build(step)
            self._queue.put((step, batch))
            step += 1

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
