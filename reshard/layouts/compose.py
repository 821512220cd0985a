"""Composition of layouts: F -> S_r (outer) followed by S_r -> sub-shards (inner) as one map.

``compose(outer, inner_by_rank)`` is how stacked parallelism is described: TP then ZeRO over the
DP group of each TP rank, TP inside a pipeline stage, TP replicated over DP. The result maps F
straight to the sub-shards, exactly:

* **Geometry.** Each outer piece (F -> S_r) meets each inner piece (S_r -> G) on the elements of
  S_r both touch. Where both are boxes of S_r the meet is one box. Where one is a flat range of
  S_r (ZeRO) and the other a nested view (strides that never overlap, e.g. a column split), the
  range is a contiguous run of the nested view's index space in row-major order, so it is at most
  ``2·ndim - 1`` boxes of it. Anything else is first cut into boxes of S_r (a flat run crossing
  rows is at most ``2·ndim - 1`` boxes; other views peel their outermost dim, which costs one
  piece per index of that dim and is only reached by views no real layout produces).
* **Locations.** An element's holders are all sub-shard ranks that hold it, whichever outer rank
  they came through (a block replicated over TP ranks and split over each TP rank's DP group is
  held by one DP rank per TP group). They are computed from coverage, not copied from either map:
  every composed piece is cut into boxes of F, boxes are cut where another rank's boxes begin or
  end, and each cell gets the exact set of ranks covering it. ``reshard.canonicalize`` then merges
  cells back into as few pieces as the canonical form allows.
* **Scale** multiplies.

:class:`ZeroComposer` builds the TP∘ZeRO composites of a whole model this way, composing each
geometry once (parameters that differ only in rank names, or not at all, share the work).

Refused (:class:`reshard.MapError`): inner maps whose keys are not the outer ranks, whose F is not
the outer shard, that carry padding of their own, or that put sub-shards of two outer ranks on one
rank (that rank would hold two different tensors). A composed piece whose F view is neither a box
nor a flat run of F is cut per element of its outermost dim rather than refused.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product

from ..errors import MapError
from ..ir.canonical import canonicalize
from ..ir.geometry import merge_dims, range_boxes
from ..ir.param_map import ParamMap
from ..ir.piece import Piece, View, prod, row_major_strides
from ..ir.shard import Shard
from ._core import flat_ranges
from .topology import Topology
from .tp import replicated
from .zero import FlatGroup

__all__ = ["ZeroComposer", "compose", "compose_zero", "replicate_over"]

ViewT = tuple[int, tuple[int, ...]]  # (offset, strides)


@dataclass(frozen=True, slots=True)
class MultiView:
    """A block seen through several views at once: one shape, one (offset, strides) per view.
    Index ``i`` of the block is address ``off_v + sum(i * strides_v)`` in view ``v``'s storage."""

    shape: tuple[int, ...]
    views: tuple[ViewT, ...]


def _from_piece(p: Piece) -> MultiView:
    return MultiView(p.shape, ((p.source.offset, p.source.strides), (p.dest.offset, p.dest.strides)))


def _normalize(mv: MultiView, key: int) -> MultiView | None:
    """``mv`` with its dims merged and ordered by view ``key`` (``geometry.merge_dims``); ``None``
    when the block is empty."""
    if any(n == 0 for n in mv.shape):
        return None
    merged = merge_dims(mv.shape, *(st for _, st in mv.views), key=key)
    shape = tuple(n for n, _ in merged)
    views = tuple((v[0], tuple(st[i] for _, st in merged)) for i, v in enumerate(mv.views))
    return MultiView(shape, views)


def _restrict(mv: MultiView, starts: Sequence[int], extents: Sequence[int]) -> MultiView:
    views = tuple((off + sum(a * s for a, s in zip(starts, st)), st) for off, st in mv.views)
    return MultiView(tuple(extents), views)


def _span(mv: MultiView, v: int) -> tuple[int, int]:
    off, st = mv.views[v]
    return off, off + sum((n - 1) * s for n, s in zip(mv.shape, st)) + 1


