"""The gradient reducer of one parameter group: its buckets reduced while backward runs, the gradient sync, the
compression state, and the group's squared gradient norm.

It is the half of the ZeRO 0-2 engine that every update rule shares (parallel/dp_engine.py composes it with a
rule): the gradient buffer (grad_buffer.py: buckets, overlap, the comm hook or ZeRO's reduce-scatter), the tp and
tied-embedding sums before the dp reduction (grad_sync.py), and the norm, written once for both ways a gradient
can be held: dp-averaged (this rank's share, summed over the axes that split it) or local (a rule that averages
something else itself: the ranks' root-mean-square norm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from large_model_training.choices import CompressionSpec
from large_model_training.compression.hook import CompressionState, wire_factor
from large_model_training.memory.buffers import FlatLayout
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.grad_buffer import GradBuffer
from large_model_training.parallel.grad_norm import reduce_norm_sq
from large_model_training.parallel.grad_sync import GradSync
from large_model_training.parallel.pieces import ShardPiece


class GradReducer:
    """Buckets, their dp reductions and the norm of one parameter group (dense, or the experts over edp)."""

    def __init__(
        self,
        layout: FlatLayout,
        n_regular: int,
        mesh: ParallelMesh,
        *,
        zero: int,
        grad_dtype: torch.dtype,
        main_grad: bool,
        sync: GradSync | None = None,
        comm_hook: Callable | None = None,
        hook_state=None,
        norm_excluded=frozenset(),
        compression_label: str = "",
    ):
        self.mesh, self.zero, self.sync, self.buckets = mesh, zero, sync, layout.buckets
        self.grads = GradBuffer(
            layout, n_regular, mesh, zero=zero, grad_dtype=grad_dtype, main_grad=main_grad, comm_hook=comm_hook,
            hook_state=hook_state,
        )  # fmt: skip
        state = self.grads.hook_state
        self.compression = state if isinstance(state, CompressionState) else None
        self.compression_label = compression_label or (str(self.compression.spec) if self.compression else "")
        # Each bucket's counted spans (bucket-relative), for the norm of whole local gradients.
        self.counted = [
            [(off - b.start, off - b.start + p.numel()) for name, p, off in b.params if name not in norm_excluded]
            for b in self.buckets
        ]

    # ---- one step ----------------------------------------------------------------------------------
    def prepare_step(self, micro_batches: int, local: bool) -> None:
        """Buffers zeroed for `micro_batches` accumulations; `local`: nothing is reduced over dp this step."""
        self.grads.defer = local
        self.grads.prepare_step(micro_batches)

    def grad_of(self, name: str) -> torch.Tensor:
        """The full accumulated gradient of a parameter (valid until its bucket is reduced)."""
        return self.grads.grad_of(name)

    def finish(self) -> int:
        """Finish every bucket's reduction (the late ones after the gradient sync); returns dp bytes sent."""
        if self.sync is not None:
            self.sync(self.grads.grad_of)
        return self.grads.finish()

    def grads_for(self, pieces: list[ShardPiece], local: bool) -> list[torch.Tensor]:
        """A gradient per piece: its dp-averaged part, or (`local`) its whole bucket's own gradient."""
        if local:
            return [self.grads.bucket_grads[p.bucket_index] for p in pieces]
        return [self.grads.part(p.bucket_index, p.lo, p.hi) for p in pieces]

    def norm_sq(self, pieces: list[ShardPiece], local: bool) -> torch.Tensor:
        """The group's squared global gradient norm (fp32), summed over the axes that split it."""
        total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        if local:  # local gradients: the ranks' root-mean-square norm
            for spans, grad in zip(self.counted, self.grads.bucket_grads):
                for a, b in spans:
                    total += grad[a:b].float().pow(2).sum()
            return reduce_norm_sq(total, self.mesh, ("tp", "pp", "grad"), local_dp=True)
        for piece, grad in zip(pieces, self.grads_for(pieces, False)):
            for a, b in piece.counted:
                total += grad[a:b].float().pow(2).sum()
        return reduce_norm_sq(total, self.mesh, ("grad", "tp", "pp") if self.zero else ("tp", "pp"))

    def reduce(self, index: int, buffer: torch.Tensor) -> torch.futures.Future:
        """The comm hook's average of `buffer` as bucket `index` (update compression's exchange)."""
        return self.grads.reduce(index, buffer)

    def release_full(self) -> None:
        """ZeRO-2: drop the full bucket buffers (after a step that read them whole)."""
        if self.zero == 2:
            self.grads.release_full()

    def comm_bytes(self) -> int:
        return self.grads.comm_bytes()

    def end_step(self, stepped: bool) -> None:
        """Compression counts the step (it seeds random-k and ends the dense warm-up); a skipped step (non-finite
        values) drops the residuals, which would carry those values on."""
        if self.compression is None:
            return
        if stepped:
            self.compression.new_step()
        else:
            self.compression.reset()

    # ---- compression -------------------------------------------------------------------------------
    @property
    def compressed_from(self) -> int | None:
        spec = self.compression.spec if self.compression is not None else None
        return self.compression.dense_steps if isinstance(spec, CompressionSpec) and spec.enabled else None

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

    def rank_state_dict(self) -> dict:
        """Compression's step counter, residuals and warm-start factors ({} without compression)."""
        return self.compression.state_dict() if self.compression is not None else {}

    def load_rank_state_dict(self, saved: dict, same_layout: bool) -> None:
        """The step counter always continues; residuals and factors only in the layout they were saved in."""
        if self.compression is None or not saved:
            return
        if same_layout:
            self.compression.load_state_dict(saved)
        else:
            self.compression.step = int(saved["step"])
