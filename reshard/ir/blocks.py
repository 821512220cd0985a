"""Block-scaled tensors as coupled maps (docs/spec.md §7.5): the map of a quantized weight's scales
derived from its payload's map by the block grid. Pure geometry; nothing here learns a name.

A payload F ``[..., N, K]`` in ``bm x bn`` blocks has one scale per block, S
``[..., ceil(N/bm), ceil(K/bn)]`` (leading dims: blocks of 1). A rank holds the scale of every
block its payload shard touches -- a block a shard boundary cuts is held by every shard it touches
(a piece with several locations), so each rank can dequantize, and re-quantize, what it owns.

Each payload shard must be a product of one index map per dim (every TP split, row or column,
fused sub-parameters, 2-D tilings, replication; not a flat ZeRO partition, whose shard is 1-D):
dest coordinate ``x`` of dim ``d`` holds F coordinate ``f_d(x)``. The scale shard is then the
product of, per dim, the blocks ``f_d`` touches in order of first touch, each once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import MapError
from .apply import extract
from .canonical import canonicalize
from .geometry import piece_blocks, unravel
from .param_map import ParamMap
from .piece import Piece, View, is_int, prod, row_major_strides
from .shard import Shard

__all__ = ["block_grid", "block_runs", "coarsen", "cover", "cut_blocks", "shard_axes"]

Run = tuple[int, int, int]  # (lo, hi, dest): S indices [lo, hi) of one dim at scale-shard index dest on


def block_grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """S's shape: ``ceil`` of each trailing dim by its block, leading dims as they are."""
    b = _full_block(shape, block)
    return tuple(-(-n // k) for n, k in zip(shape, b))


def coarsen(payload: ParamMap, block: tuple[int, ...]) -> ParamMap:
    """The scale tensor's map, from the payload's and the block (``(bm, bn)``: the two trailing
    dims; a longer tuple names leading dims too). Canonical; ranks as the payload's."""
    logical = payload.logical_shape
    b = _full_block(logical, block)
    grid = block_grid(logical, b)
    runs = {r: _shard_runs(r, s, logical, b) for r, s in payload.shards.items()}
    valid = block_grid(payload.valid_shape, b) if payload.is_padded else None
    return _map_of_runs(grid, runs, valid)


def cover(payload: ParamMap, block: tuple[int, ...]) -> ParamMap:
    """The map of the whole blocks each rank's payload shard touches (a block at F's edge cropped
    to F), per dim in the order :func:`coarsen`'s scale shard holds their scales: what a rank must
    hold to quantize its payload shard exactly, each of its blocks from the whole block. Where a
    shard boundary cuts a block, the ranks on both sides hold all of it (a replicated piece)."""
    logical = payload.logical_shape
    b = _full_block(logical, block)
    runs = {r: block_runs(payload, r, b) for r in payload.shards}
    return _map_of_runs(logical, {r: None if per is None else _elements(per, logical, b) for r, per in runs.items()},
                        None)


def block_runs(payload: ParamMap, rank: int, block: tuple[int, ...]) -> list[list[Run]] | None:
    """Per dim, the runs ``(lo, hi, dest)`` of blocks rank ``rank``'s payload shard touches, at their
    places ``dest`` in its scale shard (:func:`coarsen`'s), in blocks; ``None`` where it holds none."""
    logical = payload.logical_shape
    return _shard_runs(rank, payload.shards[rank], logical, _full_block(logical, block))


def shard_axes(payload: ParamMap, rank: int) -> list[list[tuple[int, int, int]]] | None:
    """Rank ``rank``'s shard as one index map per dim: ``(dest lo, dest hi, F lo)`` intervals, dest
    coordinate ``x`` in ``[lo, hi)`` holding F coordinate ``F lo + x - lo``; ``None`` where it holds none.
    Raises :class:`MapError` for a shard that is no product of per-dim index maps."""
    axes = _shard_axes(rank, payload.shards[rank], payload.logical_shape)
    return None if axes is None else [[(lo, hi, lo + off) for lo, hi, off in dim] for dim in axes]


def _elements(per: list[list[Run]], logical: tuple[int, ...], b: tuple[int, ...]) -> list[list[Run]]:
    """Block runs as element runs (the last block of a dim cropped to F), at cumulative places."""
    out = []
    for runs, n, k in zip(per, logical, b):
        dim, at = [], 0
        for lo, hi, _ in runs:
            e0, e1 = lo * k, min(hi * k, n)
            dim.append((e0, e1, at))
            at += e1 - e0
        out.append(dim)
    return out


def _map_of_runs(grid: tuple[int, ...], runs: Mapping[int, list[list[Run]] | None],
                 valid: tuple[int, ...] | None) -> ParamMap:
    """The canonical map whose shard on each rank is the product of its per-dim runs of ``grid``."""
    holders = [_holders({r: [(lo, hi) for lo, hi, _ in per[d]] for r, per in runs.items() if per is not None})
               for d in range(len(grid))]
    shards = {}
    for r, per in runs.items():
        if per is None:  # a rank holding none of the payload holds none of its blocks
            shards[r] = Shard((0,) * len(grid), ())
            continue
        shape = tuple(sum(hi - lo for lo, hi, _ in dim) for dim in per)
        pieces = []
        for cell in _product([[c for run in dim for c in _cut(run, holders[d])] for d, dim in enumerate(per)]):
            locations = frozenset.intersection(*(h for _, _, _, h in cell))
            pieces.append(_box(grid, shape, cell, locations))
        shards[r] = Shard(shape, tuple(pieces))
    return canonicalize(ParamMap(grid, shards, valid))


def cut_blocks(payload: ParamMap, block: tuple[int, ...]) -> dict[int, int]:
    """Per rank, the elements of the blocks its scale shard holds that its payload shard does
    not (0 everywhere: no shard boundary cuts a block). A block counts its elements inside the
    tensor (a partial last block, fewer)."""
    logical = payload.logical_shape
    b = _full_block(logical, block)
    sizes = torch.ones((), dtype=torch.int64)
    for n, k in zip(logical, b):  # elements per block, the outer product of each dim's block lengths
        per = torch.tensor([min(k, n - i * k) for i in range(-(-n // k))], dtype=torch.int64)
        sizes = sizes.unsqueeze(-1) * per
    scales = coarsen(payload, block)
    return {r: int(extract(scales, sizes, r).sum()) - payload.shard(r).numel for r in payload.ranks}


def _full_block(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    block = tuple(block)
    if not block or len(block) > len(shape) or not all(is_int(k) and k > 0 for k in block):
        raise MapError(f"block {list(block)} must be 1 to {len(shape)} positive ints for a tensor of shape "
                       f"{list(shape)}")
    return (1,) * (len(shape) - len(block)) + block


def _shard_runs(rank: int, shard: Shard, logical: tuple[int, ...], b: tuple[int, ...]) -> list[list[Run]] | None:
    """Per dim, the runs of S the shard touches at their scale-shard places (``None``: it holds nothing)."""
    axes = _shard_axes(rank, shard, logical)
    return None if axes is None else [_dim_runs(segments, k) for segments, k in zip(axes, b)]


def _shard_axes(rank: int, shard: Shard, logical: tuple[int, ...]) -> list[list[list[int]]] | None:
    """Per dim, the shard's index map as merged ``[dest lo, dest hi, F lo - dest lo]`` segments."""
    if len(shard.shape) != len(logical):
        raise MapError(f"rank {rank}: a {len(shard.shape)}-d shard of a {len(logical)}-d payload is not a product "
                       "of per-dim index maps (a flat partition): its block scales have no map")
    per_dim: list[list[tuple[int, int, int]]] = [[] for _ in logical]  # (dest lo, dest hi, F lo)
    sstrides = row_major_strides(shard.shape)
    for i, p in enumerate(shard.pieces):
        if p.scale != 1.0:
            raise MapError(f"rank {rank}: piece {i} has scale {p.scale:g}: a quantized payload's bytes are moved, "
                           "never scaled")
        for blk in piece_blocks(p, logical):
            at = unravel(blk.base, shard.shape)
            for d, ((lo, step, n), h) in enumerate(zip(blk.box, blk.strides)):
                hop = h // sstrides[d] if n > 1 else 1  # its step along the shard's dim d
                if n > 1 and (h % sstrides[d] or at[d] + (n - 1) * hop >= shard.shape[d]):
                    raise MapError(f"rank {rank}: piece {i} does not run along dim {d} of the shard as it runs "
                                   f"along dim {d} of F: its block scales have no map")
                if step == hop == 1:
                    per_dim[d].append((at[d], at[d] + n, lo))
                else:  # a folded piece (every step-th index): one index at a time
                    per_dim[d] += [(at[d] + j * hop, at[d] + j * hop + 1, lo + j * step) for j in range(n)]
    if not per_dim[0]:
        return None
    return [_dim_segments(rank, d, sorted(set(spans))) for d, spans in enumerate(per_dim)]


def _dim_segments(rank: int, d: int, spans: list[tuple[int, int, int]]) -> list[list[int]]:
    """Dim ``d``'s index map (dest intervals with their F starts, sorted) checked to be one function
    of the dest coordinate, merged: ``[dest lo, dest hi, F lo - dest lo]``."""
    segments: list[list[int]] = []  # [dest lo, dest hi, F lo - dest lo]
    for lo, hi, f in spans:
        if segments and lo <= segments[-1][1] and f - lo == segments[-1][2]:
            segments[-1][1] = max(segments[-1][1], hi)
        elif segments and lo < segments[-1][1]:
            raise MapError(f"rank {rank}: dest index {lo} of dim {d} holds F index {f} in one piece and "
                           f"{lo + segments[-1][2]} in another: the shard is not a product of per-dim index maps")
        else:
            segments.append([lo, hi, f - lo])
    return segments


def _dim_runs(segments: list[list[int]], k: int) -> list[Run]:
    """A dim's segments as runs of the blocks they touch (``k`` per block), each block once, in
    order of first touch."""
    runs: list[Run] = []
    placed: list[tuple[int, int]] = []
    dest = 0
    for lo, hi, off in segments:
        for a, z in _minus((lo + off) // k, -(-(hi + off) // k), placed):
            runs.append((a, z, dest))
            placed.append((a, z))
            dest += z - a
    return runs


def _minus(a: int, z: int, placed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[a, z)`` less the intervals in ``placed``, in order."""
    out = [(a, z)]
    for p, q in placed:
        out = [piece for lo, hi in out for piece in ((lo, min(hi, p)), (max(lo, q), hi)) if piece[0] < piece[1]]
    return out


def _holders(spans: Mapping[int, list[tuple[int, int]]]) -> list[tuple[int, int, frozenset[int]]]:
    """The line cut where its holder set changes: ``(lo, hi, ranks holding [lo, hi))``."""
    points = sorted({x for s in spans.values() for iv in s for x in iv})
    out = []
    for lo, hi in zip(points, points[1:]):
        held = frozenset(r for r, s in spans.items() if any(a <= lo and hi <= z for a, z in s))
        if held:
            out.append((lo, hi, held))
    return out


def _cut(run: Run, holders: list[tuple[int, int, frozenset[int]]]) -> list[tuple[int, int, int, frozenset[int]]]:
    """A run cut where its holders change: ``(lo, hi, dest, holders)``."""
    lo, hi, dest = run
    return [(max(lo, a), min(hi, z), dest + max(lo, a) - lo, h) for a, z, h in holders if max(lo, a) < min(hi, z)]


def _product(axes: list[list]) -> list[tuple]:
    out: list[tuple] = [()]
    for axis in axes:
        out = [c + (x,) for c in out for x in axis]
    return out


def _box(grid: tuple[int, ...], shape: tuple[int, ...], cell: tuple, locations: frozenset[int]) -> Piece:
    gs, ss = row_major_strides(grid), row_major_strides(shape)
    extents = tuple(hi - lo for lo, hi, _, _ in cell)
    src = sum(lo * s for (lo, _, _, _), s in zip(cell, gs))
    dst = sum(dest * s for (_, _, dest, _), s in zip(cell, ss))
    if not prod(extents):  # never: runs and cuts are non-empty
        raise MapError("an empty scale piece")
    return Piece(extents, View(src, gs), View(dst, ss), locations)