# -- boxes of a row-major space ------------------------------------------------------------------


def _unmerge(mv: MultiView, v: int, space: tuple[int, ...]) -> tuple[MultiView, tuple[int, ...]] | None:
    """If view ``v`` of ``mv`` is one box of ``space``, re-express ``mv`` with one dim per dim of
    ``space`` (view ``v`` then has the space's row-major strides) and return it with the box's
    start; else ``None``. ``mv`` must be normalized (no extent-1 dims)."""
    sigma = row_major_strides(space)
    starts, rem = [], mv.views[v][0]
    for n, s in zip(space, sigma):
        a = rem // s if n > 1 else 0
        rem -= a * s
        starts.append(a)
    if rem or any(a >= n for a, n in zip(starts, space) if n > 1):
        return None
    dim_of = {s: k for k, (n, s) in enumerate(zip(space, sigma)) if n > 1}
    owner: list[tuple[int, int] | None] = [None] * len(space)  # (mv dim, extent) per space dim
    ext = [1] * len(space)
    inner_prod: dict[int, int] = {}  # space dim -> product of extents inside it in its group
    for m, n in enumerate(mv.shape):
        k = dim_of.get(mv.views[v][1][m])
        if k is None:
            return None
        left, below = n, 1
        while True:
            while k >= 0 and space[k] == 1:
                k -= 1
            if k < 0 or owner[k] is not None:
                return None
            inner_prod[k] = below
            if starts[k] + left <= space[k]:
                owner[k], ext[k] = (m, left), left
                break
            if starts[k] or left % space[k]:
                return None
            owner[k], ext[k] = (m, space[k]), space[k]
            left //= space[k]
            below *= space[k]
            k -= 1
    views = []
    for off_v, st in mv.views:
        views.append(
            (off_v, tuple(0 if o is None else st[o[0]] * inner_prod[k] for k, o in enumerate(owner)))
        )
    out = MultiView(tuple(ext), tuple(views))
    if any(o is not None and out.views[v][1][k] != sigma[k] for k, o in enumerate(owner)):
        return None  # defensive: the regrouping must reproduce the space's strides
    return out, tuple(starts)


