"""Rounds of a distributed transfer: which remote plan segments move together under a byte bound.

Why a module of its own: every rank of :func:`reshard.execute.live.transfer` must arrive at the same
rounds without talking to the others, so the schedule is a pure function of the plans, the
element sizes and the bound (no torch, no communication) and can be tested without processes.

The remote segments of all parameters, in the order given and in plan order within one, are
assigned to rounds. Without a bound there is one round. With one, each segment is placed
first-fit from its link's last round and split at element boundaries of its row-major index
space where it does not fit, so that in every round each rank sends plus receives at most
``limit`` bytes. A segment part (:class:`Item`) is an index range ``[lo, hi)``: at most
``2·ndim − 1`` strided boxes (:meth:`Item.views`). Within a round each link's items are ordered
by element size, largest first, so that packed back to back every part starts aligned for its dtype.

:func:`messages` cuts a round's link into the messages that cross the wire, again from the plans
alone so that sender and receiver agree on every boundary. A run of at least ``min_bytes`` that is
contiguous in both shards travels alone, sent from the source shard and received into the target
shard: no copy on either side. A box of that size contiguous on one side only also travels alone,
with the copy on the other side. Everything else on the link is coalesced into one packed message.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import PlanError
from ..ir.geometry import range_boxes
from ..ir.piece import View, prod
from ..plan.values import Segment, TransferPlan

__all__ = ["MIN_DIRECT_BYTES", "Item", "Link", "Message", "Part", "Round", "messages", "schedule", "schedule_links"]

Link = tuple[int, int]  # (source rank, destination rank), plan ranks


@dataclass(frozen=True, slots=True)
class Item:
    """Elements ``[lo, hi)`` (row-major over ``seg.shape``) of one remote segment; ``param`` is the
    index of its ``(plan, element_size)`` pair in the list given to :func:`schedule`."""

    param: int
    seg: Segment
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def views(self, side: View) -> list[tuple[tuple[int, ...], View]]:
        """The part as ``(shape, view)`` boxes, in row-major order, on one side of its segment
        (``seg.src`` or ``seg.dst``)."""
        if self.lo == 0 and self.hi == self.seg.numel:
            return [(self.seg.shape, side)]
        out = []
        for box in range_boxes(self.lo, self.hi, self.seg.shape):  # unit-step axes: (start, 1, count)
            offset = side.offset + sum(a[0] * s for a, s in zip(box, side.strides))
            out.append((tuple(a[2] for a in box), View(offset, side.strides)))
        return out


Round = dict[Link, list[Item]]


def _check_limit(params: Sequence[tuple[TransferPlan, int]], limit: int | None) -> None:
    if limit is None:
        return
    try:
        operator.index(limit)
    except TypeError:
        raise PlanError(f"max_inflight_bytes must be an int or None, not {type(limit).__name__}") from None
    need = max((esize for plan, esize in params if any(not s.is_local for s in plan.segments)), default=0)
    if limit < max(need, 1):
        raise PlanError(f"max_inflight_bytes={limit} cannot hold one element ({need} bytes)")


def schedule(params: Sequence[tuple[TransferPlan, int]], limit: int | None = None) -> list[Round]:
    """Rounds of remote items for ``(plan, element_size)`` pairs, each rank sending plus receiving
    at most ``limit`` bytes per round (one round when ``limit`` is ``None``). Raises
    :class:`PlanError` unless ``limit`` is ``None`` or an integer that holds one element of
    every parameter with remote segments: a function of the arguments only, so ranks that agree on
    them raise alike."""
    _check_limit(params, limit)
    rounds: list[Round] = []
    loads: list[dict[int, int]] = []  # bytes each rank sends plus receives, per round
    cursor: dict[Link, int] = {}
    for k, (plan, esize) in enumerate(params):
        for seg in plan.segments:
            if seg.is_local:
                continue
            link, n = (seg.src_rank, seg.dst_rank), seg.numel
            if limit is None:
                if not rounds:
                    rounds.append({})
                rounds[0].setdefault(link, []).append(Item(k, seg, 0, n))
                continue
            r, lo = cursor.get(link, 0), 0
            while lo < n:
                if r == len(rounds):
                    rounds.append({})
                    loads.append(defaultdict(int))
                load = loads[r]
                room = (limit - max(load[link[0]], load[link[1]])) // esize
                if room <= 0:
                    r += 1
                    continue
                take = min(room, n - lo)
                rounds[r].setdefault(link, []).append(Item(k, seg, lo, lo + take))
                load[link[0]] += take * esize
                load[link[1]] += take * esize
                lo += take
                if lo < n:
                    r += 1
            cursor[link] = r
    return _aligned(rounds, params)


def _aligned(rounds: list[Round], params: Sequence[tuple[TransferPlan, int]]) -> list[Round]:
    """Each link's items, largest elements first: every part then starts aligned for its dtype."""
    for rnd in rounds:
        for items in rnd.values():
            items.sort(key=lambda it: -params[it.param][1])
    return rounds


# -- messages -------------------------------------------------------------------------------------

