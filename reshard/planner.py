"""The planner: compose a target map with the inverse of a source map into a transfer plan.

Two phases. *Geometry* (cached per pair of maps): cut every piece into blocks of F, clip both
sides to the common valid region, and intersect each target block with the source blocks that
overlap it (found through a sorted index, never an all-pairs scan). Each intersection is an exact
box with affine addresses on both sides. *Choice* (per parameter): for each target block and each
holder set overlapping it, the cost model picks one holder; the chosen intersections are merged
per (source rank, target rank) into as few N-d segments as possible.
"""

from __future__ import annotations

import bisect
import gc
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .errors import PlanError
from .ir.canonical import concat_pass, make_piece
from .ir.geometry import Block, Box, box_intersect, box_numel, clip, joint_dims, outside, piece_blocks
from .ir.param_map import ParamMap
from .ir.piece import Piece, View
from .plan import ModelPlan, Segment, TransferPlan, Unfilled

# -- cost model ---------------------------------------------------------------------------------


class CostModel(Protocol):
    """Chooses which holder of a block sends it to ``dst_rank``. ``sent`` is the number of
    elements each rank has been assigned to send so far (remote only); ``peers`` the ranks
    already sending to ``dst_rank`` in this parameter."""

    def choose(self, holders: Sequence[int], dst_rank: int, numel: int, sent: Mapping[int, int],
               peers: frozenset[int]) -> int: ...