def _range_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row-major index range ``[lo, hi)`` of ``shape`` as ``(starts, extents)`` boxes, in order
    (``geometry.range_boxes``, whose boxes have unit steps)."""
    if not shape:
        return [((), ())] if lo < hi else []
    return [(tuple(a[0] for a in b), tuple(a[2] for a in b)) for b in range_boxes(lo, hi, shape)]


def _box_split(mv: MultiView, v: int, space: tuple[int, ...]) -> list[tuple[MultiView, tuple[int, ...]]]:
    """Cut ``mv`` into sub-blocks whose view ``v`` is each one box of ``space``."""
    mv = _normalize(mv, v)
    if mv is None:
        return []
    got = _unmerge(mv, v, space)
    if got is not None:
        return [got]
    off, st = mv.views[v]
    out: list[tuple[MultiView, tuple[int, ...]]] = []
    if len(mv.shape) == 1 and st[0] == 1:
        # A flat run across rows of the space: one box per row-major sub-range.
        sigma = row_major_strides(space)
        for starts, extents in _range_boxes(off, off + mv.shape[0], space):
            a = sum(x * s for x, s in zip(starts, sigma))
            got = _unmerge(_normalize(_restrict(mv, (a - off,), (prod(extents),)), v), v, space)
            if got is None:  # only a view outside its space (a map that fails its check) gets here
                raise MapError(f"a run of {mv.shape[0]} elements at address {off} does not lie in a space "
                               f"{list(space)}: the map is not valid (ParamMap.check)")
            out.append(got)
        return out
    # Peel the outermost dim (exact; one sub-block per index of that dim).
    rest = (0,) * (len(mv.shape) - 1)
    for i in range(mv.shape[0]):
        out += _box_split(_restrict(mv, (i, *rest), (1, *mv.shape[1:])), v, space)
    return out


# -- meeting two blocks on a shared storage ---------------------------------------------------


def _count_below(rem: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """How many indices of a nested view (strides descending, each larger than the reach of the
    dims inside it) sit at address offset below ``rem``; their addresses increase in row-major
    index order, so this is also the row-major position of the first one at or above it."""
    if rem <= 0:
        return 0
    if not shape:
        return 1
    n, s = shape[0], strides[0]
    inner = prod(shape[1:])
    c = -(-rem // s)
    if c > n:
        return n * inner
    return (c - 1) * inner + _count_below(rem - (c - 1) * s, shape[1:], strides[1:])


def _nested(mv: MultiView, v: int) -> bool:
    reach = 0
    for n, s in reversed(list(zip(mv.shape, mv.views[v][1]))):
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


def _flat_run(mv: MultiView, v: int) -> bool:
    return len(mv.shape) == 0 or (len(mv.shape) == 1 and mv.views[v][1][0] == 1)


def _lex_meet(x: MultiView, xv: int, y: MultiView, yv: int) -> list[MultiView]:
    """``y`` is a flat run in view ``yv``, ``x`` is nested in view ``xv`` (both normalized)."""
    ylo = y.views[yv][0]
    yn = y.shape[0] if y.shape else 1
    xoff, xst = x.views[xv]
    lo = _count_below(ylo - xoff, x.shape, xst)
    hi = _count_below(ylo + yn - xoff, x.shape, xst)
    out = []
    for starts, extents in _range_boxes(lo, hi, x.shape):
        xs = _restrict(x, starts, extents)
        a0, ast = xs.views[xv]
        yviews = []
        for off, st in y.views:
            t = st[0] if st else 0
            yviews.append((off + (a0 - ylo) * t, tuple(s * t for s in ast)))
        out.append(MultiView(xs.shape, xs.views + tuple(yviews)))
    return out


def _meet(x: MultiView, xv: int, y: MultiView, yv: int, space: tuple[int, ...]) -> list[MultiView]:
    """The elements where view ``xv`` of ``x`` and view ``yv`` of ``y`` address the same place of
    ``space``, as blocks carrying all of ``x``'s views then all of ``y``'s."""
    nx, ny = _normalize(x, xv), _normalize(y, yv)
    if nx is None or ny is None:
        return []
    (a, b), (c, d) = _span(nx, xv), _span(ny, yv)
    if b <= c or d <= a:
        return []
    if _flat_run(ny, yv) and _nested(nx, xv):
        return _lex_meet(nx, xv, ny, yv)
    if _flat_run(nx, xv) and _nested(ny, yv):
        k = len(ny.views)
        return [MultiView(m.shape, m.views[k:] + m.views[:k]) for m in _lex_meet(ny, yv, nx, xv)]
    out = []
    ys = _box_split(ny, yv, space)
    for xb, xa in _box_split(nx, xv, space):
        xe = xb.shape
        for yb, ya in ys:
            ye = yb.shape
            lo = tuple(max(p, q) for p, q in zip(xa, ya))
            hi = tuple(min(p + m, q + n) for p, m, q, n in zip(xa, xe, ya, ye))
            if any(lo_k >= hi_k for lo_k, hi_k in zip(lo, hi)):
                continue
            ext = tuple(h - lo_k for lo_k, h in zip(lo, hi))
            xs = _restrict(xb, tuple(p - q for p, q in zip(lo, xa)), ext)
            ysub = _restrict(yb, tuple(p - q for p, q in zip(lo, ya)), ext)
            out.append(MultiView(ext, xs.views + ysub.views))
    return out


# -- exact holders ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Item:
    rank: int
    block: MultiView  # views (F, shard), dims aligned with F's dims
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    scale: float


def _piece(mv: MultiView, locations: frozenset[int], scale: float) -> Piece | None:
    mv = _normalize(mv, 0)
    if mv is None:
        return None
    if not mv.shape:
        mv = MultiView((1,), tuple((off, (1,)) for off, _ in mv.views))
    (so, ss), (do, ds) = mv.views
    return Piece(mv.shape, View(so, ss), View(do, ds), locations, scale)


def _refine(items: list[_Item]) -> dict[int, list[Piece]]:
    """Pieces per rank with exact locations: each box of F is cut at the boundaries of every
    other box overlapping it, and each cell names all ranks whose boxes contain it. Items with the
    same box (a replicated block) are handled together, so wide replication stays cheap."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[_Item]] = {}
    for it in items:
        groups.setdefault((it.lo, it.hi), []).append(it)
    keys = sorted(groups)
    ranks_of = {k: frozenset(it.rank for it in groups[k]) for k in keys}
    # overlapping boxes, by a sweep over the first dim (a 0-d F is one point)
    neighbours: dict[tuple, list[tuple]] = {k: [] for k in keys}
    active: list[tuple] = []
    for k in keys:
        start = k[0][0] if k[0] else 0
        active = [a for a in active if (a[1][0] if a[1] else 1) > start]
        for a in active:
            if all(p < s and q < t for p, t, q, s in zip(a[0], a[1], k[0], k[1])):
                neighbours[a].append(k)
                neighbours[k].append(a)
        active.append(k)
    out: dict[int, list[Piece]] = {}
    for key in keys:
        lo, hi = key
        others = neighbours[key]
        cuts = []
        for d in range(len(lo)):
            pts = {lo[d], hi[d]}
            for olo, ohi in others:
                pts.update(x for x in (olo[d], ohi[d]) if lo[d] < x < hi[d])
            cuts.append(sorted(pts))
        for cell in product(*[range(len(c) - 1) for c in cuts]):
            clo = tuple(cuts[d][j] for d, j in enumerate(cell))
            chi = tuple(cuts[d][j + 1] for d, j in enumerate(cell))
            holders = set(ranks_of[key])
            for k in others:
                if all(a <= c and e <= b for a, b, c, e in zip(k[0], k[1], clo, chi)):
                    holders |= ranks_of[k]
            at = tuple(c - a for c, a in zip(clo, lo))
            ext = tuple(h - c for c, h in zip(clo, chi))
            for it in groups[key]:
                p = _piece(_restrict(it.block, at, ext), frozenset(holders), it.scale)
                if p is not None:
                    out.setdefault(it.rank, []).append(p)
    return out


