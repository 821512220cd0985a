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
from . import zero3 as dsz3
from . import zero12 as dsw
from .recorded import Recorded
from .zero3 import SubGroup

__all__ = ["Group", "Layout", "Part", "Unit", "check_flat", "check_sub", "source", "want"]


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

    def __init__(self, rule: str, outer: Mapping[str, ParamMap] | Callable[[str], ParamMap], units: Sequence[Unit],
                 ranks: Sequence[int]) -> None:
        if rule not in ("flat", "sub"):
            raise CheckpointError(f"internal: unknown partition rule {rule!r}")
        # a target's outer maps are given; a source's lowered on first use (a function of the name)
        self._outer = dict(outer).__getitem__ if isinstance(outer, Mapping) else outer
        self.rule, self.units, self.ranks = rule, list(units), list(ranks)
        self._at: dict[tuple[str, int], tuple[Part, int]] = {}  # (name, holder) -> its part and position
        self.group_of: dict[str, Group] = {}
        self.unit_of: dict[str, int] = {}
        self.holders: dict[str, list[int]] = {}  # name -> the holders whose part lists it, in order
        for k, u in enumerate(self.units):
            for h, part in sorted(u.parts.items()):
                for i, n in enumerate(part.names):
                    self._at[(n, h)] = (part, i)
                    self.group_of[n] = u.group
                    self.unit_of[n] = k
                    self.holders.setdefault(n, []).append(h)
        self._composites: dict[str, ParamMap] = {}
        self._offsets: dict[tuple[int, int, int], dict[str, int]] = {}

    def composite(self, name: str) -> ParamMap:
        """``name``'s outer map composed with the split of each holder's share over its partition
        group, over global ranks."""
        m = self._composites.get(name)
        if m is not None:
            return m
        group, outer = self.group_of[name], self._outer(name)
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

    def inner(self, name: str, h: int) -> ParamMap | None:
        """Holder ``h``'s share of ``name`` split over its partition group (ranks: partition
        indices), ``None`` where ``h`` holds none of it."""
        at = self._at.get((name, h))
        return None if at is None else at[0].inner(at[1], self.units[self.unit_of[name]].group.size)

    def locate(self, name: str, rank: int) -> tuple[int, int] | None:
        """``(unit index, first element in the partition)`` of ``name``'s fragment on global rank
        ``rank``, ``None`` where that rank's partition holds none of it."""
        k = self.unit_of.get(name)
        if k is None:
            return None
        h, q = self.units[k].group.place(rank)
        part = self.units[k].parts.get(h)
        if part is None:
            return None
        offsets = self._offsets.get((k, h, q))
        if offsets is None:
            offsets = self._offsets[(k, h, q)] = {n: off for off, n in part.fragments(q)}
        off = offsets.get(name)
        return None if off is None else (k, off)

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


def source(ck: Recorded, align: int, outer: Callable[[str], ParamMap] | None = None) -> Layout:
    """The layout a checkpoint's ``param_shapes`` imply under DeepSpeed 0.19.8's rules, over global
    ranks ``dp_rank * mp + m``. Holders are the model-parallel ranks (a dense group's partition
    group their DP ranks), or for an expert group the EP ranks (partition group: each one's EDP
    ranks; classic MoE at TP = PP = 1, its holder's local names its global experts; AutoEP also
    folded over AutoTP, EP rank ``g % ep`` of global rank ``g``, folding.py). ZeRO-1/2 (rule "flat"): one flat group per holder and parameter group, laid out with
    ``align`` (per-parameter alignment); ZeRO-3 (rule "sub"): the sub-groups ``param_shapes``
    records, each parameter split on its own. ``outer(name)``: the outer map (a stage map, an
    expert placement), lowered on first use; without it only the partitions are known (enough to
    check what the files record)."""
    dense = Group.dense(ck.mp, ck.dp)
    rule = "sub" if ck.zero_stage == 3 else "flat"
    units = []
    for k in range(len(ck.groups(0))):
        if ck.experts is not None and k in ck.experts.groups:  # holder s * ep + e: stage s's EP rank e
            ax = ck.experts
            edp = Group(tuple(tuple(ax.holder_ranks(h)) for h in range(ax.pp * ax.ep)))
            units.append(Unit(edp, {h: _part(ck, rule, k, h, edp.size, align) for h in range(ax.pp * ax.ep)}))
        elif ck.moe is not None and k in ck.moe.groups:  # holder: EP rank (expert TP: e * etp + t)
            hs = range(ck.moe.holders)
            edp = Group(tuple(tuple(ck.moe.members(h)) for h in hs))
            units.append(Unit(edp, {h: _part(ck, rule, k, h, edp.size, align) for h in hs}))
        else:
            units.append(Unit(dense, {t: _part(ck, rule, k, t, ck.dp, align) for t in range(ck.mp)}))
    ranks = [d * ck.mp + t for t in range(ck.mp) for d in range(ck.dp)]
    return Layout(rule, outer if outer is not None else {}, units, ranks)


