"""A Llama/GPT-family decoder, written once for one device.

Choices: `mlp` swiglu|gelu, `norm` rmsnorm|layernorm, `position` rope|learned, `attention` gqa (grouped-query)
or mla (DeepSeek's multi-head latent attention, `LatentAttention`), tied or untied embeddings, `qk_norm` (Qwen3:
queries and keys RMS-normalised per head before rope), `mtp_depth` (DeepSeek-V3's multi-token prediction:
`TokenPredictor` modules after the last block, sharing the embedding and the head: on the last pipeline
stage, which then holds a copy of the embedding, summed with stage 0's like a tied head).
Parallelism is applied from outside:
  - tensor parallelism swaps the projections (`wqkv`, `wo`, `w_gate_up` (or gelu's `w_up`), `w_down`), the
    embedding and the head for parallel versions and lowers the per-rank head counts (`parallel/tensor.py`);
  - pipeline parallelism builds only a slice of the model (`Transformer(cfg, stage=StageSpec(...))`). Blocks
    live in a ModuleDict keyed by their global index, so a parameter has the same name in every layout
    (`layers.5.attn.wqkv.weight`): checkpoints and weight initialisation are layout-free.
Activation recomputation too (`memory/recompute.py`): it replaces `run_blocks` or `Attention.core` on the
instance, so no parameter name changes.

The forward of a stage takes token ids (first stage) or hidden states (later stages) and returns hidden
states (inner stages) or logits (last stage); `model.loss_fn(logits, targets)` is its loss (plain
cross-entropy from `models/loss.py`, vocab-parallel under tensor parallelism). Given the targets too,
`forward(inputs, tokens, targets)` of the last stage returns the loss itself: with `fused_loss` on (training's
default, `train.fused_loss`) the head GEMM and the loss run fused, chunk by chunk, and the logits are never
held (`models/fused_loss.py`); off, it is `loss_fn(logits, targets)`. Inside forward, so that a module hook
that gathers the head's weight (FSDP2's) holds it for the fused loss too.

Context parallelism (`set_context`, by assembly): each rank holds a zig-zag part of every sequence; positions
(rope, learned) are its tokens' global ones and attention goes through the cp group (`parallel/context.py`),
which the model only calls, so this file stays one-device code.

Document masking (`document_eod` set, as Llama 3 trained on packed sequences): attention stays inside each
document and positions restart at 0 per document. Every stage gets the micro-batch's token ids as well
(`forward(hidden, tokens)`) and derives both from them once per forward (`document_layout`); the blocks get
the gathered rope tables and one additive mask, shared by all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from large_model_training.config import ModelConfig
from large_model_training.kernels import kernels_for
from large_model_training.models.linear import Linear
from large_model_training.models.loss import AddedLoss, CrossEntropy
from large_model_training.models.moe import MoE


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model this rank builds: blocks [first_layer, last_layer), embedding, head."""

    first_layer: int
    last_layer: int
    has_embedding: bool
    has_head: bool

    @staticmethod
    def whole(cfg: ModelConfig) -> StageSpec:
        return StageSpec(0, cfg.n_layers, True, True)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same `weight`, the same state dict) computed by the device's kernel (kernels.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels_for(x.device).rms_norm(x, self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape (seq_len, head_dim / 2), fp32. Cheap: recomputed per forward."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def document_layout(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token positions restarting at each document, and which keys each query may see (causal and in its
    own document), of packed sequences `tokens` (batch, seq) whose documents each end with the token `eod`.

    The EOD is the last token of the document it ends: token i is in document (EODs strictly before i). The
    window's first document, possibly cut, starts at position 0. Returns positions (batch, seq) int64 and a
    boolean mask (batch, 1, seq, seq), True where attention is allowed.
    """
    is_eod = tokens == eod
    index = torch.arange(tokens.shape[1], device=tokens.device)
    document = is_eod.cumsum(1) - is_eod.long()
    after_eod = torch.where(is_eod, index + 1, 0)  # a document starts after each EOD
    start = F.pad(after_eod[:, :-1], (1, 0)).cummax(1).values  # start of the document token i is in
    causal = index[:, None] >= index[None, :]
    allowed = (document[:, :, None] == document[:, None, :]) & causal
    return index - start, allowed.unsqueeze(1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere, in the attention's dtype. Why not pass the boolean mask: SDPA turns a
    boolean mask into a new float one at every call, and each layer's kernel would save its own copy for
    backward; this one tensor is shared (and saved once) by every layer of the chunk."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads. n_heads / n_kv_heads are this rank's heads, each head_dim
    wide: q is hidden -> n_heads x head_dim, k and v hidden -> kv heads x head_dim, o n_heads x head_dim -> hidden
    (n_heads x head_dim need not be hidden: Qwen3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.dropout = cfg.dropout
        # q, k and v in one GEMM, rows grouped per kv head (models/fused.py): [its query heads, k, v] per group
        self.wqkv = Linear(cfg.hidden_size, (cfg.n_heads + 2 * cfg.kv_heads) * self.head_dim)
        self.wo = Linear(cfg.n_heads * self.head_dim, cfg.hidden_size)
        # qk_norm: one weight over head_dim shared by all heads, so tp replicates it (parallel/tensor.py)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.enter = nn.Identity()  # tensor parallelism puts its region entry (f, or SP all-gather) here
        self.context = None  # context parallelism: a callable (q, k, v) -> out across the cp group

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.enter(x)
        batch, seq = x.shape[0], x.shape[1]
        qkv = self.wqkv(x).view(batch, seq, self.n_kv_heads, -1, self.head_dim)  # (b, s, kv, G + 2, hd)
        # split, not indexing: its backward is one cat, where each index's backward fills a zero qkv-sized
        # gradient and adds them (3-4% of `tiny`'s CPU step).
        q, k, v = qkv.split([qkv.shape[3] - 2, 1, 1], dim=3)
        # A tensor of its own wherever something saves it for backward (attention saves v; attention or qk_norm q
        # and k when rope does not make new ones): a view would keep the whole qkv output alive. One copy each,
        # fused away under --compile; none for q and k under rope alone, which copies them anyway (a query
        # group of more than one head is copied by the reshape).
        q, k, v = q.reshape(batch, seq, -1, self.head_dim), k.squeeze(3), v.squeeze(3).contiguous()
        if rope is None or self.q_norm is not None:
            q, k = q.contiguous(), k.contiguous()
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # rotates pairs (q[2i], q[2i+1]) as Meta's Llama (kernels.py)
            rotate = kernels_for(x.device).rope
            q, k = rotate(q, *rope), rotate(k, *rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Scores, softmax and dropout: the memory-heavy, FLOP-light part (selective recompute wraps it).
        Causal unless an additive `mask` (batch, 1, seq, seq) says which keys each query sees."""
        dropout = self.dropout if self.training else 0.0
        if self.context is not None:  # causal over global positions; the layout refuses masks and dropout
            return self.context(q, k, v)
        return kernels_for(q.device).attention(q, k, v, mask, dropout, mask is None)


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2/V3): queries from a compressed query (q_lora_rank wide), keys and
    values from one latent shared by all heads (kv_lora_rank wide, cached at inference), each RMS-normalised; a
    head's query and key are [nope | rope] (qk_nope_head_dim + qk_rope_head_dim), where the key's rotary part is
    one head computed from x and shared by all heads (rope cannot pass through the latent). Values are
    v_head_dim wide. `core` (scores, softmax, dropout) is Attention's, so recompute and cp treat both alike;
    scores are scaled by 1/sqrt(nope + rope). `enter_q` / `enter_kv`: where tensor parallelism enters its region
    (on the latents, which are narrower than x)."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        h, n = cfg.hidden_size, cfg.n_heads
        self.n_heads, self.dropout = n, cfg.dropout
        self.nope, self.rope, self.v_dim, self.kv_rank = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        self.wq_a = Linear(h, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, n * (self.nope + self.rope))  # rows per head: [nope | rope]
        self.wkv_a = Linear(h, self.kv_rank + self.rope)  # [latent | the shared rotary key]
        self.kv_norm = RMSNorm(self.kv_rank, eps=cfg.norm_eps)
        self.wkv_b = Linear(self.kv_rank, n * (self.nope + self.v_dim))  # rows per head: [k nope | v]
        self.wo = Linear(n * self.v_dim, h)
        self.enter_q, self.enter_kv = nn.Identity(), nn.Identity()
        self.context = None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert rope is not None, "multi-head latent attention needs rotary positions"
        q = self.wq_b(self.enter_q(self.q_norm(self.wq_a(x))))
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], -1)
        kv_in = self.enter_kv(torch.cat((self.kv_norm(latent), k_rope), -1))
        latent, k_rope = kv_in.split([self.kv_rank, self.rope], -1)
        batch, seq = q.shape[0], q.shape[1]
        q_nope, q_rope = q.view(batch, seq, self.n_heads, -1).split([self.nope, self.rope], -1)
        k_nope, v = self.wkv_b(latent).view(batch, seq, self.n_heads, -1).split([self.nope, self.v_dim], -1)
        rotate = kernels_for(x.device).rope
        q_rope, k_rope = rotate(q_rope, *rope), rotate(k_rope.unsqueeze(2), *rope)
        q = torch.cat((q_nope, q_rope), -1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, self.n_heads, -1)), -1)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.contiguous().transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """swiglu: w_down(silu(gate) * up) with [gate, up] = w_gate_up x; gelu: w_down(gelu(w_up x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":  # gate and up in one GEMM, rows interleaved (models/fused.py), output as halves
            self.w_gate_up = Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, paired=True)
        else:
            self.w_up = Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.w_down = Linear(cfg.ffn_hidden_size, cfg.hidden_size)
        self.enter = nn.Identity()  # tensor parallelism puts its region entry here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        if self.kind == "swiglu":
            return self.w_down(kernels_for(x.device).swiglu_packed(self.w_gate_up(x)))
        return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); `mlp` is the experts in MoE blocks
    (`cfg.is_moe_layer(layer)`, models/moe.py)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg, layer) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class TokenPredictor(nn.Module):
    """DeepSeek-V3's multi-token prediction module k: h_k = block(proj([norm(h_{k-1}); norm(embed(t_{i+k}))])) over
    the positions that still have token i + k, then its own final norm and the shared head predict t_{i+k+1}."""

    def __init__(self, cfg: ModelConfig, k: int):
        super().__init__()
        self.hidden_norm, self.embed_norm = make_norm(cfg), make_norm(cfg)
        self.proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.block = Block(cfg, cfg.n_layers + k - 1)  # MoE or dense as a block after the last one would be
        self.norm = make_norm(cfg)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope, mask) -> torch.Tensor:
        return self.block(self.proj(torch.cat((self.hidden_norm(h), self.embed_norm(embedded)), -1)), rope, mask)


def future_targets(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """(depth + 1, b, s): the targets j = 0 .. depth positions further on, -1 past the sequence's end."""
    padded = F.pad(targets, (0, depth), value=-1)
    return torch.stack([padded[:, j : j + targets.shape[1]] for j in range(depth + 1)])


