"""Plan a model's move to another TP x DP topology from its TP maps alone (``reshard plan --tp``).

Each parameter's layout family is recognised from its geometry (``layouts.recognize``) and rebuilt
at TP=T; both sides are replicated over their data-parallel ranks (global rank
``dp_rank * TP + tp_rank``, DeepSpeed's order) and planned with one cost model. Only module
weights are planned; ZeRO optimizer partitions are the offline writer's business. A caller that
knows a parameter's layout at TP=T from elsewhere (a Hugging Face folder's TP plan, which transformers
defines and ``formats/hf`` lowers) passes those target maps in: this layer imports no format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import PlanError, ReshardError
from ..ir.param_map import ParamMap
from ..layouts import replicate_over
from ..layouts.recognize import Family, recognize
from ..layouts.topology import Topology
from .planner import DefaultCost, plan_model
from .values import ModelPlan

__all__ = ["TopologyPlan", "over_dp", "plan_topology"]


@dataclass(frozen=True)
class TopologyPlan:
    """The plan from a model's maps to TP=``tp`` x DP=``dp``, with the maps on both sides."""

    plan: ModelPlan
    source_maps: dict[str, ParamMap]
    target_maps: dict[str, ParamMap]
    families: dict[str, Family]
    source_tp: int
    source_dp: int
    tp: int
    dp: int


def over_dp(m: ParamMap, tp: int, dp: int) -> ParamMap:
    """A TP map (ranks ``0..tp-1``) replicated over ``dp`` data-parallel replicas."""
    if dp == 1:
        return m
    topo = Topology(1, dp, tp)
    return replicate_over(m, {t: topo.dp_group(t) for t in m.ranks})


def plan_topology(maps: Mapping[str, ParamMap], tp: int, dp: int | None = None, *, source_dp: int = 1,
                  vocab_divisible_by: int | None = None, ranks_per_node: int | None = None,
                  allow_inexact_scale: bool = False, where: str = "",
                  given: Mapping[str, tuple[ParamMap, str]] | None = None) -> TopologyPlan:
    """Target maps for TP=``tp`` x DP=``dp`` (default ``source_dp``) rebuilt from ``maps`` (TP
    maps, replicated over ``source_dp`` ranks), and the plan to them. ``given[name]`` is a
    parameter's target map at TP=``tp`` known by the caller, with the words naming its layout
    (used as is, not recognised from the source's geometry). ``where`` names the source in errors."""
    for what, v in (("tp", tp), ("dp", dp), ("source_dp", source_dp), ("vocab_divisible_by", vocab_divisible_by)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ReshardError(f"{what} must be a positive integer, got {v!r}")
    dp = source_dp if dp is None else dp
    prefix = f"{where}: " if where else ""
    families: dict[str, Family] = {}
    sources: dict[str, ParamMap] = {}
    targets: dict[str, ParamMap] = {}
    given = given or {}
    cache: dict[tuple, tuple[ParamMap, ParamMap, Family]] = {}  # identical layers: one recognition
    for name, m in maps.items():
        key = (m, given.get(name))
        if key not in cache:
            n = len(m.ranks)
            try:
                fam = (_given(m, *given[name], tp) if name in given
                       else Family("same", f"kept as is (TP={n})", lambda t, m=m: m) if n == tp
                       else recognize(m, vocab_divisible_by=vocab_divisible_by))
                target = fam.build(tp)
            except ReshardError as e:
                raise PlanError(f"{prefix}parameter {name!r} (F {list(m.logical_shape)}): {e}") from None
            cache[key] = (over_dp(m, n, source_dp), over_dp(target, tp, dp), fam)
        sources[name], targets[name], families[name] = cache[key]
    mp = plan_model(sources, targets, cost=DefaultCost(ranks_per_node), allow_inexact_scale=allow_inexact_scale)
    source_tp = max((len(m.ranks) for m in maps.values()), default=1)
    return TopologyPlan(mp, sources, targets, families, source_tp, source_dp, tp, dp)


def _given(source: ParamMap, target: ParamMap, text: str, tp: int) -> Family:
    """A target map the caller gives: of the source's F, on TP ranks ``0..tp-1``."""
    if target.logical_shape != source.logical_shape or tuple(target.ranks) != tuple(range(tp)):
        raise PlanError(f"the given target map is of F {list(target.logical_shape)} on ranks {list(target.ranks)}, "
                        f"not of F {list(source.logical_shape)} on TP ranks 0..{tp - 1}")
    return Family("given", text, lambda t: target)
