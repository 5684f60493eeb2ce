"""Gradient compression: top-k, random-k, threshold, int8/int4 and PowerSGD, with error feedback.

Two ways in:
- `compression_hook` + `CompressionState` (hook.py): the data-parallel engine's comm hook; compresses each
  gradient bucket, reduces it over dp on a real wire format (indices + values, int8/int4 + scales, low-rank
  factors) and returns the dense dp average.
- `GradientCompression.compress_gradients(gradients, compression_type)`: the seed's name, for one tensor in one
  process (no collectives): returns a payload with `.decompress()` and `.nbytes`. The seed's names map onto
  ours: 'topk' -> topk (ratio 0.1, the seed's k), 'quantization' -> int8 (int4 with bits=4), 'sparsification'
  -> threshold (1e-3 unless threshold= is given); every spec string ('topk:0.01', 'int4:stochastic',
  'powersgd:4', ...) works too.

Both share the compressors (sparse.py, quantize.py, powersgd.py) and the spec grammar (spec.py).
"""

from __future__ import annotations

import zlib
from typing import Any, Union

import torch

from large_model_training.compression.hook import (STOCHASTIC_STREAM, CompressionState, WireBytes, compression_hook,
                                                   wire_bytes)
from large_model_training.compression.powersgd import LowRankPayload, compress_matrix, initial_q, matrix_rank
from large_model_training.compression.quantize import QuantPayload, quantize
from large_model_training.compression.sparse import RANDOMK_STREAM, SparsePayload, select
from large_model_training.compression.spec import CompressionSpec, parse_compression, seeded_generator
from large_model_training.config import ConfigError

__all__ = ["CompressionSpec", "parse_compression", "CompressionState", "compression_hook", "wire_bytes",
           "WireBytes", "GradientCompression", "DensePayload", "SparsePayload", "QuantPayload", "LowRankPayload"]

SEED_NAMES = {"topk": "topk", "quantization": "int8", "sparsification": "threshold"}
DEFAULTS = {"topk": 0.1, "randomk": 0.1, "threshold": 1e-3, "powersgd": 1}
"""Values of bare names: the seed's topk_compress(k=0.1); PyTorch's PowerSGD default rank 1."""


class DensePayload:
    """An uncompressed tensor ('none', or a 1-D tensor under PowerSGD)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def decompress(self) -> torch.Tensor:
        return self.tensor


Payload = Union[DensePayload, SparsePayload, QuantPayload, LowRankPayload]


def _resolve(compression_type: str, ratio: float | None, threshold: float | None, bits: int | None,
             rank: int | None, stochastic: bool) -> CompressionSpec:
    """A spec from a seed name or spec string, with keyword values filling in (or replacing) its argument."""
    kind, sep, arg = str(compression_type).strip().lower().partition(":")
    kind = SEED_NAMES.get(kind, kind)
    if kind == "int8" and bits is not None:
        if bits not in (4, 8):
            raise ConfigError(f"quantization supports bits=8 or bits=4, got {bits}")
        kind = f"int{bits}"
    value = {"topk": ratio, "randomk": ratio, "threshold": threshold, "powersgd": rank}.get(kind)
    if kind in DEFAULTS:
        arg = str(value) if value is not None else (arg or str(DEFAULTS[kind]))
        sep = ":"
    elif kind in ("int8", "int4") and stochastic:
        sep, arg = ":", "stochastic"
    return parse_compression(f"{kind}{sep}{arg}")


class GradientCompression:
    """Compress one gradient tensor at a time, in one process, with error feedback per `name`.

        gc = GradientCompression()
        payload = gc.compress_gradients(grad, "topk", ratio=0.01)     # or "topk:0.01", "quantization", "int4"
        approx, size = payload.decompress(), payload.nbytes

    With error_feedback (the default) the part of a gradient that was not sent is kept under `name` and added to
    the next gradient compressed under the same name; `residual(name)` shows it. Calls are counted per name:
    the count seeds random-k and stochastic rounding, so equal seeds give equal results.
    """

    def __init__(self, error_feedback: bool = True, seed: int = 0):
        self.error_feedback = error_feedback
        self.seed = seed
        self.residuals: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}
        self.powersgd_q: dict[str, torch.Tensor] = {}

    def residual(self, name: str = "") -> torch.Tensor | None:
        return self.residuals.get(name)

    def reset(self) -> None:
        self.residuals.clear()
        self.steps.clear()
        self.powersgd_q.clear()

    def compress_gradients(self, gradients: Any, compression_type: str = "topk", *, name: str = "",
                           ratio: float | None = None, k: float | None = None, threshold: float | None = None,
                           bits: int | None = None, rank: int | None = None, stochastic: bool = False) -> Payload:
        """Compress `gradients` (a tensor or array) by a seed name or spec string; `k` is the seed's word for ratio."""
        spec = _resolve(compression_type, ratio if ratio is not None else k, threshold, bits, rank, stochastic)
        g = torch.as_tensor(gradients)
        x = g
        residual = self.residuals.get(name) if self.error_feedback else None
        if residual is not None:
            if residual.shape != g.shape:
                raise ValueError(f"the residual under name '{name}' has shape {tuple(residual.shape)}, the gradient "
                                 f"{tuple(g.shape)}: pass a distinct name= per tensor")
            x = g + residual
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        payload = self._compress(spec, x, name, step)
        if self.error_feedback:
            self.residuals[name] = x - payload.decompress()
        return payload

    def _compress(self, spec: CompressionSpec, x: torch.Tensor, name: str, step: int) -> Payload:
        key = zlib.crc32(name.encode())  # a stable number per name (Python's str hash is salted per process)
        if spec.kind in ("topk", "randomk", "threshold"):
            gen = seeded_generator(x.device, self.seed, RANDOMK_STREAM, step, key) if spec.kind == "randomk" else None
            return select(spec, x, gen)
        if spec.bits:
            gen = seeded_generator(x.device, self.seed, STOCHASTIC_STREAM, step, key) if spec.stochastic else None
            return quantize(x, spec.bits, spec.chunk, gen)
        if spec.kind == "powersgd" and x.dim() >= 2 and matrix_rank(x.shape, spec.rank):
            r = matrix_rank(x.shape, spec.rank)
            q = self.powersgd_q.get(name)
            if q is None or q.shape != (x[0].numel(), r):
                q = initial_q(x[0].numel(), r, torch.promote_types(x.dtype, torch.float32), x.device, self.seed, key)
            payload = compress_matrix(x, q)
            self.powersgd_q[name] = payload.q
            return payload
        return DensePayload(x.clone())
