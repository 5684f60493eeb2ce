"""Regional compilation (`--compile`): torch.compile applied to each transformer block, as torchtitan does.

Why per block, not the whole model: every block of one structure shares one compiled graph (dynamo lifts a
module's parameters to graph inputs, so block 7's graph is block 0's with other weights), so compile time does
not grow with depth; and what runs between blocks (the pipeline executor, the engine's gradient hooks, FSDP2's
gathers, the loss) stays the eager code every layout is tested with. `nn.Module.compile` compiles the block in
place: no wrapper module, so parameter names, checkpoints and the engine's buckets do not notice.

What compiles inside a block is what dynamo can trace: norms, rope, the projections (our linear function is an
autograd.Function dynamo traces whole, forward and backward), attention, swiglu and the residual adds fuse into
few kernels. What it cannot trace it runs eagerly and compiles the parts around it ("graph breaks"): a
collective whose Python counts bytes, context parallelism's ring exchange, the expert all-to-all whose split
sizes come from the host. Nothing falls back silently: after the first step the run log names the number of
graphs and of graph breaks with their reasons (`report`), and metrics.jsonl carries the seconds spent compiling
(`compile_s`, dynamo's own account: tracing, AOTAutograd and the backend, forward and the lazily compiled
backward).

Which layouts cannot compile at all is decided in the one layout check (`layout.compile_problems`).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from large_model_training.memory.recompute import checkpointed_segment, run_segments_with, segment_size

BACKENDS = ("inductor", "aot_eager")
"""inductor: fused generated kernels (the point). aot_eager: dynamo and AOTAutograd without code generation, the
same graphs run by eager kernels (torchtitan's debugging backend; the multi-rank tests use it on 2 CPU cores)."""


def chunks_of(model: nn.Module) -> list[nn.Module]:
    """The Transformers of a model: a PipelineModel's chunks, or the model itself."""
    chunks = getattr(model, "chunks", None)
    return list(chunks.values()) if isinstance(chunks, dict) else [model]


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every transformer block of `model` in place (lazily: the first forward and backward compile);
    returns how many blocks. Apply after tensor parallelism and recompute (`apply_recompute(..., traced=True)`),
    before the engine (FSDP2). Under full / every:K recompute the checkpointed segments compile instead."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown compile backend {backend!r}; one of {', '.join(BACKENDS)}")
    size = segment_size(model)
    if size is not None:  # full / every:K recompute: the checkpoint goes inside the compiled region
        segment = torch.compile(_traced_segment, backend=backend)
        for chunk in chunks_of(model):
            run_segments_with(chunk, size, segment)
    blocks = [block for chunk in chunks_of(model) for block in chunk.layers.values()]
    for block in blocks if size is None else ():
        block.compile(backend=backend)
    return len(blocks)


def _traced_segment(blocks: list[nn.Module], h: torch.Tensor, rope, mask=None) -> torch.Tensor:
    """A recompute segment as dynamo traces it (torchtitan's order: checkpoint inside compile). An eager
    checkpoint around compiled blocks fails: its recomputation, run from backward, saves the compiled graph's
    tensors in another order than the forward did (pytorch/pytorch#166926). Traced, the checkpoint becomes a
    region of the graph that AOTAutograd's partitioner recomputes."""
    return checkpointed_segment(blocks, h, rope, mask, traced=True)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's wall-time account, forward and backward)."""
    spent = torch._dynamo.utils.calculate_time_spent()
    return float(spent.get("total_wall_time", 0.0))


def report() -> str:
    """One line for the run log: graphs compiled and graph breaks, with the commonest reasons."""
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    breaks = Counter({reason.splitlines()[0][:120]: n for reason, n in counters["graph_break"].items()})
    line = f"compiled {graphs} graph(s) in {compile_seconds():.1f} s"
    if not breaks:
        return line + ", no graph breaks"
    reasons = "; ".join(f"{n}x {reason}" for reason, n in breaks.most_common(3))
    return line + f", {sum(breaks.values())} graph break(s), eager there: {reasons}"
