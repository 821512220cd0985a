"""``check(m)``: every property a map must satisfy, decided on boxes, never per element.

Order of checks: each piece alone (locations include its rank and name only ranks of the map,
views in bounds and injective), then each shard (pieces tile it exactly), then F (every element
covered; pieces sharing an element agree on locations and scale; a piece's locations are exactly
the ranks holding its elements; a rank holds each element once). Every :class:`MapError` names
the JSON path of the field at fault (``MapError.path``, docs/spec.md §5).
"""

from __future__ import annotations

import numpy as np

from ..errors import MapError
from .geometry import Box, box_str, is_injective, normalized_dims, unravel, view_boxes
from .piece import Piece, View, prod
from .shard import MapLike, Shard


class Grid:
    """Coordinate compression of a space: per dim, the sorted cut points of a set of boxes.
    A cell is a product of intervals between cuts; every box is a union of cells."""

    def __init__(self, space: tuple[int, ...], boxes: list[Box]) -> None:
        cuts: list[set[int]] = [{0, n} for n in space]
        for box in boxes:
            for d, (s, t, n) in enumerate(box):
                if t == 1:
                    cuts[d].update((s, s + n))
                else:  # strided axis: every element is its own interval (fallback)
                    for i in range(n):
                        cuts[d].update((s + i * t, s + i * t + 1))
        self.cuts = [np.array(sorted(c), dtype=np.int64) for c in cuts]
        self.shape = tuple(len(c) - 1 for c in self.cuts)

    def index(self, box: Box):
        parts = []
        fancy = False
        for d, (s, t, n) in enumerate(box):
            c = self.cuts[d]
            if t == 1:
                parts.append(slice(int(np.searchsorted(c, s)), int(np.searchsorted(c, s + n))))
            else:
                parts.append(np.searchsorted(c, s + t * np.arange(n)))
                fancy = True
        if not fancy:
            return tuple(parts)
        return np.ix_(*[np.arange(p.start, p.stop) if isinstance(p, slice) else p for p in parts])

    def cell_box(self, cell: tuple[int, ...]) -> Box:
        return tuple(
            (int(self.cuts[d][i]), 1, int(self.cuts[d][i + 1] - self.cuts[d][i])) for d, i in enumerate(cell)
        )


def _where(rank: int, index: int, p: Piece) -> str:
    return f"rank {rank} piece {index} ({p.describe()})"


def _at(rank: int, index: int | None = None, field: str = "") -> str:
    """JSON path (docs/spec.md §5) of a rank's entry, one of its pieces, or a field of that piece."""
    out = f"ranks.{rank}.pieces" if index is not None or field == "pieces" else f"ranks.{rank}"
    if index is not None:
        out += f".{index}"
        if field:
            out += field if field.startswith("[") else f".{field}"
    return out


def _check_pieces(m: MapLike, blame: bool = True) -> None:
    ranks = set(m.ranks)
    numel = m.numel
    for rank, i, p in m.pieces():
        if rank not in p.locations:
            raise MapError(f"{_where(rank, i, p)}: locations must include the rank that holds it",
                           path=_at(rank, i, "locations"))
        if not p.locations <= ranks:
            raise MapError(
                f"{_where(rank, i, p)}: locations name ranks {sorted(p.locations - ranks)} not in the map",
                path=_at(rank, i, "locations"),
            )
        if p.is_empty:
            continue
        shard_numel = m.shards[rank].numel
        sides = (
            ("source", p.source, numel, f"F of {numel} elements {list(m.logical_shape)}"),
            ("dest", p.dest, shard_numel, f"the shard of {shard_numel} elements {list(m.shards[rank].shape)}"),
        )
        for side, view, limit, what in sides:  # bounds of both views before anything enumerates
            hi = view.span(p.shape)[1]
            if hi > limit:
                field = _blame_bounds(m, rank, i, p) if blame else side
                raise MapError(f"{_where(rank, i, p)}: {side} view reaches address {hi - 1}, outside {what}",
                               path=_at(rank, i, field))
        for side, view, limit, _ in sides[::-1]:  # dest first: an injective dest bounds the piece by its shard
            if not _injective(p.shape, view, limit):
                raise MapError(f"{_where(rank, i, p)}: {side} view touches an address more than once",
                               path=_at(rank, i, f"{side}[1]"))


