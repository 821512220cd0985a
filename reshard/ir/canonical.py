"""Canonical form: the unique, smallest description of a layout that the rules below allow.

1. Each piece is normalised: empty pieces dropped, extent-1 dims dropped, dims ordered by source
   stride (then dest stride) descending, dims contiguous on both sides merged. A single element
   is shape ``(1,)`` with strides ``(1,)``.
2. Within one shard (grouping by rank comes first, docs/spec.md §4 rule 2) and within one (locations, scale)
   class (homogeneity), repeat to a fixpoint:
   - *concat*: two pieces adjacent along one dim on both sides become one;
   - *fold*: pieces of one shape whose offsets advance by a constant on both sides become one
     piece with a new outer dim, provided the result is one box of F (so a column split's rows
     fold into one piece, while Yuan's separate head groups stay separate pieces).
3. Pieces are ordered by dest offset.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TypeVar

from .geometry import merge_dims, one_box, view_boxes
from .piece import Piece, View, row_major_strides
from .shard import MapLike, Shard

MapT = TypeVar("MapT", bound=MapLike)

Dim = tuple[int, int, int]  # (extent, source stride, dest stride)


def _dims(p: Piece) -> list[Dim]:
    return [(n, s, d) for n, s, d in zip(p.shape, p.source.strides, p.dest.strides)]


def make_piece(dims: list[Dim], src: int, dst: int, like: Piece) -> Piece | None:
    """A piece of ``like``'s locations and scale over ``dims``, normalised (rule 1); ``None``
    when empty."""
    if any(n == 0 for n, _, _ in dims):
        return None
    merged = merge_dims(tuple(n for n, _, _ in dims), tuple(x[1] for x in dims), tuple(x[2] for x in dims)) or [
        (1, (1, 1))]
    return Piece.trusted(
        tuple(n for n, _ in merged),
        View.trusted(src, tuple(st[0] for _, st in merged)),
        View.trusted(dst, tuple(st[1] for _, st in merged)),
        like.locations,
        like.scale,
    )


def normalize_piece(p: Piece) -> Piece | None:
    """Rule 1; ``None`` for an empty piece."""
    return make_piece(_dims(p), p.source.offset, p.dest.offset, p)


def _is_scalar(p: Piece) -> bool:
    return p.shape == (1,)


def _dims_of(p: Piece) -> tuple[Dim, ...]:
    return () if _is_scalar(p) else tuple(_dims(p))


def _keys(p: Piece) -> list[tuple]:
    """Index keys of a piece: as a whole, and per dim with that dim's extent left free."""
    keys: list[tuple] = [("whole", _dims_of(p), p.source.offset, p.dest.offset)]
    dims = tuple(_dims(p))  # a scalar is a unit-stride run of one here: it extends runs
    for k, (_, s, d) in enumerate(dims):
        keys.append(("along", k, s, d, dims[:k] + dims[k + 1 :], p.source.offset, p.dest.offset))
    return keys


def concat_pass(pieces: list[Piece]) -> tuple[list[Piece], bool]:
    """Merge pairs adjacent along one dim on both sides. A piece with one dim fewer (a slice of
    extent 1 along that dim, scalars included) joins at either end."""
    alive = dict(enumerate(sorted(pieces, key=_order)))
    index = {key: i for i, p in alive.items() for key in _keys(p)}
    changed = False
    for i in sorted(alive):
        grew = i in alive
        while grew:
            grew = False
            p = alive[i]
            dims = tuple(_dims(p))
            for k, (n, s, d) in enumerate(dims):
                rest = dims[:k] + dims[k + 1 :]
                a_src, a_dst = p.source.offset + n * s, p.dest.offset + n * d
                for key, kind in (
                    (("along", k, s, d, rest, a_src, a_dst), "same"),
                    (("whole", rest, a_src, a_dst), "slice"),
                    (("whole", rest, p.source.offset - s, p.dest.offset - d), "before"),
                ):
                    j = index.get(key)
                    if j is None or j == i or j not in alive:
                        continue
                    q = alive.pop(j)
                    for old in _keys(q) + _keys(p):
                        if index.get(old) in (i, j):
                            del index[old]
                    grown = list(dims)
                    grown[k] = (n + (q.shape[k] if kind == "same" else 1), s, d)
                    origin = q if kind == "before" else p
                    p = Piece.trusted(tuple(x[0] for x in grown),
                                      View.trusted(origin.source.offset, tuple(x[1] for x in grown)),
                                      View.trusted(origin.dest.offset, tuple(x[2] for x in grown)),
                                      p.locations, p.scale)
                    alive[i] = p
                    index.update((key, i) for key in _keys(p))
                    grew = changed = True
                    break
                if grew:
                    break
    out = [normalize_piece(p) for p in alive.values()]
    return [p for p in out if p is not None], changed