# -- public ------------------------------------------------------------------------------------


def compose(outer: ParamMap, inner_by_rank: Mapping[int, ParamMap]) -> ParamMap:
    """The map of F straight to the sub-shards: ``outer`` takes F to shards ``S_r``,
    ``inner_by_rank[r]`` takes ``S_r`` (its F) to sub-shards on its own ranks. See the module
    docstring for what is exact and what is refused."""
    if set(inner_by_rank) != set(outer.ranks):
        raise MapError(
            f"compose: inner maps are keyed {sorted(inner_by_rank)}, the outer map's ranks are {list(outer.ranks)}"
        )
    owner_of: dict[int, int] = {}
    for r in outer.ranks:
        inner = inner_by_rank[r]
        if inner.logical_shape != outer.shard(r).shape:
            raise MapError(
                f"compose: inner map of outer rank {r} is for F {list(inner.logical_shape)}, but that rank's "
                f"shard is {list(outer.shard(r).shape)}"
            )
        if inner.is_padded:
            raise MapError(f"compose: inner map of outer rank {r} pads its F; only the outer map may pad")
        for g in inner.ranks:
            if g in owner_of:
                raise MapError(
                    f"compose: rank {g} holds sub-shards of both outer rank {owner_of[g]} and outer rank {r}"
                )
            owner_of[g] = r
    space = outer.logical_shape
    items: list[_Item] = []
    for r, shard in outer.shards.items():
        inner = inner_by_rank[r]
        for p in shard.pieces:
            if p.is_empty:
                continue
            pb = _from_piece(p)
            for g, gshard in inner.shards.items():
                for q in gshard.pieces:
                    if q.is_empty:
                        continue
                    for part in _meet(pb, 1, _from_piece(q), 0, shard.shape):
                        fg = MultiView(part.shape, (part.views[0], part.views[3]))
                        for block, lo in _box_split(fg, 0, space):
                            hi = tuple(a + n for a, n in zip(lo, block.shape))
                            items.append(_Item(g, block, lo, hi, p.scale * q.scale))
    pieces = _refine(items)
    shards = {
        g: Shard(gshard.shape, tuple(pieces.get(g, ())))
        for r in outer.ranks
        for g, gshard in inner_by_rank[r].shards.items()
    }
    return canonicalize(ParamMap(space, shards, outer.valid_shape))


