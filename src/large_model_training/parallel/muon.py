"""`--optimizer muon`: Newton-Schulz orthogonalised momentum (Keller Jordan's Muon, Moonlight's scaling) for the
2-D weights of the blocks, AdamW for everything else (embeddings, head, norms, biases, 3-D expert stacks).

The update of one matrix W (m x n), as torch.optim.Muon(nesterov=True, adjust_lr_fn="match_rms_adamw"):
    B = mu B + (1 - mu) g;  u = NS5(g + mu (B - g));  W = W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) u
NS5 is five quintic Newton-Schulz iterations (coefficients 3.4445, -4.7750, 2.0315) in bf16, as torch's and
Keller Jordan's; the 0.2 sqrt(max(m, n)) factor gives the update AdamW's RMS (Moonlight, Liu et al. 2025), so
the AdamW learning rate and weight decay serve both halves.

Why an owner rank per matrix: NS5 needs a whole matrix, and the flat shards of ZeRO-1/2 cut across matrices.
Each matrix is given one dp rank (greedy by size onto the rank with the fewest optimizer bytes so far, Adam's
moments of its shards included: the same on every rank); the bucket gradients' dp shards are
all-gathered (ZeRO-0 holds them whole already), the owner keeps the matrix's momentum, orthogonalises and
writes u into a zero bucket-sized buffer, and a sum over dp (one non-zero term per element: exact) hands each
rank u for the part of the bucket it updates. The orthogonalisation is done once per matrix, and every layout
computes it the same way, so dp x ZeRO layouts give the one-rank numbers bit for bit. Under tp the owner's tp
peers all-gather u along the shard dimension and each orthogonalises the whole matrix (fused q/k/v or gate/up
rows come in tp-shard order: a row permutation, which NS5 commutes with), keeping its own rows or columns.

What it holds: each matrix's momentum on its owner only (fp32, the tp shard's shape), and Adam's moments only for
the parameters AdamW updates (compact per piece: the matrices get none). State by name: the AdamW moments (zero
for matrices, as before) and `muon_momentum` (the full matrices, summed over dp from their owners), so
checkpoints move between dp sizes, ZeRO stages and owners, and to and from AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from large_model_training.parallel.adamw import AdamW
from large_model_training.parallel.collectives import all_gather_single
from large_model_training.parallel.pieces import ShardPiece
from large_model_training.parallel.tensor import tp_layouts
from large_model_training.parallel.update_rule import RuleContext, UpdateRule

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MOMENTUM = 0.95
NOT_MUON = ("tok_embeddings.weight", "pos_embeddings.weight", "output.weight")


def newton_schulz(
    g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of g (about U S' V^T, S' ~ 1)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_parameters(named) -> set[str]:
    """The parameters Muon updates: 2-D weights other than the embeddings and the head."""
    return {n for n, p in named if p.ndim == 2 and not n.endswith(NOT_MUON)}


@dataclass
class _Matrix:
    name: str
    bucket: int
    offset: int  # flat-buffer position of its first element
    shape: torch.Size  # this rank's (tp shard's) shape
    owner: int  # the dp rank that orthogonalises it
    shard_dim: int | None  # the dim split over tp, None if whole on every tp rank


class Muon(UpdateRule):
    """Muon on the matrices, AdamW (`adamw`, over the other parameters' spans of each piece) on the rest."""

    def __init__(self, ctx: RuleContext, *, matrices: set[str], shard_dims: dict[str, int | None]):
        shards = self.shards = ctx.shards
        self.buckets, self.zero, self.weight_decay = shards.buckets, shards.zero, ctx.weight_decay
        self.dp, self.dp_rank, self.group, self.tp = shards.dp, shards.dp_rank, shards.group, ctx.mesh.tp
        found = sorted(
            ((b.index, off, name, p.shape) for b in self.buckets for name, p, off in b.params if name in matrices),
            key=lambda m: (-m[3].numel(), m[1]),
        )
        loads = self._adamw_bytes(matrices, 2 * ctx.state_dtype.itemsize)
        self.matrices = []
        for bucket, offset, name, shape in found:  # greedy: the largest matrix to the least loaded rank
            owner = loads.index(min(loads))
            loads[owner] += 4 * shape.numel()
            self.matrices.append(_Matrix(name, bucket, offset, shape, owner, shard_dims.get(name)))
        self.matrices.sort(key=lambda m: m.offset)  # the same order on every rank (tp collectives pair up)
        self.momentum = {
            m.name: torch.zeros(m.shape, device=shards.device) for m in self.matrices if m.owner == self.dp_rank
        }
        names = {m.name for m in self.matrices}
        self.matrix_spans = [[(n, a, b) for n, a, b, _ in piece.params if n in names] for piece in shards.pieces]
        regions = []
        for piece in shards.pieces:  # AdamW's: the other parameters' spans, their moments packed
            at, spans = 0, []
            for name, a, b, _ in piece.params:
                if name not in names:
                    spans.append((a, b, at))
                    at += b - a
            regions.append(spans)
        self.adamw = AdamW(
            shards, weight_decay=ctx.weight_decay, betas=ctx.betas, state_dtype=ctx.state_dtype, regions=regions
        )
        # Each matrix's logical shape (whole over tp): what the RMS scaling reads.
        self.whole_shape = {
            m.name: tuple(s * (self.tp.size if d == m.shard_dim else 1) for d, s in enumerate(m.shape))
            for m in self.matrices
        }

    def _adamw_bytes(self, matrices: set[str], moment_bytes: int) -> list[int]:
        """Each dp rank's bytes of Adam moments (the other parameters' elements in its shards, the same on every
        rank under ZeRO-0): where the owners' momentum starts, so that the rank totals come out even."""
        out = [0] * self.dp
        for rank in range(self.dp):
            for b in self.buckets:
                lo, hi = b.shard_range(rank, self.dp) if self.zero else (b.start, b.end)
                for name, p, off in b.params:
                    if name not in matrices:
                        out[rank] += moment_bytes * max(0, min(hi, off + p.numel()) - max(lo, off))
        return out

    @torch.no_grad()
    def step(
        self, pieces: list[ShardPiece], grads: list[torch.Tensor], lr: float, grad_scale: torch.Tensor | float
    ) -> None:
        self.adamw.step(pieces, grads, lr, grad_scale)  # counts the step too
        updates = self._orthogonalised(grads, grad_scale)
        for piece, spans in zip(pieces, self.matrix_spans):
            bucket = self.buckets[piece.bucket_index]
            full = updates.get(piece.bucket_index)
            for name, a, b in spans:
                rate = lr * 0.2 * math.sqrt(max(self.whole_shape[name]))  # AdamW's RMS (Moonlight)
                at = piece.lo + a - bucket.start
                piece.master[a:b].mul_(1 - lr * self.weight_decay)
                piece.master[a:b].add_(full[at : at + b - a], alpha=-rate)

    def _orthogonalised(self, grads: list[torch.Tensor], grad_scale) -> dict[int, torch.Tensor]:
        """Per bucket holding matrices: a buffer with every matrix's u at its place (zeros elsewhere), the same
        on every dp rank."""
        buckets = sorted({m.bucket for m in self.matrices})
        full = {}
        for index in buckets:  # every matrix's whole (dp-averaged) gradient, on every rank
            if self.zero:
                full[index] = torch.empty(
                    self.buckets[index].numel, dtype=grads[index].dtype, device=grads[index].device
                )
                all_gather_single(full[index], grads[index].contiguous(), group=self.group)
            else:  # ZeRO-0: a piece is its whole bucket
                full[index] = grads[index]
        out = {index: torch.zeros(self.buckets[index].numel, device=self.shards.device) for index in buckets}
        for m in self.matrices:
            if m.owner != self.dp_rank:
                continue
            start = m.offset - self.buckets[m.bucket].start
            g = full[m.bucket][start : start + m.shape.numel()].view(m.shape).float()
            if not (isinstance(grad_scale, float) and grad_scale == 1.0):
                g = g * grad_scale
            buf = self.momentum[m.name]
            buf.lerp_(g, 1 - MOMENTUM)
            u = self._whole_over_tp(g.lerp(buf, MOMENTUM), m)
            out[m.bucket][start : start + m.shape.numel()].copy_(u.reshape(-1))
        if self.dp > 1:
            for index in buckets:
                dist.all_reduce(out[index], group=self.group)
        return out

    def _whole_over_tp(self, u: torch.Tensor, m: _Matrix) -> torch.Tensor:
        """NS5 of the whole matrix: this rank's shard of it (under tp the shards gathered first)."""
        if m.shard_dim is None or self.tp.size == 1:
            return newton_schulz(u)
        parts = torch.empty(self.tp.size * u.numel(), dtype=u.dtype, device=u.device)
        all_gather_single(parts, u.contiguous().view(-1), group=self.tp.group)
        self.tp.count_gather_or_scatter(parts)
        whole = torch.cat(list(parts.view(self.tp.size, *u.shape)), dim=m.shard_dim)
        return newton_schulz(whole).chunk(self.tp.size, dim=m.shard_dim)[self.tp.rank]

    # ---- state -------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return [*self.adamw.tensors(), *self.momentum.values()]

    def state_dict(self) -> dict:
        """The AdamW state by name, plus each matrix's momentum (from its owner: a sum over dp)."""
        state = self.adamw.state_dict()
        momentum = {}
        for m in self.matrices:
            value = self.momentum.get(m.name)
            value = value.clone() if value is not None else torch.zeros(m.shape, device=self.shards.device)
            if self.dp > 1:
                dist.all_reduce(value, group=self.group)
            momentum[m.name] = value
        state["muon_momentum"] = momentum
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.adamw.load_state_dict(state)
        saved = state.get("muon_momentum", {})
        for name, buf in self.momentum.items():
            if name in saved:
                buf.copy_(saved[name].reshape(buf.shape))
            else:
                buf.zero_()  # from an AdamW checkpoint: Muon's momentum starts afresh


def make_rule(ctx: RuleContext) -> Muon:
    """`--optimizer muon` (choices.Optimizer; layout.py: ZeRO 0-2, no DiLoCo)."""
    layouts = tp_layouts(ctx.model)
    return Muon(
        ctx,
        matrices=muon_parameters(ctx.model.named_parameters()),
        shard_dims={n: lay.shard_dim for n, lay in layouts.items()},
    )
