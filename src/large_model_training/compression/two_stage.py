"""The two-stage compressed average: 1-bit Adam's compressed all-reduce (Tang et al. 2021), whose bytes per rank
do not grow with the group. The compressed Adam (parallel/onebit_adam.py), DiLoCo's lossy outer exchanges
(parallel/diloco.py) and the per-step `int8:two-stage` / `int4:two-stage` gradient compressors (hook.py) send
their vectors through it.

Stage 1, every rank i of w: x_i (padded to a multiple of w) is cut into w equal shards, each encoded on its own
(`Codec`: signs and a scale per chunk, or int8 / int4 per 256), and one all-to-all sends shard j's message to
rank j. The caller keeps the worker error x_i - what was sent and adds it to its next x_i.
Stage 2, rank j for shard j: the mean of the w messages it received, plus its server error, encoded again and
all-gathered; the server error becomes that sum less what was sent. Every rank decodes the same w messages.

Bytes per rank for an m-byte compressed vector, ring algorithms: (w-1)/w m in each stage, 2 (w-1)/w m in all,
the factor of a ring all-reduce of m bytes at any w (so "n times fewer bytes than fp32" holds on the wire).
Gathering every rank's whole message in one stage (what the per-step gradient compressors do, quantize.py)
moves (w-1) m per rank: w/2 times more, and more than a dense fp32 all-reduce past w = 64 / bits. The two
stages' price is the second rounding, which the server error feeds back as the worker error does the first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from large_model_training.compression.sign import Codec
from large_model_training.compression.wire import CountingState, all_gather, all_to_all


def encode_shards(codec: Codec, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's messages: x (1-D fp32, its length a multiple of `parts`) as one message per equal shard;
    returns (messages as rows (parts, nbytes), the values they decode to, laid out like x)."""
    encoded = [codec.encode(shard) for shard in x.view(parts, -1)]
    return torch.stack([message for message, _ in encoded]), torch.cat([sent for _, sent in encoded])


def serve_shard(
    codec: Codec, received: torch.Tensor, numel: int, error: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 on the shard's owner: the mean of the `received` messages (rows) of `numel` values, plus the server
    `error` (updated in place to what this message leaves unsent; None: none kept), encoded again; returns
    (message, the values it decodes to)."""
    mean = codec.decode(received, numel).sum(dim=0).div_(received.shape[0])
    if error is not None:
        mean.add_(error)
    message, sent = codec.encode(mean)
    if error is not None:
        error.copy_(mean - sent)
    return message, sent


def start_average(
    state: CountingState, codec: Codec, x: torch.Tensor, server_error: torch.Tensor | None
) -> tuple[torch.Tensor, Callable[[], tuple[torch.Tensor, dist.Work]]]:
    """Stage 1 of the group's average of 1-D fp32 x, started; returns (the values this rank's messages decode to,
    laid out like x: the caller's worker error is x minus them) and `serve`, which waits for stage 1, serves this
    rank's shard with `server_error` (its ceil(numel / group_size) values, updated in place; None: none kept)
    and starts stage 2, returning (rows, work): once work is done, codec.decode(rows, shard numel) laid out flat
    and cut to x's length is the average. Every rank must call `serve` in the same order as its other
    collectives (backends pair collectives by issue order)."""
    parts, numel = state.group_size, x.numel()
    messages, sent = encode_shards(codec, F.pad(x, (0, -numel % parts)), parts)
    received, work = all_to_all(state, messages)

    def serve() -> tuple[torch.Tensor, dist.Work]:
        work.wait()
        message, _ = serve_shard(codec, received, -(-numel // parts), server_error)
        return all_gather(state, message)

    return sent[:numel], serve
