"""One rank's training state, assembled from a validated config in one function whose order is stated once
(the shape of torchtitan's `parallelize_llama`):

  1. build on meta       this rank's pipeline chunks as `Transformer`s on the meta device: no memory yet
                         (each told the end-of-document id when attention is masked per document)
  2. tensor parallel     their projections, embedding and head swapped for tp shards (mesh.tp), still on meta;
                         expert parallel: each MoE block keeps E / ep experts and dispatches over mesh.ep
  3. materialise, init   allocated on the device, tied, initialised by parameter name: a rank never allocates
                         weights it will not keep, and every layout starts from the tp=1, pp=1 weights.
                         Under ZeRO-3 this waits until step 6 has sharded the chunks on meta (as torchtitan
                         does): each rank allocates and initialises only its FSDP2 shards
  3b. context parallel   under cp > 1 each chunk gets the cp group's attention and zig-zag positions (no shape
                         changes: each rank is only fed a shorter part of every sequence)
  3c. fp8                --precision fp8: each block's linears get float8 GEMMs (models/float8.py), told which
                         dimension tp shards so that their scales are the whole tensor's
  3d. ep overlap         --parallel.ep_overlap: MoE blocks dispatch in two parts, exchanges overlapping experts
  4. recompute           the policy wraps blocks or attention cores (parameter names unchanged)
  4b. compile            --compile: each block compiled in place (regional_compile.py), after tp and recompute
                         and before FSDP2 wraps the blocks, as torchtitan orders them
  5. load weights        --init-from-hf copies a Hugging Face model into the materialised shards, before the
                         engine adopts them: what step 6 copies into flat buffers or shards is the loaded model
  6. data parallel       the engine adopts the parameters into its flat buffers (ZeRO 0-2) or shards them
                         (FSDP2, ZeRO 3), and owns the optimizer
  7. executor            the pipeline schedule over this rank's chunks (pp = 1 runs the same executor)

Resuming from a checkpoint comes after, in the trainer, because it restores the engine's optimizer state too.

A new parallel axis plugs in at four places: a mesh dimension (`mesh.py`), its rules in the one layout check
(`layout.py`), a step here (where its modules are swapped or wrapped: before materialising if it changes
shapes, around the engine if it changes what is reduced), and its planner terms (memory, time, search).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from large_model_training.choices import Schedule, bf16_compute
from large_model_training.config import Config, ModelConfig
from large_model_training.memory.recompute import apply_recompute
from large_model_training.mesh import ParallelMesh
from large_model_training.models.float8 import apply_float8, bf16_blocks
from large_model_training.models.hf import import_hf, load_hf_into_model
from large_model_training.models.init import init_parameters
from large_model_training.models.transformer import StageSpec, Transformer
from large_model_training.parallel.context import ContextAttention
from large_model_training.parallel.engine import Engine, build_engine
from large_model_training.parallel.expert import apply_expert_parallel, overlap_expert_exchanges
from large_model_training.parallel.pipeline.partition import stage_layers, stage_specs
from large_model_training.parallel.pipeline.runtime import PipelineExecutor, PipelineModel
from large_model_training.parallel.pipeline.schedules import placement_of, rank_stages
from large_model_training.parallel.tensor import apply_tensor_parallel
from large_model_training.regional_compile import compile_blocks


@dataclass
class Assembled:
    """What `assemble` returns: the rank's model, its data-parallel engine and its pipeline executor."""

    model: nn.Module
    """The `Transformer` (pp = 1) or the `PipelineModel` of this rank's chunks; names as in the whole model."""
    engine: Engine
    executor: PipelineExecutor


def build_model(
    cfg: ModelConfig,
    mesh: ParallelMesh | None,
    seed: int,
    device: torch.device | None = None,
    sequence_parallel: bool = False,
    stage: StageSpec | None = None,
    materialise: AbstractContextManager | None = None,
    on_meta: bool = False,
) -> nn.Module:
    """Steps 1-3 for one chunk (the whole model unless `stage` says which slice), initialised identically to
    the single-device model for the same seed. With a mesh whose tp axis is > 1 its layers are tp shards.
    `materialise`: a context to allocate and initialise in (`lmt rehearse`'s FakeTensorMode); the modules are
    built on meta outside it, since parameters created in fake mode cannot be swapped for allocated ones.
    `on_meta`: stop before step 3 (ZeRO-3 shards first; `materialise_chunk` completes it)."""
    device = device or (mesh.device if mesh is not None else torch.device("cpu"))
    with torch.device("meta"):
        model = Transformer(cfg, stage)
    if mesh is not None and mesh.tp_size > 1:
        apply_tensor_parallel(model, mesh.tp, sequence_parallel)
    if mesh is not None and getattr(mesh, "ep_size", 1) > 1:  # MoE blocks keep E / ep experts (on meta)
        apply_expert_parallel(model, mesh.ep)
    if on_meta:
        model.tie_weights()  # one parameter for FSDP2 to shard
        return model
    with materialise or nullcontext():
        materialise_chunk(model, cfg, seed, device)
    return model


def materialise_chunk(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device) -> None:
    """Step 3: allocate a chunk built on meta (or only its shards, after FSDP2 sharded it), tie and initialise."""
    model.to_empty(device=device)
    model.tie_weights()
    init_parameters(model, cfg, seed)


