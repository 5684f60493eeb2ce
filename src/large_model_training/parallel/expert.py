"""Expert parallelism: each MoE block's E experts split over the ep ranks (E / ep each), tokens sent to the rank
that holds their expert and their outputs sent back (Megatron-Core's all-to-all token dispatcher, torchtitan's
expert-parallel MoE; no code copied).

One dispatch, after routing and capacity dropping on the rank's own tokens (so every rank routes, drops and
computes its aux loss exactly as at ep = 1):
  1. the token copies, sorted by global expert, go in ep contiguous runs (rank r holds experts
     [r E/ep, (r+1) E/ep)); the copies per expert are exchanged first (`all_to_all_single` of int64 counts),
     which gives every rank its uneven receive sizes;
  2. `all_to_all_single` with uneven split sizes moves the rows (the list form does not run on gloo); its
     backward is the reverse all-to-all of the gradients (`AllToAll`);
  3. the received rows, ordered by source rank then local expert, are regrouped by local expert for the
     grouped GEMM, and put back in arrival order after it;
  4. the reverse all-to-all returns each copy's output to the rank that owns the token (combine).
Experts that receive no token and ranks that receive none are zero-size splits and empty groups.

Gradient scale: an expert's gradient on its rank sums the copies of ep data shards (the ep group's), so the
expert weights pass through `ScaleGrad(1 / ep)` in forward (models/moe.py): the average over the
expert-data-parallel group (dp / ep ranks) then equals the average over all dp shards, as at ep = 1.

Zero-bubble schedules (zb-h1, zbv): the routed experts' weight gradients are computed in B (grouped GEMMs under
autograd, not `models/linear.py`'s held W); the shared experts and the rest of the block split as usual. The
exchanges run in F and B, in the same action order on every rank of an ep group (same pipeline stage).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from large_model_training.mesh import AxisGroup
from large_model_training.models.moe import MoE


class AllToAll(torch.autograd.Function):
    """Rows of x sent in runs of `send` rows to the ep ranks in order; `recv` rows arrive from each. Backward:
    the reverse exchange. Bytes sent to other ranks are counted on the group (both directions)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: AxisGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group: AxisGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()
    group.bytes += (sum(send) - send[group.rank]) * row
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group.group)
    return out


def dispatch_compute_combine(x: torch.Tensor, counts: torch.Tensor, compute, ep: AxisGroup) -> torch.Tensor:
    """x (N, h): token copies sorted by global expert, `counts` (E,) copies per expert (int64, summing to N).
    `compute(rows, ends)` runs this rank's E / ep experts on rows sorted by local expert (`ends`: cumulative
    rows per local expert). Returns (N, h): each copy's expert output, in x's order."""
    local = counts.numel() // ep.size
    per_rank = counts.view(ep.size, local)
    received = torch.empty_like(per_rank)  # received[r, e]: copies rank r sends to local expert e
    ep.bytes += (ep.size - 1) * local * counts.element_size()
    dist.all_to_all_single(received, per_rank.contiguous(), group=ep.group)
    send, recv = _split_sizes(per_rank, received, x.shape[0], ep.size)
    rows = AllToAll.apply(x, send, recv, ep)  # ordered by (source rank, local expert)
    return AllToAll.apply(_by_local_expert(rows, received, compute), recv, send, ep)


