"""Layout-free weight initialisation in O(shard): each rank draws only the part of each parameter it holds.

Why layout-free: a model split over tensor-parallel ranks or pipeline stages must start from exactly the same
full weights as the unsplit model for the same seed, so that every layout trains the same loss curve and
checkpoints are portable. Drawing parameters in construction order from one global generator would tie the
values to which modules a rank happens to build.

Why tiles: drawing each full tensor and cutting a slice costs every rank the whole model's worth of random
numbers (a llama3-405b rank would draw whole 53248 x 16384 matrices). Instead the full tensor of parameter
`layers.5.attn.wq.weight` is a grid of tiles (512 x 512 for a matrix, 2^18 elements for a vector) and tile
(i, j) is drawn from its own generator, seeded by (seed, name, i, j). An element's value depends only on those,
so a rank draws just the tiles that overlap its region (`local_region`, which parallel layers in
`parallel/tensor.py` describe) and keeps their overlap: O(shard + tile boundary) random numbers and one tile of
scratch memory. Rows past the real ones (vocabulary padding) are zero.

Why 512: shards end on multiples of the head size or of ffn/tp, rarely of 1024, and a rank draws every tile it
touches. For one tp8 rank, random numbers drawn per number kept: 1.09 (512) against 1.36 (1024) for
llama-100b, 1.03 against 1.14 for llama3-405b; 256 gains ~7% more but quadruples the per-tile overhead that
dominates on an accelerator (~7,000 tiles per llama-100b rank at 512).

Tiles are drawn in fp32 on the parameter's device, then cast into the parameter (a bf16 shard holds the fp32
full tensor rounded). CPU and CUDA generators give different streams (and CUDA's can depend on the GPU model,
through the SM count in its launch shape), so the weights are identical across layouts on the same kind of
device, not across device kinds. Drawing on the host and copying per tile would make them portable, but host
drawing (~130 M normals/s per core) is the cost an accelerator rank should not pay.

Scheme (GPT-2 / Megatron): normal(0, init_std) for projections and embeddings; the two projections that
write into the residual stream (`wo`, `w_down`, the experts' and shared experts' `w_down`) scaled by
1/sqrt(2 n_layers); norms start at weight 1, bias 0. Expert weights (E, out, in) tile as E stacked matrices.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Shard

from large_model_training.config import ModelConfig

RESIDUAL_OUTPUT_PROJECTIONS = ("attn.wo.weight", "mlp.w_down.weight", "mlp.experts.w_down", "mlp.shared.w_down.weight")
MATRIX_TILE = 512
VECTOR_TILE = 1 << 18

Region = tuple[tuple[int, int], ...]
"""A block of a full tensor: (start, stop) per dim, in full-tensor coordinates."""


def tile_seed(seed: int, name: str, tile: tuple[int, ...]) -> int:
    """A stable 63-bit seed for one tile of a named parameter (blake2b is stable across processes, unlike
    hash(), and 64 bits keep the ~10^6 tiles of a large model apart, which crc32 would not)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{tile}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Tile size per dim: 2^18-element blocks of a vector, 512 x 512 blocks of the last two dims otherwise."""
    if len(shape) <= 1:
        return (VECTOR_TILE,) * len(shape)
    return (1,) * (len(shape) - 2) + (MATRIX_TILE, MATRIX_TILE)


def full_shape(module: nn.Module, param_name: str, param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of a parameter: parallel layers override it, plain ones have param.shape."""
    if hasattr(module, "full_shape"):
        return tuple(module.full_shape(param_name))
    return tuple(param.shape)


def local_region(module: nn.Module, param_name: str, param: torch.Tensor) -> Region:
    """The block of the full tensor this rank holds. It lies at the start of the local tensor along every dim;
    whatever of the local tensor is past it is padding (zero). Plain modules hold the whole tensor."""
    if hasattr(module, "local_region"):
        return tuple(module.local_region(param_name))
    return tuple((0, size) for size in param.shape)


