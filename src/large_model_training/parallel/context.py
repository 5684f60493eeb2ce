"""Context parallelism: the zig-zag split of each sequence over the cp ranks, and attention across them.

Why zig-zag: under a causal mask the last positions attend to the most keys, so contiguous slices would give
the last cp rank almost twice the average work. Cutting the sequence into 2 x cp chunks and giving rank r the
chunks r and 2cp-1-r gives every rank the same share of the causal triangle (as Megatron and Llama 3 do).
Inputs and targets are split with the same permutation, so each rank's loss is over its own tokens.

Two ways attention crosses the ranks (`cp_attention`): "ring" passes key/value blocks around the cp group
(`parallel/ring_attention.py`), "allgather" gathers all keys and values first (Llama 3's choice: simple,
and with GQA the gathered K/V are small next to the queries). Both see keys by their global positions.
The zig-zag helpers (positions, shards) are the ring's own (`parallel/ring_attention.py`), so the data path,
the rope positions and both variants lay chunks out one way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from large_model_training.kernels import kernels_for
from large_model_training.mesh import AxisGroup
from large_model_training.parallel.collectives import _reduce_scatter_single, all_gather_single
from large_model_training.parallel.ring_attention import ring_attention, zigzag_positions, zigzag_shard

VARIANTS = ("ring", "allgather")


def shard_micro_batches(
    micro: list[tuple[torch.Tensor, torch.Tensor]], cp: AxisGroup
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every cp rank reads the same micro-batches; each keeps its zig-zag part of inputs and targets alike."""
    if cp.size == 1:
        return micro
    return [(zigzag_shard(x, 1, cp.rank, cp.size), zigzag_shard(y, 1, cp.rank, cp.size)) for x, y in micro]


class _GatherSequence(torch.autograd.Function):
    """All-gather over cp along the sequence (dim 2 of (b, h, s, d)), in rank order; backward sums every
    rank's gradient of the gathered keys and keeps this rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        out = torch.empty((cp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_single(out, x.contiguous(), group=cp.group)
        cp.count_gather_or_scatter(out)
        return out.unflatten(0, (cp.size, -1)).permute(1, 2, 0, 3, 4).flatten(2, 3)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        b, h, s, d = grad.shape
        parts = grad.unflatten(2, (cp.size, s // cp.size)).permute(2, 0, 1, 3, 4).flatten(0, 1).contiguous()
        out = torch.empty((b, h, s // cp.size, d), dtype=grad.dtype, device=grad.device)
        _reduce_scatter_single(out, parts, group=cp.group)
        cp.count_gather_or_scatter(parts)
        return out, None


def allgather_mask(s_local: int, cp: AxisGroup, device: torch.device) -> torch.Tensor:
    """Which gathered keys (every rank's zig-zag part, in rank order) each local query may see: causal by
    global position. (s_local, s_local * cp) booleans, the same for every layer of a micro-batch shape."""
    seq = s_local * cp.size
    q_pos = zigzag_positions(seq, cp.rank, cp.size, device)
    k_pos = torch.cat([zigzag_positions(seq, r, cp.size, device) for r in range(cp.size)])
    return q_pos[:, None] >= k_pos[None, :]


def allgather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: AxisGroup, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of the local queries (b, h, s_local, d) against every rank's keys and values
    (b, kv_h, s_local, d each), masked by global zig-zag positions (`allgather_mask`, built here unless
    given). Only kv heads travel (GQA)."""
    keys, values = _GatherSequence.apply(k, cp), _GatherSequence.apply(v, cp)
    if allowed is None:
        allowed = allgather_mask(q.shape[2], cp, q.device)
    return kernels_for(q.device).attention(q, keys, values, allowed, 0.0, False)


class ContextAttention:
    """What a Transformer under cp holds (`Transformer.set_context`): its tokens' global positions and the
    attention across the cp group, in the chosen variant."""

    def __init__(self, cp: AxisGroup, variant: str):
        if variant not in VARIANTS:
            raise ValueError(f"cp_attention must be one of {', '.join(VARIANTS)}, not '{variant}'")
        self.cp, self.variant = cp, variant
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}  # built once, not per layer and step

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's local_len tokens (rope tables and learned positions index them)."""
        return zigzag_positions(local_len * self.cp.size, self.cp.rank, self.cp.size, device)

    def future_targets(self, targets: torch.Tensor, depth: int) -> torch.Tensor:
        """Multi-token prediction's labels (models/transformer.py `future_targets`) for this rank's positions:
        (depth + 1, b, s_local), the targets j = 0 .. depth positions further on in the whole sequence, -1 past
        its end. A position's later targets sit in other ranks' chunks: the targets (b x s_local ids, once per
        micro-batch) are all-gathered over cp and put back in sequence order first."""
        b, s_local = targets.shape
        seq, device = s_local * self.cp.size, targets.device
        gathered = torch.empty((self.cp.size * b, s_local), dtype=targets.dtype, device=device)
        all_gather_single(gathered, targets.contiguous(), group=self.cp.group)
        self.cp.count_gather_or_scatter(gathered)
        order = torch.cat([zigzag_positions(seq, r, self.cp.size, device) for r in range(self.cp.size)])
        whole = torch.empty((b, seq), dtype=targets.dtype, device=device)
        whole[:, order] = gathered.view(self.cp.size, b, s_local).permute(1, 0, 2).reshape(b, seq)
        padded = F.pad(whole, (0, depth), value=-1)
        here = self.positions(s_local, device)
        return torch.stack([padded[:, here + j] for j in range(depth + 1)])

    def labelled(self, s_local: int, shift: int) -> int:
        """How many of this rank's s_local positions have a position `shift` further on in the sequence: a prefix
        of them, as its two chunks (r, then 2cp-1-r) run in ascending order."""
        seq, chunk = s_local * self.cp.size, s_local // 2
        starts = (self.cp.rank * chunk, (2 * self.cp.size - 1 - self.cp.rank) * chunk)
        return sum(min(max(seq - shift - start, 0), chunk) for start in starts)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.variant == "ring":
            narrow = q.shape[-1] - v.shape[-1]  # MLA's values are narrower than its queries and keys
            if narrow > 0:  # the ring's kernel takes one width: zero columns give zero outputs, cut after
                return ring_attention(q, k, F.pad(v, (0, narrow)), self.cp)[..., : v.shape[-1]]
            return ring_attention(q, k, v, self.cp)
        key = (q.shape[2], q.device)
        if key not in self._masks:
            self._masks[key] = allgather_mask(q.shape[2], self.cp, q.device)
        return allgather_attention(q, k, v, self.cp, self._masks[key])
