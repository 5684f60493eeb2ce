"""Gradient compression: top-k, random-k, threshold, int8/int4 and PowerSGD, with error feedback.

Two ways in:
- `compression_hook` + `CompressionState` (hook.py): the data-parallel engine's comm hook; compresses each
  gradient bucket, reduces it over dp on a real wire format (indices + values, int8/int4 + scales, low-rank
  factors) and returns the dense dp average.
- `lmt.GradientCompression` (the seed's name, in `api.py`): one tensor in one process, no collectives.
- sign.py: 1-bit sign compression and the codecs `--optimizer onebit-adam` sends its momentum through.

Both share the compressors (sparse.py, quantize.py, powersgd.py) and the spec (`choices.CompressionSpec`).
"""

from __future__ import annotations

from large_model_training.compression.hook import (
    STOCHASTIC_STREAM,
    CompressionState,
    WireBytes,
    compression_hook,
    wire_bytes,
    wire_factor,
)
from large_model_training.compression.powersgd import LowRankPayload, compress_matrix, initial_q, matrix_rank
from large_model_training.compression.quantize import QuantPayload, quantize
from large_model_training.compression.sign import SignPayload, sign_compress
from large_model_training.compression.sparse import RANDOMK_STREAM, SparsePayload, select
from large_model_training.compression.spec import CompressionSpec, parse_compression, seeded_generator
from large_model_training.compression.wire import DensePayload

__all__ = [
    "CompressionSpec",
    "parse_compression",
    "CompressionState",
    "compression_hook",
    "wire_bytes",
    "wire_factor",
    "WireBytes",
    "DensePayload",
    "SparsePayload",
    "QuantPayload",
    "LowRankPayload",
    "Payload",
    "STOCHASTIC_STREAM",
    "RANDOMK_STREAM",
    "compress_matrix",
    "initial_q",
    "matrix_rank",
    "quantize",
    "select",
    "seeded_generator",
    "SignPayload",
    "sign_compress",
]

Payload = DensePayload | SparsePayload | QuantPayload | LowRankPayload | SignPayload
