"""Sampling from a trained model (temperature and top-k), so a user can see what it learned."""

from __future__ import annotations

import warnings

import torch

from large_model_training.assembly import build_model
from large_model_training.config import ModelConfig
from large_model_training.data.tokenizer import load_tokenizer
from large_model_training.train import checkpoint


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    max_seq_len: int,
    generator: torch.Generator,
) -> list[int]:
    """Autoregressive sampling without a KV cache (the window is recomputed each token: fine for small models)."""
    model.eval()
    ids = list(prompt_ids)
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-max_seq_len:]], device=device)
        logits = model(window)[0, -1].float()
        if temperature == 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1).cpu()
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids


def generate_from_checkpoint(
    path: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    ckpt = checkpoint.resolve_checkpoint(path)
    meta = checkpoint.read_meta(ckpt)
    model_cfg = ModelConfig(**meta["model"])
    tokenizer = load_tokenizer(meta["config"]["data"]["tokenizer"])
    model = build_model(model_cfg, None, seed=0)
    with warnings.catch_warnings():  # DCP notes that it loads without a process group: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        checkpoint.load_checkpoint(ckpt, model)
    prompt_ids = [int(i) for i in tokenizer.encode(prompt)] or [ord("\n")]
    ids = sample(
        model,
        prompt_ids,
        max_new_tokens,
        temperature,
        top_k,
        model_cfg.max_seq_len,
        torch.Generator().manual_seed(seed),
    )
    return tokenizer.decode(ids)
