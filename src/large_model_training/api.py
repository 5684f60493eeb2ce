"""The founding document's names for our concepts, in one public module (`lmt.TensorParallelism`, ...).

The seed sketched single-process toys with these names; each class here keeps its methods and does the real
thing with the library's machinery: tensor-parallel layers over a mesh's tp group, recompute policies,
compressors with error feedback, and pipeline schedules over real ranks (see `examples/`).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from large_model_training.assembly import build_chunks, build_model
from large_model_training.choices import CompressionSpec, RecomputePolicy, SyncMode, parse_compression
from large_model_training.compression import (
    RANDOMK_STREAM,
    STOCHASTIC_STREAM,
    DensePayload,
    Payload,
    compress_matrix,
    initial_q,
    matrix_rank,
    quantize,
    seeded_generator,
    select,
    sign_compress,
)
from large_model_training.config import Config, ModelConfig, SyncConfig, apply_overrides
from large_model_training.config_checks import check_fields
from large_model_training.errors import ConfigError
from large_model_training.memory.recompute import apply_recompute
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.collectives import all_reduce_
from large_model_training.parallel.grad_sync import GradSync
from large_model_training.parallel.pipeline.partition import stage_layers
from large_model_training.parallel.pipeline.runtime import PipelineExecutor, PipelineModel
from large_model_training.parallel.pipeline.schedules import COMPUTE, Op, build_schedule, placement_of


class TensorParallelism:
    """The seed's `TensorParallelism`, made real over a mesh's tp group.

    tp = lmt.TensorParallelism(mesh)
    model = tp.parallelize(model_cfg, seed)        # this rank's shard of the model, tp=1 weights
    shard = tp.split_tensor(weight, dim=0)         # this rank's slice of a full tensor
    total = tp.all_reduce(partial)                 # sum over the tp group (in place)
    """

    def __init__(self, mesh, sequence_parallel: bool = False):
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.group = mesh.tp

    @property
    def num_devices(self) -> int:
        return self.group.size

    def parallelize(self, model_cfg: ModelConfig, seed: int) -> nn.Module:
        return build_model(model_cfg, self.mesh, seed, sequence_parallel=self.sequence_parallel)

    def split_tensor(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if tensor.shape[dim] % self.group.size:
            raise ValueError(f"dim {dim} of size {tensor.shape[dim]} does not split over tp={self.group.size}")
        return tensor.chunk(self.group.size, dim=dim)[self.group.rank]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_(tensor, self.group)

    def sync_partial_gradients(self, model: nn.Module) -> None:
        """Sum over tp the gradients each rank holds only a part of (SP norms, replicated kv weights): what the
        engine's gradient sync does in training, for a loop written by hand."""
        grads = {name: p.grad for name, p in model.named_parameters()}
        GradSync.for_model(model, self.mesh, tie_embeddings=False)(grads.__getitem__)


