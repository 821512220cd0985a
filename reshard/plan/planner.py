"""The planner: compose a target map with the inverse of a source map into a transfer plan.

Two phases. *Geometry* (cached per pair of maps, and shared by pairs that differ only in rank
names): cut every piece into blocks of F, clip both sides to the common valid region, and
intersect each target block with the source blocks that overlap it (found through a sorted
index, never an all-pairs scan). Each intersection is an exact box with affine addresses on both
sides. *Choice* (per parameter, from that parameter alone): for each target block and each holder
set overlapping it, the cost model picks one holder; the chosen intersections are merged per
(source rank, target rank) into as few N-d segments as possible. Since neither phase looks at
other parameters, one rank can plan just the segments it sends or receives (``plan_for_rank``)
and get the global plan's.
"""

from __future__ import annotations

import bisect
import gc
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import PlanError
from ..ir.canonical import concat_pass, make_piece
from ..ir.geometry import Block, Box, box_intersect, box_numel, clip, joint_dims, outside, piece_blocks
from ..ir.param_map import ParamMap
from ..ir.piece import Piece, View
from .values import ModelPlan, Segment, TransferPlan, Unfilled

# -- cost model ---------------------------------------------------------------------------------


class CostModel(Protocol):
    """Chooses which holder of a block sends it to ``dst_rank``. ``sent`` is the number of
    elements each rank has been assigned to send so far *in this parameter* (remote only);
    ``peers`` the ranks already sending to ``dst_rank`` in this parameter; ``salt`` a number
    fixed per parameter for breaking ties differently in identical parameters (``plan_model``:
    how many parameters before it have the same pair of maps). A choice must depend on these
    arguments only, never on other parameters' choices: that is what lets one rank plan its own
    segments alone and get the global plan's choices (``plan_for_rank``)."""

    def choose(self, holders: Sequence[int], dst_rank: int, numel: int, sent: Mapping[int, int],
               peers: frozenset[int], salt: int) -> int: ...