def _fold_pass(pieces: list[Piece], space: tuple[int, ...]) -> tuple[list[Piece], bool]:
    """Stack pieces that are one box of F, identical but for their position along one dim d
    where they have extent 1, and whose offsets advance by a constant on both sides, into one
    piece with a new outer dim (stepping along d). Inner dims are tried first."""
    S = row_major_strides(space)
    buckets: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for i, p in enumerate(pieces):
        if not space or not one_box(p.source, p.shape, space):
            continue
        box = view_boxes(p.source, p.shape, space)[0]
        for d, (start, _, count) in enumerate(box):
            if count == 1:
                key = (-d, box[:d], box[d + 1 :], p.shape, p.source.strides, p.dest.strides)
                buckets[key].append((start, i))
    used: set[int] = set()
    out: list[Piece] = []
    changed = False
    for key in sorted(buckets):
        members = [(c, i) for c, i in sorted(buckets[key]) if i not in used]
        k = 0
        while k + 1 < len(members):
            (c0, i0), (c1, i1) = members[k], members[k + 1]
            dc, dd = c1 - c0, pieces[i1].dest.offset - pieces[i0].dest.offset
            j = k + 1
            while (j + 1 < len(members) and members[j + 1][0] - members[j][0] == dc
                   and pieces[members[j + 1][1]].dest.offset - pieces[members[j][1]].dest.offset == dd):
                j += 1
            if dd <= 0:
                k += 1
                continue
            first = pieces[i0]
            folded = make_piece(_dims(first) + [(j - k + 1, dc * S[-key[0]], dd)], first.source.offset,
                           first.dest.offset, first)
            if folded is not None:
                out.append(folded)
                used.update(i for _, i in members[k : j + 1])
                changed = True
            k = j + 1
    out.extend(p for i, p in enumerate(pieces) if i not in used)
    return out, changed


def _order(p: Piece) -> tuple:
    return (p.dest.offset, p.source.offset, p.shape, p.source.strides, p.dest.strides)


def canonical_pieces(pieces: tuple[Piece, ...] | list[Piece], space: tuple[int, ...]) -> tuple[Piece, ...]:
    classes: dict[tuple, list[Piece]] = defaultdict(list)
    for p in pieces:
        q = normalize_piece(p)
        if q is not None:
            classes[(q.locations, q.scale)].append(q)
    out: list[Piece] = []
    for cls in classes.values():
        changed = True
        while changed:
            cls, c1 = concat_pass(cls)
            cls, c2 = _fold_pass(cls, space)
            changed = c1 or c2
        out.extend(cls)
    return tuple(sorted(out, key=_order))


def canonicalize(m: MapT) -> MapT:
    """The canonical form of ``m`` (deterministic, idempotent, never more pieces)."""
    return type(m)(
        m.logical_shape,
        {r: Shard(s.shape, canonical_pieces(s.pieces, m.logical_shape)) for r, s in m.shards.items()},
        m.valid_shape,
    )
