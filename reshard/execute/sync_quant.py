"""FP8 block quantization on the way into an engine (:class:`reshard.WeightSync`'s ``quantize``).

A block of the target that straddles two trainer shards must be quantized from the whole block
(its amax is all its elements'), yet no rank should all-gather whole tensors. So the sync moves, to
each engine rank, the *cover* of its payload shard (:func:`reshard.ir.blocks.cover`: the whole
blocks its shard touches, cropped at the tensor's edge) in the sync's dtype, like any target: only
those rows and columns travel, from whichever trainer ranks hold them. The engine rank then
quantizes each block of its cover (:func:`reshard.ir.codec.fp8_block_encode`, transformers'
``Fp8Quantize`` bit for bit) and writes the part its payload shard holds into the engine's FP8
tensor and every block's scale into its ``weight_scale_inv`` (the scale map is
:func:`reshard.ir.blocks.coarsen` of the payload's: a block cut by an engine shard boundary is
quantized alike by each rank that holds part of it). The result equals quantizing the full
weight in the sync's dtype and slicing, whatever the trainer's shard boundaries.

Which weights: :class:`Fp8Block` ``weights`` (a predicate on name and shape), else the offline
``--quantize`` choice (:func:`reshard.formats.safetensors.writer.quantizable`: transformers' FP8
quantizer's linears where ``hf_config`` builds the model, else by name).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MapError, QuantizedError
from ..ir.apply import view_of
from ..ir.blocks import block_runs, coarsen, cover, shard_axes
from ..ir.codec import SCALE_FORMATS, fp8_block_encode, scale_grid
from ..ir.param_map import ParamMap
from ..ir.piece import View, is_int, prod, row_major_strides
from ..layouts.inference import Placed, check_placed

__all__ = ["Fp8Block", "QuantTarget", "RankQuant", "compile_rank", "quantized_targets", "scale_name"]

COVER = "#cover"  # suffix of the staging tensor a quantized parameter's cover lands in (no engine name has it)


@dataclass(frozen=True, slots=True)
class Fp8Block:
    """Push weights as FP8 E4M3 with a ``weight_scale_inv`` per ``block`` (rows, cols), transformers'
    ``Fp8Quantize`` of the values in the sync's dtype. ``scale``: ``"float32"`` (DeepSeek-V3) or
    ``"ue8m0"`` (a power of two in one byte). ``weights(name, shape)`` says which parameters are
    quantized; by default the offline ``--quantize`` choice (``hf_config``: the model's config.json
    as a dict, for transformers' own choice of linears)."""

    block: tuple[int, int] = (128, 128)
    scale: str = "float32"
    weights: Callable[[str, tuple[int, ...]], bool] | None = None
    hf_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        b = tuple(self.block)
        if len(b) != 2 or not all(is_int(k) and k > 0 for k in b):
            raise MapError(f"Fp8Block: block {self.block!r} must be two positive ints (rows, cols)")
        object.__setattr__(self, "block", (int(b[0]), int(b[1])))
        if self.scale not in SCALE_FORMATS:
            raise MapError(f"Fp8Block: scale {self.scale!r} must be one of {sorted(SCALE_FORMATS)}")

    @property
    def scale_dtype(self) -> torch.dtype:
        return SCALE_FORMATS[self.scale]

    def chosen(self, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
        """The names of ``shapes`` (source name -> full shape) pushed quantized."""
        if self.weights is not None:
            return {n for n, s in shapes.items() if len(s) >= 2 and self.weights(n, tuple(s))}
        from ..formats.safetensors.writer import fp8_linears, quantizable  # the offline choice, one rule

        model = fp8_linears(dict(self.hf_config), list(shapes)) if self.hf_config else None
        return {n for n, s in shapes.items() if quantizable(n, tuple(s), model)}


def scale_name(into: str) -> str:
    """The engine's scale tensor beside payload ``into`` (``X.weight`` -> ``X.weight_scale_inv``)."""
    return into + "_scale_inv"


@dataclass(frozen=True, slots=True)
class QuantTarget:
    """One quantized parameter: ``cover`` (what the sync moves, into a staging tensor), ``payload``
    (the engine's FP8 tensor, as given), ``scale`` (its scale tensor)."""

    name: str
    cover: Placed
    payload: Placed
    scale: Placed


def quantized_targets(targets: Mapping[str, Placed], chosen: set[str], fp8: Fp8Block
                      ) -> tuple[dict[str, Placed], dict[str, QuantTarget]]:
    """``targets`` with each ``chosen`` one replaced by its cover (into a staging tensor
    ``name + COVER``), and the quantized parameters. Raises :class:`MapError` naming the parameter
    for a target that cannot carry block scales: a padded one, one that is no product of per-dim
    index maps, a fused part that does not start on a block row of its engine tensor."""
    out, quant = dict(targets), {}
    for n in sorted(chosen):
        t = targets[n]
        try:
            quant[n] = _quantized(n, t, fp8.block)
        except MapError as e:
            raise MapError(f"{n!r}: cannot be pushed as FP8 blocks of {list(fp8.block)}: {e}") from e
        out[n] = quant[n].cover
    check_placed({q.name: q.scale for q in quant.values()})  # fused parts' scales tile the engine's
    return out, quant


def _quantized(name: str, t: Placed, block: tuple[int, int]) -> QuantTarget:
    m = t.map
    if m.is_padded:
        raise MapError("its target is padded")
    c = cover(m, block)
    staging = Placed(c, name + COVER, {r: s.shape for r, s in c.shards.items()}, dict.fromkeys(c.ranks, 0))
    s = coarsen(m, block)
    shapes, offsets = {}, {}
    for r in m.ranks:
        eng, shard = tuple(t.shapes[r]), m.shards[r].shape
        if eng == tuple(shard):  # a whole engine tensor: its scales are the coarsened shard's
            shapes[r], offsets[r] = s.shards[r].shape, 0
        else:
            shapes[r], offsets[r] = scale_grid(eng, block), _scale_offset(r, eng, t.offsets[r], m, block)
    return QuantTarget(name, staging, t, Placed(s, scale_name(t.into), shapes, offsets))


def _scale_offset(rank: int, engine: tuple[int, ...], offset: int, m: ParamMap, block: tuple[int, int]) -> int:
    """Where a fused part's scales start in the engine's scale tensor: the part must span whole
    rows of a 2-D engine tensor, start on a block row of it and on a block row of its own weight
    (so that the engine's blocks are the weight's, as vLLM requires)."""
    cols = prod(engine[1:])
    row = offset // cols
    axes = shard_axes(m, rank)
    start = axes[0][0][2] if axes and len(axes[0]) == 1 else -1
    if len(engine) != 2 or offset % cols or row % block[0] or m.shards[rank].shape[1:] != engine[1:] \
            or start < 0 or start % block[0]:
        raise MapError(f"rank {rank}: its part (rows from {start} of the weight) at element {offset} of the engine "
                       f"tensor {list(engine)} does not start on a row that starts a block of {block[0]} rows")
    return (row // block[0]) * scale_grid(engine, block)[1]


# -- one rank's encoding ---------------------------------------------------------------------------

Box = tuple[tuple[int, ...], View, View]  # (shape, source view, dest view)


@dataclass(frozen=True, slots=True)
class RankQuant:
    """What one engine rank does for one quantized parameter after the move: encode each ``cells``
    box of the cover (its shape, its view in the cover, its scales' view in the scale shard, its
    first element in F), then copy ``crops`` (cover -> payload shard) and write the scale shard."""

    name: str
    cover_shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    cells: tuple[tuple[tuple[int, ...], View, View, tuple[int, ...]], ...]
    crops: tuple[Box, ...]
    payload_into: str
    payload_offset: int
    scale_into: str
    scale_offset: int


def compile_rank(q: QuantTarget, rank: int, block: tuple[int, int]) -> RankQuant | None:
    """Rank ``rank``'s encoding of ``q`` (``None``: it holds no part of the payload)."""
    m = q.payload.map
    if rank not in m.shards:
        return None
    runs = block_runs(m, rank, block)
    axes = shard_axes(m, rank)
    if runs is None or axes is None:
        return None
    logical = m.logical_shape
    b = (1,) * (len(logical) - 2) + block
    elems = []  # per dim: (F lo, F hi, cover dest, scale dest)
    for dim, n, k in zip(runs, logical, b):
        at, out = 0, []
        for lo, hi, dest in dim:
            e0, e1 = lo * k, min(hi * k, n)
            out.append((e0, e1, at, dest))
            at += e1 - e0
        elems.append(out)
    cover_shape = tuple(sum(e1 - e0 for e0, e1, _, _ in dim) for dim in elems)
    scale_shape = tuple(sum(hi - lo for lo, hi, _ in dim) for dim in runs)
    cs, ss = row_major_strides(cover_shape), row_major_strides(scale_shape)
    cells = []
    for cell in _product(elems):
        shape = tuple(e1 - e0 for e0, e1, _, _ in cell)
        at_cover = View.trusted(sum(c[2] * s for c, s in zip(cell, cs)), cs)
        at_scale = View.trusted(sum(c[3] * s for c, s in zip(cell, ss)), ss)
        cells.append((shape, at_cover, at_scale, tuple(c[0] for c in cell)))
    shard = m.shards[rank].shape
    ps = row_major_strides(shard)
    crops = []
    for parts in _product([_crop_axis(ax, dim) for ax, dim in zip(axes, elems)]):
        shape = tuple(n for _, _, n in parts)
        src = View.trusted(sum(e * s for (_, e, _), s in zip(parts, cs)), cs)
        dst = View.trusted(sum(t * s for (t, _, _), s in zip(parts, ps)), ps)
        crops.append((shape, src, dst))
    return RankQuant(q.name, cover_shape, scale_shape, tuple(cells), tuple(crops), q.payload.into,
                     q.payload.offsets[rank], q.scale.into, q.scale.offsets[rank])


def _crop_axis(axis: list[tuple[int, int, int]], cover_dim: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    """A payload dim's segments located in the cover: ``(payload dest, cover dest, length)``."""
    out = []
    for lo, hi, f in axis:
        for e0, e1, at, _ in cover_dim:
            a, z = max(f, e0), min(f + hi - lo, e1)
            if a < z:
                out.append((lo + a - f, at + a - e0, z - a))
    return out


def _product(axes: list[list]) -> list[tuple]:
    out: list[tuple] = [()]
    for axis in axes:
        out = [c + (x,) for c in out for x in axis]
    return out


def encode(rq: RankQuant, staged: torch.Tensor, block: tuple[int, int], scale: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 cover and the scale shard of ``rq`` from its staged cover (flat, the sync's dtype).
    Raises :class:`QuantizedError` naming the block and the part of F it was counted in."""
    q = torch.empty(rq.cover_shape, dtype=torch.float8_e4m3fn, device=staged.device).view(-1)
    s = torch.empty(rq.scale_shape, dtype=SCALE_FORMATS[scale], device=staged.device).view(-1)
    for shape, at_cover, at_scale, at in rq.cells:
        try:
            cq, cs = fp8_block_encode(view_of(staged, shape, at_cover), block, scale)
        except QuantizedError as e:  # its index is the cell's: say where it lies in the weight
            raise QuantizedError(_where(view_of(staged, shape, at_cover), at, block, str(e))) from None
        view_of(q, shape, at_cover).copy_(cq)
        view_of(s, tuple(cs.shape), at_scale).copy_(cs)
    return q, s


def _where(cell: torch.Tensor, at: tuple[int, ...], block: tuple[int, int], why: str) -> str:
    """A refused cell's first NaN/inf element and its block, in F's coordinates (else ``why`` and the cell)."""
    bad = (~torch.isfinite(cell)).nonzero()
    if not len(bad):
        return f"{why} (counted within F[{', '.join(f'{a}:{a + n}' for a, n in zip(at, cell.shape))}])"
    f = [a + int(i) for a, i in zip(at, bad[0])]
    b = (1,) * (len(f) - 2) + block
    return (f"element {f} is {cell[tuple(bad[0])].item()}: block {[x // k for x, k in zip(f, b)]} cannot be "
            "quantized (FP8 holds no NaN or infinity)")


def write(rq: RankQuant, q: torch.Tensor, s: torch.Tensor, into: Mapping[str, torch.Tensor]) -> None:
    """Copy the payload shard's part of the FP8 cover ``q`` and the scale shard ``s`` into the engine
    tensors (flat, by name)."""
    payload = into[rq.payload_into]
    for shape, src, dst in rq.crops:
        view_of(payload, shape, View.trusted(dst.offset + rq.payload_offset, dst.strides)).copy_(view_of(q, shape, src))
    into[rq.scale_into].narrow(0, rq.scale_offset, s.numel()).copy_(s)


def quantize_rank(plans: list[RankQuant], staged: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor],
                  fp8: Fp8Block, rank: int) -> list[str]:
    """Encode every parameter of this rank, then (only when none failed) write them: the problem
    lines, one per parameter that failed (nothing written then)."""
    done, problems = [], []
    for rq in plans:
        try:
            done.append((rq, *encode(rq, staged[rq.name], fp8.block, fp8.scale)))
        except QuantizedError as e:
            problems.append(f"rank {rank}: {rq.name!r}: {e}")
    if not problems:
        for rq, q, s in done:
            write(rq, q, s, into)
    return problems
