"""The data-parallel engine: flat buffers, bucketed reduction overlapped with backward, ZeRO 1/2, mixed precision.

Why by hand rather than DDP: one engine that also shards the optimizer (ZeRO, Rajbhandari et al. 2020, as
Megatron-LM's distributed optimizer), lets gradient compression replace a bucket's reduction (a comm hook),
and runs the same on gloo, NCCL and HCCL. `bench/dp_vs_ddp.py` holds it to DDP's speed. It is three parts over
one bucket layout: the gradient reducer (grad_reducer.py: buffers, reductions, sync, norm), this rank's pieces of
the flat parameters (pieces.py) and one update rule (update_rule.py: AdamW, 1-bit Adam, Muon, DiLoCo's outer
step around AdamW). The engine orders them; none of them reaches into another.

One step, in order:
  1. `prepare_step(m)`: gradient buffers zeroed (ZeRO-2: allocated), each bucket expects (params x m) gradient
     accumulations.
  2. Backward: every parameter's post-accumulate-grad hook counts down its bucket (bf16 with fp32 reduction:
     the hook first adds the bf16 gradient into the fp32 buffer). When a bucket's last gradient of the last
     micro-batch has arrived, its reduction starts asynchronously while backward continues:
     ZeRO-0: the comm hook (average over dp, or compression); ZeRO-1/2: an in-place reduce-scatter, so each
     rank gets the averaged gradient of its shard of every bucket.
  3. `finish_grad_sync()`: the gradient sync (grad_sync.py) runs on the full gradients of the "late"
     parameters (tied embeddings across pipeline stages, tp-partial gradients), then their bucket reduces;
     every handle is waited on. ZeRO-2 keeps the shard and frees the full bucket buffers.
  4. `grad_norm()` over what this rank owns (dp-summed under ZeRO), `step(lr, scale)`: the rule on this rank's
     pieces in fp32 (master weights under bf16), the masters published into the parameters, then ZeRO-1/2
     all-gather the updated parameters in place.
  5. `end_step(stepped)`: compression's step counter moves on (or, after a skipped step, its residuals go), then
     the rule's (DiLoCo's outer step).

Compressing the update instead of the gradient (`compress_update`, ZeRO-0 only): backward reduces nothing;
each rank runs AdamW's moments on its own gradient, and the comm hook (compression, with error feedback)
averages the resulting updates, lr x m / (sqrt(v) + eps), which every rank then applies to its identical
parameters. Why: error feedback on the update is plain bookkeeping of motion not yet made, so a coordinate
sent late still moves as far as the steps it waited for; on the gradient, AdamW turns the late, accumulated
sums into motion non-linearly, and top-1% of the gradient ends 40% behind dense on `tiny` where top-1% of the
update ends 16% behind (docs/benchmarks.md, with the rescalings of the gradient path that did not help). 1-bit
Adam (Tang et al. 2021) compresses the momentum for the same reason. The moments are per rank (from the
rank's own gradients), so each rank saves its own (`rank_state_dict`); clipping uses the ranks'
root-mean-square gradient norm, and the cost is the overlap with backward: the reduction happens in `step`.
"""

from __future__ import annotations

from collections.abc import Callable, Set as AbstractSet

import torch
from torch import nn

from large_model_training.choices import bf16_compute
from large_model_training.memory.buffers import tensor_bytes
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.adamw import make_rule as adamw_rule
from large_model_training.parallel.grad_buffer import bucket_layout
from large_model_training.parallel.grad_reducer import GradReducer
from large_model_training.parallel.grad_sync import GradSync
from large_model_training.parallel.local_state import PersistentBuffers
from large_model_training.parallel.pieces import FlatShards
from large_model_training.parallel.update_rule import RuleContext, RuleFactory


