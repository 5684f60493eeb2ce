"""Fused projections: q, k, v as one weight (`attn.wqkv`) and gate, up as one (`mlp.w_gate_up`), so a block's
forward runs 4 GEMMs instead of 7 (qkv, o, gate_up, down), and how they map to the separate weights that Hugging
Face files and checkpoints written before the fusion hold.

Row order, chosen so that every tensor-parallel shard is a plain contiguous block of rows of the full weight
(and init by name, DCP checkpoints, FSDP2 and the flat gradient buffers need no special case):
  - wqkv is grouped per key/value head, as Megatron-LM lays it out: for kv head g, the G = n_heads / n_kv_heads
    query heads that read it, then k_g, then v_g (each head head_dim rows). A tp rank holds n_kv_heads / tp
    whole groups: its query heads and the key/value heads they read, together. (So tp must divide n_kv_heads:
    `layout.py` refuses tp > n_kv_heads, as Megatron and torchtitan do.)
  - w_gate_up interleaves rows: row 2i is gate row i, row 2i+1 up row i. Any even block of rows holds matching
    pairs, whatever tp is. The GEMM reads the (local) weight reordered as [gate rows | up rows] (`linear(...,
    paired=True)`, models/linear.py), so gate and up come out as the contiguous halves of the output: the
    swiglu on stride-2 columns cost 2.5x a contiguous one on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from large_model_training.config import ModelConfig

QKV, GATE_UP = "attn.wqkv.weight", "w_gate_up.weight"
SEPARATE_QKV = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight")
SEPARATE_GATE_UP = ("w_gate.weight", "w_up.weight")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Full wq (n_heads hd, h), wk and wv (n_kv hd, h) -> wqkv ((n_heads + 2 n_kv) hd, h), grouped per kv head."""
    groups = [t.reshape(n_kv_heads, -1, t.shape[-1]) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, q.shape[-1])


def split_qkv(w: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    head_dim = w.shape[0] // (n_heads + 2 * n_kv_heads)
    grouped = w.reshape(n_kv_heads, -1, head_dim, w.shape[-1])  # (n_kv, G + 2, hd, h)
    group = grouped.shape[1] - 2
    return (
        grouped[:, :group].reshape(-1, w.shape[-1]),
        grouped[:, group].reshape(-1, w.shape[-1]),
        grouped[:, group + 1].reshape(-1, w.shape[-1]),
    )


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up (f, h) -> (2f, h), rows interleaved."""
    return torch.stack((gate, up), dim=1).reshape(-1, gate.shape[-1])


def split_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_gate_up`."""
    return w[0::2], w[1::2]


def _fused_name(name: str, names) -> tuple[str, tuple[str, ...]] | None:
    """(fused name, its separate names) when `name` is one of a fused weight's separate names and all of them
    are in `names`, else None (a gelu MLP's lone `w_up` stays as it is)."""
    for fused, parts in ((QKV, SEPARATE_QKV), (GATE_UP, SEPARATE_GATE_UP)):
        for part in parts:
            if name.endswith(part) and (len(name) == len(part) or name[-len(part) - 1] == "."):
                prefix = name[: len(name) - len(part)]
                separate = tuple(prefix + p for p in parts)
                return (prefix + fused, separate) if all(p in names for p in separate) else None
    return None


def fuse_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A full state dict with separate projections -> the fused one (other entries unchanged)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        found = _fused_name(name, state)
        if found is None:
            out[name] = t
        elif found[0] not in out:
            parts = [state[p] for p in found[1]]
            if found[0].endswith(QKV):
                q, k, v = parts
                out[found[0]] = fuse_qkv(q, k, v, cfg.kv_heads)
            else:
                out[found[0]] = fuse_gate_up(*parts)
    return out


def split_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `fuse_state`: the separate projections Hugging Face files (and old checkpoints) hold."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(QKV):
            parts = split_qkv(t, cfg.n_heads, cfg.kv_heads)
            out.update(zip((name[: -len(QKV)] + p for p in SEPARATE_QKV), parts))
        elif name.endswith(GATE_UP):
            out.update(zip((name[: -len(GATE_UP)] + p for p in SEPARATE_GATE_UP), split_gate_up(t)))
        else:
            out[name] = t
    return out


class FusedView(Mapping):
    """A mapping of separate projection names (an HF folder's `HFWeights`, read on access) seen by fused names:
    `view['layers.0.attn.wqkv.weight']` reads wq, wk and wv and fuses them."""

    def __init__(self, separate: Mapping[str, torch.Tensor], cfg: ModelConfig):
        self.separate, self.cfg = separate, cfg
        self._keys = set(separate)
        self._names = _fused_names(separate)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._keys:  # already fused (or not a projection)
            return self.separate[name]
        if name.endswith(QKV):
            prefix = name[: -len(QKV)]
            q, k, v = (self.separate[prefix + p] for p in SEPARATE_QKV)
            return fuse_qkv(q, k, v, self.cfg.kv_heads)
        if name.endswith(GATE_UP):
            prefix = name[: -len(GATE_UP)]
            return fuse_gate_up(*(self.separate[prefix + p] for p in SEPARATE_GATE_UP))
        return self.separate[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _fused_names(separate: Mapping) -> list[str]:
    names: dict[str, None] = {}
    keys = set(separate)  # names only: `in` on a lazy mapping would read the tensors
    for name in separate:
        found = _fused_name(name, keys)
        names[name if found is None else found[0]] = None
    return list(names)