class GradientCheckpointing:
    """The seed's `GradientCheckpointing`, made real: a recompute policy applied to a model.

        gc = lmt.GradientCheckpointing(policy="every:10")   # the seed's default: every 10 layers
        gc.apply(model)                                      # in place; parameter names unchanged
        out = gc.forward_with_checkpoint(model, tokens)      # = model(tokens) with the policy applied
        gc.backward_with_checkpoint(loss)                    # = loss.backward(): recomputes as it goes

    The seed copied the output of layers 0, 10, 20, ... in forward (`checkpoint`) and handed them back to
    its layers in backward (`restore`). Here every:10 keeps (by reference, no copy) the input of blocks 0,
    10, 20, ... and autograd re-runs the 10 blocks after each kept input when backward reaches them, with
    the same dropout masks. `policy` also accepts 'full', 'selective' and 'none'.
    """

    def __init__(self, policy: RecomputePolicy | str = "every:10"):
        self.policy = policy if isinstance(policy, RecomputePolicy) else RecomputePolicy.parse(policy)

    def apply(self, model: nn.Module) -> nn.Module:
        return apply_recompute(model, self.policy)

    def forward_with_checkpoint(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        if getattr(model, "recompute_policy", None) != self.policy:
            self.apply(model)
        return model(inputs)

    @staticmethod
    def backward_with_checkpoint(output: torch.Tensor, grad_output: torch.Tensor | None = None) -> None:
        torch.autograd.backward(output, grad_output)


SEED_NAMES = {"topk": "topk", "quantization": "int8", "sparsification": "threshold"}
DEFAULTS = {"topk": 0.1, "randomk": 0.1, "threshold": 1e-3, "powersgd": 1}
"""Values of bare names: the seed's topk_compress(k=0.1); PyTorch's PowerSGD default rank 1."""


def _resolve(
    compression_type: str,
    ratio: float | None,
    threshold: float | None,
    bits: int | None,
    rank: int | None,
    stochastic: bool,
) -> CompressionSpec:
    """A spec from a seed name or spec string, with keyword values filling in (or replacing) its argument."""
    kind, sep, arg = str(compression_type).strip().lower().partition(":")
    kind = SEED_NAMES.get(kind, kind)
    if kind == "int8" and bits is not None:
        if bits not in (4, 8):
            raise ConfigError(f"quantization supports bits=8 or bits=4, got {bits}")
        kind = f"int{bits}"
    value = {"topk": ratio, "randomk": ratio, "threshold": threshold, "powersgd": rank}.get(kind)
    if kind in DEFAULTS:
        arg = str(value) if value is not None else (arg or str(DEFAULTS[kind]))
        sep = ":"
    elif kind in ("int8", "int4") and stochastic:
        sep, arg = ":", "stochastic"
    return parse_compression(f"{kind}{sep}{arg}")


class GradientCompression:
    """Compress one gradient tensor at a time, in one process, with error feedback per `name`.

        gc = GradientCompression()
        payload = gc.compress_gradients(grad, "topk", ratio=0.01)     # or "topk:0.01", "quantization", "int4"
        payload = gc.compress_gradients(grad, "sign")                 # 1 bit + a mean |x| per 1024 (1-bit Adam's)
        approx, size = payload.decompress(), payload.nbytes

    With error_feedback (the default) the part of a gradient that was not sent is kept under `name` and added to
    the next gradient compressed under the same name; `residual(name)` shows it. Calls are counted per name:
    the count seeds random-k and stochastic rounding, so equal seeds give equal results.

    In training, per-step compression of the gradient is `--compression SPEC`; 1-bit Adam (the momentum sent as
    "sign" or int8 after a dense warm-up, ZeRO 0-2) is `--optimizer onebit-adam` (parallel/onebit_adam.py).
    Synchronising less often instead (DiLoCo, docs/slow_links.md) is `--sync local:H` or `streaming:H`, or in
    code `cfg.sync = GradientCompression.sync("local:50", compression="int8")`.
    """

    def __init__(self, error_feedback: bool = True, seed: int = 0):
        self.error_feedback = error_feedback
        self.seed = seed
        self.residuals: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}
        self.powersgd_q: dict[str, torch.Tensor] = {}

    def residual(self, name: str = "") -> torch.Tensor | None:
        return self.residuals.get(name)

    def reset(self) -> None:
        self.residuals.clear()
        self.steps.clear()
        self.powersgd_q.clear()

    @staticmethod
    def sync(mode: str = "local:50", **settings: Any) -> SyncConfig:
        """A checked [sync] section (config.SyncConfig) for a Config: mode 'every-step', 'local:H' or 'streaming:H';
        settings: outer_lr, outer_momentum, compression ('none', 'bf16', 'int8', 'int4', 'sign'), fragments, overlap."""
        cfg = Config()
        cfg.sync.mode = SyncMode.parse(mode)
        apply_overrides(cfg, {f"sync.{name}": value for name, value in settings.items()})  # typed; unknown: error
        check_fields(cfg)
        return cfg.sync

    def compress_gradients(
        self,
        gradients: Any,
        compression_type: str = "topk",
        *,
        name: str = "",
        ratio: float | None = None,
        k: float | None = None,
        threshold: float | None = None,
        bits: int | None = None,
        rank: int | None = None,
        stochastic: bool = False,
    ) -> Payload:
        """Compress `gradients` (a tensor or array) by a seed name or spec string; `k` is the seed's word for ratio."""
        onebit = str(compression_type).strip().lower() in ("sign", "onebit", "1bit")
        spec = (
            None
            if onebit
            else _resolve(compression_type, ratio if ratio is not None else k, threshold, bits, rank, stochastic)
        )
        g = torch.as_tensor(gradients)
        x = g
        residual = self.residuals.get(name) if self.error_feedback else None
        if residual is not None:
            if residual.shape != g.shape:
                raise ValueError(
                    f"the residual under name '{name}' has shape {tuple(residual.shape)}, the gradient "
                    f"{tuple(g.shape)}: pass a distinct name= per tensor"
                )
            x = g + residual
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        payload = self._compress(spec, x, name, step)
        if self.error_feedback:
            self.residuals[name] = x - payload.decompress()
        return payload

    def _compress(self, spec: CompressionSpec | None, x: torch.Tensor, name: str, step: int) -> Payload:
        if spec is None:  # 1-bit sign compression
            return sign_compress(x)
        key = zlib.crc32(name.encode())  # a stable number per name (Python's str hash is salted per process)
        if spec.kind in ("topk", "randomk", "threshold"):
            gen = seeded_generator(x.device, self.seed, RANDOMK_STREAM, step, key) if spec.kind == "randomk" else None
            return select(spec, x, gen)
        if spec.bits:
            gen = seeded_generator(x.device, self.seed, STOCHASTIC_STREAM, step, key) if spec.stochastic else None
            return quantize(x, spec.bits, spec.chunk, gen)
        if spec.kind == "powersgd" and x.dim() >= 2 and matrix_rank(x.shape, spec.rank):
            r = matrix_rank(x.shape, spec.rank)
            q = self.powersgd_q.get(name)
            if q is None or q.shape != (x[0].numel(), r):
                q = initial_q(x[0].numel(), r, torch.promote_types(x.dtype, torch.float32), x.device, self.seed, key)
            payload = compress_matrix(x, q)
            self.powersgd_q[name] = payload.q
            return payload
        return DensePayload(x.clone())


