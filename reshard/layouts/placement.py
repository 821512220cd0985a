"""Placement layouts: experts over an expert-parallel group, parameters over pipeline stages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import MapError
from ..ir.param_map import ParamMap
from ._core import as_shape, dim_blocks, global_ranks
from .topology import Topology
from .tp import replicated

__all__ = [
    "autoep_placement",
    "expert_placement",
    "pipeline_stage",
    "uniform_experts",
]


def expert_placement(
    shape: Sequence[int], experts_by_rank: Sequence[Sequence[int]], *, ranks: Sequence[int] | None = None
) -> ParamMap:
    """A ``[num_experts, ...]`` parameter: EP rank ``i`` holds the experts ``experts_by_rank[i]``
    packed in that order. An expert several ranks hold names all of them; consecutive experts with
    the same holders, consecutive in both F and the shard, are one piece."""
    shape = as_shape(shape)
    if not shape:
        raise MapError("an expert parameter needs a leading experts dim")
    labels = global_ranks(len(experts_by_rank), ranks)
    seen: set[int] = set()
    for r, experts in zip(labels, experts_by_rank):
        if len(set(experts)) != len(experts):
            raise MapError(f"rank {r} lists an expert twice: {list(experts)}")
        for e in experts:
            if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < shape[0]:
                raise MapError(f"rank {r}: expert {e!r} outside [0, {shape[0]})")
        seen.update(experts)
    missing = sorted(set(range(shape[0])) - seen)
    if missing:
        raise MapError(f"experts {missing} are placed on no rank")
    return dim_blocks(shape, 0, {r: [(e, 1) for e in ex] for r, ex in zip(labels, experts_by_rank)})


def uniform_experts(num_experts: int, ep: int) -> list[list[int]]:
    """The legacy placement: rank ``i`` holds ``num_experts / ep`` consecutive experts."""
    if ep < 1 or num_experts % ep:
        raise MapError(f"{num_experts} experts do not spread evenly over {ep} ranks")
    n = num_experts // ep
    return [list(range(i * n, (i + 1) * n)) for i in range(ep)]


def autoep_placement(
    descriptor: Mapping[str, Any], shape: Sequence[int], *, ranks: Sequence[int] | None = None
) -> ParamMap:
    """From DeepSpeed AutoEP's placement descriptor (version 1:
    ``{"version": 1, "num_experts": E, "ep_size": N, "ranks": [{"rank": i, "experts": [...]}]}``),
    whose ranks are EP-local; ``ranks`` relabels them to global ranks."""
    if not isinstance(descriptor, Mapping) or descriptor.get("version") != 1:
        raise MapError(f"expected an AutoEP placement descriptor of version 1, got {descriptor!r}")
    num_experts, ep, entries = descriptor.get("num_experts"), descriptor.get("ep_size"), descriptor.get("ranks")
    if not isinstance(ep, int) or not isinstance(entries, list) or len(entries) != ep:
        raise MapError(f"AutoEP descriptor: ep_size {ep!r} does not match its rank entries")
    shape = as_shape(shape)
    if not shape or shape[0] != num_experts:
        raise MapError(f"expert parameter shape {list(shape)} must start with num_experts ({num_experts})")
    by_rank: dict[int, list[int]] = {}
    for entry in entries:
        r = entry.get("rank") if isinstance(entry, Mapping) else None
        if not isinstance(r, int) or not 0 <= r < ep or r in by_rank:
            raise MapError(f"AutoEP descriptor: bad or repeated rank entry {entry!r}")
        by_rank[r] = list(entry.get("experts", []))
    return expert_placement(shape, [by_rank[i] for i in range(ep)], ranks=ranks)


def pipeline_stage(shape: Sequence[int], topology: Topology, stages: int | Sequence[int]) -> ParamMap:
    """A parameter that lives whole on pipeline stage(s) ``stages`` (several for tied weights such
    as embeddings shared by the first and last stage): every rank of those stages holds it, so
    one piece whose locations are all of them. Compose with a TP or ZeRO map per stage to say how
    the stage holds it (:func:`reshard.layouts.compose`)."""
    stage_list = [stages] if isinstance(stages, int) else list(stages)
    members = sorted(r for s in stage_list for r in topology.stage_ranks(s))
    return replicated(shape, global_ranks(len(members), members))
