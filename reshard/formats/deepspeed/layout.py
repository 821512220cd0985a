"""Every DeepSpeed 0.19.8 checkpoint as one layout: per parameter an *outer map* over its holders
(a TP map, a pipeline stage map, or an expert placement over EP ranks), the *partition group*
of each holder (the global ranks that split what it holds: its DP ranks, or its
expert-data-parallel ranks), and the *rule* that cuts a holder's share into partitions:

* ``"flat"`` (ZeRO-1/2): each optimizer parameter group of a holder is one flat buffer
  (``zero12.flat_group``), cut into as many equal partitions as the group has ranks;
* ``"sub"`` (ZeRO-3): every parameter is split on its own (``zero3(shape, n, shard="fragment")``),
  its partitions end to end in sub-groups (``zero3.sub_groups``).

The optimizer state of a rank is, per *unit* (a flat group, a sub-group), the partition its
position in the holder's partition group selects; each parameter's fragment there is a slot of
its *composite* map (the outer map composed with the inner split, over global ranks). ZeRO-1/2 and
ZeRO-3, dense, AutoTP, pipeline stages, AutoEP and classic MoE experts are this one object with
other outer maps and groups; every target declares its optimizer buffers and fills its
optimizer files through it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...layouts import compose_zero, zero3
from ...layouts.topology import Topology
from ...layouts.zero import FlatGroup
from ...storage.torch_zip import Storage
from ..contract import BEST, MOMENTS, Buffer, Slot
from . import zero12 as dsw
from .zero3 import SubGroup

__all__ = ["Group", "Layout", "Part", "Unit", "check_flat", "flat_source", "want"]


def want(state: str) -> tuple[str, ...]:
    """What an optimizer state's slot is made from: the master from the source's master, else its
    weights (a source without an optimizer); a moment only from itself (else zeros)."""
    return BEST if state == "fp32" else (state,)


@dataclass(frozen=True, slots=True)
class Group:
    """The partition group of each holder: ``members[h]`` the global ranks that split holder
    ``h``'s share, in partition order (all alike in size)."""

    members: tuple[tuple[int, ...], ...]
    _place: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def dense(cls, holders: int, size: int) -> Group:
        """Model-parallel rank ``t`` split over DP ranks ``d``: global rank ``d * holders + t``."""
        return cls(tuple(tuple(d * holders + t for d in range(size)) for t in range(holders)))

    def __post_init__(self) -> None:
        for h, ranks in enumerate(self.members):
            for q, r in enumerate(ranks):
                self._place[r] = (h, q)

    @property
    def size(self) -> int:
        return len(self.members[0])

    def place(self, rank: int) -> tuple[int, int]:
        """(holder, partition index) of a global rank."""
        return self._place[rank]

    @property
    def relabel(self) -> dict[int, int] | None:
        """``Topology(1, size, holders)`` ranks -> these members, ``None`` where they agree."""
        h = len(self.members)
        out = {q * h + e: r for e, ranks in enumerate(self.members) for q, r in enumerate(ranks)}
        return None if all(k == v for k, v in out.items()) else out


@dataclass(frozen=True, slots=True)
class Part:
    """One holder's unit: a ZeRO-1/2 flat group or a ZeRO-3 sub-group, ``names`` the parameter
    of F at each of its positions (a classic MoE holder's local experts are global ones)."""

    unit: FlatGroup | SubGroup
    names: tuple[str, ...]

    @property
    def numel(self) -> int:
        """Elements of one partition."""
        return self.unit.partition if isinstance(self.unit, FlatGroup) else self.unit.numel

    def fragments(self, q: int) -> list[tuple[int, str]]:
        """``(offset in partition q, name)`` of every parameter a flat group's partition ``q``
        meets (a sub-group: every parameter; whether ``q`` holds any of it is the composite's)."""
        if isinstance(self.unit, FlatGroup):
            base = q * self.unit.partition
            return [(lo - base, self.names[i]) for i, lo, _ in self.unit.fragments(q)]
        return list(zip(self.unit.offsets, self.names))

    def inner(self, i: int, size: int) -> ParamMap:
        """Position ``i``'s split over the ``size`` partitions."""
        if isinstance(self.unit, FlatGroup):
            return self.unit.param_map(i)
        return zero3(self.unit.shapes[i], size, shard="fragment")


@dataclass(frozen=True, slots=True)
class Unit:
    """One optimizer unit (a parameter group under ZeRO-1/2, a sub-group under ZeRO-3): its
    holders' partition group and each holder's part (a holder without one holds none)."""

    group: Group
    parts: Mapping[int, Part]


