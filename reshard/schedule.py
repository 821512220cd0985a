"""Rounds of a distributed transfer: which remote plan segments move together under a byte bound.

Why a module of its own: every rank of :func:`reshard.dist.transfer` must arrive at the same
rounds without talking to the others, so the schedule is a pure function of the plans, the
element sizes and the bound (no torch, no communication) and can be tested without processes.

The remote segments of all parameters, in the order given and in plan order within one, are
assigned to rounds. Without a bound there is one round. With one, each segment is placed
first-fit from its link's last round and split at element boundaries of its row-major index
space where it does not fit, so that in every round each rank sends plus receives at most
``limit`` bytes. A segment part (:class:`Item`) is an index range ``[lo, hi)``: at most
``2·ndim − 1`` strided boxes (:meth:`Item.views`). Within a round each link's items are ordered
by element size, largest first, so that packed back to back every part starts aligned for its dtype.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PlanError
from .ir.geometry import range_boxes
from .ir.piece import View
from .plan import Segment, TransferPlan

__all__ = ["Item", "Link", "Round", "schedule"]

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
    for rnd in rounds:  # largest elements first: every part then starts aligned for its dtype
        for items in rnd.values():
            items.sort(key=lambda it: -params[it.param][1])
    return rounds