def _injective(shape: tuple[int, ...], view: View, limit: int) -> bool:
    """Whether an in-bounds view is injective; more elements than addresses never are
    (pigeonhole), so any enumeration is bounded by the tensor the view lies in."""
    return prod(shape) <= limit and is_injective(shape, view.strides)


def _fits(shape: tuple[int, ...], view: View, limit: int) -> bool:
    return view.span(shape)[1] <= limit and _injective(shape, view, limit)


def _blame_bounds(m: MapLike, rank: int, i: int, p: Piece) -> str:
    """The field of a piece whose view leaves its tensor that a single edit would repair: an
    offset, an extent or a stride, each set to the nearest value that fits. A repair that makes
    the whole map valid wins; else the smallest relative change; else the view as a whole."""
    limits = {"source": m.numel, "dest": m.shards[rank].numel}

    def ok(q: Piece) -> bool:  # dest first: a piece that fits its shard is no larger than the file's tensor
        return _fits(q.shape, q.dest, limits["dest"]) and _fits(q.shape, q.source, limits["source"])

    bad = [s for s in ("dest", "source") if getattr(p, s).span(p.shape)[1] > limits[s]]
    cands: list[tuple[float, str, Piece]] = []
    if len(bad) == 1:  # an offset or stride moves one view only
        side = bad[0]
        v = getattr(p, side)
        excess = v.span(p.shape)[1] - limits[side]
        if v.offset >= excess:
            cands.append((excess / v.offset, f"{side}[0]", _with(p, side, View(v.offset - excess, v.strides))))
        for d, (n, st) in enumerate(zip(p.shape, v.strides)):
            need = -(-excess // (n - 1)) if n > 1 else st + 1
            if need <= st:
                strides = v.strides[:d] + (st - need,) + v.strides[d + 1:]
                cands.append((need / st, f"{side}[1][{d}]", _with(p, side, View(v.offset, strides))))
    for d, n in enumerate(p.shape):
        lo, hi = 0, n - 1  # the largest extent in [1, n) that fits: fitting is monotone in it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(_with(p, "shape", p.shape[:d] + (mid,) + p.shape[d + 1:])) else (lo, mid - 1)
        if lo:
            cands.append(((n - lo) / n, f"shape[{d}]", _with(p, "shape", p.shape[:d] + (lo,) + p.shape[d + 1:])))
    cands = [c for c in cands if ok(c[2])]
    for _, field, q in cands:
        if _valid(_Patched(m, rank, i, q)):
            return field
    return min(cands, key=lambda c: c[0])[1] if cands else bad[0]


def _with(p: Piece, what: str, value) -> Piece:
    parts = {"shape": p.shape, "source": p.source, "dest": p.dest}
    parts[what] = value
    return Piece.trusted(parts["shape"], parts["source"], parts["dest"], p.locations, p.scale)


class _Patched:
    """``m`` with one piece replaced (a candidate repair, for :func:`_blame_bounds`)."""

    def __init__(self, m: MapLike, rank: int, i: int, q: Piece) -> None:
        self.logical_shape, self.valid_shape, self.is_padded = m.logical_shape, m.valid_shape, m.is_padded
        s = m.shards[rank]
        self.shards = {**m.shards, rank: Shard(s.shape, s.pieces[:i] + (q,) + s.pieces[i + 1:])}
        self.ranks, self.numel = tuple(self.shards), prod(m.logical_shape)

    def shard(self, rank: int) -> Shard:
        return self.shards[rank]

    def pieces(self):
        for rank, shard in self.shards.items():
            for i, p in enumerate(shard.pieces):
                yield rank, i, p


def _valid(m: MapLike) -> bool:
    try:
        _check(m, blame=False)
    except MapError:
        return False
    return True


def _check_shard_tiling(m: MapLike, rank: int) -> None:
    shard = m.shards[rank]
    live = [(i, p) for i, p in enumerate(shard.pieces) if not p.is_empty]
    # Fast path: dest views that are dense intervals (the usual case) are checked by a sweep.
    intervals = []
    for i, p in live:
        dims = normalized_dims(p.shape, p.dest.strides)
        if len(dims) > 1 or (dims and dims[0][0] != 1):
            break
        intervals.append((p.dest.offset, p.dest.offset + p.numel, i))
    else:
        intervals.sort()
        cursor, prev = 0, None
        for lo, hi, i in intervals:
            if lo < cursor:
                raise MapError(
                    f"{_where(rank, i, shard.pieces[i])}: writes shard address {lo}, "
                    f"overlapping piece {prev}", path=_at(rank, i, "dest")
                )
            if lo > cursor:
                raise MapError(f"rank {rank}: shard addresses [{cursor}, {lo}) are written by no piece",
                               path=_at(rank, field="pieces"))
            cursor, prev = hi, i
        if cursor != shard.numel:
            raise MapError(f"rank {rank}: shard addresses [{cursor}, {shard.numel}) are written by no piece",
                           path=_at(rank, field="pieces"))
        return
    boxes = [(i, view_boxes(p.dest, p.shape, shard.shape)) for i, p in live]
    grid = Grid(shard.shape, [b for _, bs in boxes for b in bs])
    owner = np.full(grid.shape, -1, dtype=np.int64)
    for i, bs in boxes:
        for b in bs:
            idx = grid.index(b)
            taken = owner[idx]
            if (taken >= 0).any():
                other = int(taken[taken >= 0].flat[0])
                raise MapError(
                    f"{_where(rank, i, shard.pieces[i])}: writes shard region {box_str(b)}, "
                    f"overlapping piece {other}", path=_at(rank, i, "dest")
                )
            owner[idx] = i
    holes = np.argwhere(owner < 0)
    if len(holes):
        raise MapError(
            f"rank {rank}: shard region {box_str(grid.cell_box(tuple(holes[0])))} is written by no piece",
            path=_at(rank, field="pieces"),
        )


class _Coverage:
    """Per-cell facts about F: which piece covered it first, its locations id, how many ranks
    cover it, the last rank that did, and its scale."""

    def __init__(self, m: MapLike) -> None:
        self.m = m
        self.items = [
            (rank, i, p, view_boxes(p.source, p.shape, m.logical_shape))
            for rank, i, p in m.pieces()
            if not p.is_empty
        ]
        self.grid = Grid(m.logical_shape, [b for *_, bs in self.items for b in bs])
        shape = self.grid.shape
        self.owner = np.full(shape, -1, dtype=np.int64)
        self.count = np.zeros(shape, dtype=np.int64)
        self.last_rank = np.full(shape, -1, dtype=np.int64)
        self.scale = np.full(shape, np.nan)
        self.loc_ids: dict[frozenset[int], int] = {}
        self.loc_of = np.full(shape, -1, dtype=np.int64)
        for k, item in enumerate(self.items):
            self._add(k, *item)

    def _add(self, k: int, rank: int, i: int, p: Piece, boxes: list[Box]) -> None:
        lid = self.loc_ids.setdefault(p.locations, len(self.loc_ids))
        for b in boxes:
            idx = self.grid.index(b)
            seen = self.loc_of[idx]
            clash = (seen >= 0) & (seen != lid)
            if clash.any():
                o_rank, o_i, o_p, _ = self.items[int(self.owner[idx][clash].flat[0])]
                raise MapError(
                    f"{_where(rank, i, p)}: shares F region {box_str(b)} with {_where(o_rank, o_i, o_p)} "
                    f"but names different locations; pieces holding the same element must agree",
                    path=_at(rank, i, "locations"),
                )
            if (self.last_rank[idx] == rank).any():
                raise MapError(f"{_where(rank, i, p)}: rank {rank} already holds part of F region {box_str(b)}",
                               path=_at(rank, i, "source"))
            sc = self.scale[idx]
            if ((sc == sc) & (sc != p.scale)).any():
                o_rank, o_i, o_p, _ = self.items[int(self.owner[idx][sc == sc].flat[0])]
                raise MapError(
                    f"{_where(rank, i, p)}: overlaps {_where(o_rank, o_i, o_p)} with a different scale",
                    path=_at(rank, i, "scale"),
                )
            first = seen < 0
            self.owner[idx] = np.where(first, k, self.owner[idx])
            self.loc_of[idx] = lid
            self.count[idx] += 1
            self.last_rank[idx] = rank
            self.scale[idx] = p.scale

    def uncovered_cells(self) -> np.ndarray:
        return np.argwhere(self.count == 0)

    def holders_mismatch(self) -> None:
        sizes = np.zeros(max(len(self.loc_ids), 1), dtype=np.int64)
        for locs, lid in self.loc_ids.items():
            sizes[lid] = len(locs)
        covered = self.count > 0
        expect = np.where(covered, sizes[np.maximum(self.loc_of, 0)], 0)
        bad = np.argwhere(covered & (expect != self.count))
        if not len(bad):
            return
        cell = tuple(int(c) for c in bad[0])
        box = self.grid.cell_box(cell)
        corner = tuple(a[0] for a in box)
        holders = sorted(
            {r for r, _, _, bs in self.items if any(_contains(b, corner) for b in bs)}
        )
        rank, i, p, _ = self.items[int(self.owner[cell])]
        raise MapError(
            f"{_where(rank, i, p)}: locations {sorted(p.locations)} but F element {list(corner)} "
            f"(region {box_str(box)}) is held by ranks {holders}; locations must be exact",
            path=_at(rank, i, "locations"),
        )


def _contains(box: Box, point: tuple[int, ...]) -> bool:
    return all(s <= x <= s + (n - 1) * t and (x - s) % t == 0 for (s, t, n), x in zip(box, point))


def check(m: MapLike, path: str = "") -> None:
    """Raise :class:`MapError` naming rank, piece and reason unless ``m`` is a valid map; its
    ``path`` is the JSON path of the field at fault, under ``path`` (where the map sits in its
    document or file)."""
    try:
        _check(m)
    except MapError as e:
        if not path:
            raise
        raise MapError(e.reason, path=f"{path}.{e.path}" if e.path else path) from None


def _check(m: MapLike, blame: bool = True) -> None:
    _check_pieces(m, blame)
    for rank in m.ranks:
        _check_shard_tiling(m, rank)
    cov = _Coverage(m)
    holes = cov.uncovered_cells()
    if len(holes):
        boxes = _merge_cells(cov, holes)
        more = f" and {len(boxes) - 3} more regions" if len(boxes) > 3 else ""
        raise MapError(
            f"F {list(m.logical_shape)}: region(s) {', '.join(box_str(b) for b in boxes[:3])}{more} "
            f"covered by no piece (P1)", path="ranks"
        )
    cov.holders_mismatch()


def _merge_cells(cov: _Coverage, cells: np.ndarray) -> list[Box]:
    """Uncovered cells as boxes, neighbouring cells along the last dim merged."""
    boxes = [cov.grid.cell_box(tuple(int(c) for c in cell)) for cell in cells]
    merged: list[Box] = []
    for b in boxes:
        if merged:
            last = merged[-1]
            s, t, n = last[-1]
            if last[:-1] == b[:-1] and s + n == b[-1][0]:
                merged[-1] = last[:-1] + ((s, 1, n + b[-1][2]),)
                continue
        merged.append(b)
    return merged


def uncovered(m: MapLike) -> list[Box]:
    """Regions of F no piece covers, as boxes ``((start, step, count), ...)`` per dim. Runs the
    per-piece checks first, since coverage is meaningless for out-of-bounds views."""
    _check_pieces(m)
    cov = _Coverage(m)
    return _merge_cells(cov, cov.uncovered_cells())


__all__ = ["check", "uncovered", "Grid", "prod", "unravel"]
