"""1-bit sign compression, and the codecs of the compressed Adam (`--optimizer onebit-adam`).

Sign compression (1-bit Adam, Tang et al. 2021): each chunk of `chunk` elements becomes its signs times one fp32
scale, the chunk's mean |x| (||x||_1 / n: the scale that keeps the chunk's L1 mass; DeepSpeed's uses the L2 norm
over sqrt(n), the same for a flat chunk, larger where the chunk has outliers). A sign is one bit (1 for x >= 0),
packed eight to a byte, low bit first. Error feedback is what makes it train: x - decompress(x) is kept and added
to the next input, so over steps the sum of what was sent plus the last error equals the sum of the inputs (to
fp32 rounding: unlike int8's round-to-nearest, x - s here is not exact in floating point).

Wire format of one message: [ceil(n / chunk) fp32 scales | ceil(n / 8) sign bytes] (`wire.pack` order).
    bytes = ceil(n / 8) + 4 ceil(n / chunk)    (n / 7.75 at chunk 1024: 31.0x fewer than fp32)

`Codec` is what the two-stage compressed average (compression/two_stage.py: the compressed Adam, DiLoCo's lossy
outer exchanges) sends a vector through: 'sign', 'int8' / 'int4' (quantize.py's per-chunk absmax, round to
nearest) or 'none' (the fp32 bytes: the identity, for tests and as the dense reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from large_model_training.choices import QUANT_CHUNK
from large_model_training.compression.quantize import dequantize, payload_nbytes, quantize, quantized_nbytes
from large_model_training.compression.wire import pack, unpack

SIGN_CHUNK = 1024
"""Elements per sign scale: 128 bytes of signs and a 4-byte scale (3% overhead over pure 1 bit per element)."""

OUTER_SIGN_CHUNK = 256
"""Elements per scale of DiLoCo's sign exchange (`--sync.compression sign`): 12.5% overhead over 1 bit, and a
closer scale for each stretch of the outer gradient, which spans tensors of very different magnitudes. Measured
with the one-stage exchange (docs/benchmarks.md, local:2 at dp = 4, two seeds): +3.18% / +3.33% behind dense,
against 1024's +4.19% / +3.16%: within the runs' spread, kept for the smaller worst case."""


def sign_nbytes(numel: int, chunk: int = SIGN_CHUNK) -> int:
    return math.ceil(numel / 8) + 4 * math.ceil(numel / chunk)


@dataclass
class SignPayload:
    """A sign-compressed tensor: packed sign `bits` (uint8) and fp32 `scales` (one per chunk)."""

    bits: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    chunk: int = SIGN_CHUNK

    @property
    def nbytes(self) -> int:
        return self.bits.numel() + self.scales.numel() * 4

    def decompress(self) -> torch.Tensor:
        values = sign_decompress(self.bits, self.scales, self.shape.numel(), self.chunk)
        return values.to(self.dtype).view(self.shape)


def sign_compress(x: torch.Tensor, chunk: int = SIGN_CHUNK) -> SignPayload:
    """Signs and per-chunk mean |x| of x's flattened values."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    chunks = F.pad(flat, (0, -n % chunk)).view(-1, chunk)
    counts = torch.full((chunks.shape[0],), float(chunk), device=flat.device)
    counts[-1] = n - (chunks.shape[0] - 1) * chunk  # the padded last chunk's mean is over its real elements
    scales = chunks.abs().sum(dim=1) / counts
    positive = F.pad(flat >= 0, (0, -n % 8)).view(-1, 8).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)  # made on the device: no host copy per call
    bits = (positive << shifts).sum(dim=1, dtype=torch.uint8)
    return SignPayload(bits, scales, x.shape, x.dtype, chunk)


def sign_decompress(bits: torch.Tensor, scales: torch.Tensor, numel: int, chunk: int = SIGN_CHUNK) -> torch.Tensor:
    """fp32 values of one message (1-D inputs) or of several (rows of 2-D inputs)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    unpacked = ((bits.unsqueeze(-1) >> shifts) & 1).view(*bits.shape[:-1], -1)[..., :numel]
    return (unpacked.float() * 2 - 1) * scales.repeat_interleave(chunk, dim=-1)[..., :numel]


class Codec:
    """Encodes a 1-D fp32 vector into one uint8 message and decodes rows of such messages."""

    BITS = {"int8": 8, "int4": 4}

    def __init__(self, kind: str, sign_chunk: int = SIGN_CHUNK):
        if kind not in ("sign", "none", *self.BITS):
            raise ValueError(f"a codec is sign, int8, int4 or none, got {kind!r}")
        self.kind, self.sign_chunk = kind, sign_chunk

    @property
    def lossy(self) -> bool:
        return self.kind != "none"

    def nbytes(self, numel: int) -> int:
        if self.kind == "sign":
            return sign_nbytes(numel, self.sign_chunk)
        if self.kind in self.BITS:
            return quantized_nbytes(numel, self.BITS[self.kind], QUANT_CHUNK)
        return 4 * numel

    def _layout(self, numel: int) -> list[tuple[torch.dtype, int]]:
        if self.kind == "sign":
            return [(torch.float32, math.ceil(numel / self.sign_chunk)), (torch.uint8, math.ceil(numel / 8))]
        payload = payload_nbytes(numel, self.BITS[self.kind])
        return [(torch.float32, math.ceil(numel / QUANT_CHUNK)), (torch.uint8, payload)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(message, what the receivers will decode from it) of fp32 vector x."""
        if self.kind == "none":
            return x.view(torch.uint8), x
        if self.kind == "sign":
            payload = sign_compress(x, self.sign_chunk)
            return pack([payload.scales, payload.bits]), payload.decompress()
        q = quantize(x, self.BITS[self.kind], QUANT_CHUNK)
        return pack([q.scales, q.data]), q.decompress()

    def decode(self, rows: torch.Tensor, numel: int) -> torch.Tensor:
        """(rows, nbytes) uint8 messages -> (rows, numel) fp32 values."""
        rows = rows if rows.dim() == 2 else rows.unsqueeze(0)
        if self.kind == "none":
            return rows.view(torch.float32)
        scales, data = unpack(rows, self._layout(numel))
        if self.kind == "sign":
            return sign_decompress(data, scales, numel, self.sign_chunk)
        return dequantize(data, scales, numel, self.BITS[self.kind], QUANT_CHUNK)
