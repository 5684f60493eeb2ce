"""dp = 4 ranks simulated in one process, for the one-process studies (topk_adamw_study.py, sync_study.py): the
`tiny` preset on the default corpus, global batch 16 x 256 tokens (or `global_batch`), each rank's one micro-batch
per step from its own loader shard (as `lmt train --dp 4` cuts them), the model's parameters read and written as
one flat fp32 vector. The validation batches stay 128 x 256 tokens whatever the training batch."""

from __future__ import annotations

import torch

from large_model_training.assembly import build_model
from large_model_training.config import build_config
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard

DP, GLOBAL_BATCH, MICRO_BATCH = 4, 16, 4


class SimulatedRanks:
    """The model, its flat initial parameters, which elements weight decay applies to, and per-rank batches."""

    def __init__(self, device: torch.device = torch.device("cpu"), global_batch: int = GLOBAL_BATCH, **overrides):
        torch.set_num_threads(1)
        micro_batch = global_batch // DP
        self.cfg = build_config(overrides={"train.global_batch_size": global_batch,
                                           "train.micro_batch_size": micro_batch, **overrides})
        t = self.cfg.train
        self.model = build_model(self.cfg.model, None, t.seed).to(device)
        self.params = list(self.model.parameters())
        self.decayed = torch.cat([torch.full((p.numel(),), float(p.dim() >= 2), device=device) for p in self.params])
        self.initial = torch.cat([p.detach().reshape(-1) for p in self.params])
        streams = load_training_data(self.cfg.data, prepare_missing=True)
        self.loaders = [BatchLoader(streams.train, t.seq_len, Shard(r, DP, global_batch, micro_batch), t.seed,
                                    device, prefetch=False) for r in range(DP)]
        self.val = BatchLoader(streams.val, t.seq_len, Shard(0, 1, GLOBAL_BATCH * t.eval_batches, MICRO_BATCH),
                               t.seed, device, shuffle=False, prefetch=False).next()

    def set_params(self, values: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.data.copy_(values[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def gradient(self, rank: int, at: torch.Tensor | None = None) -> torch.Tensor:
        """The flat gradient of rank `rank`'s next micro-batch, at `at` (None: the parameters as they are)."""
        if at is not None:
            self.set_params(at)
        self.model.zero_grad(set_to_none=True)
        inputs, targets = self.loaders[rank].next()[0]
        loss = self.model.loss_fn(self.model(inputs), targets)
        loss.backward()
        self.last_loss = loss.detach()  # a tensor: no device sync unless someone reads it
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    @torch.no_grad()
    def val_loss(self, at: torch.Tensor) -> float:
        self.set_params(at)
        return sum(float(self.model.loss_fn(self.model(x), y)) for x, y in self.val) / len(self.val)