class PipelineParallelism:
    """`lmt.PipelineParallelism`: the seed's split_model / forward / backward flow, on real stages and ranks.

        pipe = lmt.PipelineParallelism(mesh)                 # mesh.pp_size stages, one per pipeline rank
        pipe.split_model(model_cfg, seed)                    # this rank's stage: the whole model's weights
        loss = pipe.forward(micro_batches)                   # GPipe's forward phase over every micro-batch
        pipe.backward()                                      # GPipe's backward phase: this stage's gradients
        loss = pipe.train_step(micro_batches)                # or one step of any schedule (1f1b, interleaved)

    forward/backward are the two phases of the GPipe schedule (all forwards, then all backwards), which is the
    only schedule where the seed's separate calls make sense; 1F1B and interleaving mix the phases, so they run
    through `train_step`. The returned loss is the mean over the micro-batches, on every rank.
    """

    def __init__(self, mesh: ParallelMesh, schedule: str = "1f1b", virtual_stages: int = 1):
        self.mesh = mesh
        self.num_stages = mesh.pp_size
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.model: PipelineModel | None = None
        self._pending: tuple | list = []
        self._executors: dict[tuple[str, int], PipelineExecutor] = {}

    def split_model(self, model_cfg: ModelConfig, seed: int, seq_len: int = 0, layers: str = "") -> torch.nn.Module:
        """Build this rank's stage(s) of the model (balanced split unless `layers` like '2,3' is given)."""
        counts = stage_layers(
            model_cfg, self.num_stages, self.virtual_stages, self.schedule, seq_len or model_cfg.max_seq_len, layers
        )
        self.model = PipelineModel(
            build_chunks(model_cfg, self.mesh, seed, counts, placement=placement_of(self.schedule))
        )
        self._executors = {}
        return self.model

    def _executor(self, kind: str, m: int) -> PipelineExecutor:
        """One executor per (schedule, micro-batch count), built once: the schedule is computed at build."""
        key = (kind, m)
        if key not in self._executors:
            v = self.virtual_stages if kind == self.schedule else 1
            # None: the last chunk computes its loss (the fused head and loss, as lmt train runs it)
            self._executors[key] = PipelineExecutor(self.model.chunks, None, self.mesh, kind, m, v)
        return self._executors[key]

    def _mean_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        if self.num_stages > 1:
            dist.all_reduce(loss_sum, group=self.mesh.pp_group)  # only the last stage holds it
        return loss_sum

    def forward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every micro-batch through every stage, keeping what backward needs (GPipe's first phase)."""
        self._gpipe = self._executor("gpipe", len(micro_batches))
        actions = self._gpipe.actions
        # The backward phase starts at the first backward, or at the receive of its gradient before it.
        first_backward = next(i for i, a in enumerate(actions) if a.op in (Op.BACKWARD, Op.RECV_GRAD))
        self._gpipe.start_step()
        self._gpipe.run(actions[:first_backward], micro_batches, 1.0 / len(micro_batches))
        self._pending = (actions[first_backward:], micro_batches)
        return self._mean_loss(self._gpipe.loss_sum.clone())

    def backward(self) -> None:
        """Gradients of this rank's stage(s), accumulated into .grad (GPipe's second phase)."""
        actions, micro_batches = self._pending
        self._gpipe.run(actions, micro_batches, 1.0 / len(micro_batches))
        self._gpipe.finish_step()

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch in the order of the configured schedule."""
        executor = self._executor(self.schedule, len(micro_batches))
        return self._mean_loss(executor.forward_backward(micro_batches, 1.0 / len(micro_batches)))

    @staticmethod
    def grid(kind: str, p: int, m: int, v: int = 1) -> list[list[str]]:
        """The schedule's compute actions per rank, as strings like '0F1' (and '0W1' for zb-h1 and zbv)."""
        return [[str(a) for a in rank if a.op in COMPUTE] for rank in build_schedule(kind, p, m, v)]