class Transformer(nn.Module):
    """The decoder, or the slice of it that one pipeline stage holds."""

    def __init__(self, cfg: ModelConfig, stage: StageSpec | None = None):
        super().__init__()
        self.cfg = cfg
        self.stage = stage or StageSpec.whole(cfg)
        # Hooks for tensor parallelism (identity / plain on one device): see parallel/tensor.py.
        self.embed_exit = nn.Identity()  # SP: keep this rank's sequence chunk after the embedding
        self.head_entry = nn.Identity()  # f or SP all-gather before the vocab-parallel head
        self.seq_shards = 1  # SP: hidden states hold seq_len / seq_shards positions
        self.loss_fn = CrossEntropy(cfg.vocab_size)  # vocab-parallel under tp
        self.fused_loss = True  # forward(..., targets): the head and the loss fused (models/fused_loss.py)
        self.document_eod: int | None = None  # set: attention and positions restart after each EOD token
        self.context = None  # context parallelism (`set_context`): global positions and attention across cp
        if self.stage.has_embedding or (self.stage.has_head and cfg.mtp_depth):  # MTP embeds tokens again
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if self.stage.has_embedding:
            if cfg.position == "learned":
                self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
            self.embed_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, i) for i in range(self.stage.first_layer, self.stage.last_layer)}
        )
        if self.stage.has_head:
            self.norm = make_norm(cfg)
            self.output = Linear(cfg.hidden_size, cfg.vocab_size)
            if cfg.mtp_depth:  # beside the head, sharing it and the embedding (or its copy: pp > 1)
                self.mtp = nn.ModuleDict({str(k): TokenPredictor(cfg, k) for k in range(1, cfg.mtp_depth + 1)})
        self.mtp_weight = 0.3  # train.mtp_loss_weight (assembly sets it)
        self.mtp_losses: torch.Tensor | None = None  # each depth's loss summed over forwards (metrics), detached
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head (again after `to_empty`, which gives each module its own tensor)."""
        if self.cfg.tie_embeddings and self.stage.has_head and hasattr(self, "tok_embeddings"):
            self.output.weight = self.tok_embeddings.weight

    def set_context(self, context) -> None:
        """Context parallelism: `context.positions(local_len, device)` gives the global positions of this
        rank's tokens and `context(q, k, v)` is the attention across the cp group (`parallel/context.py`)."""
        self.context = context
        for block in self.layers.values():
            block.attn.context = context
            if isinstance(block.mlp, MoE):  # routes this rank's chunks; the aux loss's f_e spans the cp group
                block.mlp.cp = context.cp
        for predictor in getattr(self, "mtp", {}).values():
            predictor.block.attn.context = context
            if isinstance(predictor.block.mlp, MoE):
                predictor.block.mlp.cp = context.cp

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.cfg.position == "learned":
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos_embeddings(positions)
        return self.embed_dropout(self.embed_exit(h))

    def forward(
        self, inputs: torch.Tensor, tokens: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (batch, seq) int64 on the first stage, else hidden (batch, seq, h) -> logits or hidden.
        `tokens`: the micro-batch's token ids (the whole sequence, also under sequence parallelism), which a
        later stage needs for document masking; the first stage reads them from `inputs`. `targets` (last
        stage): return the mean loss instead of the logits (`head`)."""
        positions = allowed = mask = None
        if self.document_eod is not None:
            tokens = inputs if tokens is None and self.stage.has_embedding else tokens
            if tokens is None:
                raise ValueError("document masking: a stage without the embedding needs forward(hidden, tokens)")
            positions, allowed = document_layout(tokens, self.document_eod)
        elif self.context is not None:  # (seq / cp,) global positions; SP shards come after the embedding
            local = inputs.shape[1] * (1 if self.stage.has_embedding else self.seq_shards)
            positions = self.context.positions(local, inputs.device)
        h = self.embed(inputs, positions) if self.stage.has_embedding else inputs
        if allowed is not None:
            mask = additive_mask(allowed, h.dtype)
        rope = None
        if self.cfg.position == "rope":
            cp = self.context.cp.size if self.context is not None else 1
            rope = rope_tables(h.shape[1] * self.seq_shards * cp, self.cfg.rope_dim, self.cfg.rope_theta, h.device)
            if positions is not None:
                rope = (rope[0][positions], rope[1][positions])  # (batch or none, seq, head_dim / 2)
        h = self.run_blocks(h, rope, mask)
        if not self.stage.has_head:
            return h
        loss = self.head(h, targets)
        if targets is not None and self.cfg.mtp_depth and self.training:
            loss = self.predict_further(loss, h, targets, rope, mask)
        return loss

    def predict_further(self, loss: torch.Tensor, h: torch.Tensor, targets: torch.Tensor, rope, mask) -> torch.Tensor:
        """Multi-token prediction: at position i depth k embeds t_{i+k} and predicts t_{i+k+1}. As Megatron does,
        every depth runs over all s positions, its tokens and labels rolled k further (`future_targets`), and
        the last k positions, which have no label, leave the loss; causal attention keeps them out of the other
        positions, so this equals DeepSeek-V3's shortened sequences, and keeps the layout of tp's, SP's and
        cp's shards. The mean of the depths' losses joins the gradient with `mtp_weight` (`AddedLoss`); the
        returned (logged) loss stays the next-token one."""
        seq = targets.shape[1] * (self.context.cp.size if self.context is not None else 1)
        shifted = (
            self.context.future_targets(targets, len(self.mtp))
            if self.context is not None
            else future_targets(targets, len(self.mtp))
        )
        losses = []
        for k, predictor in enumerate(self.mtp.values(), start=1):
            embedded = self.embed_exit(self.tok_embeddings(shifted[k - 1].clamp(min=0)))  # t_{i+k}; SP: this shard
            h = predictor(h, embedded, rope, mask)
            # each rank's mean over its labelled positions (a prefix of its own: known on the host, no sync),
            # weighted so that the mean over cp is the global one
            s_local = targets.shape[1]
            keep = self.context.labelled(s_local, k) if self.context is not None else s_local - k
            losses.append(self.head(h, shifted[k], predictor.norm, keep) * (keep * seq / (s_local * (seq - k))))
        extra = torch.stack(losses)
        if torch._C._current_graph_task_id() == -1:  # not a recompute in backward
            self.mtp_losses = extra.detach() if self.mtp_losses is None else self.mtp_losses + extra.detach()
        return AddedLoss.apply(loss, extra.mean(), self.mtp_weight)

    def head(
        self,
        h: torch.Tensor,
        targets: torch.Tensor | None = None,
        norm: nn.Module | None = None,
        keep: int | None = None,
    ) -> torch.Tensor:
        """Final norm (`norm`: a prediction module's own), the tp region entry, then the logits; with `targets`
        the mean loss (over the first `keep` positions only, when given): fused (the logits never held) when
        `fused_loss`, else `loss_fn` on the logits."""
        h = self.head_entry((norm or self.norm)(h))
        if targets is None:
            return self.output(h)
        if keep is not None:
            h, targets = h[:, :keep], targets[:, :keep]
        if self.fused_loss:
            return self.loss_fn.fused(h, self.output.weight, targets)
        return self.loss_fn(self.output(h), targets)

    def run_blocks(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The blocks in order. Recompute policies (`memory/recompute.py`) replace this on the instance to run
        them in checkpointed segments, calling each block as a module (so its hooks, e.g. FSDP2's, run)."""
        for block in self.layers.values():
            h = block(h, rope, mask)
        return h
