"""Infrequent synchronisation of data-parallel replicas: DiLoCo (`--sync local:H`) and Streaming DiLoCo
(`--sync streaming:H`).

DiLoCo (Douillard et al. 2023): each dp replica (its ranks, with their own tp / pp inside) trains on its own
share of every global batch for H inner steps with the ordinary AdamW, reducing gradients over no dp group at
all (the inner engine is built on `mesh.reducing_over(None, 1, 0)`; the tp and pipeline sums stay). Then the
outer step: the outer gradient delta = anchor - params (fp32), averaged over dp, moves the fp32 anchor by
Nesterov momentum SGD (`sync.outer_lr`, `sync.outer_momentum`), and every replica's parameters become the new
anchor. Inner AdamW moments stay per replica, as in the paper. Clipping of inner steps uses the replica's own
gradient norm. With H = 1, outer_lr = 1 and momentum 0 the outer step is plain averaging of the replicas'
parameters after one AdamW step each: the same as dense data parallelism with AdamW's update averaged
(`--compression-target update`); not the same as averaging gradients, because AdamW is not linear in them.
`sync.warmup` N: the first N steps each end by averaging the replicas' parameters (a dense start: DiLoCo's
recipe starts from a densely pretrained model); the outer schedule runs after them.

Streaming DiLoCo (Douillard et al. 2025): the model's parameters (this rank's, in parameter order) are split
into `sync.fragments` contiguous groups of about equal size; fragment i syncs at the steps t with
(t - o_i) % H == 0, o_i = i H / fragments, so only 1 / fragments of the model is on the wire at a time. Its
exchange starts right after the inner step t and is applied `sync.overlap` inner steps later, while those steps
compute (overlap 0: at once; streaming:H with fragments = 1 and overlap = 0 is local:H). Applying replaces the
fragment by the new anchor (the paper's mixing factor alpha = 0): the overlapped inner steps' progress on that
fragment is dropped, as in the paper's alpha = 0 runs.

What goes on the wire (`sync.compression`): 'none' fp32 all-reduce (4 bytes per element), 'bf16' all-reduce (2),
'int8' / 'int4' per-chunk absmax (compression/quantize.py: 1 or 1/2 byte + 4 / 256) and 'sign' (signs and one mean
|x| per 256, compression/sign.py's OUTER_SIGN_CHUNK: 1/8 byte + 4 / 256) through the two-stage compressed average
(compression/two_stage.py: an all-to-all of each replica's shards, each shard's owner averages and encodes again,
an all-gather), whose bytes per rank on the wire are a ring all-reduce's of the compressed size at any dp (an
all-gather of every replica's whole message, as before, moved dp / 2 times more). The lossy formats keep an
error-feedback residual per element (what a sync did not send is added to the next outer gradient), and the
two-stage ones a server residual for the shard this rank serves. The bytes count in comm_bytes_dp on the step
each collective starts: the all-to-all on the step the exchange starts, the all-gather (which needs its result)
on the step that waits for it, `overlap` steps later under streaming, where only the first stage overlaps the
inner steps. Inner steps send nothing else over dp.

Checkpoints: the anchor, the outer momentum and the outer step count are identical on every replica and are
saved with the optimizer state by parameter name (through DCP, any layout). Between syncs the replicas'
parameters differ, and the inner AdamW moments always do; DCP keeps one copy of equally named tensors, so each
rank also saves its own fp32 parameters, inner moments, residuals and any exchange in flight (already averaged)
in its rank file (`rank_state_dict`): a resume in the same layout is exact at any step. In another layout the
rank files do not map one to one: every replica restarts from the anchor with the saved inner moments of one
replica, residuals zero and an exchange in flight dropped.
"""

from __future__ import annotations

import torch

from large_model_training.choices import SYNC_CODED
from large_model_training.compression.sign import OUTER_SIGN_CHUNK, Codec
from large_model_training.compression.two_stage import start_average
from large_model_training.compression.wire import all_reduce
from large_model_training.config import SyncConfig
from large_model_training.mesh import ParallelMesh
from large_model_training.parallel.adamw import AdamW
from large_model_training.parallel.comm_hooks import AllReduceState
from large_model_training.parallel.pieces import ShardPiece
from large_model_training.parallel.update_rule import RuleContext, RuleFactory, UpdateRule