def _split_sizes(per_rank: torch.Tensor, received: torch.Tensor, rows: int, ep: int) -> tuple[list[int], list[int]]:
    """Rows sent to and received from each ep rank: the one host sync of the dispatch. Under `lmt rehearse`
    (fake tensors, no values) balanced routing stands in: rows / ep to and from every rank."""
    if is_fake(per_rank):
        even = [rows // ep + (r < rows % ep) for r in range(ep)]
        return even, even
    send, recv = torch.stack((per_rank.sum(1), received.sum(1))).tolist()
    return send, recv


def _by_local_expert(rows: torch.Tensor, received: torch.Tensor, compute) -> torch.Tensor:
    """`compute` on rows that arrived ordered by (source rank, local expert), `received[r, e]` of them from rank
    r for local expert e: regrouped by local expert for the grouped GEMM, its outputs put back in arrival order."""
    ranks, local = received.shape
    expert_of = (
        torch.arange(local, device=rows.device)
        .repeat(ranks)
        .repeat_interleave(received.reshape(-1), output_size=rows.shape[0])
    )
    order = torch.argsort(expert_of, stable=True)
    out = compute(rows[order], torch.cumsum(received.sum(0), 0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back]


class _Exchange:
    """One asynchronous exchange in flight between `Start` and `Wait` (forward), and its reverse (backward)."""

    def __init__(self, send: list[int], recv: list[int], group: AxisGroup):
        self.send, self.recv, self.group = send, recv, group
        self.work: dist.Work | None = None  # the forward exchange
        self.reverse: dist.Work | None = None  # the gradients' exchange back, and its receive buffer
        self.reversed: torch.Tensor | None = None


def _launch(x: torch.Tensor, send: list[int], recv: list[int], group: AxisGroup):
    out = x.new_empty((sum(recv), *x.shape[1:]))
    group.bytes += (sum(send) - send[group.rank]) * math.prod(x.shape[1:]) * x.element_size()
    work = dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group.group, async_op=True
    )
    return out, work


class Start(torch.autograd.Function):
    """Launches the exchange of x's rows and returns the receive buffer (filled once `Wait` has run). Backward:
    waits for the reverse exchange that `Wait`'s backward launched, and returns its result."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flight: _Exchange) -> torch.Tensor:
        ctx.flight = flight
        out, flight.work = _launch(x, flight.send, flight.recv, flight.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flight = ctx.flight
        flight.reverse.wait()
        return flight.reversed, None


class Wait(torch.autograd.Function):
    """Identity once the exchange has arrived. Backward: launches the reverse exchange of the gradient (the
    gradient itself passes on to `Start`, which ignores it and waits for the reverse)."""

    @staticmethod
    def forward(ctx, received: torch.Tensor, flight: _Exchange) -> torch.Tensor:
        ctx.flight = flight
        flight.work.wait()
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flight = ctx.flight
        flight.reversed, flight.reverse = _launch(grad.contiguous(), flight.recv, flight.send, flight.group)
        return grad, None


def _start(x: torch.Tensor, send: list[int], recv: list[int], group: AxisGroup) -> tuple[torch.Tensor, _Exchange]:
    flight = _Exchange(send, recv, group)
    return Start.apply(x, flight), flight


def dispatch_overlapped(x: torch.Tensor, counts: torch.Tensor, compute, ep: AxisGroup, chunks: int = 2) -> torch.Tensor:
    """`dispatch_compute_combine` with the layer's copies in `chunks` parts (each expert's run split evenly), so
    that one part's dispatch and combine travel while another's expert GEMMs compute, in forward and in backward
    (Megatron's and DeepSeek's overlap within a micro-batch; chosen over overlapping one micro-batch's forward
    with another's backward because it needs nothing of the pipeline schedule). The counts of all parts are
    exchanged in one all-to-all: one host sync per layer, as without chunks."""
    local = counts.numel() // ep.size
    parts = torch.stack([(counts + chunks - 1 - c) // chunks for c in range(chunks)])  # (chunks, E), summing to counts
    per_rank = parts.view(chunks, ep.size, local).transpose(0, 1).contiguous()  # (ep, chunks, local)
    received = torch.empty_like(per_rank)
    ep.bytes += (ep.size - 1) * chunks * local * counts.element_size()
    dist.all_to_all_single(received, per_rank, group=ep.group)
    sizes = torch.stack((per_rank.sum(2), received.sum(2))).tolist()  # (2, ep, chunks): the one host sync
    # Copy j of expert e (its run sorted) goes to the part whose cumulative share of that run contains j.
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts, output_size=x.shape[0])
    within = torch.arange(x.shape[0], device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
    part_of = (within.unsqueeze(1) >= torch.cumsum(parts, 0).t()[expert]).sum(1)
    rows = [torch.nonzero(part_of == c).squeeze(1) for c in range(chunks)]
    flights = []
    for c in range(chunks):
        send, recv = [r[c] for r in sizes[0]], [r[c] for r in sizes[1]]
        flights.append(_start(x[rows[c]], send, recv, ep) + (send, recv))
    outputs = []
    for c, (buffer, flight, send, recv) in enumerate(flights):
        arrived = Wait.apply(buffer, flight)  # ordered by (source rank, local expert)
        outputs.append(_start(_by_local_expert(arrived, received[:, c, :], compute), recv, send, ep))
    combined = torch.cat([Wait.apply(buffer, flight) for buffer, flight in outputs])
    place = torch.empty_like(part_of)
    place[torch.cat(rows)] = torch.arange(x.shape[0], device=x.device)
    return combined[place]


def apply_expert_parallel(model: nn.Module, ep: AxisGroup) -> nn.Module:
    """Give every MoE block of a (meta-device) model its share of the experts: E / ep of each stacked weight,
    before materialising (the shape change), and the group its dispatch talks over."""
    if ep.size > 1:
        for module in model.modules():
            if isinstance(module, MoE):
                module.experts.shard(ep.size, ep.rank, partial(dispatch_compute_combine, ep=ep))
    return model


def overlap_expert_exchanges(model: nn.Module, ep: AxisGroup, chunks: int = 2) -> None:
    """`--parallel.ep_overlap`: the MoE blocks of a model already sharded over ep dispatch in `chunks` parts whose
    exchanges overlap the other parts' expert GEMMs (`dispatch_overlapped`)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts.dispatch = partial(dispatch_overlapped, ep=ep, chunks=chunks)