@dataclass(frozen=True, slots=True)
class DefaultCost:
    """Local copy first; then the holders ``prefer(holder, dst_rank)`` accepts (the offline writer
    keeps each TP rank's copy of a replicated block on the same TP rank); then a holder on the same
    node (``ranks_per_node`` consecutive global ranks per node); then a holder already sending to
    this target (fewer, larger messages, and segments that can merge); then the holder that has
    sent least so far in this parameter; then the first holder in rank order rotated by ``salt``
    (``salt`` 0: the lowest rank). Since ``plan_model`` salts the k-th parameter of a given pair
    of maps with k, identical parameters (the layers of a model) take turns over their replicas:
    the balance a tally over the whole model gave, with choices that stay local."""

    ranks_per_node: int | None = None
    prefer: Callable[[int, int], bool] | None = None
    local: bool = True  # a holder numbered like the target rank is the same process (live); not so between files

    def choose(self, holders: Sequence[int], dst_rank: int, numel: int, sent: Mapping[int, int],
               peers: frozenset[int] = frozenset(), salt: int = 0) -> int:
        if self.local and dst_rank in holders:
            return dst_rank
        pool = list(holders)
        if self.prefer is not None:
            pool = [r for r in pool if self.prefer(r, dst_rank)] or pool
        if self.ranks_per_node:
            near = [r for r in pool if r // self.ranks_per_node == dst_rank // self.ranks_per_node]
            pool = near or pool
        friends = [r for r in pool if r in peers]
        turn = {r: (i - salt) % len(holders) for i, r in enumerate(sorted(holders))}
        return min(friends or pool, key=lambda r: (sent.get(r, 0), turn[r]))


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
    fixed: tuple[int, ...] | None = None  # the picks when every need has one holder (no choice)


def _factor(src_scale: float, dst_scale: float, allow_inexact: bool, where: str) -> float:
    f = dst_scale / src_scale
    if f != 1.0 and not allow_inexact and math.frexp(f)[0] != 0.5:
        raise PlanError(
            f"{where}: moving a block held at scale {src_scale:g} to scale {dst_scale:g} multiplies by "
            f"{f:g}, which is not a power of two and would round; pass allow_inexact_scale=True to accept"
        )
    return f


@dataclass(frozen=True, slots=True)
class _TargetBlocks:
    """A target map cut into blocks: per block its rank, piece index and scale, the part inside
    the valid region (or ``None``) and the padding outside it."""

    blocks: tuple[tuple[int, int, float, Block | None], ...]
    unfilled: tuple[Unfilled, ...]


def _source_index(source: ParamMap) -> _Index:
    valid = source.valid_shape
    srcs: list[_Src] = []
    for rank, _, p in source.pieces():
        for b in piece_blocks(p, source.logical_shape):
            c = clip(b, valid)
            if c is not None:
                srcs.append(_Src(rank, c, p.locations, p.scale))
    return _Index(srcs)


def _target_blocks(target: ParamMap) -> _TargetBlocks:
    valid = target.valid_shape
    blocks, unfilled = [], []
    for t, j, q in target.pieces():
        for b in piece_blocks(q, target.logical_shape):
            unfilled.extend(_unfilled(t, pad) for pad in outside(b, valid))
            blocks.append((t, j, q.scale, clip(b, valid)))
    return _TargetBlocks(tuple(blocks), tuple(unfilled))


def _geometry(source: ParamMap, target: ParamMap, allow_inexact: bool) -> _Geometry:
    """Every intersection of a target block with the source blocks, grouped into needs."""
    if source.valid_shape != target.valid_shape:
        raise PlanError(
            f"source valid shape {list(source.valid_shape)} differs from target valid shape "
            f"{list(target.valid_shape)}: these are not the same parameter"
        )
    index, cut = _source_index(source), _target_blocks(target)
    needs: list[_Need] = []
    for t, j, q_scale, c in cut.blocks:
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
            f = _factor(scale, q_scale, allow_inexact, f"target rank {t} piece {j}")
            numel = sum(box_numel(r.box) for r in next(iter(per_rank.values())))
            options = tuple((r, f, tuple(per_rank[r])) for r in sorted(per_rank))
            needs.append(_Need(t, numel, options))
    fixed = (0,) * len(needs) if all(len(n.options) == 1 for n in needs) else None
    return _Geometry(tuple(needs), cut.unfilled, fixed)


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


def _choose(geo: _Geometry, cost: CostModel, salt: int) -> tuple[int, ...]:
    """One pick per need. Depends on this parameter alone (its geometry and salt): the tally of
    elements sent starts empty for every parameter."""
    if geo.fixed is not None:
        return geo.fixed
    picks = []
    sent: dict[int, int] = {}
    peers: dict[int, set[int]] = defaultdict(set)
    for need in geo.needs:  # sole holders first, so choices can join their messages
        if len(need.options) == 1:
            peers[need.dst_rank].add(need.options[0][0])
    for need in geo.needs:
        if len(need.options) == 1:
            r, k = need.options[0][0], 0
        else:
            holders = [r for r, _, _ in need.options]
            r = cost.choose(holders, need.dst_rank, need.numel, sent, frozenset(peers[need.dst_rank]), salt)
            if r not in holders:
                raise PlanError(f"cost model chose rank {r}, which is not among the holders {holders}")
            peers[need.dst_rank].add(r)
            k = holders.index(r)
        if r != need.dst_rank:
            sent[r] = sent.get(r, 0) + need.numel
        picks.append(k)
    return tuple(picks)


def _assemble(source: ParamMap, target: ParamMap, geo: _Geometry, picks: tuple[int, ...],
              ranks: frozenset[int] | None) -> TransferPlan:
    """The plan of the chosen intersections; with ``ranks``, only the segments a rank of
    ``ranks`` sends or receives (merging never crosses a (source, target) pair, so these are
    exactly the global plan's segments involving them)."""
    groups: dict[tuple[int, int, float], list[_Raw]] = defaultdict(list)
    for need, k in zip(geo.needs, picks):
        r, f, raws = need.options[k]
        if ranks is None or r in ranks or need.dst_rank in ranks:
            groups[(r, need.dst_rank, f)].extend(raws)
    segments = []
    for (src, dst, f) in sorted(groups):
        segs = [_segment(src, dst, f, raw) for raw in _merge(groups[(src, dst, f)])]
        segments.extend(sorted(_compress(segs), key=lambda x: (x.dst.offset, x.src.offset)))
    unfilled = geo.unfilled if ranks is None else tuple(u for u in geo.unfilled if u.dst_rank in ranks)
    return TransferPlan(
        target.logical_shape,
        {r: s.shape for r, s in source.shards.items()},
        {r: s.shape for r, s in target.shards.items()},
        tuple(segments),
        unfilled,
    )


# -- public API ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Names:
    """A pair of maps without its rank names. ``key`` is equal for pairs that differ only by an
    order-preserving renaming of their ranks, under which geometry, merging and segment order are
    unchanged (everything is sorted by rank); ``ranks[i]`` is the real name of local rank ``i``
    and ``local`` the inverse."""

    key: tuple
    ranks: tuple[int, ...]
    local: dict[int, int]


@dataclass(slots=True)
class Planner:
    """Plans many parameters with one cost model. Geometry is computed once per pair of maps
    *up to rank names* (the layers of a model on different stages or DP ranks) and renamed per
    pair; plans are kept per (pair, choices). Every parameter's choices depend on that parameter
    alone (``CostModel``), with its real ranks, so planning a subset of a model, or one rank's
    share of it, gives the same segments as planning the whole."""

    cost: CostModel = field(default_factory=DefaultCost)
    allow_inexact_scale: bool = False
    check: bool = True
    _geo: dict = field(default_factory=dict)  # (source, target) -> (geometry, names)
    _forms: dict = field(default_factory=dict)  # map -> its form (_form)
    _shared: dict = field(default_factory=dict)  # names.key -> geometry on local ranks
    _shared_plans: dict = field(default_factory=dict)  # (names.key, picks) -> segments, unfilled
    _plans: dict = field(default_factory=dict)
    _checked: set = field(default_factory=set)

    def plan(self, source: ParamMap, target: ParamMap, *, salt: int = 0,
             ranks: frozenset[int] | None = None, cost: CostModel | None = None) -> TransferPlan:
        """The plan of one parameter (``salt`` rotates its tie-breaks, see :class:`DefaultCost`);
        with ``ranks``, only the segments and unfilled regions involving those ranks; ``cost``,
        this plan's own choice of holders (the geometry is shared whatever the cost)."""
        key = (source, target)
        got = self._geo.get(key)
        if got is None:
            if self.check:
                for m in (source, target):
                    if m not in self._checked:
                        m.check()
                        self._checked.add(m)
            got = self._geo[key] = self._geometry(source, target)
        geo, names = got
        picks = _choose(geo, cost or self.cost, salt)
        pkey = (key, picks, ranks)
        plan = self._plans.get(pkey)
        if plan is None:
            plan = self._plans[pkey] = self._assemble(source, target, geo, names, picks, ranks)
        return plan

    def _geometry(self, source: ParamMap, target: ParamMap) -> tuple[_Geometry, _Names | None]:
        names = self._names(source, target)
        if names is None:
            return _geometry(source, target, self.allow_inexact_scale), None
        local = self._shared.get(names.key)
        if local is None:
            geo = _geometry(source, target, self.allow_inexact_scale)
            self._shared[names.key] = _rename_geometry(geo, names.local)
            return geo, names
        return _rename_geometry(local, names.ranks), names

    def _assemble(self, source: ParamMap, target: ParamMap, geo: _Geometry, names: _Names | None,
                  picks: tuple[int, ...], ranks: frozenset[int] | None) -> TransferPlan:
        if names is None or ranks is not None:
            return _assemble(source, target, geo, picks, ranks)
        local = self._shared_plans.get((names.key, picks))
        if local is None:
            plan = _assemble(source, target, geo, picks, None)
            self._shared_plans[(names.key, picks)] = _rename_parts(plan.segments, plan.unfilled, names.local)
            return plan
        segments, unfilled = _rename_parts(*local, names.ranks)
        return TransferPlan(target.logical_shape, {r: s.shape for r, s in source.shards.items()},
                            {r: s.shape for r, s in target.shards.items()}, segments, unfilled)

    def _names(self, source: ParamMap, target: ParamMap) -> _Names | None:
        forms = []
        for m in (source, target):
            form = self._forms.get(m, False)
            if form is False:
                form = self._forms[m] = _form(m)
            if form is None:
                return None
            forms.append(form)
        union = sorted(set(source.shards) | set(target.shards))
        local = {r: i for i, r in enumerate(union)}
        key = (*forms, tuple(local[r] for r in source.shards), tuple(local[r] for r in target.shards))
        return _Names(key, tuple(union), local)


def _form(m: ParamMap) -> tuple | None:
    """``m`` with every rank named by its position among ``m``'s ranks (``None`` when a piece
    names a rank outside the map, which only an unchecked, invalid map does)."""
    pos = {r: i for i, r in enumerate(m.shards)}
    shards = []
    for s in m.shards.values():
        pieces = []
        for p in s.pieces:
            if not p.locations <= pos.keys():
                return None
            pieces.append((p.shape, p.source, p.dest, tuple(sorted(pos[r] for r in p.locations)), p.scale))
        shards.append((s.shape, tuple(pieces)))
    return m.logical_shape, m.valid_shape, tuple(shards)


def _rename_geometry(geo: _Geometry, name: Mapping[int, int] | Sequence[int]) -> _Geometry:
    needs = tuple(_Need(name[n.dst_rank], n.numel, tuple((name[r], f, raws) for r, f, raws in n.options))
                  for n in geo.needs)
    unfilled = tuple(Unfilled(name[u.dst_rank], u.dst, u.shape) for u in geo.unfilled)
    return _Geometry(needs, unfilled, geo.fixed)


def _rename_parts(segments: Sequence[Segment], unfilled: Sequence[Unfilled],
                  name: Mapping[int, int] | Sequence[int]) -> tuple[tuple[Segment, ...], tuple[Unfilled, ...]]:
    return (tuple(Segment(name[s.src_rank], s.src, name[s.dst_rank], s.dst, s.shape, s.factor) for s in segments),
            tuple(Unfilled(name[u.dst_rank], u.dst, u.shape) for u in unfilled))


def plan(source: ParamMap, target: ParamMap, *, cost: CostModel | None = None,
         allow_inexact_scale: bool = False, check: bool = True) -> TransferPlan:
    """Compose ``target ∘ source⁻¹`` into a :class:`TransferPlan` (see module doc)."""
    return Planner(cost or DefaultCost(), allow_inexact_scale, check).plan(source, target)


def plan_model(source_maps: Mapping[str, ParamMap], target_maps: Mapping[str, ParamMap], *,
               cost: CostModel | None = None, allow_inexact_scale: bool = False,
               check: bool = True, ranks: Collection[int] | None = None) -> ModelPlan:
    """Plan every parameter; parameters with identical geometry are planned once. The k-th
    parameter (in ``source_maps`` order) with a given pair of maps is salted k (see
    :class:`DefaultCost`), so identical layers spread over replicas.

    With ``ranks``, plan only what those ranks send or receive: the parameters some of them hold
    in the source or the target, each with only the segments (and unfilled regions) involving
    them, exactly the global plan's; the geometry of other parameters is never computed (nor
    their maps checked), only their pairs of maps counted for the salt."""
    missing = sorted(set(source_maps) ^ set(target_maps))
    if missing:
        raise PlanError(f"source and target name different parameters: {missing[:5]}"
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    planner = Planner(cost or DefaultCost(), allow_inexact_scale, check)
    only = None if ranks is None else frozenset(ranks)
    seen: dict[tuple[ParamMap, ParamMap], int] = {}
    out = {}
    # Planning allocates many small acyclic objects; the cyclic collector would repeatedly scan
    # every map of the model for nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for name, source in source_maps.items():
            target = target_maps[name]
            salt = seen[(source, target)] = seen.get((source, target), -1) + 1
            if only is not None and not (_touches(source, only) or _touches(target, only)):
                continue
            try:
                out[name] = planner.plan(source, target, salt=salt, ranks=only)
            except PlanError as e:
                raise PlanError(f"parameter {name!r}: {e}") from None
    finally:
        if collecting:
            gc.enable()
    return ModelPlan(out, only)


def plan_for_rank(source_maps: Mapping[str, ParamMap], target_maps: Mapping[str, ParamMap], rank: int, *,
                  cost: CostModel | None = None, allow_inexact_scale: bool = False, check: bool = True) -> ModelPlan:
    """What ``rank`` sends and receives in a live move: ``plan_model(..., ranks={rank})``, the
    global plan's segments involving ``rank``. Costs what the parameters ``rank`` holds cost,
    not what the model costs; give it every parameter's maps (the salts count them)."""
    return plan_model(source_maps, target_maps, cost=cost, allow_inexact_scale=allow_inexact_scale, check=check,
                      ranks=(rank,))


def _touches(m: ParamMap, ranks: frozenset[int]) -> bool:
    shards = m.shards
    if len(ranks) <= len(shards):
        return any(r in shards for r in ranks)
    return any(r in ranks for r in shards)
