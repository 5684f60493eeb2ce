"""Mixture-of-Experts terms in the planner: which ep degrees to search, what an MoE block holds and saves on a rank,
how long its MLP takes and what the all-to-all costs, as the runtime runs expert parallelism.

The runtime (models/moe.py, expert parallelism carved from dp): an MoE block's router scores its tokens, each token
goes to k of the E experts (plus the shared ones, which every token runs); with ep > 1 the experts of each MoE
block are split over the ep ranks of an expert group carved from the data-parallel ranks (E/ep each), the token
copies are dispatched to the rank holding their expert and combined back with all_to_all_single. Expert gradients
are reduced over the expert-data-parallel group (edp = dp/ep, times cp), dense ones over dp x cp; ZeRO 1/2 shard
expert optimizer states (and ZeRO-2 gradients) over edp. With tp > 1 MoE needs sequence parallelism: the router,
the experts and the shared experts are replicated over tp and each tp rank routes its own n/t tokens (no tp
collective in an MoE MLP), so their gradients are also summed over tp. ZeRO-3 is refused for MoE.

Notation: n = s/cp x b tokens of a micro-batch, T = n/t the tokens a rank routes (SP), k = moe_top_k, E experts of
width f (expert_ffn), S shared experts (width S f), h hidden, B activation bytes.

  parameters   per MoE block on a rank: E/ep x 3 h f (experts) + E h (router) + 3 h S f (shared); the dense part
               (attention, norms, dense blocks' MLP / t, embedding, head) as for a dense model. Blocks are counted
               per chunk (the first `moe_first_dense` blocks are dense).
  activations  what an MoE block's MLP saves, in place of the dense 4 n (f/t) B (tests/test_planner_moe.py
               measures it with the saved-tensor hooks): router: fp32 copy of its input (bf16 only), scores 4 T E,
               chosen experts 8 T k, renormalised gates 4 T (k + 1); dispatch: sort order and token index 16 T k,
               the dispatched copies T k h B (the received ones under ep), the expert hidden 4 T k f B (gate,
               silu, up, product), the expert output T k h B, its gates T k B and the gated output T k h B (which
               index_add_ saves to combine); shared experts 4 T S f B.
               Balanced routing: every ep rank receives T k copies. Recomputation: held as a dense block; a rebuilt
               block (full, every:K) rebuilds this too. Zero-bubble W: experts are grouped GEMMs outside
               models/linear.py, so their weight gradients run in B; only the shared experts' wait for W.
  time         active FLOPs: the router (fp32, as the runtime computes it), k experts per token as grouped GEMMs of
               T k rows over E/ep weight sets (the catalogue's GEMM efficiency: no grouped-GEMM calibration yet) and
               the shared experts; permutation, swiglu and combine memory-bound; all-to-all: dispatch and combine,
               forward and backward, T k h B bytes each of which (ep-1)/ep leave the rank, not overlapped
               (all_to_all_bytes: 4 T k h B (ep-1)/ep per MoE block and micro-batch); full recomputation runs the
               dispatch and combine again. The ep group is ep consecutive dp ranks (tp, then cp, innermost): its
               peers in the same node are reached over the intra-node link, the others over the inter-node link,
               concurrently (the slower share decides).
  step         expert gradients reduced over edp (all-reduce, or reduce-scatter under ZeRO 1/2) and, with tp > 1,
               summed over tp; ZeRO 1/2 gather the updated experts over edp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from large_model_training.choices import bf16_compute, splits_backward
from large_model_training.config import ModelConfig
from large_model_training.layout import Job, Layout
from large_model_training.planner.eager_ops import mlp_bytes
from large_model_training.planner.overlap import overlapped


def ep_degrees(cfg: ModelConfig, dp: int, fixed: int | None = None) -> list[int]:
    """The ep degrees to search for dp data-parallel ranks: divisors of dp that divide the experts (MoE only);
    a fixed --ep is passed through for `layout_problems` to judge."""
    if fixed:
        return [fixed]
    if not cfg.moe_experts:
        return [1]
    return [e for e in range(1, dp + 1) if dp % e == 0 and cfg.moe_experts % e == 0]


def dense_view(cfg: ModelConfig) -> ModelConfig:
    """The model with its MoE blocks' MLPs taken as dense ones (what the per-block dense formulas describe)."""
    return replace(cfg, moe_experts=0) if cfg.moe_experts else cfg