class DataParallelEngine:
    """ZeRO 0-2: a gradient reducer (`reducer`) and an update rule (`rule`) over one bucket layout's pieces
    (`shards`); `update_rule` builds the rule (AdamW by default; build_engine picks `--optimizer`'s)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: ParallelMesh,
        *,
        zero: int,
        bucket_mb: float,
        precision: str,
        grad_reduce_fp32: bool,
        weight_decay: float,
        betas: tuple[float, float],
        norm_excluded: AbstractSet[str] = frozenset(),
        sync: GradSync | None = None,
        comm_hook: Callable | None = None,
        hook_state=None,
        compress_update: bool = False,
        own_buckets: AbstractSet[str] = frozenset(),
        compression_label: str = "",
        rank_layout: list | None = None,
        params: set[str] | None = None,
        state_dtype: torch.dtype = torch.float32,
        sr_master: bool = False,
        train=None,
        update_rule: RuleFactory = adamw_rule,
    ):
        if compress_update and (zero != 0 or comm_hook is None):
            raise ValueError("compress_update needs ZeRO-0 (every rank holds whole moments) and a comm hook")
        self.model, self.mesh, self.zero = model, mesh, zero
        compute_dtype = torch.bfloat16 if bf16_compute(precision) else torch.float32
        grad_dtype = torch.float32 if precision == "fp32" or grad_reduce_fp32 else torch.bfloat16
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (params is None or n in params)]
        layout, n_regular = bucket_layout(
            named,
            sync.names if sync else set(),
            own_buckets,
            bucket_mb,
            torch.finfo(grad_dtype).bits // 8,
            mesh.grad_size,
        )
        self.buckets, self.numel = layout.buckets, layout.numel
        # The pieces first: they move the parameters into the flat buffer and cast them to the compute dtype,
        # which the gradient views attached next must match.
        self.shards = FlatShards(
            layout, mesh, zero=zero, compute_dtype=compute_dtype, norm_excluded=norm_excluded, sr_master=sr_master
        )
        self.param_buffer = self.shards.param_buffer
        self.buffers = PersistentBuffers(model)  # the in-memory copies' (local_state_dict)
        self.reducer = GradReducer(
            layout,
            n_regular,
            mesh,
            zero=zero,
            grad_dtype=grad_dtype,
            main_grad=grad_dtype != compute_dtype,
            sync=sync,
            comm_hook=comm_hook,
            hook_state=hook_state,
            norm_excluded=norm_excluded,
            compression_label=compression_label,
        )
        self.grads, self.compression = self.reducer.grads, self.reducer.compression
        self.rule = update_rule(
            RuleContext(
                self.shards,
                self.reducer,
                mesh,
                weight_decay,
                betas,
                state_dtype=state_dtype,
                compress_update=compress_update,
                train=train,
                model=model,
            )
        )
        self.rank_layout = rank_layout
        self._gather_bytes = 0

    def grad_of(self, name: str) -> torch.Tensor:
        """The full accumulated gradient of a parameter (valid until its bucket is reduced)."""
        return self.reducer.grad_of(name)

    # ---- one step ----------------------------------------------------------------------------------
    def prepare_step(self, micro_batches: int) -> None:
        self.rule.prepare_step()
        self.reducer.prepare_step(micro_batches, self.rule.local_grads)
        self._gather_bytes = 0

    def before_backward(self, stage: int, last: bool) -> None:
        """ZeRO-2: the previous backward's rounds finish reducing and free their buffers before this one fills
        more (the executor calls this before every backward)."""
        self.reducer.grads.settle_rounds()

    def finish_grad_sync(self) -> int:
        """Finish every bucket's reduction (the late ones after the gradient sync); returns dp bytes sent."""
        return self.reducer.finish()

    def comm_bytes(self) -> int:
        """Bytes this rank passed to dp collectives this step (reductions, the rule's own exchange, parameter
        all-gathers)."""
        return self.reducer.comm_bytes() + self._gather_bytes + self.rule.comm_bytes()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient: over this rank's share, summed over the axes that split it."""
        return self.norm_sq().sqrt()

    def norm_sq(self) -> torch.Tensor:
        """The squared global norm of this engine's parameters' gradients (`params`: all, or a part)."""
        return self.reducer.norm_sq(self.shards.pieces, self.rule.local_grads)

    def step(self, lr: float, grad_scale: torch.Tensor | float = 1.0) -> None:
        """The rule on this rank's pieces, the masters published, then the ZeRO re-gather."""
        local = self.rule.local_grads
        self.rule.step(self.shards.pieces, self.reducer.grads_for(self.shards.pieces, local), lr, grad_scale)
        self.shards.publish()
        self._gather_bytes += self.shards.gather_parameters()
        if local:  # ZeRO-2 kept the whole local gradients for the rule: drop them now
            self.reducer.release_full()

    def end_step(self, stepped: bool) -> None:
        """After every step, on every rank: the reducer's compression, then the rule (DiLoCo's outer step)."""
        self.reducer.end_step(stepped)
        self.rule.end_step(stepped)

    @property
    def compressed_from(self) -> int | None:
        """The first step (0-based) whose exchange is compressed, for the run log's note; None without."""
        own = self.rule.compressed_from
        return own if own is not None else self.reducer.compressed_from

    def step_record(self) -> dict:
        """This step's metrics particular to the engine: the rule's."""
        return self.rule.record()

    def compression_note(self, sent: int) -> str:
        if self.rule.compressed_from is not None:
            return self.rule.compression_note(sent)
        return self.reducer.compression_note(sent)

    # ---- state -------------------------------------------------------------------------------------
    def memory_by_kind(self) -> dict[str, int]:
        """model_state_bytes by kind: the flat parameter buffer, gradient buffers, fp32 masters and the rule's
        state."""
        return {
            "parameters": tensor_bytes(self.param_buffer),
            "gradients": tensor_bytes(*self.reducer.grads.tensors()),
            "optimizer_states": tensor_bytes(*self.shards.masters(), *self.rule.tensors()),
        }

    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer states this rank holds between steps."""
        return sum(self.memory_by_kind().values())

    def state_dict(self) -> dict:
        """Optimizer state by parameter name, independent of dp size and ZeRO stage."""
        return {**self.rule.state_dict(), **self.shards.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state)
        self.shards.load_state_dict(state)

    def rank_state_dict(self) -> dict:
        """What this rank alone holds, in its own file: the reducer's compression state and the rule's own (1-bit
        Adam's errors, a DiLoCo replica, per-rank moments under update compression), with the layout they fit;
        {} when there is none."""
        saved = {**self.reducer.rank_state_dict(), **self.rule.rank_state_dict()}
        return {**saved, "layout": self.rank_layout} if saved else {}

    def load_rank_state_dict(self, saved: dict | None) -> None:
        """Each part takes its own: in the layout it was saved in (each rank reads its own file then) all of it,
        elsewhere what does not depend on the layout (compression's step counter)."""
        saved = saved or {}
        same = bool(saved) and saved.get("layout") == self.rank_layout
        self.reducer.load_rank_state_dict(saved, same)
        self.rule.load_rank_state_dict(saved, same)

    def model_state_dict(self) -> dict:
        return self.model.state_dict()

    def local_state_dict(self, buffers: bool = True) -> dict:
        """The flat parameter buffer (one tensor, not one per parameter: a copy per step is taken of it), the
        model's persistent buffers (`buffers`: not when an engine beside this one on the model copies them), this
        rank's fp32 masters and the rule's state, as they lie: under ZeRO nothing is gathered (the by-name
        `state_dict` gathers the moments over dp)."""
        return {
            "parameters": self.param_buffer,
            "buffers": self.buffers.tensors() if buffers else {},
            "masters": self.shards.masters(),
            "rule": self.rule.local_state_dict(),
        }

    @torch.no_grad()
    def load_local_state_dict(self, state: dict) -> None:
        self.param_buffer.copy_(state["parameters"])
        if state["buffers"]:
            self.buffers.load(state["buffers"])
        for mine, saved in zip(self.shards.masters(), state["masters"]):
            mine.copy_(saved)  # exact, where reload_parameters would round them through the bf16 parameters
        self.rule.load_local_state_dict(state["rule"])

    def load_model_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def reload_parameters(self) -> None:
        """After parameters were loaded into the model (views of the flat buffer), refresh fp32 masters."""
        self.shards.reload_parameters()