def replicate_over(m: ParamMap, groups: Mapping[int, Sequence[int]]) -> ParamMap:
    """``m`` with each rank's shard held identically by every rank of ``groups[rank]`` (TP shards
    replicated over the data-parallel group of each TP rank, say)."""
    return compose(m, {r: replicated(m.shard(r).shape, tuple(groups[r])) for r in m.ranks})


def compose_zero(model_map: ParamMap, zero_maps: Mapping[int, ParamMap | None], topology: Topology) -> ParamMap:
    """A model-parallel map composed with the ZeRO split of every rank's shard, over global ranks.

    ``zero_maps[t]`` splits rank ``t``'s shard (its F) over DP ranks ``0..dp-1`` (``None`` where
    ``t`` holds none of the parameter); DP rank ``d`` of model-parallel rank ``t`` becomes global
    rank ``topology.rank(0, d, t)``. The one home of the TP∘ZeRO composite a checkpoint's optimizer
    state follows (``inspect --composed``, both sides of ``reshard reshard``)."""
    inner = {}
    for t in model_map.ranks:
        shard, split = model_map.shard(t), zero_maps.get(t)
        if split is None:
            if shard.numel:
                raise MapError(f"model-parallel rank {t} holds {shard.numel} elements but no ZeRO split of them")
            inner[t] = ParamMap(shard.shape, {})
        else:
            inner[t] = split.with_ranks({d: topology.rank(0, d, t) for d in split.ranks})
    return compose(model_map, inner)


# -- many composites, built once per geometry ----------------------------------------------------

Fragments = Mapping[int, Sequence[tuple[int, int, int]]]  # outer rank -> (rank, lo, hi) of its shard


