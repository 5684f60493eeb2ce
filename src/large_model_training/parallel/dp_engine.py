"""The data-parallel engine: flat buffers, bucketed reduction overlapped with backward, ZeRO 1/2, mixed precision.

Why by hand rather than DDP: one engine that also shards the optimizer (ZeRO, Rajbhandari et al. 2020, as
Megatron-LM's distributed optimizer), lets gradient compression replace a bucket's reduction (a comm hook),
and runs the same on gloo, NCCL and HCCL. `bench/dp_vs_ddp.py` holds it to DDP's speed. It is two parts over
one bucket layout: the gradient buffer with its reductions (grad_buffer.py) and the sharded AdamW (adamw.py).

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
  4. `grad_norm()` over what this rank owns (dp-summed under ZeRO), `step(lr, scale)`: AdamW on this rank's
     shard in fp32 (master weights under bf16), then ZeRO-1/2 all-gather the updated parameters in place.
  5. `end_step(stepped)`: compression's step counter moves on (or, after a skipped step, its residuals go).

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

from large_model_training.choices import CompressionSpec, bf16_compute
from large_model_training.compression.hook import CompressionState, wire_factor
from large_model_training.memory.buffers import tensor_bytes
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.adamw import ShardedAdamW
from large_model_training.parallel.grad_buffer import GradBuffer, bucket_layout
from large_model_training.parallel.grad_norm import reduce_norm_sq
from large_model_training.parallel.grad_sync import GradSync


class DataParallelEngine:
    """ZeRO 0-2: the gradient buffer (`grads`) and the sharded optimizer (`optimizer`) over one bucket layout;
    `update_rule` builds the optimizer (ShardedAdamW, or a subclass with another update: parallel/muon.py)."""

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
        update_rule: Callable = ShardedAdamW,
    ):
        if compress_update and (zero != 0 or comm_hook is None):
            raise ValueError("compress_update needs ZeRO-0 (every rank holds whole moments) and a comm hook")
        self.model, self.mesh, self.zero, self.sync = model, mesh, zero, sync
        self.compress_update = compress_update
        compute_dtype = torch.bfloat16 if bf16_compute(precision) else torch.float32
        grad_dtype = torch.float32 if precision == "fp32" or grad_reduce_fp32 else torch.bfloat16
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (params is None or n in params)]
        layout, n_regular = bucket_layout(
            named,
            sync.names if sync else set(),
            own_buckets,
            bucket_mb,
            torch.finfo(grad_dtype).bits // 8,
            mesh.dp_size,
        )
        self.buckets, self.numel = layout.buckets, layout.numel
        # The optimizer first: it moves the parameters into its buffer and casts them to the compute dtype,
        # which the gradient views attached next must match.
        self.optimizer = update_rule(
            layout,
            mesh,
            zero=zero,
            compute_dtype=compute_dtype,
            weight_decay=weight_decay,
            betas=betas,
            norm_excluded=norm_excluded,
        )
        self.param_buffer = self.optimizer.param_buffer
        self.grads = GradBuffer(
            layout,
            n_regular,
            mesh,
            zero=zero,
            grad_dtype=grad_dtype,
            main_grad=grad_dtype != compute_dtype,
            comm_hook=comm_hook,
            hook_state=hook_state,
            defer=compress_update,
        )
        state = self.grads.hook_state
        self.compression = state if isinstance(state, CompressionState) else None
        self.compression_label = compression_label or (str(self.compression.spec) if self.compression else "")
        self.rank_layout = rank_layout
        self._gather_bytes = 0

    def grad_of(self, name: str) -> torch.Tensor:
        """The full accumulated gradient of a parameter (valid until its bucket is reduced)."""
        return self.grads.grad_of(name)

    def _owned_grads(self) -> list[torch.Tensor]:
        """Per optimizer piece, its gradient (dp-averaged, unless updates are compressed)."""
        return [self.grads.part(p.bucket_index, p.lo, p.hi) for p in self.optimizer.pieces]

    # ---- one step ----------------------------------------------------------------------------------
    def prepare_step(self, micro_batches: int) -> None:
        self.grads.prepare_step(micro_batches)
        self._gather_bytes = 0

    def finish_grad_sync(self) -> int:
        """Finish every bucket's reduction (the late ones after the gradient sync); returns dp bytes sent."""
        if self.sync is not None:
            self.sync(self.grads.grad_of)
        return self.grads.finish()

    def comm_bytes(self) -> int:
        """Bytes this rank passed to dp collectives this step (reductions and parameter all-gathers)."""
        return self.grads.comm_bytes() + self._gather_bytes

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the averaged gradient: over this rank's share, summed over the axes that split it."""
        return self.norm_sq().sqrt()

    def norm_sq(self) -> torch.Tensor:
        """The squared global norm of this engine's parameters' gradients (`params`: all, or a part)."""
        total = self.optimizer.norm_sq(self._owned_grads())
        if self.compress_update:  # local gradients: the ranks' root-mean-square norm
            return reduce_norm_sq(total, self.mesh, ("tp", "pp", "dp"), local_dp=True)
        return reduce_norm_sq(total, self.mesh, ("dp", "tp", "pp") if self.zero else ("tp", "pp"))

    def step(self, lr: float, grad_scale: torch.Tensor | float = 1.0) -> None:
        """AdamW on this rank's shard (identical, element for element, to torch.optim.AdamW), then re-gather;
        under update compression AdamW's update is what the comm hook averages."""
        if self.compress_update:
            self.optimizer.step_update(lr, grad_scale, self._owned_grads(), self.grads.reduce)
        else:
            self._gather_bytes += self.optimizer.step(lr, grad_scale, self._owned_grads())

    def end_step(self, stepped: bool) -> None:
        """After every step, on every rank: compression counts the step (it seeds random-k and ends the dense
        warm-up); a skipped step (non-finite values) drops the residuals, which would carry those values on."""
        if self.compression is None:
            return
        if stepped:
            self.compression.new_step()
        else:
            self.compression.reset()

    @property
    def compressed_from(self) -> int | None:
        """The first step (0-based) whose exchange is compressed, for the run log's note; None without."""
        spec = self.compression.spec if self.compression is not None else None
        return self.compression.dense_steps if isinstance(spec, CompressionSpec) and spec.enabled else None

    def step_record(self) -> dict:
        """This step's metrics particular to the engine (none here)."""
        return {}

    def compression_note(self, sent: int) -> str:
        """The run log's statement of what compression saves, against a dense bucketed all-reduce."""
        if self.compression is None:
            return ""
        dense = sum(b.numel for b in self.buckets) * torch.finfo(self.grads.grad_dtype).bits // 8
        world, spec = self.compression.group_size, self.compression.spec
        ratio = dense / sent if sent else float("inf")
        on_wire = ratio * wire_factor("none", world) / wire_factor(spec, world) if world > 1 else ratio
        return (
            f"compression {self.compression_label}: {sent:,} dp bytes per step vs {dense:,} dense "
            f"({ratio:.1f}x fewer into collectives, {on_wire:.1f}x fewer on a ring's links), error feedback "
            f"{'on' if self.compression.error_feedback else 'off'}"
        )

    # ---- state -------------------------------------------------------------------------------------
    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer states this rank holds between steps."""
        params, *state = self.optimizer.tensors()
        return tensor_bytes(params, *self.grads.tensors(), *state)

    def memory_by_kind(self) -> dict[str, int]:
        """model_state_bytes by kind: the flat parameter buffer, gradient buffers, fp32 masters and moments."""
        params, *state = self.optimizer.tensors()
        return {
            "parameters": tensor_bytes(params),
            "gradients": tensor_bytes(*self.grads.tensors()),
            "optimizer_states": tensor_bytes(*state),
        }

    def state_dict(self) -> dict:
        """Optimizer state by parameter name, independent of dp size and ZeRO stage."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def rank_state_dict(self) -> dict:
        """What this rank alone holds and must save in its own file: compression's step counter, residuals and
        warm-start factors, with the layout they fit; under update compression its own AdamW moments (the
        optimizer's checkpoint copy is one rank's, by name). Empty without compression."""
        if self.compression is None:
            return {}
        saved = {**self.compression.state_dict(), "layout": self.rank_layout}
        if self.compress_update:
            saved["moments"] = self.optimizer.rank_moments()
        return saved

    def load_rank_state_dict(self, saved: dict | None) -> None:
        """The compression step counter always continues (it seeds random-k and ends the dense warm-up); the
        per-rank residuals, PowerSGD factors and moments come back only in the layout they were saved in (each
        rank reads its own file then). Elsewhere they start from zero, as after a skipped step."""
        if self.compression is None or saved is None:
            return
        if saved.get("layout") == self.rank_layout:
            self.compression.load_state_dict(saved)
            self.optimizer.load_rank_moments(saved.get("moments", []))
        else:
            self.compression.step = int(saved["step"])

    def model_state_dict(self) -> dict:
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def reload_parameters(self) -> None:
        """After parameters were loaded into the model (views of the flat buffer), refresh fp32 masters."""
        self.optimizer.reload_parameters()