class Layout:
    """Outer maps, partition groups and units of a checkpoint under ``rule`` ("flat" or "sub"):
    composites, the optimizer buffers each rank declares, and their storages."""

    def __init__(self, rule: str, outer: Mapping[str, ParamMap], units: Sequence[Unit], ranks: Sequence[int]) -> None:
        if rule not in ("flat", "sub"):
            raise CheckpointError(f"internal: unknown partition rule {rule!r}")
        self.rule, self.outer, self.units, self.ranks = rule, dict(outer), list(units), list(ranks)
        self._at: dict[tuple[str, int], tuple[Part, int]] = {}  # (name, holder) -> its part and position
        self.group_of: dict[str, Group] = {}
        for u in self.units:
            for h, part in u.parts.items():
                for i, n in enumerate(part.names):
                    self._at[(n, h)] = (part, i)
                    self.group_of[n] = u.group
        self._composites: dict[str, ParamMap] = {}

    def composite(self, name: str) -> ParamMap:
        """``name``'s outer map composed with the split of each holder's share over its partition
        group, over global ranks."""
        m = self._composites.get(name)
        if m is not None:
            return m
        group, outer = self.group_of[name], self.outer[name]
        inner: dict[int, ParamMap | None] = {}
        for h in outer.ranks:
            at = self._at.get((name, h))
            inner[h] = None if at is None else at[0].inner(at[1], group.size)
        only = inner.get(0) if self.rule == "sub" and len(group.members) == 1 else None
        if only is not None:  # ZeRO-3 whole on one holder: its split is the map
            m = only
        else:
            m = compose_zero(outer, inner, Topology(1, group.size, len(group.members)))
            relabel = group.relabel
            if relabel is not None:
                m = m.with_ranks(relabel)
        self._composites[name] = m
        return m

    def rank_units(self, rank: int) -> list[tuple[int, Part, int]]:
        """``(unit index, part, partition index)`` of every unit global rank ``rank`` holds a
        partition of, in order."""
        out = []
        for k, u in enumerate(self.units):
            h, q = u.group.place(rank)
            part = u.parts.get(h)
            if part is not None:
                out.append((k, part, q))
        return out

    def buffers(self, key: Callable[[int, int], str], states: Sequence[str]) -> list[Buffer]:
        """Every rank's partition of every unit, one buffer per state, keyed
        ``key(rank, unit):state``; each parameter's fragment a slot of its composite."""
        out = []
        for r in self.ranks:
            for k, part, q in self.rank_units(r):
                frags = [(off, n) for off, n in part.fragments(q)
                         if self.rule == "flat" or r in self.composite(n).shards]
                out += [Buffer(f"{key(r, k)}:{s}", torch.float32, part.numel,
                               tuple(Slot(off, n, want(s), self.composite(n), r) for off, n in frags)) for s in states]
        return out

    def partitions(self, engine: Any, declared: Mapping[str, Buffer], key: Callable[[int, int], str], rank: int,
                   states: Sequence[str]) -> tuple[list[Storage], list[dict[str, Any]]]:
        """Global rank ``rank``'s declared partitions: per unit the fp32 master's storage and the
        moments' views (those of ``states``)."""
        fp32, moments = [], []
        for k, part, _ in self.rank_units(rank):
            bufs = {s: engine.storage(declared[f"{key(rank, k)}:{s}"]) for s in states}
            fp32.append(bufs["fp32"])
            moments.append({m: bufs[m].view((part.numel,)) for m in MOMENTS if m in bufs})
        return fp32, moments


# -- a source's layout, from what it records -----------------------------------------------------------


def flat_source(ck: Any, align: int) -> Layout:
    """The layout a ZeRO-1/2 checkpoint's ``param_shapes`` imply under DeepSpeed 0.19.8's rule: per
    model-parallel rank and parameter group one flat group over the DP ranks; an expert group
    (AutoEP, classic MoE: TP = PP = 1) one flat group of EP rank 0's shapes over each EP rank's EDP
    group. Outer maps are not needed to check what the files record, and are left out."""
    experts = ck.experts if ck.experts is not None else ck.moe
    dense = Group.dense(ck.mp, ck.dp)
    units = []
    for g in range(len(ck.groups(0))):
        if experts is not None and g in experts.groups:
            grp = ck.groups(0)[g]
            fg = dsw.flat_group(list(grp), list(grp.values()), experts.edp, param_align=align)
            edp = Group(tuple(tuple(experts.members(e)) for e in range(experts.ep)))
            units.append(Unit(edp, dict.fromkeys(range(experts.ep), Part(fg, fg.names))))
            continue
        parts = {}
        for t in range(ck.mp):
            grp = ck.groups(t)[g]
            fg = dsw.flat_group(list(grp), list(grp.values()), ck.dp, param_align=align)
            parts[t] = Part(fg, fg.names)
        units.append(Unit(dense, parts))
    return Layout("flat", {}, units, [d * ck.mp + t for t in range(ck.mp) for d in range(ck.dp)])


def check_flat(ck: Any, align: int) -> None:
    """Every ZeRO-1/2 rank's recorded ``param_slice_mappings``, ``group_paddings``,
    ``param_alignment_paddings`` and fp32 partition length against :func:`flat_source`: one check
    for every kind (dense, AutoTP, pipeline stages, AutoEP and classic MoE experts)."""
    layout = flat_source(ck, align)
    for r in layout.ranks:
        t, d = r % ck.mp, r // ck.mp
        osd, path = ck.osd(t, d), ck.optim_files[(t, d)]
        for k, part, q in layout.rank_units(r):
            if not isinstance(part.unit, FlatGroup):
                raise CheckpointError(f"internal: {path}: unit {k} is not a flat group")
            dsw.check_partition(part.unit, q, osd, k, f"{ck.tag_dir} (model-parallel rank {t}, {path.name}): dp rank {d}",
                                path)
