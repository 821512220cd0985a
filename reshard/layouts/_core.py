"""Shared machinery of the layout builders: rank labels, box pieces, exact holder sets.

Builders describe a layout in the simplest terms they can (blocks along one dim, flat ranges),
compute who holds what from those terms, and hand the pieces to ``reshard.canonicalize`` so that
every builder emits the one canonical form the IR defines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..errors import MapError
from ..ir.canonical import canonicalize
from ..ir.param_map import ParamMap
from ..ir.piece import Piece, View, prod, row_major_strides
from ..ir.shard import Shard

Shape = tuple[int, ...]


def as_shape(shape: Iterable[int], what: str = "shape") -> Shape:
    out = tuple(shape)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in out):
        raise MapError(f"{what} must be non-negative ints, got {list(out)!r}")
    return out


def positive(value: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MapError(f"{what} must be a positive int, got {value!r}")
    return value


def global_ranks(count: int, ranks: Sequence[int] | None) -> tuple[int, ...]:
    """The global rank of each local position ``0..count-1``: ``ranks`` if given, else identity."""
    if ranks is None:
        return tuple(range(count))
    labels = tuple(ranks)
    if len(labels) != count:
        raise MapError(f"expected {count} global ranks, got {len(labels)}: {list(labels)}")
    if len(set(labels)) != count:
        raise MapError(f"global ranks must be distinct, got {list(labels)}")
    for r in labels:
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise MapError(f"global ranks must be non-negative ints, got {r!r}")
    return labels


def check_dim(shape: Shape, dim: int) -> int:
    if not shape:
        raise MapError("a 0-d tensor has no dim to split")
    if not -len(shape) <= dim < len(shape):
        raise MapError(f"dim {dim} out of range for shape {list(shape)}")
    return dim % len(shape)


def box_piece(
    full: Shape,
    starts: Sequence[int],
    extents: Sequence[int],
    shard: Shape,
    shard_starts: Sequence[int],
    locations: Iterable[int],
    scale: float = 1.0,
) -> Piece:
    """The box ``full[starts : starts + extents]`` placed at ``shard[shard_starts ...]``."""
    fs, ss = row_major_strides(full), row_major_strides(shard)
    return Piece(
        tuple(extents),
        View(sum(a * s for a, s in zip(starts, fs)), fs),
        View(sum(a * s for a, s in zip(shard_starts, ss)), ss),
        frozenset(locations),
        scale,
    )


def flat_piece(src: int, dst: int, n: int, locations: Iterable[int], scale: float = 1.0) -> Piece:
    """``n`` elements from flat offset ``src`` of F to flat offset ``dst`` of the shard."""
    return Piece((n,), View(src, (1,)), View(dst, (1,)), frozenset(locations), scale)


def finish(logical: Shape, shards: Mapping[int, tuple[Shape, list[Piece]]], valid: Shape | None = None) -> ParamMap:
    """Drop empty pieces and return the canonical map."""
    built = {
        r: Shard(tuple(shape), tuple(p for p in pieces if not p.is_empty)) for r, (shape, pieces) in shards.items()
    }
    return canonicalize(ParamMap(tuple(logical), built, valid))


# -- holder sets ---------------------------------------------------------------------------------


def holder_intervals(intervals: Mapping[int, Iterable[tuple[int, int]]]) -> list[tuple[int, int, frozenset[int]]]:
    """Cut a line into maximal intervals ``[a, b)`` held by one constant set of ranks.

    ``intervals[r]`` are the half-open ranges rank ``r`` holds. Segments nobody holds are left out.
    """
    events: dict[int, list[tuple[int, int]]] = {}
    for r, spans in intervals.items():
        for a, b in spans:
            if a < b:
                events.setdefault(a, []).append((r, +1))
                events.setdefault(b, []).append((r, -1))
    count: dict[int, int] = {}
    out: list[tuple[int, int, frozenset[int]]] = []
    points = sorted(events)
    for x, nxt in zip(points, points[1:] + [None]):
        for r, delta in events[x]:
            count[r] = count.get(r, 0) + delta
        if nxt is None:
            break
        holders = frozenset(r for r, c in count.items() if c > 0)
        if not holders:
            continue
        if out and out[-1][1] == x and out[-1][2] == holders:
            out[-1] = (out[-1][0], nxt, holders)
        else:
            out.append((x, nxt, holders))
    return out


def cut_by_holders(
    a: int, b: int, intervals: list[tuple[int, int, frozenset[int]]]
) -> list[tuple[int, int, frozenset[int]]]:
    """``[a, b)`` cut where its holder set changes (``intervals`` from :func:`holder_intervals`)."""
    out = []
    for s, e, h in intervals:
        lo, hi = max(a, s), min(b, e)
        if lo < hi:
            out.append((lo, hi, h))
    if sum(hi - lo for lo, hi, _ in out) != b - a:
        raise MapError(f"range [{a}, {b}) is not fully held")  # a builder bug, never user input
    return out


def dim_blocks(
    shape: Shape,
    dim: int,
    blocks_by_rank: Mapping[int, Sequence[tuple[int, int]]],
    *,
    scale: float = 1.0,
    valid: Shape | None = None,
) -> ParamMap:
    """Each rank's shard is blocks of F along ``dim`` (``(start, length)``, in shard order),
    concatenated along the same dim (DeepSpeed's ``segmented_map`` and ``block_gather_map`` are
    special cases). Holder sets are computed from all ranks' blocks, so a block
    several ranks take (replication, partial replication) gets exact locations."""
    shape = as_shape(shape)
    dim = check_dim(shape, dim)
    for r, blocks in blocks_by_rank.items():
        for start, length in blocks:
            if start < 0 or length < 0 or start + length > shape[dim]:
                raise MapError(f"rank {r}: block [{start}, {start + length}) is outside dim {dim} of {list(shape)}")
    intervals = holder_intervals({r: [(s, s + n) for s, n in bl] for r, bl in blocks_by_rank.items()})
    shards: dict[int, tuple[Shape, list[Piece]]] = {}
    for r, blocks in blocks_by_rank.items():
        width = sum(n for _, n in blocks)
        sshape = shape[:dim] + (width,) + shape[dim + 1 :]
        pieces: list[Piece] = []
        cursor = 0
        for start, length in blocks:
            for lo, hi, holders in cut_by_holders(start, start + length, intervals):
                starts = [0] * len(shape)
                starts[dim] = lo
                extents = list(shape)
                extents[dim] = hi - lo
                dst = [0] * len(shape)
                dst[dim] = cursor + lo - start
                pieces.append(box_piece(shape, starts, extents, sshape, dst, holders, scale))
            cursor += length
        shards[r] = (sshape, pieces)
    return finish(shape, shards, valid)


def flat_ranges(
    shape: Shape,
    ranges_by_rank: Mapping[int, tuple[int, Sequence[tuple[int, int, int]]]],
) -> ParamMap:
    """Each rank's shard is 1-D of the given size; ``(src, dst, n)`` copies ``n`` elements from
    flat offset ``src`` of F to flat offset ``dst`` of the shard. Ranks map to ``(size, ranges)``."""
    shape = as_shape(shape)
    numel = prod(shape)
    for r, (size, ranges) in ranges_by_rank.items():
        for src, dst, n in ranges:
            if src < 0 or dst < 0 or n < 0 or src + n > numel or dst + n > size:
                raise MapError(f"rank {r}: flat range {src}+{n} -> {dst} does not fit F ({numel}) / shard ({size})")
    intervals = holder_intervals({r: [(s, s + n) for s, _, n in rg] for r, (_, rg) in ranges_by_rank.items()})
    shards: dict[int, tuple[Shape, list[Piece]]] = {}
    for r, (size, ranges) in ranges_by_rank.items():
        pieces = []
        for src, dst, n in ranges:
            for lo, hi, holders in cut_by_holders(src, src + n, intervals):
                pieces.append(flat_piece(lo, dst + lo - src, hi - lo, holders))
        shards[r] = ((size,), pieces)
    return finish(shape, shards)