def _slices(box: Region, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """Indices of `box` (full-tensor coordinates) in a tensor whose element 0 sits at `origin`."""
    return tuple(slice(start - o, stop - o) for (start, stop), o in zip(box, origin))


def _extent(region: Region) -> tuple[slice, ...]:
    """Where a region lies in the local tensor: at its start."""
    return _slices(region, tuple(start for start, _ in region))


def local_shard(module: nn.Module, param_name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full tensor (loading full weights, or comparing with a full model's tensors): its
    `local_region`, zero-padded to the local shape; a view when there is no padding."""
    local_shape = tuple(getattr(module, param_name).shape)
    region = local_region(module, param_name, full)
    cut = full[_slices(region, (0,) * full.dim())]
    if tuple(cut.shape) == local_shape:
        return cut
    out = full.new_zeros(local_shape)
    out[_extent(region)] = cut
    return out


def fill_region(
    out: torch.Tensor, cfg: ModelConfig, name: str, shape: tuple[int, ...], region: Region, seed: int
) -> None:
    """Write `region` of parameter `name`'s full initial value (full shape `shape`) into `out` (the region's
    size, any dtype and device), drawing only the tiles that overlap it, each in fp32 on out's device. A fake
    tensor (FakeTensorMode: `lmt rehearse`) or a meta one (parameter counts) holds no values, so nothing is
    drawn for it (nor a generator made for a device this machine may not have)."""
    if any(start >= stop for start, stop in region) or is_fake(out) or out.device.type == "meta":
        return
    if "norm" in name:
        out.fill_(1.0 if name.rsplit(".", 1)[-1] == "weight" else 0.0)
        return
    std = cfg.init_std
    if name.endswith(RESIDUAL_OUTPUT_PROJECTIONS):
        std /= math.sqrt(2 * cfg.n_layers)
    tiles = tile_shape(shape)
    generator = torch.Generator(device=out.device)
    spans = [range(start // t, (stop - 1) // t + 1) for (start, stop), t in zip(region, tiles)]
    region_origin = tuple(start for start, _ in region)
    for index in itertools.product(*spans):
        bounds = [(i * t, min((i + 1) * t, size)) for i, t, size in zip(index, tiles, shape)]
        generator.manual_seed(tile_seed(seed, name, index))
        tile = torch.empty([hi - lo for lo, hi in bounds], device=out.device).normal_(0.0, std, generator=generator)
        overlap = tuple((max(lo, r_lo), min(hi, r_hi)) for (lo, hi), (r_lo, r_hi) in zip(bounds, region))
        out[_slices(overlap, region_origin)].copy_(tile[_slices(overlap, tuple(lo for lo, _ in bounds))])


def draw_full(
    cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The full initial value of parameter `name` (fp32), identical in every layout: a reference, never needed
    to initialise a model."""
    full = torch.empty(shape, device=device)
    fill_region(full, cfg, name, shape, tuple((0, size) for size in shape), seed)
    return full


def _dp_shard(region: Region, param: DTensor) -> tuple[Region, torch.Tensor]:
    """The part of `region` (the tp or ep shard the unsharded parameter holds, as `param`'s global shape) that
    FSDP2's dim-0 shard `param` holds on this rank, and the local tensor to write it to. FSDP2 cuts dim 0 as
    `torch.chunk` does: ceil(rows / group) rows per rank, the last ranks' shorter or empty."""
    (placement,) = param.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise ValueError(f"expected FSDP2's Shard(0) placement, got {param.placements}")
    local = param.to_local()
    rows = param.shape[0]
    (coordinate,) = param.device_mesh.get_coordinate() or (0,)  # this rank's place in the 1-D FSDP mesh
    start = min(coordinate * -(-rows // param.device_mesh.size()), rows)
    (lo, hi), rest = region[0], region[1:]
    first = min(lo + start, hi)
    return ((first, min(first + local.shape[0], hi)), *rest), local


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of (a possibly sharded, possibly partial) model with its layout-free value, each
    rank drawing only its own region of each parameter, on the parameter's device."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight is initialised once, under its first name
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            if cfg.tie_embeddings and name == "output.weight":  # a last stage's copy of the tied embedding
                name = "tok_embeddings.weight"
            region, local = local_region(module, param_name, param), param
            if isinstance(param, DTensor):  # FSDP2's shard of it (ZeRO-3 shards on meta, then materialises)
                region, local = _dp_shard(region, param)
            inside = local[_extent(region)]
            if inside.shape != local.shape:  # padding rows start at zero
                local.zero_()
            fill_region(inside, cfg, name, full_shape(module, param_name, param), region, seed)
        # `to_empty` leaves buffers uninitialised too: the MoE routers' expert bias starts at zero.
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer_name == "expert_bias" and not is_fake(buffer) and buffer.device.type != "meta":
                buffer.zero_()
