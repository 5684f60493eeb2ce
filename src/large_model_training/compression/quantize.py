"""int8 / int4 quantisation: each chunk of `chunk` elements becomes small integers times one fp32 scale.

Symmetric absmax per chunk: scale = max|x| / L with L = 127 (int8) or 7 (int4), q = round(x / scale) in
[-L, L]. Symmetric because gradients are centred on zero (the seed's min/max affine scheme spends a level on
an offset and needs a zero point); per chunk (256 elements, choices.QUANT_CHUNK) because one outlier then
coarsens only its own chunk. Round-to-nearest errs by at most scale/2 per element; stochastic rounding
(q = floor(x / scale + u), u ~ U[0, 1) from a seeded generator) errs by less than one scale but is unbiased.

Error feedback is exact with round-to-nearest: q != 0 only when |x| > scale/2, so the dequantised value
s = q * scale lies within a factor of 2 of x and x - s is exact in floating point (Sterbenz), hence
s + (x - s) == x bit for bit. Stochastic rounding can lift a tiny x to one full scale, where x - s rounds.

int4 packs two values per byte, low nibble first, each stored as q + 8 (1..15).

Wire format (one message per rank): [ceil(n / chunk) fp32 scales | payload: n bytes (int8) or ceil(n / 2)
bytes (int4)], all-gathered; every rank dequantises all w messages and averages them in fp32.
    sent = ceil(n b / 8) + 4 ceil(n / chunk)    received = w x sent
Why all-gather by default: it is one collective with no second quantisation, so the result is exactly the
average of what the ranks sent and error feedback stays rank-local. Its cost grows with w: it receives
w n b/8 bytes against roughly 2 x 4n for a dense fp32 ring all-reduce, so it wins while w < 64/b (dp < 8 for
int8, < 16 for int4). Past that `int8:two-stage` / `int4:two-stage` is the better wire (two_stage.py: an
all-to-all of quantised shards, each owner dequantises and averages its shard, quantises it again with a server
residual and all-gathers it; about 2 n b/8 received at any w), at the price of that second rounding and of
one wait between the two collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from large_model_training.compression.wire import CountingState, all_gather, pack, unpack


def levels(bits: int) -> int:
    """Largest quantised magnitude L: 127 for int8, 7 for int4 (symmetric: -128 / -8 are never used)."""
    return 2 ** (bits - 1) - 1


def payload_nbytes(numel: int, bits: int) -> int:
    return math.ceil(numel * bits / 8)


def quantized_nbytes(numel: int, bits: int, chunk: int) -> int:
    """Bytes of one quantised message: the payload plus one fp32 scale per chunk."""
    return payload_nbytes(numel, bits) + 4 * math.ceil(numel / chunk)


@dataclass
class QuantPayload:
    """A quantised tensor: `data` (uint8 bytes of int8 values or packed int4 pairs) and fp32 `scales`."""

    data: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    chunk: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * 4

    def decompress(self) -> torch.Tensor:
        values = dequantize(self.data, self.scales, self.shape.numel(), self.bits, self.chunk)
        return values.to(self.dtype).view(self.shape)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    nibbles = F.pad((q + 8).to(torch.uint8), (0, q.numel() % 2))  # -7..7 -> 1..15; a pad nibble of 0 is unused
    return nibbles[0::2] | (nibbles[1::2] << 4)


def _unpack_int4(data: torch.Tensor, numel: int) -> torch.Tensor:
    """(rows, bytes) uint8 -> (rows, numel) int8 in -7..7."""
    pairs = torch.stack([data & 15, data >> 4], dim=-1).view(*data.shape[:-1], -1)
    return pairs[..., :numel].to(torch.int8) - 8


def quantize(x: torch.Tensor, bits: int, chunk: int, generator: torch.Generator | None = None) -> QuantPayload:
    """Quantise x (any shape) per chunk of its flattened values; a generator turns on stochastic rounding."""
    flat = x.reshape(-1).float()
    n, top = flat.numel(), levels(bits)
    chunks = F.pad(flat, (0, -n % chunk)).view(-1, chunk)
    scales = chunks.abs().amax(dim=1) / top
    y = chunks / torch.where(scales > 0, scales, 1.0).unsqueeze(1)  # an all-zero chunk has scale 0 and q = 0
    if generator is None:
        q = y.round()
    else:
        q = (y + torch.rand(y.shape, generator=generator, device=y.device)).floor()
    q = q.clamp_(-top, top).to(torch.int8).view(-1)[:n]
    data = q.view(torch.uint8) if bits == 8 else _pack_int4(q)
    return QuantPayload(data, scales, x.shape, x.dtype, bits, chunk)


def dequantize(data: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, chunk: int) -> torch.Tensor:
    """fp32 values of one message (1-D inputs) or of several (rows of 2-D inputs)."""
    q = data.view(torch.int8) if bits == 8 else _unpack_int4(data, numel)
    return q.float() * scales.repeat_interleave(chunk, dim=-1)[..., :numel]


def reduce_quantized(
    state: CountingState, x: torch.Tensor, bits: int, chunk: int, generator: torch.Generator | None
) -> tuple[QuantPayload, torch.futures.Future]:
    """Quantise 1-D x, start the all-gather; returns (this rank's payload, future of the dense dp average)."""
    payload = quantize(x, bits, chunk, generator)
    rows, work = all_gather(state, pack([payload.scales, payload.data]))
    layout = [(torch.float32, payload.scales.numel()), (torch.uint8, payload.data.numel())]

    def dequantize_mean(_: torch.futures.Future) -> torch.Tensor:
        scales, data = unpack(rows, layout)
        total = dequantize(data, scales, x.numel(), bits, chunk).sum(dim=0)
        return total.div_(state.group_size).to(x.dtype)

    return payload, work.get_future().then(dequantize_mean)