@dataclass(slots=True)
class ZeroComposer:
    """Composite maps (a model-parallel map composed with a ZeRO-1/2 split of every shard) of many
    parameters, each geometry composed once, the way ``plan_model`` plans each geometry once.

    ``compose(outer, fragments)`` equals ``compose(outer, inner)`` where ``inner[t]`` gives rank
    ``g`` the elements ``[lo, hi)`` of outer rank ``t``'s flattened shard for each ``(g, lo, hi)``
    in ``fragments[t]`` (ZeRO's ``shard="fragment"``, what ``FlatGroup.fragments_of`` returns
    with its DP ranks made global). A flat group lays parameters end to end, so the layers of a
    model differ in where their fragments fall and in the ranks holding them; composition is
    exact and does not depend on rank labels, so the composite is computed once per *shape* of
    the problem (outer map on ranks ``0..k-1``, fragments as ranges) and relabelled per use, and
    each labelled result is kept, so identical parameters get one map object (which the planner's
    geometry cache then shares too)."""

    _maps: dict = field(default_factory=dict)  # (outer, fragments) -> composite
    _shapes: dict = field(default_factory=dict)  # (local outer, ranges) -> composite on local ranks
    _local: dict = field(default_factory=dict)  # outer -> outer on ranks 0..k-1
    _labellings: dict = field(default_factory=dict)  # (outer ranks, their DP ranks) -> small id

    def compose(self, outer: ParamMap, fragments: Fragments) -> ParamMap:
        """``outer`` composed with the fragments of every shard (see the class docstring)."""
        key = (outer, tuple(sorted((t, tuple(map(tuple, f))) for t, f in fragments.items())))
        got = self._maps.get(key)
        if got is None:
            got = self._maps[key] = self._build(outer, key[1])
        return got

    def group(self, outer_maps: Sequence[ParamMap], groups: Mapping[int, FlatGroup],
              dp_ranks: Mapping[int, Sequence[int]]) -> list[ParamMap]:
        """The composite map of every parameter of a ZeRO-1/2 group: parameter ``i``'s
        model-parallel map is ``outer_maps[i]``; ``groups[t]`` is the flat group of outer rank
        ``t``'s shards (``groups[t].shapes[i]`` that rank's shard of parameter ``i``), DP rank
        ``d`` of it global rank ``dp_ranks[t][d]``. Equals ``compose(outer_maps[i], ...)`` with
        ``groups[t].param_map(i, ranks=dp_ranks[t])`` for every ``t``. When every ``t`` has the
        same flat group (even TP shards) a parameter's fragments are computed once, not per ``t``."""
        # Like planning, this allocates many small acyclic objects: the cyclic collector would
        # rescan every map already built for nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._group(outer_maps, groups, dp_ranks)
        finally:
            if collecting:
                gc.enable()

    def _group(self, outer_maps: Sequence[ParamMap], groups: Mapping[int, FlatGroup],
               dp_ranks: Mapping[int, Sequence[int]]) -> list[ParamMap]:
        ts = sorted(groups)
        labels = tuple(tuple(dp_ranks[t]) for t in ts)
        lid = self._labellings.setdefault((tuple(ts), labels), len(self._labellings))
        first = groups[ts[0]] if ts else None
        uniform = all(groups[t] is first for t in ts)
        out = []
        for i, outer in enumerate(outer_maps):
            frags = first.fragments_of(i) if uniform else tuple(groups[t].fragments_of(i) for t in ts)
            key = (outer, uniform, frags, lid)
            got = self._maps.get(key)
            if got is None:
                per_t = (frags,) * len(ts) if uniform else frags
                global_frags = {t: tuple((lab[d], lo, hi) for d, lo, hi in f) for t, lab, f in zip(ts, labels, per_t)}
                got = self._maps[key] = self.compose(outer, global_frags)
            out.append(got)
        return out

    def _build(self, outer: ParamMap, frags: tuple) -> ParamMap:
        if {t for t, _ in frags} != set(outer.ranks):
            raise MapError(f"ZeroComposer: fragments are keyed {[t for t, _ in frags]}, "
                           f"the outer map's ranks are {list(outer.ranks)}")
        labels = [g for _, f in frags for g, _, _ in f]
        if len(set(labels)) != len(labels):
            raise MapError(f"ZeroComposer: a rank holds fragments of two shards: {labels}")
        local = self._local.get(outer)
        if local is None:
            local = self._local[outer] = outer.with_ranks({t: i for i, t in enumerate(outer.ranks)})
        shape_key = (local, tuple(tuple((lo, hi) for _, lo, hi in f) for _, f in frags))
        base = self._shapes.get(shape_key)
        if base is None:
            base = self._shapes[shape_key] = _compose_ranges(local, shape_key[1])
        return base.with_ranks(dict(enumerate(labels)))


def _compose_ranges(local: ParamMap, ranges: tuple) -> ParamMap:
    """``compose`` of ``local`` (ranks ``0..k-1``) with fragments on ranks ``0, 1, ...`` in order."""
    inner, j = {}, 0
    for t, rs in zip(local.ranks, ranges):
        shape = local.shard(t).shape
        numel = prod(shape)
        if any(a < 0 or b > numel or a >= b for a, b in rs) or _overlap(rs) or sum(b - a for a, b in rs) != numel:
            raise MapError(f"ZeroComposer: fragments {list(rs)} do not tile rank {t}'s shard of {numel} elements")
        inner[t] = flat_ranges(shape, {j + k: (b - a, [(a, 0, b - a)]) for k, (a, b) in enumerate(rs)})
        j += len(rs)
    return compose(local, inner)


def _overlap(rs: Sequence[tuple[int, int]]) -> bool:
    s = sorted(rs)
    return any(b > c for (_, b), (c, _) in zip(s, s[1:]))

