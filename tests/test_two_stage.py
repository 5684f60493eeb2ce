"""The two-stage compressed average (compression/two_stage.py), w ranks simulated in one process."""

from __future__ import annotations

import pytest
import torch

from large_model_training.compression.sign import Codec
from large_model_training.compression.two_stage import encode_shards, serve_shard


def _average(
    codec: Codec, inputs: list[torch.Tensor], worker: list[torch.Tensor], server: list[torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """One exchange: every rank's shards encoded (worker errors in and out), each shard served by its rank (server
    errors in and out); returns (what every rank decodes, bytes one rank's stage-1 and stage-2 messages hold)."""
    w = len(inputs)
    stage1 = []
    for i, x in enumerate(inputs):
        x = x + worker[i]
        messages, sent = encode_shards(codec, x, w)
        worker[i] = x - sent
        stage1.append(messages)
    served = [
        serve_shard(
            codec,
            torch.stack([stage1[i][j] for i in range(w)]),
            inputs[0].numel() // w,
            server[j] if codec.lossy else None,
        )
        for j in range(w)
    ]
    decoded = torch.cat([codec.decode(message, inputs[0].numel() // w).view(-1) for message, _ in served])
    for (_, sent), piece in zip(served, decoded.view(w, -1)):
        assert torch.equal(sent, piece)  # the server's view of its shard is what every rank decodes
    return decoded, stage1[0].numel() + served[0][0].numel()


@pytest.mark.parametrize("kind", ["none", "int8", "int4", "sign"])
def test_the_average_plus_what_the_errors_hold_is_the_true_mean(kind):
    """Over many exchanges the decoded averages, the mean worker error and the server errors add up to the sum of
    the true means: nothing is lost, only delayed (and 'none' is the mean itself)."""
    w, n, gen = 4, 2048, torch.Generator().manual_seed(0)
    codec = Codec(kind, 256)
    worker, server = [torch.zeros(n) for _ in range(w)], [torch.zeros(n // w) for _ in range(w)]
    true_sum, decoded_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(20):
        inputs = [torch.randn(n, generator=gen) * 0.1 for _ in range(w)]
        decoded, nbytes = _average(codec, inputs, worker, server)
        mean = torch.stack(inputs).mean(dim=0)
        if kind == "none":
            torch.testing.assert_close(decoded, mean, rtol=0, atol=1e-7)
        true_sum += mean.double()
        decoded_sum += decoded.double()
    held = torch.stack(worker).double().mean(dim=0) + torch.cat(server).double()
    torch.testing.assert_close(decoded_sum + held, true_sum, rtol=0, atol=1e-5)
    assert nbytes == (w + 1) * codec.nbytes(n // w)  # all-to-all of w shard messages, all-gather of one
    if codec.lossy:
        assert held.abs().max() < 1.0  # fed back, not accumulated