# A message costs some 50 us of CPU over both ends (gloo sends two notifications besides the data,
# each a write and a wake-up; Python posts and waits); packing and unpacking this many bytes costs
# about as much on a loaded host. Runs at least this large travel alone, without staging copies.
MIN_DIRECT_BYTES = 256 << 10


@dataclass(frozen=True, slots=True)
class Part:
    """One strided box of an item: ``shape`` elements at ``src`` in the source shard of parameter
    ``param``, going to ``dst`` in its target shard, times ``factor ** scale_power``."""

    param: int
    shape: tuple[int, ...]
    src: View
    dst: View
    factor: float


@dataclass(frozen=True, slots=True)
class Message:
    """What one send / receive pair carries: ``parts`` back to back, row-major each.
    ``from_source``: a lone part contiguous in the source shard, sent from it without a copy;
    ``into_target``: a lone unscaled part contiguous in the target shard, received into it."""

    parts: tuple[Part, ...]
    nbytes: int
    from_source: bool = False
    into_target: bool = False


def _run(shape: tuple[int, ...], *views: View) -> int:
    """Index of the first axis of the longest row-major suffix of ``shape`` contiguous in every
    view (``len(shape)`` when even the last axis is not). Extent-1 axes fit any stride."""
    step = 1
    for k in range(len(shape) - 1, -1, -1):
        if shape[k] != 1 and any(v.strides[k] != step for v in views):
            return k + 1
        step *= shape[k]
    return 0


def _runs(part: Part, axis: int) -> list[Part]:
    """``part`` cut into its contiguous runs: one part per index of the axes before ``axis``."""
    outer, inner = part.shape[:axis], part.shape[axis:]
    out = []
    for flat in range(prod(outer)):
        so, do = part.src.offset, part.dst.offset
        for k in range(len(outer) - 1, -1, -1):
            flat, i = divmod(flat, outer[k])
            so += i * part.src.strides[k]
            do += i * part.dst.strides[k]
        out.append(Part(part.param, inner, View.trusted(so, part.src.strides[axis:]),
                        View.trusted(do, part.dst.strides[axis:]), part.factor))
    return out


def _link_messages(items: list[Item], esizes: Sequence[int], scale_power: int, min_bytes: int) -> list[Message]:
    alone: list[Message] = []
    packed: list[Part] = []
    for it in items:
        esize = esizes[it.param]
        unscaled = it.seg.factor ** scale_power == 1.0
        for (shape, src), (_, dst) in zip(it.views(it.seg.src), it.views(it.seg.dst)):
            part = Part(it.param, shape, src, dst, it.seg.factor)
            both = _run(shape, src, dst)
            n = prod(shape[both:]) * esize
            if unscaled and both < len(shape) and n >= min_bytes:  # runs travel alone: no copy at all
                alone += [Message((r,), n, True, True) for r in _runs(part, both)]
                continue
            from_src, into_dst = _run(shape, src) == 0, unscaled and _run(shape, dst) == 0
            if prod(shape) * esize >= min_bytes and (from_src or into_dst):
                alone.append(Message((part,), prod(shape) * esize, from_src, into_dst))
            else:
                packed.append(part)
    if packed:
        alone.append(Message(tuple(packed), sum(prod(p.shape) * esizes[p.param] for p in packed)))
    # sends from the source shard first: the sender posts them before it packs anything
    return sorted(alone, key=lambda m: not m.from_source)


def messages(rnd: Round, esizes: Sequence[int], scale_power: int = 1,
             min_bytes: int = MIN_DIRECT_BYTES) -> dict[Link, list[Message]]:
    """The messages of each link of ``rnd``, in wire order (``esizes``: element size per
    parameter index). Parts of the packed message keep the round's order (largest element size
    first), so each is aligned for its dtype."""
    return {link: _link_messages(items, esizes, scale_power, min_bytes) for link, items in rnd.items()}


def schedule_links(params: Sequence[tuple[TransferPlan, int]], budgets: Mapping[Link, int]) -> list[Round]:
    """Rounds cut link by link, for plans made per rank: link ``(a, b)`` carries at most
    ``budgets[(a, b)]`` bytes per round, its items in order, split at element boundaries where a
    round is full. Unlike :func:`schedule`, a link's cuts depend on that link's items alone, so
    its two ends, each holding only its own segments, cut it alike; a rank's round ``r`` is the
    ``r``-th cut of each of its links. Each budget must hold one element of its link."""
    rounds: list[Round] = []
    at: dict[Link, tuple[int, int]] = {}  # link -> (its current round, bytes used in it)
    for k, (plan, esize) in enumerate(params):
        for seg in plan.segments:
            if seg.is_local:
                continue
            link, n, lo = (seg.src_rank, seg.dst_rank), seg.numel, 0
            r, used = at.get(link, (0, 0))
            while lo < n:
                room = (budgets[link] - used) // esize
                if room <= 0:
                    r, used = r + 1, 0
                    continue
                take = min(room, n - lo)
                while len(rounds) <= r:
                    rounds.append({})
                rounds[r].setdefault(link, []).append(Item(k, seg, lo, lo + take))
                used, lo = used + take * esize, lo + take
            at[link] = (r, used)
    return _aligned(rounds, params)