def chunk_moe_layers(cfg: ModelConfig, chunks: list[int]) -> list[int]:
    """MoE blocks in each virtual stage (chunks: blocks per virtual stage, in model order)."""
    out, start = [], 0
    for c in chunks:
        out.append(sum(cfg.is_moe_layer(i) for i in range(start, start + c)))
        start += c
    return out


def expert_group(layout: Layout) -> int:
    """Ranks that hold the same experts and reduce their gradients: edp = dp / ep (times cp)."""
    return layout.dp // layout.ep * layout.cp


def expert_parameters(cfg: ModelConfig, ep: int) -> int:
    """One MoE block's routed-expert parameters on a rank: E/ep experts of 3 h f (replicated over tp)."""
    return cfg.moe_experts // ep * 3 * cfg.hidden_size * cfg.expert_ffn


def replicated_parameters(cfg: ModelConfig) -> int:
    """One MoE block's router and shared experts (on every ep rank, replicated over tp)."""
    return cfg.moe_experts * cfg.hidden_size + 3 * cfg.hidden_size * cfg.expert_ffn * cfg.moe_shared_experts


def routed_tokens(job: Job, layout: Layout) -> int:
    """T: tokens of one micro-batch a rank routes (its sequence shard under SP)."""
    n = job.seq_len // layout.cp * layout.micro_batch_size
    return n // (layout.tp if layout.sequence_parallel else 1)


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, ep: int, dtype_bytes: int) -> float:
    """Bytes one rank sends per MoE block for `tokens` routed tokens: dispatch and combine, forward and backward,
    of the T k h B token copies, (ep-1)/ep of which go to other ranks: 4 T k h B (ep-1)/ep."""
    return 4.0 * tokens * top_k * hidden * dtype_bytes * (ep - 1) / ep


def ep_bytes_per_step(job: Job, layout: Layout, moe_layers: int) -> float:
    """comm_bytes_ep of one step on a rank running `moe_layers` MoE blocks: every micro-batch's all-to-alls."""
    B = 2 if bf16_compute(job.precision) else 4
    tokens = routed_tokens(job, layout) * job.micro_batches(layout)
    return moe_layers * all_to_all_bytes(tokens, job.model.moe_top_k, job.model.hidden_size, layout.ep, B)


# ---- activations ----------------------------------------------------------------------------------------------


def moe_mlp_activation_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> float:
    """Bytes an MoE block's MLP saves for backward for `tokens` routed tokens (module docstring)."""
    T, k, h, f, B = tokens, cfg.moe_top_k, cfg.hidden_size, cfg.expert_ffn, dtype_bytes
    router = (4 * T * h if B != 4 else 0) + 4 * T * cfg.moe_experts + 8 * T * k
    if cfg.moe_router == "sigmoid" or cfg.moe_norm_topk:
        router += 4 * T * (k + 1)  # the division by the gates' sum saves both
    dispatch = 16 * T * k + T * k * h * B  # sort order, token index; the dispatched copies
    experts = 4 * T * k * f * B + 2 * T * k * h * B + T * k * B  # gate, silu, up, product; output, weighted, gates
    shared = 4 * T * f * cfg.moe_shared_experts * B
    return float(router + dispatch + experts + shared)


