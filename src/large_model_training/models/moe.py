"""Mixture-of-Experts MLP on one device: a top-k router over E swiglu experts, plus optional shared experts.

Design (after Megatron-Core's `transformer/moe/` and torchtitan's MoE, no code copied):
  - Router: scores = softmax or sigmoid of `router.weight @ x` (fp32). The top-k experts are chosen on
    scores + `expert_bias`, but the gates are the scores themselves (DeepSeek-V3: the bias chooses, it never
    weights); sigmoid gates are renormalised to sum to 1 over the chosen k, softmax gates when moe_norm_topk.
  - Experts: stacked weights `experts.w_gate`/`w_up` (E, f, h) and `w_down` (E, h, f), so parameter names stay
    layout-free. Token copies are sorted by expert and run as grouped GEMMs (the device's kernel, kernels.py:
    `F.grouped_mm` with int32 end offsets on CPU / CUDA) where the kernel accepts the dtype and strides, else as
    a loop over experts: same numbers.
  - Load balancing: the Switch loss E * sum_e f_e P_e over the micro-batch's tokens (f_e the share of token
    copies routed to e, P_e its mean score), whose gradient enters in backward through `AuxLossScaler` (the
    trick of Megatron's MoEAuxLossAutoScaler): activations pass unchanged, so pipeline stages need no extra
    loss wiring. The expert bias is moved by the trainer once per optimizer step from the counts gathered here.
  - Dropless unless `moe_capacity_factor` > 0: then each expert keeps its first ceil(cf T k / E) copies.
Expert parallelism (parallel/expert.py) keeps E / ep experts per rank and dispatches the kept copies to them
after routing and capacity, so routing, drops and the aux loss are those of ep = 1. Under tensor parallelism
(sequence parallelism required) the block runs on this rank's sequence shard, replicated weights, tp-partial
gradients; only the aux loss's f_e is summed over tp. Statistics (this rank's tokens) for metrics and the bias
update accumulate on the module over a step's micro-batches (training forwards only) until the trainer reads
and clears them (`take_stats`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from large_model_training.config import ModelConfig
from large_model_training.kernels import kernels_for
from large_model_training.models.linear import Linear


class AuxLossScaler(torch.autograd.Function):
    """Identity on the activations; in backward also feeds `scale` as the aux loss's gradient, so the aux loss
    is optimised without being added to the (pipeline's) scalar loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_output, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the device's grouped GEMM (kernels.py) runs x (N, K) @ weight (E, K, M): on CPU F.grouped_mm in fp32
    or bf16, on CUDA in bf16 on Hopper+, every row stride a multiple of 16 bytes; Ascend's in fp16 / bf16."""
    return kernels_for(x.device).grouped_mm_fits(x, weight)


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Rows of x sorted by expert, expert e owning rows [ends[e-1], ends[e]); weight (E, out, in) -> (N, out)."""
    w = weight.transpose(1, 2)  # (E, in, out)
    if is_fake(x):  # `lmt rehearse`: fake kernels know no fp32 grouped GEMM and the loop needs the counts;
        return x @ w[0]  # a stand-in with the same shapes (activations, gradients), which is what it measures
    if grouped and x.shape[0]:  # no rows at all (an ep rank that receives none): its backward fails, loop
        return kernels_for(x.device).grouped_mm(x, w, ends)
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([rows @ w_e for rows, w_e in zip(x.split(counts), w.unbind(0))])


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.top_k = cfg.moe_router, cfg.moe_top_k
        self.renormalise = cfg.moe_router == "sigmoid" or cfg.moe_norm_topk
        self.groups, self.topk_groups, self.scale = cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_routed_scale
        self.weight = nn.Parameter(torch.empty(cfg.moe_experts, cfg.hidden_size))
        # A buffer, not a parameter: no gradient, no optimizer state, but checkpoints keep it.
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, h) -> scores (T, E) fp32, chosen experts (T, k), gates (T, k) fp32."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.kind == "softmax" else logits.sigmoid()
        chosen = torch.topk(self.group_limited(scores.detach() + self.expert_bias), self.top_k, dim=-1).indices
        gates = scores.gather(-1, chosen)
        if self.renormalise:
            gates = gates / gates.sum(-1, keepdim=True)
        return scores, chosen, gates * self.scale if self.scale != 1.0 else gates

    def group_limited(self, biased: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's node-limited routing: each token keeps the `topk_groups` expert groups whose two best
        (biased) scores sum highest; the other groups' experts are -inf, so top-k never picks them (a group is
        a node's experts under ep, bounding the nodes a token's dispatch reaches)."""
        if self.groups == 1:
            return biased
        grouped = biased.view(biased.shape[0], self.groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1)  # (T, groups)
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(biased)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (an expert's gradient under ep sums ep data shards)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class Experts(nn.Module):
    """The routed experts' stacked weights: all E of them, or under expert parallelism (`shard`) this ep rank's
    E / ep, whose token copies `dispatch` (parallel/expert.py) brings here and takes back."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, f, h = cfg.moe_experts, cfg.expert_ffn, cfg.hidden_size
        self.n_experts, self.ep_size, self.ep_rank = e, 1, 0
        self.dispatch: Callable | None = None  # under ep: the exchange around `compute` (parallel/expert.py)
        self.w_gate = nn.Parameter(torch.empty(e, f, h))
        self.w_up = nn.Parameter(torch.empty(e, f, h))
        self.w_down = nn.Parameter(torch.empty(e, h, f))
        self.use_grouped_mm = True  # tests turn it off to compare with the loop
        self.rows = 0  # token copies this rank's experts computed since the last reset (the ep straggler)

    def shard(self, ep_size: int, ep_rank: int, dispatch) -> None:
        """Keep experts [ep_rank E/ep, (ep_rank+1) E/ep) (on meta, before materialising); `dispatch(x, counts,
        compute)` exchanges the copies with the other ep ranks around `compute` (this rank's experts)."""
        local = self.n_experts // ep_size
        for name in ("w_gate", "w_up", "w_down"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty((local, *full.shape[1:]), device=full.device)))
        self.ep_size, self.ep_rank, self.dispatch = ep_size, ep_rank, dispatch

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.n_experts, *getattr(self, name).shape[1:])

    def local_region(self, name: str) -> tuple[tuple[int, int], ...]:
        shape = getattr(self, name).shape
        return ((self.ep_rank * shape[0], (self.ep_rank + 1) * shape[0]), *((0, n) for n in shape[1:]))

    def forward(self, x: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """x: copies sorted by (global) expert, `ends` their cumulative counts, `counts` the counts (ep > 1)."""
        if self.dispatch is not None:
            return self.dispatch(x, counts, self.compute)
        return self.compute(x, ends)

    def compute(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """This rank's experts on rows sorted by local expert (`ends`: cumulative rows per local expert)."""
        weights = [self.w_gate, self.w_up, self.w_down]
        if self.ep_size > 1:
            weights = [ScaleGrad.apply(w, 1.0 / self.ep_size) for w in weights]
        if torch._C._current_graph_task_id() == -1:  # not a recompute in backward
            self.rows += x.shape[0]
        w_gate, w_up, w_down = weights
        grouped = (
            self.use_grouped_mm
            and grouped_mm_fits(x, w_gate.transpose(1, 2))
            and grouped_mm_fits(x.new_empty(0, w_down.shape[2]), w_down.transpose(1, 2))
        )
        hidden = kernels_for(x.device).swiglu(
            expert_matmul(x, w_gate, ends, grouped), expert_matmul(x, w_up, ends, grouped)
        )
        return expert_matmul(hidden, w_down, ends, grouped)


class SharedExperts(nn.Module):
    """The shared experts as one dense swiglu (their widths side by side), run by every token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        f = cfg.expert_ffn * cfg.moe_shared_experts
        self.w_gate_up = Linear(cfg.hidden_size, 2 * f, paired=True)  # one GEMM, rows interleaved (models/fused.py)
        self.w_down = Linear(f, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(kernels_for(x.device).swiglu_packed(self.w_gate_up(x)))


class MoE(nn.Module):
    """The MLP of an MoE block: (batch, seq, h) -> (batch, seq, h).

    Under --compile the layer runs eagerly inside its compiled block (the attention half compiles): its
    statistics are Python state updated per forward (dynamo would guard on them and compile again every
    step), the loop over experts and the ep exchange take their sizes from the host, and a traced run of it
    gave a step-1 gradient norm 0.2% off eager's: not faithful, so not traced."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_experts, self.top_k = layer, cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor, self.aux_coef = cfg.moe_capacity_factor, cfg.moe_aux_loss_coef
        self.per_sequence = cfg.moe_aux_loss_scope == "sequence"
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared = SharedExperts(cfg) if cfg.moe_shared_experts else None
        self.aux_grad_scale = 1.0  # the trainer sets 1 / micro-batches, the scale the LM loss gets
        # The groups (AxisGroup) holding the micro-batch's other token shards, each routed on its own rank (the aux
        # loss's f_e spans them): tp under SP, cp (its zig-zag chunks); set by parallel/tensor.py and set_context.
        self.tp: Any = None
        self.cp: Any = None
        self.reset_stats()

    def reset_stats(self) -> None:
        """Tensors on the activations' device (no host sync per forward); None until the first forward."""
        self.counts = self.aux_sum = self.dropped = None  # copies routed per expert, aux summed, copies dropped
        self.forwards = 0
        self.experts.rows = 0

    def take_stats(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
        """(copies per expert, summed aux loss, copies dropped, training forwards) since the last call."""
        stats = (self.counts, self.aux_sum, self.dropped, self.forwards)
        self.reset_stats()
        return stats

    def _accumulate(self, counts: torch.Tensor, aux: torch.Tensor, dropped: torch.Tensor) -> None:
        if self.counts is None:
            self.counts, self.aux_sum, self.dropped = counts, aux, dropped
        else:
            self.counts, self.aux_sum, self.dropped = self.counts + counts, self.aux_sum + aux, self.dropped + dropped
        self.forwards += 1

    def aux_loss(self, scores: torch.Tensor, counts: torch.Tensor, shards: int = 1) -> torch.Tensor:
        """Switch: E * sum_e f_e P_e; 1 when balanced. Sigmoid scores are normalised per token first.
        Under sequence or context parallelism (`shards` = the tp x cp ranks holding the micro-batch's tokens,
        `counts` summed over them) this rank's part: E * sum_e f_e (its tokens' summed P_te) / T; the parts add
        up to the micro-batch's loss, and their router gradients to its gradient.

        Sequence-wise (DeepSeek-V3), `scores` (b, s, E) and `counts` (b, E): the same loss per sequence, over its
        s tokens (s / shards on this rank), averaged over the b sequences."""
        probs = scores if self.router.kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        share = counts.float() / counts.sum(-1, keepdim=True)
        if shards == 1:
            per_unit = self.n_experts * (share * probs.mean(-2)).sum(-1)
        else:
            per_unit = self.n_experts * (share * probs.sum(-2)).sum(-1) / (scores.shape[-2] * shards)
        return per_unit.mean() if self.per_sequence else per_unit

    @torch.compiler.disable  # --compile: eager, see the note below
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens = x.shape[0]
        scores, chosen, gates = self.router(x)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # copies grouped by expert, in token order within one
        # scatter_add, not bincount: a static output shape, which `lmt rehearse`'s fake tensors need
        counts = flat.new_zeros(self.n_experts).scatter_add_(0, flat, torch.ones_like(flat))
        kept_counts = counts
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)
            starts = torch.cumsum(counts, 0) - counts
            sorted_expert = flat[order]
            keep = torch.arange(order.numel(), device=x.device) - starts[sorted_expert] < capacity
            order = order[keep]
            kept_counts = counts.clamp(max=capacity)
        ends = torch.cumsum(kept_counts, 0)
        token = order // self.top_k
        out = self.experts(x[token], ends, kept_counts) * gates.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, token, out)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.training:
            unit_scores, unit_counts = scores, counts  # the tokens f_e and P_e are taken over
            if self.per_sequence:
                unit_scores = scores.view(shape[0], -1, self.n_experts)
                unit_counts = flat.new_zeros(shape[0], self.n_experts).scatter_add_(
                    1, chosen.view(shape[0], -1), torch.ones_like(chosen).view(shape[0], -1)
                )
            groups = [g for g in (self.tp, self.cp) if g is not None and g.size > 1]
            if groups:  # f_e over the whole micro-batch or sequence (no gradient)
                unit_counts = unit_counts.clone()
            for group in groups:
                group.count_all_reduce(unit_counts)
                torch.distributed.all_reduce(unit_counts, group=group.group)
            aux = self.aux_loss(unit_scores, unit_counts, math.prod(g.size for g in groups))
            # A forward re-run in backward (activation recompute: a graph task is running) routes the same
            # tokens again: its statistics are not counted twice.
            if torch._C._current_graph_task_id() == -1:
                self._accumulate(counts.detach(), aux.detach(), (counts - kept_counts).sum().detach())
            if self.aux_coef > 0 and torch.is_grad_enabled():
                # Each shard's part adds up to the loss: tp sums the router's partial gradients, cp averages them
                # (its ranks are part of the gradient group), so a cp rank's part counts cp times.
                cp = self.cp.size if self.cp is not None else 1
                y = AuxLossScaler.apply(y, aux, self.aux_coef * self.aux_grad_scale * cp)
        return y.reshape(shape)