@torch.no_grad()
def nesterov_step(param: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor, lr: float, momentum: float) -> None:
    """torch.optim.SGD(nesterov=True, dampening=0) on one tensor: buf = mu buf + g; param -= lr (g + mu buf).
    A zero buffer on the first step gives torch's buf = g."""
    buf.mul_(momentum).add_(grad)
    param.sub_(grad.add(buf, alpha=momentum), alpha=lr)


def fragment_spans(pieces, order: list[str], fragments: int) -> list[list[tuple[int, int, int]]]:
    """Split the parameters (in `order`) into `fragments` contiguous groups of about equal element count; each
    group is a list of (piece index, a, b) spans of the pieces' flat buffers, adjacent spans merged."""
    where = {name: (i, a, b) for i, piece in enumerate(pieces) for name, a, b, _ in piece.params}
    names = [n for n in order if n in where]
    total = sum(where[n][2] - where[n][1] for n in names) or 1
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(fragments)]
    before = 0
    for name in names:
        i, a, b = where[name]
        spans = out[min(fragments - 1, before * fragments // total)]
        if spans and spans[-1][0] == i and spans[-1][2] == a:
            spans[-1] = (i, spans[-1][1], b)
        else:
            spans.append((i, a, b))
        before += b - a
    return out


class _Exchange:
    """One fragment's outer gradient on its way: the averaged delta once `average()` has waited for it."""

    def __init__(self, fragment: int, apply_at: int, wait=None, value: torch.Tensor | None = None):
        self.fragment, self.apply_at, self._wait, self._value = fragment, apply_at, wait, value

    def average(self) -> torch.Tensor:
        if self._value is None:
            self._value, self._wait = self._wait(), None
        return self._value


class DiLoCo(UpdateRule):
    """The outer step around an inner rule (AdamW) whose gradients reduce over no dp group: the inner rule steps
    every step, `end_step` runs the outer step of the fragments due over the outer (dp) group."""

    def __init__(self, inner: AdamW, ctx: RuleContext, mesh: ParallelMesh, sync: SyncConfig):
        if ctx.shards.zero != 0:
            raise ValueError("--sync local/streaming needs ZeRO-0 (whole optimizer state per replica)")
        self.inner, self.shards = inner, ctx.shards
        self.sync = sync
        self.state = AllReduceState(mesh.grad_group, mesh.grad_size)  # the outer group: all replicas (byte counter)
        self.pieces = ctx.shards.pieces
        self.every = sync.mode.every
        streaming = sync.mode.kind == "streaming"
        n_fragments = sync.fragments if streaming else 1
        self.overlap = sync.overlap if streaming else 0
        order = [n for n, p in ctx.model.named_parameters() if p.requires_grad]
        self.fragments = fragment_spans(self.pieces, order, n_fragments)
        self.offsets = [i * self.every // n_fragments for i in range(n_fragments)]
        self.anchor = [p.master.detach().float().clone() for p in self.pieces]
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        lossy = sync.compression != "none" and self.state.group_size > 1
        self.residual = [torch.zeros_like(a) for a in self.anchor] if lossy else None
        self.codec = Codec(sync.compression, OUTER_SIGN_CHUNK) if lossy and sync.compression in SYNC_CODED else None
        n = self.state.group_size  # the server residual: this rank's shard of each fragment
        self.server_residual = (
            [
                torch.zeros(-(-sum(b - a for _, a, b in spans) // n), device=self.anchor[0].device)
                for spans in self.fragments
            ]
            if self.codec
            else []
        )
        self.outer_steps = 0  # inner steps taken so far (the schedule's clock; saved with the anchor)
        self.pending: list[_Exchange] = []
        self._applied: list[int] = []  # fragments (streaming) whose outer update was applied this step
        shapes = {name: param.shape for bucket in ctx.shards.buckets for name, param, _ in bucket.params}
        self._named = [
            (name, i, a, b, shapes[name]) for i, piece in enumerate(self.pieces) for name, a, b, _ in piece.params
        ]

    def step(
        self, pieces: list[ShardPiece], grads: list[torch.Tensor], lr: float, grad_scale: torch.Tensor | float
    ) -> None:
        self.inner.step(pieces, grads, lr, grad_scale)

    def end_step(self, stepped: bool) -> None:
        """After every step on every rank (the schedule counts skipped steps too, so every rank of the outer
        group exchanges the same fragments): apply the exchanges due, then start the fragments due."""
        self.inner.end_step(stepped)
        self.outer_steps += 1
        self.state.bytes_sent, self._applied = 0, []
        t = self.outer_steps
        for ex in [ex for ex in self.pending if ex.apply_at <= t]:
            self.pending.remove(ex)
            self._apply(ex.fragment, ex.average())
        if t <= self.sync.warmup:  # dense start: the replicas' parameters averaged after every step
            for f in range(len(self.fragments)):
                if self.fragments[f]:
                    self._apply(f, self._start(f, t).average(), averaging=True)
            return
        for f, offset in enumerate(self.offsets):
            if t >= max(offset, self.sync.warmup + 1) and (t - offset) % self.every == 0 and self.fragments[f]:
                ex = self._start(f, t + self.overlap)
                if self.overlap:
                    self.pending.append(ex)
                else:
                    self._apply(f, ex.average())

    @torch.no_grad()
    def _start(self, f: int, apply_at: int) -> _Exchange:
        """Start fragment f's exchange: its outer gradient (anchor - params, plus the residual) averaged."""
        spans = self.fragments[f]
        delta = torch.cat([self.anchor[i][a:b] - self.pieces[i].master[a:b].float() for i, a, b in spans])
        n = self.state.group_size
        if n == 1:
            return _Exchange(f, apply_at, value=delta)
        if self.residual is not None:
            delta += torch.cat([self.residual[i][a:b] for i, a, b in spans])
        if self.codec is not None:
            return _Exchange(f, apply_at, self._start_two_stage(f, spans, delta))
        kind = self.sync.compression
        buf = delta.bfloat16() if kind == "bf16" else delta
        if kind == "bf16":
            self._keep_residual(spans, delta - buf.float())
        work = all_reduce(self.state, buf)
        return _Exchange(f, apply_at, lambda: (work.wait(), buf.float().div_(n))[1])

    def _start_two_stage(self, f: int, spans, delta: torch.Tensor):
        """Stage 1 of fragment f's compressed average started; returns what waits for it and runs stage 2."""
        error = self.server_residual[f]
        sent, serve = start_average(self.state, self.codec, delta, error)
        self._keep_residual(spans, delta - sent)

        def finish() -> torch.Tensor:
            rows, gather = serve()
            gather.wait()
            return self.codec.decode(rows, error.numel()).view(-1)[: delta.numel()]

        return finish

    def _keep_residual(self, spans, rest: torch.Tensor) -> None:
        at = 0
        for i, a, b in spans:
            self.residual[i][a:b].copy_(rest[at : at + b - a])
            at += b - a

    @torch.no_grad()
    def _apply(self, f: int, average: torch.Tensor, averaging: bool = False) -> None:
        """The outer Nesterov step on fragment f's anchor (`averaging`: the anchor becomes the replicas' mean,
        the momentum untouched); the replica's parameters become the new anchor."""
        at = 0
        for i, a, b in self.fragments[f]:
            anchor = self.anchor[i][a:b]
            if averaging:
                anchor.sub_(average[at : at + b - a])
            else:
                nesterov_step(
                    anchor,
                    self.momentum[i][a:b],
                    average[at : at + b - a],
                    self.sync.outer_lr,
                    self.sync.outer_momentum,
                )
            at += b - a
            self._set_params(i, a, b, anchor)
        self._applied.append(f)

    def _set_params(self, i: int, a: int, b: int, values: torch.Tensor) -> None:
        piece = self.pieces[i]
        piece.master[a:b].copy_(values)
        if piece.own_master:  # bf16 parameters from their fp32 masters
            piece.param_view[a:b].copy_(piece.master[a:b])

    def record(self) -> dict:
        """This step's metrics: sync_outer (1 when the replicas took a synchronised anchor at this step's end: an
        outer update, or a `sync.warmup` averaging), streaming: which fragments."""
        record: dict[str, int | list[int]] = {"sync_outer": int(bool(self._applied))}
        if self.sync.mode.kind == "streaming":
            record["sync_fragments"] = list(self._applied)
        return record

    def comm_bytes(self) -> int:
        """dp bytes this step: what the outer exchanges' collectives started this step were given (inner steps
        send nothing over dp)."""
        return self.inner.comm_bytes() + self.state.bytes_sent

    # ---- state -------------------------------------------------------------------------------------
    def _outer_tensors(self) -> list[torch.Tensor]:
        return [*self.anchor, *self.momentum, *(self.residual or []), *self.server_residual]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.inner.tensors(), *self._outer_tensors()]

    def _by_name(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensors[i][a:b].view(shape) for name, i, a, b, shape in self._named}

    def state_dict(self) -> dict:
        """The inner optimizer's state by name, plus the outer state every replica holds alike: the fp32 anchor,
        the Nesterov momentum and the step clock."""
        return {
            **self.inner.state_dict(),
            "outer_anchor": self._by_name(self.anchor),
            "outer_momentum": self._by_name(self.momentum),
            "outer_steps": torch.tensor(self.outer_steps),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict({k: v for k, v in state.items() if not k.startswith("outer_")})
        for ours, key in ((self.anchor, "outer_anchor"), (self.momentum, "outer_momentum")):
            for name, view in self._by_name(ours).items():
                view.copy_(state[key][name])
        self.outer_steps = int(state["outer_steps"])

    def rank_state_dict(self) -> dict:
        """What differs between replicas: this rank's fp32 parameters, inner moments, residuals (the server's: of
        the shards this rank serves), and any exchange in flight (waited for first: its average, and the server
        residual it leaves), with the layout they fit."""
        pending = [{"fragment": ex.fragment, "apply_at": ex.apply_at, "average": ex.average()} for ex in self.pending]
        return {
            "diloco": 1,
            "steps": self.outer_steps,
            "masters": [p.master.float() for p in self.pieces],
            "moments": self.inner.rank_moments(),
            "residuals": self.residual or [],
            "server_residuals": self.server_residual,
            "pending": pending,
        }

    @torch.no_grad()
    def load_rank_state_dict(self, saved: dict, same_layout: bool) -> None:
        """The replica's own state in the layout it was saved in; elsewhere (or without it) every replica
        restarts from the anchor (the inner moments stay those of the checkpoint's copy)."""
        for ex in self.pending:
            ex.average()  # every rank started it: let it finish before it is dropped
        self.pending = []
        if same_layout and saved.get("diloco") and saved.get("steps") == self.outer_steps:
            for i, master in enumerate(saved["masters"]):
                self._set_params(i, 0, master.numel(), master)
            self.inner.load_rank_moments(saved["moments"])
            for ours, theirs in zip(
                [*(self.residual or []), *self.server_residual],
                [*saved["residuals"], *saved.get("server_residuals", [])],
            ):
                ours.copy_(theirs)
            self.pending = [_Exchange(p["fragment"], p["apply_at"], value=p["average"]) for p in saved["pending"]]
            return
        for i, anchor in enumerate(self.anchor):
            self._set_params(i, 0, anchor.numel(), anchor)
        for residual in [*(self.residual or []), *self.server_residual]:
            residual.zero_()


def outer_rule(inner: RuleFactory, mesh: ParallelMesh, sync: SyncConfig) -> RuleFactory:
    """DiLoCo's rule factory: `inner`'s rule inside the outer step over `mesh`'s dp group (the engine itself is
    built on `mesh.reducing_over(None, 1, 0)`, ZeRO-0)."""

    def make(ctx: RuleContext) -> DiLoCo:
        rule = inner(ctx)
        if not isinstance(rule, AdamW):
            raise ValueError("--sync local/streaming runs AdamW inner steps")
        return DiLoCo(rule, ctx, mesh, sync)

    return make
