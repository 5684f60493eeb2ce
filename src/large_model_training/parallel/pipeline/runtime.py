"""The pipeline runtime: one executor that runs any schedule from `schedules.py` on this rank's stages.

It walks the rank's action list in order. Sends are non-blocking (`isend`); a receive blocks until its data
is there. Both are on global ranks of the same (dp, tp) position on other stages. The schedule guarantees
that this order cannot deadlock and that, between any two ranks, receives are posted in the order of the
sends (which NCCL requires); `checks.validate_schedule` proves it for every schedule we build. A send is
waited, and its buffer freed, as soon as the schedule proves it received (`simulate.send_releases`: gloo
reports a send complete only once waited, and its wait blocks until the peer receives), the rest at the end
of the step. Evaluation runs the forward-only program of the same schedules module through the same loop.

Gradient accumulation: each micro-batch's loss is scaled by 1/m on the last stage, so the accumulated
gradient is the mean. The data-parallel engine needs no signal from here: its parameter hooks start reducing a
bucket as soon as its last gradient is accumulated, while the other chunks are still computing.

Zero-bubble schedules (zb-h1, zbv) split each backward: B runs autograd with the executor's `WeightGradStore`
collecting, so every linear layer computes its input gradient and holds its weight-gradient GEMM; the W action
of the same (stage, micro-batch) runs the held GEMMs (`models/linear.py`). The dp engine's hooks fire in W,
so the last micro-batches' W actions start the dp reduction. Consecutive stages on one rank (zbv's V: the
bottom of the V) hand their tensors over locally, without messages.

Timeline: every action's start and end (seconds from the step start) are recorded, so the trainer can
report the bubble and write a Chrome trace and a Gantt chart of a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.mesh import ParallelMesh
from large_model_training.models.linear import WeightGradStore
from large_model_training.models.transformer import Transformer
from large_model_training.parallel.pipeline.schedules import (
    Action,
    Op,
    build_forward_schedule,
    build_schedule,
    placement_of,
    splits_backward,
    stage_to_rank,
)
from large_model_training.parallel.pipeline.simulate import send_releases


class PipelineModel(nn.Module):
    """This rank's chunks (virtual stages), registered under the whole model's parameter names.

    Blocks are keyed by their global index, so `layers.5.attn.wq.weight` has the same name here as in the
    unsplit model; checkpoints and initialisation do not depend on the split.
    """

    def __init__(self, chunks: dict[int, Transformer]):
        super().__init__()
        self.chunks = chunks  # virtual stage index -> module (a plain dict: modules registered below by name)
        first = next(iter(chunks.values()))
        self.cfg = first.cfg
        self.layers = nn.ModuleDict()
        for chunk in chunks.values():
            self.layers.update(chunk.layers)
            for name in ("tok_embeddings", "pos_embeddings", "norm", "output", "mtp"):
                if hasattr(chunk, name):
                    self.add_module(name, getattr(chunk, name))
        last = chunks[max(chunks)]
        self.loss_fn = last.loss_fn
        # With tied embeddings the last stage keeps its own copy of the embedding as `output.weight`; after the
        # gradient sync between first and last stage it equals the first stage's: count it once in norms. zbv's V
        # puts both stages on rank 0: the copy stays (summed there locally), so the gradients add up in the order
        # they do when two ranks hold them.
        self.duplicate_parameters = set()
        head = self._modules.get("output")
        embedding = self._modules.get("tok_embeddings")
        if self.cfg.tie_embeddings and head is not None and (embedding is None or embedding.weight is not head.weight):
            self.duplicate_parameters.add("output.weight")
        if embedding is not None and not any(chunk.stage.has_embedding for chunk in chunks.values()):
            self.duplicate_parameters.add("tok_embeddings.weight")  # multi-token prediction's copy, synced alike

    def tie_weights(self) -> None:
        for chunk in self.chunks.values():
            chunk.tie_weights()

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs under PipelineExecutor, not by calling the model")


class PipelineExecutor:
    """Runs one step of a pipeline schedule (or the forward-only evaluation program) on this rank's chunks.

    chunks: virtual stage index -> module (with pp = 1 the whole model as {0: model}: the same executor,
    and the same parameters, as for pp > 1); loss_fn(output, targets) runs after the last stage, or, with
    loss_fn None (what assembly gives), the last chunk computes its loss itself from the targets
    (`Transformer.forward(x, tokens, targets)`: the fused head and loss unless `train.fused_loss` is off). With one
    rank every schedule has no messages, and 1f1b's order is the plain F, B per micro-batch loop. Against
    that loop the executor costs nothing measurable: 0.95-1.01x the CPU time per step (tiny preset, m = 4
    and 16, one thread, within the runs' +-5% noise); no accelerator was measured.
    """

    def __init__(
        self,
        chunks: dict[int, nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        mesh: ParallelMesh,
        kind: str,
        micro_batches: int,
        virtual_stages: int,
    ):
        self.chunks, self.loss_fn, self.mesh = chunks, loss_fn, mesh
        self.p, self.m, self.v = mesh.pp_size, micro_batches, virtual_stages
        self.kind, self.placement = kind, placement_of(kind)
        schedule = build_schedule(kind, self.p, self.m, self.v)
        self.actions = schedule[mesh.pp_rank]
        self._train_releases = send_releases(schedule, self.p, mesh.pp_rank, self.placement)
        # Zero-bubble kinds: one store for this rank's linear layers, which hold their weight GEMMs in B.
        self.weight_grads = WeightGradStore() if splits_backward(kind) else None
        if self.weight_grads is not None:
            for chunk in chunks.values():
                for module in chunk.modules():
                    if hasattr(module, "weight_grads"):
                        module.weight_grads = self.weight_grads
        self._forward_programs: dict[int, tuple[list[Action], dict[Action, list[Action]]]] = {}
        self.last_stage = self.p * self.v - 1
        # Told (stage, last) before each backward: whether it is that chunk's last of the step (ZeRO-3 syncs then).
        self.before_backward: Callable[[int, bool], None] | None = None
        first = next(iter(chunks.values()))
        self.hidden_size, self.seq_shards = first.cfg.hidden_size, first.seq_shards
        self.bytes = 0  # point-to-point bytes this rank sent in the last step
        self.events: list[tuple[Action, float, float]] = []
        self.peak_in_flight = 0  # most micro-batches whose forward ran and backward did not, last step
        self.peak_sends = 0  # most send buffers held at once, last step
        self.act_dtype = next(first.parameters()).dtype  # dtype of stage-boundary tensors (bf16 under mixed)

    # ---- helpers -------------------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.mesh.stage_rank(stage_to_rank(stage, self.p, self.placement))

    def _activation(self, like: torch.Tensor) -> torch.Tensor:
        """An empty buffer for a stage boundary tensor: (micro_batch, seq / seq_shards, hidden), where seq is
        this rank's zig-zag part under cp (the micro-batch it is fed is already seq_len / cp long)."""
        return torch.empty(
            like.shape[0],
            like.shape[1] // self.seq_shards,
            self.hidden_size,
            dtype=self.act_dtype,
            device=self.mesh.device,
        )

    def _send(self, tensor: torch.Tensor, stage: int, action: Action) -> None:
        tensor = tensor.detach().contiguous()
        self.bytes += tensor.numel() * tensor.element_size()
        self._sends[action] = (dist.isend(tensor, dst=self._peer(stage)), tensor)
        self.peak_sends = max(self.peak_sends, len(self._sends))

    def _recv(self, like: torch.Tensor, stage: int) -> torch.Tensor:
        buf = self._activation(like)
        dist.recv(buf, src=self._peer(stage))
        return buf

    # ---- one step --------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Reset the per-step state for a training step (`run` may then take the schedule in phases)."""
        self._begin(True, self._train_releases)

    def _begin(self, training: bool, releases: dict[Action, list[Action]]) -> None:
        self._training, self._releases = training, releases
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._sends: dict[Action, tuple[dist.Work, torch.Tensor]] = {}
        self._backwards_left = {j: self.m for j in self.chunks}  # B actions to come per chunk (before_backward)
        self._held: set[tuple[int, int]] = set()  # F done, backward (W for split kinds) not yet
        self.loss_sum = torch.zeros((), device=self.mesh.device)
        self.bytes = 0
        self.events = []
        self.peak_in_flight = 0
        self.peak_sends = 0
        self._t0 = time.perf_counter()

    def run(
        self, actions: list[Action], micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float
    ) -> None:
        """Execute `actions` (all of a step, or a phase of it) in order.

        After an action, the sends that the schedule proves received (`send_releases`) are waited and
        dropped: a rank holds the buffers its schedule has in flight, not every micro-batch's.
        """
        for action in actions:
            started = time.perf_counter() - self._t0
            self._execute(action, micro_batches, loss_scale)
            for send in self._releases.get(action, ()):
                self._sends.pop(send)[0].wait()
            self.events.append((action, started, time.perf_counter() - self._t0))

    def finish_step(self) -> torch.Tensor:
        """Wait for outstanding sends; returns the summed scaled loss (non-zero on the last stage only)."""
        for work, _ in self._sends.values():
            work.wait()
        self._sends = {}
        if self.weight_grads is not None and self.weight_grads.pending:
            raise RuntimeError(f"{self.weight_grads.pending} B action(s) had no W action in this step")
        return self.loss_sum

    def forward_backward(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float
    ) -> torch.Tensor:
        self.start_step()
        self.run(self.actions, micro_batches, loss_scale)
        return self.finish_step()

    def _execute(self, a: Action, micro_batches, loss_scale: float) -> None:
        key = (a.stage, a.microbatch)
        tokens, targets = micro_batches[a.microbatch]
        if a.op is Op.RECV_ACT:
            self._inputs[key] = self._recv(tokens, a.stage - 1).requires_grad_(self._training)
        elif a.op is Op.FORWARD:
            self._forward(a, key, tokens, targets, loss_scale)
        elif a.op is Op.SEND_ACT:
            out = self._outputs[key] if self._training else self._outputs.pop(key)
            self._send(out, a.stage + 1, a)
        elif a.op is Op.RECV_GRAD:
            self._grads[key] = self._recv(tokens, a.stage + 1)
        elif a.op is Op.BACKWARD:
            self._backward(a, key)
        elif a.op is Op.WEIGHT:
            self.weight_grads.run_weight_gradients(key)
            self._done(key)
        elif a.op is Op.SEND_GRAD:
            self._send(self._input_grads.pop(key), a.stage - 1, a)

    def _forward(self, a: Action, key: tuple[int, int], tokens, targets, loss_scale: float) -> None:
        # Training keeps the input and output for the backward; evaluation only the output, until sent.
        x = tokens if a.stage == 0 else (self._inputs[key] if self._training else self._inputs.pop(key))
        chunk, last = self.chunks[a.stage], a.stage == self.last_stage
        if last and self.loss_fn is None:  # the chunk's forward returns its loss (the fused head, by default)
            out = chunk(x, tokens, targets) * loss_scale
        else:
            out = chunk(x, tokens)  # every stage sees the token ids (document masking)
            if last:
                out = self.loss_fn(out, targets) * loss_scale
        if last:
            self.loss_sum += out.detach()
        local_next = a.stage + 1 in self.chunks
        if local_next:  # the next stage is on this rank: hand over without a message
            self._inputs[(a.stage + 1, a.microbatch)] = out.detach().requires_grad_(self._training)
        if self._training:
            self._outputs[key] = out
            self._held.add(key)
            self.peak_in_flight = max(self.peak_in_flight, len(self._held))
        elif a.stage != self.last_stage and not local_next:
            self._outputs[key] = out

    def _backward(self, a: Action, key: tuple[int, int]) -> None:
        out = self._outputs.pop(key)
        grad = None if a.stage == self.last_stage else self._grads.pop(key)
        split = self.weight_grads.input_gradients_only(key) if self.weight_grads is not None else nullcontext()
        self._backwards_left[a.stage] -= 1
        if self.before_backward is not None:
            self.before_backward(a.stage, self._backwards_left[a.stage] == 0)
        with split:  # zero-bubble kinds: the linear layers hold their weight GEMMs for this key's W
            torch.autograd.backward(out, grad_tensors=grad)
        if a.stage > 0:
            input_grad = self._inputs.pop(key).grad
            if a.stage - 1 in self.chunks:  # the previous stage is on this rank
                self._grads[(a.stage - 1, a.microbatch)] = input_grad
            else:
                self._input_grads[key] = input_grad
        if self.weight_grads is None:
            self._done(key)

    def _done(self, key: tuple[int, int]) -> None:
        """This (stage, micro-batch)'s gradients are complete (B, or W for split kinds)."""
        self._held.discard(key)

    # ---- evaluation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Sum of per-micro-batch losses on the last stage (zero elsewhere), unscaled: the forward-only
        program (`build_forward_schedule`) through the same action loop as training."""
        m = len(micro_batches)
        if m not in self._forward_programs:
            schedule, rank = build_forward_schedule(self.p, m, self.v, self.placement), self.mesh.pp_rank
            self._forward_programs[m] = (schedule[rank], send_releases(schedule, self.p, rank, self.placement))
        actions, releases = self._forward_programs[m]
        self._begin(False, releases)
        self.run(actions, micro_batches, 1.0)  # x * 1.0 == x exactly: the losses are summed unscaled
        return self.finish_step()

    # ---- reporting ---------------------------------------------------------------------------------------
    def busy_and_span(self) -> tuple[float, float]:
        """(seconds of forward/backward compute, seconds from step start to last action end) on this rank."""
        busy = sum(end - start for a, start, end in self.events if a.op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT))
        span = max((end for _, _, end in self.events), default=0.0)
        return busy, span


def measured_bubble(executor: PipelineExecutor, mesh: ParallelMesh) -> float:
    """1 - (compute time summed over the pipeline ranks) / (p x the longest rank's step span). Collective over pp."""
    busy, span = executor.busy_and_span()
    busy_t = torch.tensor([busy], dtype=torch.float64)
    span_t = torch.tensor([span], dtype=torch.float64)
    if mesh.pp_size > 1:
        group = mesh.pp_group
        busy_t, span_t = busy_t.to(mesh.device), span_t.to(mesh.device)
        dist.all_reduce(busy_t, group=group)
        dist.all_reduce(span_t, op=dist.ReduceOp.MAX, group=group)
    span_max = float(span_t)
    return 0.0 if span_max == 0 else max(0.0, 1.0 - float(busy_t) / (mesh.pp_size * span_max))
