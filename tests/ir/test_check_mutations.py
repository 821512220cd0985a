"""``check()`` against an element-walk oracle, on valid maps and on mutations of them.

``check()`` decides validity on boxes, never per element. The oracle below decides it the obvious
way: it enumerates every address every view touches (small maps only) and applies docs/spec.md
section 2 word for word. Valid maps (``tests.support.irgen`` generators, ``reshard.layouts`` builders) are
mutated (offsets shifted, pieces dropped or duplicated, strides, extents, locations, scales and
shard shapes changed; some mutations keep validity) and ``check()`` must refuse exactly the maps
the oracle calls invalid.

Maps are mutated in a plain form (``Raw``), so that values the ``Piece``/``View``/``ParamMap``
constructors refuse (a negative offset, empty locations, a zero scale) can be produced too: a
constructor ``MapError`` counts as a refusal, and the oracle applies the vocabulary rules of
section 1 (offsets, strides and extents non-negative; scale finite and non-zero) to match.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from itertools import product
from typing import NamedTuple

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from reshard import ParamMap, Piece, Shard, View, layouts
from reshard.errors import MapError
from tests.support import irgen

EXAMPLES = int(os.environ.get("RESHARD_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None)


# -- plain form ---------------------------------------------------------------------------------


class RP(NamedTuple):
    """A piece as plain values: no validation, so mutations can produce anything."""

    shape: tuple[int, ...]
    src: int
    src_strides: tuple[int, ...]
    dst: int
    dst_strides: tuple[int, ...]
    locs: frozenset[int]
    scale: float = 1.0


class Raw(NamedTuple):
    logical: tuple[int, ...]
    valid: tuple[int, ...] | None
    shards: dict[int, tuple[tuple[int, ...], tuple[RP, ...]]]  # rank -> (shard shape, pieces)


def raw_of(m: ParamMap) -> Raw:
    return Raw(
        m.logical_shape,
        m.valid_shape if m.valid_shape != m.logical_shape else None,
        {
            r: (s.shape, tuple(RP(p.shape, p.source.offset, p.source.strides, p.dest.offset, p.dest.strides,
                                  p.locations, p.scale) for p in s.pieces))
            for r, s in m.shards.items()
        },
    )


def build(raw: Raw) -> ParamMap:
    """The ``ParamMap``; raises ``MapError`` where a constructor refuses a value."""
    return ParamMap(
        raw.logical,
        {
            r: Shard(shape, tuple(Piece(p.shape, View(p.src, p.src_strides), View(p.dst, p.dst_strides),
                                        p.locs, p.scale) for p in pieces))
            for r, (shape, pieces) in raw.shards.items()
        },
        raw.valid,
    )


def _numel(shape) -> int:
    return math.prod(shape)


def _row_major(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _addresses(offset: int, strides: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    return [offset + sum(i * s for i, s in zip(idx, strides)) for idx in product(*(range(n) for n in shape))]


# -- the oracle ---------------------------------------------------------------------------------


def oracle(raw: Raw) -> str | None:
    """``None`` if the map is valid per docs/spec.md sections 1-2, else the first reason found.
    Enumerates every element; for small maps only."""
    ranks = set(raw.shards)
    n_f = _numel(raw.logical)
    if any(n < 0 for n in raw.logical):
        return "negative F extent"
    if raw.valid is not None and (len(raw.valid) != len(raw.logical)
                                  or any(not 0 <= v <= n for v, n in zip(raw.valid, raw.logical))):
        return "valid_shape outside logical_shape"
    held: dict[int, list[tuple[int, frozenset[int], float]]] = defaultdict(list)  # F address -> holders
    for r, (sshape, pieces) in raw.shards.items():
        if r < 0 or any(n < 0 for n in sshape):
            return f"rank {r}: negative rank or shard extent"
        n_s = _numel(sshape)
        writes: Counter[int] = Counter()
        for i, p in enumerate(pieces):
            where = f"rank {r} piece {i}"
            # section 1: views are non-negative offsets and strides; extents non-negative;
            # scale finite and non-zero; locations a set of ranks
            if (p.src < 0 or p.dst < 0 or any(n < 0 for n in p.shape)
                    or any(s < 0 for s in p.src_strides + p.dst_strides)):
                return f"{where}: negative offset, stride or extent"
            if len(p.src_strides) != len(p.shape) or len(p.dst_strides) != len(p.shape):
                return f"{where}: strides do not match the shape"
            if not math.isfinite(p.scale) or p.scale == 0:
                return f"{where}: scale {p.scale}"
            # P0: locations contain the rank and name only ranks of the map
            if r not in p.locs:
                return f"{where}: locations {sorted(p.locs)} miss rank {r}"
            if not p.locs <= ranks:
                return f"{where}: locations {sorted(p.locs)} name ranks not in the map"
            # P0: views in bounds and injective
            src = _addresses(p.src, p.src_strides, p.shape)
            dst = _addresses(p.dst, p.dst_strides, p.shape)
            if any(not 0 <= a < n_f for a in src):
                return f"{where}: source outside F"
            if any(not 0 <= a < n_s for a in dst):
                return f"{where}: dest outside the shard"
            if len(set(src)) != len(src):
                return f"{where}: source not injective"
            if len(set(dst)) != len(dst):
                return f"{where}: dest not injective"
            writes.update(dst)
            for a in src:
                held[a].append((r, p.locs, p.scale))
        # tiling: every shard address written by exactly one piece
        for a in range(n_s):
            if writes[a] != 1:
                return f"rank {r}: shard address {a} written {writes[a]} times"
    # P1: every element of F covered
    for a in range(n_f):
        if not held[a]:
            return f"F element {a} uncovered"
    # homogeneity: holders(e) == locations of every piece holding e; one scale; a rank holds e once
    for a, hs in held.items():
        holders = [r for r, _, _ in hs]
        if len(set(holders)) != len(holders):
            return f"F element {a} held twice by one rank ({sorted(holders)})"
        if len({sc for _, _, sc in hs}) != 1:
            return f"F element {a} held with scales {sorted({sc for _, _, sc in hs})}"
        for _, locs, _ in hs:
            if locs != set(holders):
                return f"F element {a} held by {sorted(holders)}, a piece says {sorted(locs)}"
    return None


def check_verdict(raw: Raw) -> str | None:
    """``None`` if ``check()`` accepts the map, else its refusal (a constructor's included)."""
    try:
        build(raw).check()
    except MapError as e:
        return str(e)
    return None


# -- valid maps ---------------------------------------------------------------------------------


small_shapes = irgen.shapes(max_ndim=3, max_extent=6)


@st.composite
def _sizes(draw, total: int, parts: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def irgen_maps(draw) -> ParamMap:
    m = draw(irgen.layouts(draw(small_shapes)))
    if draw(st.booleans()):
        m = irgen.fragment(m, draw(st.lists(st.integers(0, 20), min_size=1, max_size=3)))
    return m


@st.composite
def split_maps(draw) -> ParamMap:
    shape = draw(small_shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    return layouts.split(shape, dim, draw(_sizes(shape[dim], draw(st.integers(1, 4)))))


@st.composite
def replicated_maps(draw) -> ParamMap:
    return layouts.replicated(draw(small_shapes), draw(st.integers(1, 3)),
                              scale=draw(st.sampled_from([1.0, 0.5, 0.25])))


@st.composite
def sub_param_maps(draw) -> ParamMap:
    shape = draw(irgen.shapes(max_ndim=2, max_extent=8))
    dim = draw(st.integers(0, len(shape) - 1))
    tp = draw(st.integers(1, 3))
    subs = draw(_sizes(shape[dim], draw(st.integers(1, 3))))
    widths = [draw(_sizes(s, tp)) for s in subs]
    return layouts.sub_params(shape, subs, widths, dim=dim)


@st.composite
def fused_maps(draw) -> ParamMap:
    kind = draw(st.sampled_from(["bloom", "glm", "qwen"]))
    rows = draw(st.integers(1, 4)) * 3
    return layouts.fused_qkv(kind, (rows, draw(st.integers(1, 3))), draw(st.integers(1, 3)))


@st.composite
def zero_maps(draw) -> ParamMap:
    shapes = draw(st.lists(irgen.shapes(max_ndim=2, max_extent=5), min_size=1, max_size=3))
    dp = draw(st.integers(1, 4))
    alignment = draw(st.sampled_from([None, dp]))  # a multiple of dp
    maps = layouts.zero12_group(shapes, dp, alignment=alignment, shard="fragment")
    return maps[draw(st.integers(0, len(maps) - 1))]


@st.composite
def composed_maps(draw) -> ParamMap:
    shape = draw(irgen.shapes(max_ndim=2, max_extent=6))
    dim = draw(st.integers(0, len(shape) - 1))
    tp = draw(st.integers(1, 3))
    outer = layouts.split(shape, dim, draw(_sizes(shape[dim], tp)))
    inner, next_rank = {}, 0
    for r in outer.ranks:
        sshape = outer.shard(r).shape
        kind = draw(st.sampled_from(["zero", "split", "replicated"]))
        n = draw(st.integers(1, 3))
        labels = list(range(next_rank, next_rank + n))
        next_rank += n
        if kind == "zero":
            m = layouts.zero12_group([sshape], n, alignment=draw(st.sampled_from([n, None])), ranks=labels,
                                     shard="fragment")[0]
            if not m.ranks:  # an empty TP shard: nobody holds it
                m = layouts.replicated(sshape, labels[:1])
        elif kind == "split":
            d = draw(st.integers(0, len(sshape) - 1))
            m = layouts.split(sshape, d, draw(_sizes(sshape[d], n)), ranks=labels)
        else:
            m = layouts.replicated(sshape, labels)
        inner[r] = m
    return layouts.compose(outer, inner)


@st.composite
def interleaved_maps(draw) -> ParamMap:
    """Rank ``r`` of ``k`` holds every ``k``-th element of flat F from ``r``: source strides that
    cross F's rows irregularly (boxes only per run). A rank's run may be folded into 2-d, and its
    shard may hold it transposed."""
    shape = draw(small_shapes)
    n, k = _numel(shape), draw(st.integers(1, 4))
    shards = {}
    for r in range(min(k, n)):
        count = len(range(r, n, k))
        rows = draw(st.sampled_from([d for d in range(1, count + 1) if count % d == 0]))
        cols = count // rows
        dest = draw(st.sampled_from([(cols, 1), (1, rows)]))
        p = Piece((rows, cols), View(r, (k * cols, k)), View(0, dest), frozenset({r}))
        shards[r] = Shard((count,), (p,))
    return ParamMap(shape, shards)


@st.composite
def padded_maps(draw) -> ParamMap:
    tp = draw(st.integers(1, 4))
    return irgen.padded_vocab_map(draw(st.integers(1, 9)), draw(st.integers(1, 3)), tp)


valid_maps = st.one_of(irgen_maps(), split_maps(), replicated_maps(), sub_param_maps(), fused_maps(),
                       zero_maps(), composed_maps(), padded_maps(), interleaved_maps())


# -- mutations ----------------------------------------------------------------------------------
# Each takes (raw, data) and returns a new Raw, or None when it does not apply to this map.


def _pick(raw: Raw, data, nonempty: bool = True) -> tuple[int, int] | None:
    options = [(r, i) for r, (_, ps) in raw.shards.items() for i, p in enumerate(ps)
               if not nonempty or _numel(p.shape) > 0]
    if not options:
        return None
    return data.draw(st.sampled_from(options))


def _with_piece(raw: Raw, r: int, i: int, p: RP | None) -> Raw:
    shape, pieces = raw.shards[r]
    pieces = pieces[:i] + ((p,) if p is not None else ()) + pieces[i + 1:]
    return raw._replace(shards={**raw.shards, r: (shape, pieces)})


def _with_shard(raw: Raw, r: int, shape, pieces) -> Raw:
    return raw._replace(shards={**raw.shards, r: (tuple(shape), tuple(pieces))})


def _delta(data, space: tuple[int, ...]) -> int:
    """±1, ±a row, or ± the stride of some dim of ``space``."""
    strides = _row_major(space) or (1,)
    step = data.draw(st.sampled_from(sorted({1, strides[0], *strides})))
    return step * data.draw(st.sampled_from([1, -1]))


def shift_source(raw: Raw, data) -> Raw | None:
    if (at := _pick(raw, data)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    return _with_piece(raw, *at, p._replace(src=p.src + _delta(data, raw.logical)))


def shift_dest(raw: Raw, data) -> Raw | None:
    if (at := _pick(raw, data)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    return _with_piece(raw, *at, p._replace(dst=p.dst + _delta(data, raw.shards[at[0]][0])))


def drop_piece(raw: Raw, data) -> Raw | None:
    if (at := _pick(raw, data, nonempty=False)) is None:
        return None
    return _with_piece(raw, *at, None)


def duplicate_in_place(raw: Raw, data) -> Raw | None:
    """A second copy of a piece in its shard: both write the same addresses."""
    if (at := _pick(raw, data, nonempty=False)) is None:
        return None
    shape, pieces = raw.shards[at[0]]
    return _with_shard(raw, at[0], shape, pieces + (pieces[at[1]],))


def _append(raw: Raw, r: int, p: RP) -> Raw:
    """Append ``p`` to rank ``r``'s shard in new addresses: the shard becomes flat and grows."""
    shape, pieces = raw.shards[r]
    n = _numel(shape)
    moved = p._replace(dst=n, dst_strides=_row_major(p.shape))
    return _with_shard(raw, r, (n + _numel(p.shape),), pieces + (moved,))


def duplicate_appended(raw: Raw, data) -> Raw | None:
    """The rank holds the same block twice, at different shard addresses."""
    if (at := _pick(raw, data)) is None:
        return None
    return _append(raw, at[0], raw.shards[at[0]][1][at[1]])


def replicate_onto(raw: Raw, data) -> Raw | None:
    """Another rank also holds a piece's block: the new rank is added to the locations of every
    piece with that block and those locations (valid when the block is a whole piece everywhere)."""
    if (at := _pick(raw, data)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    others = sorted(set(raw.shards) - p.locs)
    if not others:
        return None
    r2 = data.draw(st.sampled_from(others))
    locs = p.locs | {r2}
    key = (p.shape, p.src, p.src_strides, p.locs)
    shards = {
        r: (shape, tuple(q._replace(locs=locs) if (q.shape, q.src, q.src_strides, q.locs) == key else q
                         for q in ps))
        for r, (shape, ps) in raw.shards.items()
    }
    return _append(raw._replace(shards=shards), r2, p._replace(locs=locs))


def move_piece(raw: Raw, data) -> Raw | None:
    """A piece moves to another rank's shard, locations unchanged; a shard left with no pieces
    shrinks to nothing. Moving one replica onto another holder makes that rank hold its block
    twice while the holder count still matches the locations."""
    if (at := _pick(raw, data)) is None or len(raw.shards) < 2:
        return None
    r, i = at
    r2 = data.draw(st.sampled_from(sorted(set(raw.shards) - {r})))
    p = raw.shards[r][1][i]
    out = _with_piece(raw, r, i, None)
    if not out.shards[r][1]:
        out = _with_shard(out, r, (0,), ())
    return _append(out, r2, p)


def change_stride(raw: Raw, data) -> Raw | None:
    if (at := _pick(raw, data)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    if not p.shape:
        return None
    side = data.draw(st.sampled_from(["src_strides", "dst_strides"]))
    strides = list(getattr(p, side))
    d = data.draw(st.integers(0, len(strides) - 1))
    how = data.draw(st.sampled_from(["+1", "-1", "zero", "double", "swap"]))
    if how == "swap":
        if len(strides) < 2:
            return None
        e = data.draw(st.sampled_from([e for e in range(len(strides)) if e != d]))
        strides[d], strides[e] = strides[e], strides[d]
    else:
        strides[d] = {"+1": strides[d] + 1, "-1": strides[d] - 1, "zero": 0, "double": 2 * strides[d]}[how]
    return _with_piece(raw, *at, p._replace(**{side: tuple(strides)}))


def change_extent(raw: Raw, data) -> Raw | None:
    if (at := _pick(raw, data, nonempty=False)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    if not p.shape:
        return None
    shape = list(p.shape)
    d = data.draw(st.integers(0, len(shape) - 1))
    shape[d] += data.draw(st.sampled_from([1, -1]))
    return _with_piece(raw, *at, p._replace(shape=tuple(shape)))


def remove_location(raw: Raw, data) -> Raw | None:
    if (at := _pick(raw, data, nonempty=False)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    if not p.locs:
        return None
    gone = data.draw(st.sampled_from(sorted(p.locs)))
    return _with_piece(raw, *at, p._replace(locs=p.locs - {gone}))


def add_location(raw: Raw, data) -> Raw | None:
    if (at := _pick(raw, data, nonempty=False)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    # a rank of the map that does not hold the piece, or a rank that is not in the map
    candidates = sorted(set(raw.shards) - p.locs) + [max(raw.shards) + 1]
    return _with_piece(raw, *at, p._replace(locs=p.locs | {data.draw(st.sampled_from(candidates))}))


SCALES = [2.0, 0.5, 3.0, -1.0, 0.0, math.inf]


def change_scale(raw: Raw, data) -> Raw | None:
    """One piece's scale: valid when nobody else holds its elements."""
    if (at := _pick(raw, data, nonempty=False)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    return _with_piece(raw, *at, p._replace(scale=p.scale * data.draw(st.sampled_from(SCALES))))


def change_class_scale(raw: Raw, data) -> Raw | None:
    """The scale of every piece with one (locations, scale): keeps validity (finite factors)."""
    if (at := _pick(raw, data, nonempty=False)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    factor = data.draw(st.sampled_from([2.0, 0.25, 3.0]))
    shards = {
        r: (shape, tuple(q._replace(scale=q.scale * factor) if (q.locs, q.scale) == (p.locs, p.scale) else q
                         for q in ps))
        for r, (shape, ps) in raw.shards.items()
    }
    return raw._replace(shards=shards)


def change_shard_shape(raw: Raw, data) -> Raw | None:
    """Grow or shrink one dim of a shard (invalid), or flatten / regroup it (same size: valid)."""
    r = data.draw(st.sampled_from(sorted(raw.shards)))
    shape, pieces = raw.shards[r]
    how = data.draw(st.sampled_from(["grow", "shrink", "flatten", "unsqueeze", "regroup"]))
    if how == "flatten":
        new = (_numel(shape),)
    elif how == "regroup":
        n = _numel(shape)
        k = data.draw(st.sampled_from([k for k in range(1, n + 1) if n % k == 0] or [1]))
        new = data.draw(st.sampled_from([(k, n // k), (n // k, 1, k)] + ([()] if n == 1 else [])))
    elif how == "unsqueeze":
        new = (1, *shape)
    else:
        if not shape:
            return None
        new = list(shape)
        d = data.draw(st.integers(0, len(new) - 1))
        new[d] += 1 if how == "grow" else -1
        if new[d] < 0:
            return None
    return _with_shard(raw, r, new, pieces)


def reshape_f(raw: Raw, data) -> Raw | None:
    """F with another shape of the same size: views address F flat, so validity is unchanged."""
    n = _numel(raw.logical)
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    if not divisors:
        return None
    k = data.draw(st.sampled_from(divisors))
    new = data.draw(st.sampled_from([(n,), (k, n // k), (n // k, 1, k)] + ([()] if n == 1 else [])))
    return raw._replace(logical=new, valid=None)


def resize_f(raw: Raw, data) -> Raw | None:
    """F one larger or smaller along a dim: a new last row is covered by nobody (P1 alone fails);
    other dims move F's row-major addresses under the views."""
    if not raw.logical:
        return None
    d = data.draw(st.integers(0, len(raw.logical) - 1))
    new = list(raw.logical)
    new[d] += data.draw(st.sampled_from([1, -1]))
    return raw._replace(logical=tuple(new))


def reorder_pieces(raw: Raw, data) -> Raw | None:
    r = data.draw(st.sampled_from(sorted(raw.shards)))
    shape, pieces = raw.shards[r]
    return _with_shard(raw, r, shape, data.draw(st.permutations(pieces)))


def swap_dests(raw: Raw, data) -> Raw | None:
    """Two same-shaped pieces of a shard trade places in it: keeps validity."""
    r = data.draw(st.sampled_from(sorted(raw.shards)))
    shape, pieces = raw.shards[r]
    pairs = [(i, j) for i in range(len(pieces)) for j in range(i + 1, len(pieces))
             if (pieces[i].shape, pieces[i].dst_strides) == (pieces[j].shape, pieces[j].dst_strides)]
    if not pairs:
        return None
    i, j = data.draw(st.sampled_from(pairs))
    out = list(pieces)
    out[i], out[j] = pieces[i]._replace(dst=pieces[j].dst), pieces[j]._replace(dst=pieces[i].dst)
    return _with_shard(raw, r, shape, out)


def relabel_rank(raw: Raw, data) -> Raw | None:
    """A rank renamed, in its key and (unless ``keys_only``) in every locations set."""
    old = data.draw(st.sampled_from(sorted(raw.shards)))
    new = max(raw.shards) + 1
    keys_only = data.draw(st.booleans())

    def move(q: RP) -> RP:
        return q if keys_only or old not in q.locs else q._replace(locs=(q.locs - {old}) | {new})

    return raw._replace(shards={(new if r == old else r): (shape, tuple(move(q) for q in ps))
                                for r, (shape, ps) in raw.shards.items()})


def split_piece(raw: Raw, data) -> Raw | None:
    """A piece cut in two along one dim: the same layout, so valid."""
    if (at := _pick(raw, data)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    dims = [d for d, n in enumerate(p.shape) if n > 1]
    if not dims:
        return None
    d = data.draw(st.sampled_from(dims))
    k = data.draw(st.integers(1, p.shape[d] - 1))
    a, b = list(p.shape), list(p.shape)
    a[d], b[d] = k, p.shape[d] - k
    first = p._replace(shape=tuple(a))
    second = p._replace(shape=tuple(b), src=p.src + k * p.src_strides[d], dst=p.dst + k * p.dst_strides[d])
    shape, pieces = raw.shards[at[0]]
    return _with_shard(raw, at[0], shape, pieces[:at[1]] + (first, second) + pieces[at[1] + 1:])


def permute_piece_dims(raw: Raw, data) -> Raw | None:
    """A piece's dims listed in another order (shape and both strides alike): the same piece."""
    if (at := _pick(raw, data)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    order = data.draw(st.permutations(range(len(p.shape))))
    return _with_piece(raw, *at, p._replace(shape=tuple(p.shape[d] for d in order),
                                            src_strides=tuple(p.src_strides[d] for d in order),
                                            dst_strides=tuple(p.dst_strides[d] for d in order)))


def unmerge_piece_dim(raw: Raw, data) -> Raw | None:
    """A dim of extent ``a * b`` written as two dims ``(a, b)``: the same piece."""
    if (at := _pick(raw, data)) is None:
        return None
    p = raw.shards[at[0]][1][at[1]]
    options = [(d, a) for d, n in enumerate(p.shape) for a in range(2, n) if n % a == 0]
    if not options:
        return None
    d, a = data.draw(st.sampled_from(options))
    b = p.shape[d] // a

    def two(t):
        return t[:d] + (a, b) + t[d + 1:]

    def two_strides(t):
        return t[:d] + (t[d] * b, t[d]) + t[d + 1:]

    return _with_piece(raw, *at, p._replace(shape=two(p.shape), src_strides=two_strides(p.src_strides),
                                            dst_strides=two_strides(p.dst_strides)))


MUTATIONS = {f.__name__: f for f in (
    shift_source, shift_dest, drop_piece, duplicate_in_place, duplicate_appended, replicate_onto, move_piece,
    change_stride, change_extent, remove_location, add_location, change_scale, change_class_scale,
    change_shard_shape, reshape_f, resize_f, reorder_pieces, swap_dests, relabel_rank, split_piece,
    permute_piece_dims, unmerge_piece_dim,
)}


def describe(raw: Raw) -> str:
    lines = [f"F {list(raw.logical)}" + (f" valid {list(raw.valid)}" if raw.valid else "")]
    for r, (shape, pieces) in raw.shards.items():
        lines.append(f"  rank {r} shard {list(shape)}")
        for p in pieces:
            s = f"    {list(p.shape)} F@{p.src}{list(p.src_strides)} -> shard@{p.dst}{list(p.dst_strides)}"
            lines.append(s + f" on {sorted(p.locs)}" + (f" x{p.scale:g}" if p.scale != 1.0 else ""))
    return "\n".join(lines)


def assert_agree(raw: Raw) -> str | None:
    want = oracle(raw)
    got = check_verdict(raw)
    assert (want is None) == (got is None), (
        f"check() and the element-walk oracle disagree on\n{describe(raw)}\n"
        f"oracle: {want or 'valid'}\ncheck(): {got or 'valid'}"
    )
    return want


# -- tests --------------------------------------------------------------------------------------


# One test per first mutation (hypothesis would otherwise favour the first few names), followed
# by up to two more drawn at random.
@pytest.mark.parametrize("first", sorted(MUTATIONS))
@SETTINGS
@given(m=valid_maps, data=st.data())
def test_check_refuses_exactly_what_the_oracle_refuses(first: str, m: ParamMap, data):
    raw = raw_of(m)
    assert oracle(raw) is None, f"generator produced a map the oracle refuses: {oracle(raw)}\n{describe(raw)}"
    m.check()
    more = data.draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=2), label="more mutations")
    for name in [first, *more]:
        mutated = MUTATIONS[name](raw, data)
        if mutated is not None:
            raw = mutated
            event(f"mutation {name}")
    event("oracle: valid" if assert_agree(raw) is None else "oracle: invalid")


def _raw(logical, shards, valid=None) -> Raw:
    return Raw(tuple(logical), valid, {r: (tuple(s), tuple(RP(*p[:5], frozenset(p[5]), *p[6:]) for p in ps))
                                       for r, (s, ps) in shards.items()})


# A 4x6 F split in column halves over two ranks, then planted defects the oracle must see.
_COLS = {0: ((4, 3), [((4, 3), 0, (6, 1), 0, (3, 1), frozenset({0}))]),
         1: ((4, 3), [((4, 3), 3, (6, 1), 0, (3, 1), frozenset({1}))])}


def _cols(**edit) -> Raw:
    raw = _raw((4, 6), _COLS)
    p = raw.shards[1][1][0]._replace(**edit)
    return _with_piece(raw, 1, 0, p)


ORACLE_CASES = [
    ("valid column split", _cols(), None),
    ("transposed source block is the same set",
     _raw((2, 2), {0: ((4,), [((2, 2), 0, (1, 2), 0, (2, 1), {0})])}), None),
    ("zero-extent piece covers nothing", _raw((2,), {0: ((2,), [((2,), 0, (1,), 0, (1,), {0}),
                                                             ((0, 3), 9, (1, 1), 9, (1, 1), {0})])}), None),
    ("source shifted into the neighbour", _cols(src=4), "source outside F"),
    ("source shifted left leaves a column", _cols(src=2), "F element 5 uncovered"),
    ("source row stride too small", _cols(src_strides=(3, 1)), "uncovered"),
    ("two ranks each claim a block alone",
     _raw((2,), {0: ((2,), [((2,), 0, (1,), 0, (1,), {0})]), 1: ((2,), [((2,), 0, (1,), 0, (1,), {1})])}),
     "held by [0, 1], a piece says [0]"),
    ("non-injective dest", _cols(dst_strides=(1, 1)), "dest not injective"),
    ("dest gap", _cols(dst_strides=(4, 1)), "dest outside the shard"),
    ("locations miss own rank", _cols(locs=frozenset({0})), "miss rank 1"),
    ("locations name a stranger", _cols(locs=frozenset({1, 7})), "not in the map"),
    ("locations name a non-holder", _cols(locs=frozenset({0, 1})), "a piece says [0, 1]"),
    ("scale on a private block is fine", _cols(scale=0.5), None),
    ("replicas disagree on scale",
     _raw((2,), {0: ((2,), [((2,), 0, (1,), 0, (1,), {0, 1})]),
                 1: ((2,), [((2,), 0, (1,), 0, (1,), {0, 1}, 2.0)])}),
     "scales"),
    ("a rank holds a replicated element twice, the other replica holds nothing",
     _raw((2,), {0: ((4,), [((2,), 0, (1,), 0, (1,), {0, 1}), ((2,), 0, (1,), 2, (1,), {0, 1})]),
                 1: ((0,), [])}),
     "held twice"),
    ("a rank holds an element twice",
     _raw((2,), {0: ((4,), [((2,), 0, (1,), 0, (1,), {0}), ((2,), 0, (1,), 2, (1,), {0})])}), "held twice"),
    ("uncovered element", _raw((3,), {0: ((2,), [((2,), 0, (1,), 0, (1,), {0})])}), "uncovered"),
    ("two pieces write one address",
     _raw((2,), {0: ((1,), [((1,), 0, (1,), 0, (1,), {0}), ((1,), 1, (1,), 0, (1,), {0})])}),
     "written 2 times"),
]


@pytest.mark.parametrize("name,raw,reason", ORACLE_CASES, ids=[c[0] for c in ORACLE_CASES])
def test_oracle_on_planted_defects(name, raw, reason):
    """The oracle itself: right verdicts on hand-made maps, and ``check()`` agrees."""
    got = oracle(raw)
    if reason is None:
        assert got is None, got
    else:
        assert got is not None and reason in got, got
    assert_agree(raw)