def build_chunks(
    cfg: ModelConfig,
    mesh: ParallelMesh,
    seed: int,
    chunk_layers: list[int],
    sequence_parallel: bool = False,
    materialise: AbstractContextManager | None = None,
    placement: str = "loop",
    on_meta: bool = False,
) -> dict[int, nn.Module]:
    """This pipeline rank's chunks (virtual stage index -> module), from the blocks of every virtual stage;
    `placement` says which stages a rank holds (the schedule's: "loop", or zbv's "v")."""
    specs = stage_specs(chunk_layers)
    v = len(chunk_layers) // mesh.pp_size
    return {
        j: build_model(
            cfg,
            mesh,
            seed,
            sequence_parallel=sequence_parallel,
            stage=specs[j],
            materialise=materialise,
            on_meta=on_meta,
        )
        for j in rank_stages(mesh.pp_rank, mesh.pp_size, v, placement)
    }


def assemble(
    cfg: Config,
    mesh: ParallelMesh,
    micro_batches: int,
    document_eod: int | None = None,
    materialise: AbstractContextManager | None = None,
) -> Assembled:
    """Steps 1-7 (module docstring) for this rank of `mesh`, training `micro_batches` per step and dp rank.
    `document_eod`: the end-of-document token id when attention and positions stay inside each document of a
    packed sequence (`data.document_mask`), else None. `materialise`: the context steps 3-7 allocate in (a
    FakeTensorMode when `lmt rehearse` runs a rank of a huge world without its memory), else none."""
    p, t = cfg.parallel, cfg.train
    layers = stage_layers(cfg.model, p.pp, p.virtual_stages, p.schedule, t.seq_len, p.pp_layers)
    # ZeRO-3 materialises after FSDP2 has sharded the chunks on meta: a rank never holds the whole model (a
    # 70B model is 280 GB in fp32). Not when Hugging Face weights are loaded: they arrive whole anyway.
    shard_first = p.zero == 3 and not _loads_hf(cfg)
    chunks = build_chunks(
        cfg.model,
        mesh,
        t.seed,
        layers,
        p.sequence_parallel,
        materialise,  # steps 1-3 (1-2 when sharding first)
        placement_of(p.schedule) if mesh.pp_size > 1 else "loop",
        on_meta=shard_first,
    )
    with materialise or nullcontext():
        return _wrap(cfg, mesh, micro_batches, document_eod, chunks, shard_first)


def _loads_hf(cfg: Config) -> bool:
    """Step 5 runs: a Hugging Face model initialises the run (a resumed run loads its checkpoint instead)."""
    return bool(cfg.run.init_from_hf) and not cfg.run.resume


def _wrap(
    cfg: Config,
    mesh: ParallelMesh,
    micro_batches: int,
    document_eod: int | None,
    chunks: dict[int, nn.Module],
    on_meta: bool = False,
) -> Assembled:
    """Steps 4-7 around the materialised chunks (`on_meta`: still on meta; the engine materialises them)."""
    p, t = cfg.parallel, cfg.train
    for chunk in chunks.values():
        chunk.document_eod = document_eod
        chunk.fused_loss = t.fused_loss  # the last chunk's loss: the head fused in, or on whole logits
        chunk.mtp_weight = t.mtp_loss_weight
        if mesh.cp_size > 1:  # step 3b
            chunk.set_context(ContextAttention(mesh.cp, p.cp_attention))
        if t.precision == "fp8":  # step 3c
            apply_float8(chunk, t.fp8_recipe, mesh.tp, bf16_blocks(cfg.model.n_layers, t.fp8_bf16_first_last))
        if p.ep_overlap and getattr(mesh, "ep_size", 1) > 1:  # step 3d
            overlap_expert_exchanges(chunk, mesh.ep)
    model = chunks[0] if mesh.pp_size == 1 else PipelineModel(chunks)
    apply_recompute(model, t.recompute, traced=t.compile)  # step 4
    if t.compile:  # step 4b
        compile_blocks(model, t.compile_backend)
    if _loads_hf(cfg):  # step 5
        load_hf_into_model(model, import_hf(cfg.run.init_from_hf, cfg.model)[1])

    def materialise() -> None:  # step 3, after FSDP2 has sharded the chunks
        for chunk in chunks.values():
            materialise_chunk(chunk, cfg.model, t.seed, mesh.device)

    engine = build_engine(model, mesh, cfg, materialise if on_meta else None)  # step 6
    # On one stage every schedule is F, B per micro-batch: run 1f1b's order (gpipe's all-F-then-all-B would hold
    # every micro-batch's activations at once for nothing).
    schedule = p.schedule if mesh.pp_size > 1 else Schedule.ONE_F_ONE_B
    executor = PipelineExecutor(
        chunks,
        None,
        mesh,
        schedule,
        micro_batches,  # step 7 (the last chunk's own loss)
        p.virtual_stages,
    )
    executor.act_dtype = torch.bfloat16 if bf16_compute(t.precision) else torch.float32
    executor.before_backward = getattr(engine, "before_backward", None)  # ZeRO-3: its per-step sync; ZeRO-2: rounds
    return Assembled(model, engine, executor)