def _part(ck: Recorded, rule: str, k: int, h: int, size: int, align: int) -> Part:
    """Holder ``h``'s part of unit ``k`` (a parameter group, or a ZeRO-3 sub-group) over ``size``
    partitions: a dense holder's shapes are its own ``param_shapes``; an AutoEP holder's its EP
    rank's shards of the fused experts; a classic MoE holder's EP rank 0's (the local experts'),
    named as its global experts."""
    if ck.experts is not None and k in ck.experts.groups:  # holder h: stage h // ep's EP rank h % ep
        s, e = divmod(h, ck.experts.ep)
        grp = {n: ck.experts.params[n].shard_shape(e) for n in ck.groups(s * ck.tp)[k]}
    else:  # a classic MoE holder: its TP rank's local expert shapes (unsplit: rank 0's, alike)
        moe = ck.moe is not None and k in ck.moe.groups
        grp = ck.groups(h % ck.moe.etp if moe else h)[k]
    names = list(grp)
    if ck.moe is not None and k in ck.moe.groups:
        e = h // ck.moe.etp
        local = {q.local: q.name for q in ck.moe.params.values() if q.ep_rank == e and q.group == k}
        names = [local[n] for n in grp]
    if rule == "sub":
        return Part(SubGroup(k, tuple(grp), tuple(tuple(s) for s in grp.values()), size), tuple(names))
    fg = dsw.flat_group(list(grp), list(grp.values()), size, param_align=align)
    return Part(fg, tuple(names))


def check_flat(ck: Recorded, align: int) -> None:
    """Every ZeRO-1/2 rank's recorded ``param_slice_mappings``, ``group_paddings``,
    ``param_alignment_paddings`` and fp32 partition length against :func:`source`: one check
    for every kind (dense, AutoTP, pipeline stages, AutoEP and classic MoE experts)."""
    layout = source(ck, align)
    for r in layout.ranks:
        t, d = r % ck.mp, r // ck.mp
        osd, path = ck.osd(t, d), ck.optim_files[(t, d)]
        for k, part, q in layout.rank_units(r):
            if not isinstance(part.unit, FlatGroup):
                raise CheckpointError(f"internal: {path}: unit {k} is not a flat group")
            dsw.check_partition(part.unit, q, osd, k, f"{ck.tag_dir} (model-parallel rank {t}, {path.name}): dp rank {d}"
                                f"{_edp(ck, layout.units[k].group, r)}", path)
    if ck.experts is not None:  # DeepSpeed's count of an AutoEP expert group's partitions: its EDP size
        for k, u in enumerate(layout.units):
            if k in ck.experts.groups:
                for g in (g for ranks in u.group.members for g in ranks):  # global ranks (folded: over TP too)
                    counts = ck.osd(g % ck.mp, g // ck.mp).get("partition_count")
                    if isinstance(counts, (list, tuple)) and len(counts) > k and counts[k] != u.group.size:
                        raise CheckpointError(f"{ck.optim_files[(g % ck.mp, g // ck.mp)]}: partition_count {list(counts)} cuts expert "
                                              f"group {k} into {counts[k]} partitions, but its EDP group has "
                                              f"{u.group.size} ranks")


def _edp(ck: Recorded, group: Group, rank: int) -> str:
    """Where an expert group's partition of ``rank`` sits, as a refusal names it: its EP rank and
    EDP group, in the order DeepSpeed's config gives (empty for a dense group)."""
    experts = ck.experts if ck.experts is not None else ck.moe
    if experts is None or group.size == ck.dp:
        return ""
    e, _ = group.place(rank)
    order = "use_data_before_expert_parallelism" if experts.data_before_expert else "expert before data"
    return f" (EP rank {e}, EDP group {list(group.members[e])} in DeepSpeed's {order} order)"


def check_sub(ck: Recorded) -> dict[tuple[int, int], list[SubGroup]]:
    """Every ZeRO-3 kind's sub-group facts (dense, AutoTP, AutoEP experts), before :func:`source`
    is trusted: per TP rank, the recorded sub-groups (``param_shapes``, the units of
    :func:`source`) are the ones DeepSpeed 0.19.8's rule cuts from the optimizer's parameter groups
    (``param_groups`` numbering the sub-groups in order), a dense group's over all DP ranks, an
    expert group's over each EP rank's EDP group; no group mixes expert and dense sub-groups; every
    TP rank holds the same parameters in the same groups. Returns each (TP rank, DP rank)'s
    sub-groups as :func:`source` lays them out, in order: what its partitions must hold
    (``zero3.check_partitions``)."""
    size = dsz3.sub_group_size(ck.model_state(0).get("ds_config"), str(ck.model_files[0]))
    expert = ck.experts.groups if ck.experts is not None else frozenset()
    names_by_tp = []
    for t in range(ck.tp):
        recorded = ck.groups(t)
        lists = dsz3.sub_group_lists(ck, t, len(recorded))
        for g, lst in enumerate(lists):
            if len({k in expert for k in lst}) != 1:
                raise CheckpointError(f"{ck.optim_files[(t, 0)]}: optimizer group {g} mixes expert and dense sub-groups")
        groups = [[(n, s) for k in lst for n, s in recorded[k].items()] for lst in lists]
        parts = [ck.experts.edp if ck.experts is not None and lst[0] in expert else ck.dp for lst in lists]
        dsz3.check_cut(dsz3.sub_groups(groups, parts, size), list(recorded), size, ck.model_files[t])
        names_by_tp.append([[n for n, _ in g] for g in groups])
    for t in range(1, ck.tp):
        if names_by_tp[t] != names_by_tp[0]:
            raise CheckpointError(f"{ck.model_files[t]}: TP rank {t} records other parameters or parameter "
                                  "groups than TP rank 0")
        if len(ck.groups(t)) != len(ck.groups(0)):  # its shards cut otherwise: one layout has one unit list
            raise CheckpointError(f"{ck.model_files[t]}: TP rank {t} records {len(ck.groups(t))} sub-groups, TP "
                                  f"rank 0 {len(ck.groups(0))}: not supported")
    layout = source(ck, 1)  # no alignment under ZeRO-3: each parameter is split on its own
    return {(r % ck.mp, r // ck.mp): [p.unit for _, p, _ in layout.rank_units(r) if isinstance(p.unit, SubGroup)]
            for r in layout.ranks}