@dataclass(frozen=True, slots=True)
class DefaultCost:
    """Local copy first; then the holders ``prefer(holder, dst_rank)`` accepts (the offline writer
    keeps each TP rank's copy of a replicated block on the same TP rank); then a holder on the same
    node (``ranks_per_node`` consecutive global ranks per node); then a holder already sending to
    this target (fewer, larger messages, and segments that can merge); then the holder that has
    sent least so far; then the lowest rank."""

    ranks_per_node: int | None = None
    prefer: Callable[[int, int], bool] | None = None

    def choose(self, holders: Sequence[int], dst_rank: int, numel: int, sent: Mapping[int, int],
               peers: frozenset[int] = frozenset()) -> int:
        if dst_rank in holders:
            return dst_rank
        pool = list(holders)
        if self.prefer is not None:
            pool = [r for r in pool if self.prefer(r, dst_rank)] or pool
        if self.ranks_per_node:
            near = [r for r in pool if r // self.ranks_per_node == dst_rank // self.ranks_per_node]
            pool = near or pool
        friends = [r for r in pool if r in peers]
        return min(friends or pool, key=lambda r: (sent.get(r, 0), r))


# -- phase 1: geometry ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Src:
    rank: int
    block: Block
    locations: frozenset[int]
    scale: float


class _Index:
    """Source blocks sorted by their start on the most discriminating axis, with a running max
    of ends, so a query touches the blocks overlapping on that axis and few others."""

    def __init__(self, items: list[_Src]) -> None:
        ndim = len(items[0].block.box) if items else 0
        self.axis = max(range(ndim), key=lambda d: len({it.block.box[d][0] for it in items}), default=0)
        self.items = sorted(items, key=lambda it: _lo(it.block.box, self.axis))
        self.starts = [_lo(it.block.box, self.axis) for it in self.items]
        ends, run = [], -1
        for it in self.items:
            run = max(run, _hi(it.block.box, self.axis))
            ends.append(run)
        self.max_end = ends

    def query(self, box: Box) -> list[_Src]:
        if not self.items:
            return []
        lo, hi = _lo(box, self.axis), _hi(box, self.axis)
        first = bisect.bisect_right(self.max_end, lo - 1)
        last = bisect.bisect_left(self.starts, hi + 1)
        return self.items[first:last]


def _lo(box: Box, d: int) -> int:
    return box[d][0] if box else 0


def _hi(box: Box, d: int) -> int:
    return box[d][0] + (box[d][2] - 1) * box[d][1] if box else 0


@dataclass(frozen=True, slots=True)
class _Raw:
    """An intersection before merging: a box of F with affine addresses on both sides (a
    :class:`Block` of each shard)."""

    box: Box
    src_base: int
    src_strides: tuple[int, ...]
    dst_base: int
    dst_strides: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Need:
    """A part of one target block held by one holder set: per holder, the intersections."""

    dst_rank: int
    numel: int
    options: tuple[tuple[int, float, tuple[_Raw, ...]], ...]  # (src rank, factor, raws)


@dataclass(frozen=True, slots=True)
class _Geometry:
    needs: tuple[_Need, ...]
    unfilled: tuple[Unfilled, ...]


def _factor(src_scale: float, dst_scale: float, allow_inexact: bool, where: str) -> float:
    f = dst_scale / src_scale
    if f != 1.0 and not allow_inexact and math.frexp(f)[0] != 0.5:
        raise PlanError(
            f"{where}: moving a block held at scale {src_scale:g} to scale {dst_scale:g} multiplies by "
            f"{f:g}, which is not a power of two and would round; pass allow_inexact_scale=True to accept"
        )
    return f


def _geometry(source: ParamMap, target: ParamMap, allow_inexact: bool) -> _Geometry:
    if source.valid_shape != target.valid_shape:
        raise PlanError(
            f"source valid shape {list(source.valid_shape)} differs from target valid shape "
            f"{list(target.valid_shape)}: these are not the same parameter"
        )
    valid = source.valid_shape
    srcs: list[_Src] = []
    for rank, _, p in source.pieces():
        for b in piece_blocks(p, source.logical_shape):
            c = clip(b, valid)
            if c is not None:
                srcs.append(_Src(rank, c, p.locations, p.scale))
    index = _Index(srcs)
    needs: list[_Need] = []
    unfilled: list[Unfilled] = []
    for t, j, q in target.pieces():
        for b in piece_blocks(q, target.logical_shape):
            for pad in outside(b, valid):
                unfilled.append(_unfilled(t, pad))
            c = clip(b, valid)
            if c is None:
                continue
            # a holder class is a set of ranks with one scale: homogeneity makes them hold the
            # same elements, so any one of them can fill the intersection
            by_class: dict[tuple[frozenset[int], float], dict[int, list[_Raw]]] = defaultdict(lambda: defaultdict(list))
            for s in index.query(c.box):
                x = box_intersect(s.block.box, c.box)
                if x is None:
                    continue
                sb, db = s.block.sub(x), c.sub(x)
                by_class[(s.locations, s.scale)][s.rank].append(_Raw(x, sb.base, sb.strides, db.base, db.strides))
            for locs, scale in sorted(by_class, key=lambda k: (sorted(k[0]), k[1])):
                per_rank = by_class[(locs, scale)]
                f = _factor(scale, q.scale, allow_inexact, f"target rank {t} piece {j}")
                numel = sum(box_numel(r.box) for r in next(iter(per_rank.values())))
                options = tuple((r, f, tuple(per_rank[r])) for r in sorted(per_rank))
                needs.append(_Need(t, numel, options))
    return _Geometry(tuple(needs), tuple(unfilled))


def _unfilled(rank: int, b: Block) -> Unfilled:
    shape = tuple(a[2] for a in b.box)
    dims = joint_dims(shape, b.strides, b.strides)
    return Unfilled(rank, View(b.base, tuple(d for _, _, d in dims) or (1,)),
                    tuple(n for _, n, _ in dims) or (1,))


# -- phase 2: choice and merging -----------------------------------------------------------------


def _merge(raws: list[_Raw]) -> list[_Raw]:
    """Merge intersections that extend each other along one axis of F (contiguously or as a
    constant stride) with addresses advancing by constants on both sides, to a fixpoint."""
    changed = True
    while changed and len(raws) > 1:
        changed = False
        ndim = len(raws[0].box)
        for d in reversed(range(ndim)):
            buckets: dict[tuple, list[_Raw]] = defaultdict(list)
            for r in raws:
                key = (r.box[:d], r.box[d + 1 :], r.src_strides[:d], r.src_strides[d + 1 :], r.dst_strides[:d], r.dst_strides[d + 1 :])
                buckets[key].append(r)
            out: list[_Raw] = []
            for group in buckets.values():
                group.sort(key=lambda r: r.box[d][0])
                cur = group[0]
                for nxt in group[1:]:
                    m = _join(cur, nxt, d)
                    if m is None:
                        out.append(cur)
                        cur = nxt
                    else:
                        cur, changed = m, True
                out.append(cur)
            raws = out
    return raws


def _join(a: _Raw, b: _Raw, d: int) -> _Raw | None:
    (sa, ta, na), (sb_, tb, nb) = a.box[d], b.box[d]
    if na > 1:
        step, hs, hd = ta, a.src_strides[d], a.dst_strides[d]
    elif nb > 1:
        step, hs, hd = tb, b.src_strides[d], b.dst_strides[d]
    else:
        step, hs, hd = sb_ - sa, b.src_base - a.src_base, b.dst_base - a.dst_base
    if step <= 0 or hs <= 0 or hd <= 0:
        return None
    if sb_ != sa + na * step or b.src_base != a.src_base + na * hs or b.dst_base != a.dst_base + na * hd:
        return None
    if nb > 1 and (tb != step or b.src_strides[d] != hs or b.dst_strides[d] != hd):
        return None
    box = a.box[:d] + ((sa, step, na + nb),) + a.box[d + 1 :]
    src_strides = a.src_strides[:d] + (hs,) + a.src_strides[d + 1 :]
    dst_strides = a.dst_strides[:d] + (hd,) + a.dst_strides[d + 1 :]
    return _Raw(box, a.src_base, src_strides, a.dst_base, dst_strides)


def _segment(src: int, dst: int, factor: float, r: _Raw) -> Segment:
    shape = tuple(a[2] for a in r.box)
    dims = joint_dims(shape, r.src_strides, r.dst_strides)
    if not dims:
        return Segment(src, View.trusted(r.src_base, (1,)), dst, View.trusted(r.dst_base, (1,)), (1,), factor)
    return Segment(src, View.trusted(r.src_base, tuple(s for s, _, _ in dims)), dst,
                   View.trusted(r.dst_base, tuple(x for _, _, x in dims)), tuple(n for _, n, _ in dims), factor)


_ONE = frozenset({0})


def _compress(segs: list[Segment]) -> list[Segment]:
    """Merge one (source rank, target rank) pair's segments in shard space, where F's geometry
    no longer matters: join segments contiguous in both shards (a flat range crossing rows of F),
    and stack same-shaped segments whose offsets advance by constants into one N-d segment
    (docs/spec.md §6 rule 5: group by source rank, then fold in N dimensions)."""
    if len(segs) < 2:
        return segs
    first = segs[0]
    pieces = [Piece.trusted(s.shape, s.src, s.dst, _ONE, 1.0) for s in segs]
    changed = True
    while changed:
        pieces, joined = concat_pass(pieces)
        pieces, stacked = _stack(pieces)
        changed = joined or stacked
    return [Segment(first.src_rank, p.source, first.dst_rank, p.dest, p.shape, first.factor) for p in pieces]


def _stack(pieces: list[Piece]) -> tuple[list[Piece], bool]:
    groups: dict[tuple, list[Piece]] = defaultdict(list)
    for p in pieces:
        groups[(p.shape, p.source.strides, p.dest.strides)].append(p)
    out: list[Piece] = []
    changed = False
    for group in groups.values():
        group.sort(key=lambda p: (p.dest.offset, p.source.offset))
        i = 0
        while i < len(group):
            j = i
            if i + 1 < len(group):
                ds = group[i + 1].source.offset - group[i].source.offset
                dd = group[i + 1].dest.offset - group[i].dest.offset
                j = i + 1
                while (j + 1 < len(group) and group[j + 1].source.offset - group[j].source.offset == ds
                       and group[j + 1].dest.offset - group[j].dest.offset == dd):
                    j += 1
                if ds <= 0 or dd <= 0:
                    j = i
            if j > i:
                p = group[i]
                dims = [(n, a, b) for n, a, b in zip(p.shape, p.source.strides, p.dest.strides)]
                out.append(make_piece(dims + [(j - i + 1, ds, dd)], p.source.offset, p.dest.offset, p))
                changed = True
            else:
                out.append(group[i])
            i = j + 1
    return out, changed


def _choose(geo: _Geometry, cost: CostModel, sent: dict[int, int]) -> tuple[int, ...]:
    picks = []
    peers: dict[int, set[int]] = defaultdict(set)
    for need in geo.needs:  # sole holders first, so choices can join their messages
        if len(need.options) == 1:
            peers[need.dst_rank].add(need.options[0][0])
    for need in geo.needs:
        holders = [r for r, _, _ in need.options]
        r = holders[0] if len(holders) == 1 else cost.choose(
            holders, need.dst_rank, need.numel, sent, frozenset(peers[need.dst_rank]))
        peers[need.dst_rank].add(r)
        if r not in holders:
            raise PlanError(f"cost model chose rank {r}, which is not among the holders {holders}")
        if r != need.dst_rank:
            sent[r] = sent.get(r, 0) + need.numel
        picks.append(holders.index(r))
    return tuple(picks)


def _assemble(source: ParamMap, target: ParamMap, geo: _Geometry, picks: tuple[int, ...]) -> TransferPlan:
    groups: dict[tuple[int, int, float], list[_Raw]] = defaultdict(list)
    for need, k in zip(geo.needs, picks):
        r, f, raws = need.options[k]
        groups[(r, need.dst_rank, f)].extend(raws)
    segments = []
    for (src, dst, f) in sorted(groups):
        segs = [_segment(src, dst, f, raw) for raw in _merge(groups[(src, dst, f)])]
        segments.extend(sorted(_compress(segs), key=lambda x: (x.dst.offset, x.src.offset)))
    return TransferPlan(
        target.logical_shape,
        {r: s.shape for r, s in source.shards.items()},
        {r: s.shape for r, s in target.shards.items()},
        tuple(segments),
        geo.unfilled,
    )


# -- public API ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Planner:
    """Plans many parameters with one cost model and one running tally of bytes sent, caching
    the geometry of identical map pairs."""

    cost: CostModel = field(default_factory=DefaultCost)
    allow_inexact_scale: bool = False
    check: bool = True
    sent: dict[int, int] = field(default_factory=dict)
    _geo: dict = field(default_factory=dict)
    _plans: dict = field(default_factory=dict)
    _checked: set = field(default_factory=set)

    def plan(self, source: ParamMap, target: ParamMap) -> TransferPlan:
        key = (source, target)
        geo = self._geo.get(key)
        if geo is None:
            if self.check:
                for m in (source, target):
                    if m not in self._checked:
                        m.check()
                        self._checked.add(m)
            geo = self._geo[key] = _geometry(source, target, self.allow_inexact_scale)
        picks = _choose(geo, self.cost, self.sent)
        pkey = (key, picks)
        plan = self._plans.get(pkey)
        if plan is None:
            plan = self._plans[pkey] = _assemble(source, target, geo, picks)
        return plan


def plan(source: ParamMap, target: ParamMap, *, cost: CostModel | None = None,
         allow_inexact_scale: bool = False, check: bool = True) -> TransferPlan:
    """Compose ``target ∘ source⁻¹`` into a :class:`TransferPlan` (see module doc)."""
    return Planner(cost or DefaultCost(), allow_inexact_scale, check).plan(source, target)


def plan_model(source_maps: Mapping[str, ParamMap], target_maps: Mapping[str, ParamMap], *,
               cost: CostModel | None = None, allow_inexact_scale: bool = False,
               check: bool = True) -> ModelPlan:
    """Plan every parameter; parameters with identical geometry are planned once."""
    missing = sorted(set(source_maps) ^ set(target_maps))
    if missing:
        raise PlanError(f"source and target name different parameters: {missing[:5]}"
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    planner = Planner(cost or DefaultCost(), allow_inexact_scale, check)
    out = {}
    # Planning allocates many small acyclic objects; the cyclic collector would repeatedly scan
    # every map of the model for nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for name in source_maps:
            try:
                out[name] = planner.plan(source_maps[name], target_maps[name])
            except PlanError as e:
                raise PlanError(f"parameter {name!r}: {e}") from None
    finally:
        if collecting:
            gc.enable()
    return ModelPlan(out)