def dense_mlp_activation_bytes(cfg: ModelConfig, tokens: int, tp: int, dtype_bytes: int) -> float:
    """What a dense block's MLP saves (activations.layer_activation_terms' `mlp`): n tokens, f/t wide."""
    return (4 if cfg.mlp == "swiglu" else 2) * tokens * (cfg.ffn_hidden_size // tp) * dtype_bytes


@dataclass(frozen=True)
class ChunkDelta:
    """What a chunk's MoE blocks add to the dense formulas' ChunkActivations (may be negative)."""

    held: float = 0.0
    pending: float = 0.0
    in_backward: float = 0.0


def chunk_delta(job: Job, layout: Layout, moe_layers: int, dtype_bytes: int, split: bool) -> ChunkDelta:
    """A chunk with `moe_layers` MoE blocks against the same chunk of dense blocks (what the activation formulas
    count), one micro-batch: held and rebuilt by the recompute policy; between B and W (split backward)."""
    if not moe_layers:
        return ChunkDelta()
    cfg, t, B = job.model, layout.tp, dtype_bytes
    n = job.seq_len // layout.cp * layout.micro_batch_size
    T = routed_tokens(job, layout)
    diff = moe_mlp_activation_bytes(cfg, T, B) - dense_mlp_activation_bytes(cfg, n, t, B)
    kind = layout.recompute.kind
    if kind in ("none", "selective"):
        held, rebuilt = moe_layers * diff, moe_layers * diff
    else:  # one block (full) or one segment of K blocks (every:K) rebuilt at a time
        held, rebuilt = 0.0, min(moe_layers, 1 if kind == "full" else layout.recompute.every) * diff
    pending = 0.0
    if split:  # the shared experts' linears wait for W; the dense MLP's (input, hidden, gradients) do not exist
        r = t if layout.sequence_parallel else 1
        f_s = cfg.expert_ffn * cfg.moe_shared_experts
        pending = 3 * T * f_s * B - 3 * n * (cfg.ffn_hidden_size // t) * B
        if not cfg.moe_shared_experts:
            pending -= 2 * n * cfg.hidden_size * B / r  # no w_down output gradient, no MLP input for W
        pending *= moe_layers
    return ChunkDelta(held, pending, rebuilt)


def transient_bytes(job: Job, layout: Layout, dtype_bytes: int) -> float:
    """In flight with ep > 1: the permuted send buffer of a dispatch while the received copies fill (T k h B)."""
    if layout.ep == 1 or not job.model.moe_experts:
        return 0.0
    return float(routed_tokens(job, layout) * job.model.moe_top_k * job.model.hidden_size * dtype_bytes)


# ---- time -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchKernel:
    """How an all-to-all kernel uses the links: the fraction of each link's bandwidth it reaches, and whether a
    token's copies bound for one node cross the inter-node link once (then NVLink inside that node)."""

    intra: float
    inter: float
    node_dedup: bool
    overlap: bool = False
    """The all-to-alls run beside another micro-batch's compute (DualPipe), taking SMs from it (planner/overlap.py)."""


# nccl: torch.distributed.all_to_all_single, what the runtime runs (parallel/expert.py): NCCL's all-to-all is
#   point-to-point sends to every peer, without the ring's pipelining; 0.75 of a link on either side is an
#   assumption (nccl-tests' alltoall bus bandwidth on NVSwitch and InfiniBand nodes is reported well below the
#   ring collectives'). deepep: DeepEP's README (deepseek-ai/DeepEP, H800, normal kernels): intranode dispatch
#   153 GB/s and combine 158 GB/s over NVLink (of the H800's 200 GB/s per direction: 0.77), internode 43-47 GB/s
#   of a 50 GB/s CX7 NIC (0.9), tokens sent once per node over RDMA and forwarded over NVLink (DeepSeek-V3
#   section 3.2.2, with node-limited routing: at most moe_topk_groups nodes per token). deepep-dualpipe: DeepEP
#   under DualPipe (DeepSeek-V3 section 3.2.1): each forward chunk is paired with a backward chunk of another
#   micro-batch, so "both all-to-all and PP communication can be fully hidden during execution", the
#   communication kernels holding 20 of the H800's 132 SMs: a block takes the longer of its compute (slowed by
#   the SMs the collectives hold) and its all-to-alls.
DISPATCH_KERNELS = {
    "nccl": DispatchKernel(0.75, 0.75, False),
    "deepep": DispatchKernel(0.77, 0.9, True),
    "deepep-dualpipe": DispatchKernel(0.77, 0.9, True, overlap=True),
}


def remote_node_copies(cfg: ModelConfig, nodes: int) -> float:
    """Expected nodes other than its own a token's k copies reach when each node gets one copy (node_dedup):
    k experts spread evenly over `nodes` nodes reach nodes (1 - (1 - 1/nodes)^k) of them, at most
    moe_topk_groups under group-limited routing; (nodes - 1)/nodes of them are remote."""
    k = cfg.moe_top_k
    reached = nodes * (1 - (1 - 1 / nodes) ** k)
    if cfg.moe_groups > 1:
        reached = min(reached, cfg.moe_topk_groups)
    return reached * (nodes - 1) / nodes


def all_to_all_time(nbytes: float, layout: Layout, hw, devices_per_node: int, kernel=None, cfg=None) -> float:
    """One all-to-all of `nbytes` per rank over the ep group: (ep-1)/ep of it leaves the rank; peers in the same
    node over the intra-node link, the others over the inter-node one, concurrently, each at the kernel's share
    of the link (`kernel`: a DispatchKernel, default nccl's); a node-deduplicating kernel sends each token once
    per remote node (`cfg` gives k and the node limit)."""
    ep, kernel = layout.ep, kernel or DISPATCH_KERNELS["nccl"]
    if ep == 1:
        return 0.0
    stride = layout.tp * layout.cp  # ep consecutive dp ranks, tp and cp innermost
    local = max(1, min(ep, devices_per_node // stride))  # ep ranks in one node (this one included)
    intra = nbytes * (local - 1) / ep / (hw.intra_node_bandwidth * kernel.intra)
    remote = nbytes * (ep - local) / ep
    if kernel.node_dedup and cfg is not None and local < ep:  # nbytes is k copies of each token
        remote = nbytes / cfg.moe_top_k * remote_node_copies(cfg, ep // local)
    inter = remote / (hw.inter_node_bandwidth * kernel.inter)
    latency = hw.inter_node_latency if local < ep else hw.intra_node_latency
    return latency + max(intra, inter)


@dataclass(frozen=True)
class MlpTimes:
    """One block's MLP, one micro-batch: forward, backward (B only when split), W (split only)."""

    forward: float
    backward: float
    weight: float
    beside: float = 0.0
    """All-to-all seconds per direction that run beside the compute (an overlapping kernel) instead of in it."""


def dense_mlp_times(
    cfg: ModelConfig, tokens: int, tp: int, hw, precision: str, gemm, tp_one: float, regather: float, split: bool
) -> MlpTimes:
    """The dense MLP's share of timing._block_times: its GEMMs, swiglu/gelu traffic, its tp collective pair and
    (lean SP) the regather of its input, as that function counts them."""
    B, h, f = (2 if bf16_compute(precision) else 4), cfg.hidden_size, cfg.ffn_hidden_size // tp
    first = gemm(hw, precision, tokens, f, h)
    gemms = (2 if cfg.mlp == "swiglu" else 1) * first + gemm(hw, precision, tokens, h, f)
    # as timing._block_times counted them: op by op on an accelerator (eager_ops), one pass on a calibrated CPU
    once = (5 if cfg.mlp == "swiglu" else 2) * tokens * f * B
    elem_f, elem_b = mlp_bytes(cfg.mlp, tokens, f, cfg.hidden_size, B) if hw.fused_kernels else (once, 2.0 * once)
    forward = gemms + elem_f / hw.stream_bandwidth + tp_one
    backward = gemms + elem_b / hw.stream_bandwidth + tp_one
    if split:
        return MlpTimes(forward, backward, gemms + regather)
    return MlpTimes(forward, backward + gemms + max(0.0, regather - first), 0.0)


def moe_mlp_times(job: Job, layout: Layout, hw, devices_per_node: int, gemm, split: bool) -> MlpTimes:
    """An MoE block's MLP on one rank (module docstring): router, grouped expert GEMMs, shared experts,
    memory-bound permutation and combine, and the four all-to-alls."""
    cfg, prec = job.model, job.precision
    B, h, f, k = (2 if bf16_compute(prec) else 4), cfg.hidden_size, cfg.expert_ffn, cfg.moe_top_k
    T, local = routed_tokens(job, layout), cfg.moe_experts // layout.ep
    router = gemm(hw, "fp32", T, cfg.moe_experts, h)
    experts = 2 * gemm(hw, prec, T * k, f, h, weights=local) + gemm(hw, prec, T * k, h, f, weights=local)
    f_s = f * cfg.moe_shared_experts
    shared = (2 * gemm(hw, prec, T, f_s, h) + gemm(hw, prec, T, h, f_s)) if f_s else 0.0
    moved = 6 * T * k * h * B + 5 * T * k * f * B + 5 * T * f_s * B + 3 * 4 * T * cfg.moe_experts + T * h * B
    elementwise = moved / hw.stream_bandwidth
    kernel = DISPATCH_KERNELS[job.moe_dispatch]
    a2a = all_to_all_time(T * k * h * B, layout, hw, devices_per_node, kernel, cfg)
    beside, a2a = (2 * a2a, 0.0) if kernel.overlap else (0.0, a2a)
    forward = router + experts + shared + elementwise + 2 * a2a
    backward = 2 * router + 2 * experts + 2 * elementwise + 2 * a2a + shared
    if split:  # the shared experts' weight gradients wait for W; the experts' run in B (grouped GEMMs)
        return MlpTimes(forward, backward, shared, beside)
    return MlpTimes(forward, backward + shared, 0.0, beside)


def moe_block_times(
    job: Job, layout: Layout, hw, devices_per_node: int, dense_block, gemm, tp_one: float, regather: float
) -> MlpTimes:
    """An MoE block's (forward, backward, weight) from the dense block's (`dense_block`: timing.BlockTimes of
    the dense view): its dense MLP taken out, the MoE MLP put in; full and every:K recomputation run the MoE
    forward (all-to-alls included) again in backward."""
    split = splits_backward(layout.schedule)
    n = job.seq_len // layout.cp * layout.micro_batch_size
    dense = dense_mlp_times(job.model, n, layout.tp, hw, job.precision, gemm, tp_one, regather, split)
    moe = moe_mlp_times(job, layout, hw, devices_per_node, gemm, split)
    backward = dense_block.backward - dense.backward + moe.backward
    forward = dense_block.forward - dense.forward + moe.forward
    rebuilt = layout.recompute.kind in ("full", "every", "sac")  # sac: grouped GEMMs are not kept, run again
    if rebuilt:
        backward += moe.forward - dense.forward
    if moe.beside:  # DualPipe: the block's all-to-alls beside the paired micro-batch's compute
        backward = overlapped(backward, moe.beside * (2 if rebuilt else 1), hw)
        forward = overlapped(forward, moe.beside, hw)
    return MlpTimes(forward, backward, dense_block.weight - dense.weight + moe.weight)


def expert_gradient_time(
    layout: Layout,
    hw,
    expert_params: int,
    replicated_params: int,
    g_bytes: int,
    devices_per_node: int,
    collective,
    link,
) -> tuple[float, float]:
    """Per step, (over edp, over tp): the expert gradients reduced over edp (all-reduce; reduce-scatter under ZeRO
    1/2), and with tp > 1 the experts', router's and shared experts' gradients summed over tp (each tp rank routed
    its own tokens); g_bytes per gradient. collective, link: planner.timing's (timing imports this module)."""
    edp, t = expert_group(layout), layout.tp
    over_edp = over_tp = 0.0
    if edp > 1 and expert_params:
        kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
        over_edp = collective(
            kind, expert_params * g_bytes, edp, *link(hw, t * layout.cp * layout.dp, devices_per_node)
        )
    if t > 1 and (expert_params or replicated_params):
        over_tp = collective(
            "all_reduce", (expert_params + replicated_params) * g_bytes, t, *link(hw, t, devices_per_node)
        )
    return over_edp, over_tp
