"""Per-rank planning and planning at scale: a rank's plan (``plan_model(..., ranks=...)``,
``plan_for_rank``) is exactly the global plan's segments involving it, on random rank subsets of
ZeRO composites, replicated layouts and random layout pairs; a parameter's choices depend on it
alone; identical layers take turns over replicas; ``ZeroComposer`` builds the maps ``compose``
builds."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import ParamMap, apply_plan, plan_model
from reshard.errors import MapError, PlanError
from reshard.layouts import (
    compose,
    even_sizes,
    replicate_over,
    replicated,
    split,
    zero12_group,
    zero12_group_layout,
)
from reshard.layouts.compose import ZeroComposer
from reshard.layouts.topology import Topology
from reshard.plan.planner import DefaultCost, Planner, plan_for_rank
from tests.support.irgen import layouts, shapes

HIDDEN, INTER = 16, 12


def _stage_params(topo: Topology, layers: int, stage: int, experts: int, vocab: int):
    per = layers // topo.pp
    out = []
    for i in range(stage * per, (stage + 1) * per):
        p = f"l{i}."
        out += [(p + "qkv", (3 * HIDDEN, HIDDEN), 0), (p + "o", (HIDDEN, HIDDEN), 1), (p + "norm", (HIDDEN,), None),
                (p + "router", (experts, HIDDEN), None)]
        for e in range(experts):
            out += [(p + f"e{e}.w1", (INTER, HIDDEN), 0), (p + f"e{e}.w2", (HIDDEN, INTER), 1)]
    if vocab and stage == 0:
        out.insert(0, ("embed", (vocab, HIDDEN), 0))
    if vocab and stage == topo.pp - 1:
        out += [("final_norm", (HIDDEN,), None), ("head", (vocab, HIDDEN), 0)]
    return out


def _tp_maps(topo: Topology, params, stage: int) -> tuple[tuple[int, ...], list[ParamMap]]:
    ranks = tuple(topo.rank(stage, 0, t) for t in range(topo.tp))
    return ranks, [replicated(s, ranks) if d is None else split(s, d, even_sizes(s[d], topo.tp), ranks=ranks)
                   for _, s, d in params]


def moe(topo: Topology, layers: int = 4, experts: int = 2, vocab: int = 0, composer: ZeroComposer | None = None):
    """A small MoE: TP inside each pipeline stage composed with ZeRO-1 over the stage's DP group,
    built with a ZeroComposer (one flat group shared by every TP rank, as with even TP shards)."""
    composer = composer or ZeroComposer()
    maps = {}
    for stage in range(topo.pp):
        params = _stage_params(topo, layers, stage, experts, vocab)
        ranks, outer = _tp_maps(topo, params, stage)
        group = zero12_group_layout([m.shard(ranks[0]).shape for m in outer], topo.dp)
        dp = {r: [topo.rank(stage, d, t) for d in range(topo.dp)] for t, r in enumerate(ranks)}
        maps.update(zip((n for n, _, _ in params), composer.group(outer, {r: group for r in ranks}, dp)))
    return maps


def moe_composed(topo: Topology, layers: int = 4, experts: int = 2, vocab: int = 0):
    """The same model built parameter by parameter with ``compose`` (the reference)."""
    maps = {}
    for stage in range(topo.pp):
        params = _stage_params(topo, layers, stage, experts, vocab)
        ranks, outer = _tp_maps(topo, params, stage)
        for t, r in enumerate(ranks):
            dp = [topo.rank(stage, d, t) for d in range(topo.dp)]
            zero = zero12_group([m.shard(r).shape for m in outer], topo.dp, ranks=dp, shard="fragment")
            for (name, _, _), tm, zm in zip(params, outer, zero):
                maps.setdefault(name, (tm, {}))[1][r] = zm
    return {name: compose(tm, inner) for name, (tm, inner) in maps.items()}


def _replicated_model(tp: int, dp: int, base: int, layers: int = 6, hidden: int = 8):
    """TP maps replicated over DP (DeepSpeed order: TP fastest), ranks from ``base``."""
    ranks = [base + t for t in range(tp)]
    groups = {base + t: [base + d * tp + t for d in range(dp)] for t in range(tp)}
    out = {}
    for i in range(layers):
        for name, shape, dim in [("w", (hidden, hidden), 1), ("up", (2 * hidden, hidden), 0), ("norm", (hidden,), None)]:
            m = replicated(shape, ranks) if dim is None else split(shape, dim, even_sizes(shape[dim], tp), ranks=ranks)
            out[f"l{i}.{name}"] = replicate_over(m, groups) if dp > 1 else m
    return out


MOE_PAIRS = [
    (Topology(pp=2, dp=2, tp=4), Topology(pp=4, dp=2, tp=2), 4, 2, 0),
    (Topology(pp=2, dp=3, tp=2), Topology(pp=2, dp=2, tp=4), 4, 3, 24),
    (Topology(pp=1, dp=5, tp=2), Topology(pp=2, dp=3, tp=1), 2, 2, 40),
]


@pytest.mark.parametrize("src,tgt,layers,experts,vocab", MOE_PAIRS)
def test_zero_composer_builds_the_maps_compose_builds(src, tgt, layers, experts, vocab):
    for topo in (src, tgt):
        fast, slow = moe(topo, layers, experts, vocab), moe_composed(topo, layers, experts, vocab)
        assert list(fast) == list(slow)
        for name, m in fast.items():
            assert m == slow[name], name
            m.check()


def test_zero_composer_shares_identical_parameters():
    composer = ZeroComposer()
    maps = moe(Topology(pp=1, dp=2, tp=2), layers=8, experts=1, composer=composer)
    assert len({id(m) for m in maps.values()}) < len(maps)
    # layers wholly inside one partition are one map object
    a, b = maps["l1.e0.w1"], maps["l2.e0.w1"]
    assert a == b and (a is b) == (a.ranks == b.ranks)


def test_zero_composer_refuses_fragments_that_do_not_tile():
    outer = split((4, 4), 0, [2, 2], ranks=[0, 1])
    with pytest.raises(MapError, match="do not tile"):
        ZeroComposer().compose(outer, {0: [(10, 0, 5)], 1: [(11, 0, 8)]})
    with pytest.raises(MapError, match="two shards"):
        ZeroComposer().compose(outer, {0: [(10, 0, 8)], 1: [(10, 0, 8)]})
    with pytest.raises(MapError, match="keyed"):
        ZeroComposer().compose(outer, {0: [(10, 0, 8)]})


def _filtered(global_plan, ranks):
    out = {}
    for name, p in global_plan.params.items():
        segs = tuple(s for s in p.segments if s.src_rank in ranks or s.dst_rank in ranks)
        unfilled = tuple(u for u in p.unfilled if u.dst_rank in ranks)
        out[name] = (segs, unfilled)
    return out


def _assert_rank_plans_match(source, target, subsets, **options):
    whole = plan_model(source, target, **options)
    for ranks in subsets:
        mine = plan_model(source, target, ranks=ranks, **options)
        want = _filtered(whole, frozenset(ranks))
        for name, (segs, unfilled) in want.items():
            held = any(r in source[name].shards or r in target[name].shards for r in ranks)
            assert (name in mine.params) == held, name
            if held:
                p = mine.params[name]
                assert p.segments == segs, (name, ranks)
                assert p.unfilled == unfilled, (name, ranks)
                assert p.logical_shape == whole.params[name].logical_shape
                assert p.target_shards == whole.params[name].target_shards
            else:
                assert not segs and not unfilled, name


def _subsets(world: list[int], count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(world, rng.randint(1, min(6, len(world)))) for _ in range(count)]


@pytest.mark.parametrize("src,tgt,layers,experts,vocab", MOE_PAIRS)
def test_rank_plans_are_the_global_plan_on_zero_composites(src, tgt, layers, experts, vocab):
    source, target = moe(src, layers, experts, vocab), moe(tgt, layers, experts, vocab)
    world = list(range(max(src.world_size, tgt.world_size)))
    _assert_rank_plans_match(source, target, _subsets(world, 12, seed=len(source)))


@pytest.mark.parametrize("src,tgt", [((4, 2, 0), (2, 1, 8)), ((2, 4, 0), (4, 1, 8)), ((4, 2, 0), (2, 2, 0)),
                                     ((2, 2, 0), (1, 4, 2))])
def test_rank_plans_are_the_global_plan_with_replicas(src, tgt):
    source, target = _replicated_model(*src), _replicated_model(*tgt)
    world = sorted({r for m in (*source.values(), *target.values()) for r in m.ranks})
    _assert_rank_plans_match(source, target, _subsets(world, 10, seed=sum(src + tgt)))


def test_every_rank_alone_gives_back_the_global_plan():
    """Each segment appears in the plans of exactly its sender and its receiver."""
    src, tgt = MOE_PAIRS[1][0], MOE_PAIRS[1][1]
    source, target = moe(src, 4, 3, 24), moe(tgt, 4, 3, 24)
    whole = plan_model(source, target)
    found: dict[tuple[str, object], set[int]] = {}
    for r in range(max(src.world_size, tgt.world_size)):
        for name, p in plan_for_rank(source, target, r).params.items():
            for s in p.segments:
                found.setdefault((name, s), set()).add(r)
    want = {(name, s): {s.src_rank, s.dst_rank} for name, p in whole.params.items() for s in p.segments}
    assert found == want


@st.composite
def models(draw):
    """A few parameters, each a random layout pair with the target's ranks shifted (partly
    overlapping the source's), some repeated (identical layers, salted apart)."""
    params = {}
    for i in range(draw(st.integers(1, 4))):
        shape = draw(shapes(max_ndim=3, max_extent=6))
        shift = draw(st.integers(0, 3))
        src, tgt = draw(layouts(shape)), draw(layouts(shape))
        tgt = tgt.with_ranks({r: r + shift for r in tgt.ranks})
        for k in range(draw(st.integers(1, 3))):
            params[f"p{i}.{k}"] = (src, tgt)
    return params


@settings(max_examples=60, deadline=None)
@given(model=models(), data=st.data())
def test_rank_plans_are_the_global_plan_on_random_layouts(model, data):
    source = {n: s for n, (s, _) in model.items()}
    target = {n: t for n, (_, t) in model.items()}
    world = sorted({r for s, t in model.values() for r in (*s.ranks, *t.ranks)})
    subsets = [data.draw(st.lists(st.sampled_from(world), min_size=1, max_size=4, unique=True)) for _ in range(3)]
    try:
        _assert_rank_plans_match(source, target, subsets, allow_inexact_scale=True)
    except PlanError:
        pytest.skip("layouts that are not one parameter")


@settings(max_examples=60, deadline=None)
@given(pair=models(), stretch=st.integers(1, 3), offset=st.integers(0, 5), per_node=st.sampled_from([None, 2, 3]))
def test_geometry_shared_up_to_rank_names_plans_like_a_fresh_planner(pair, stretch, offset, per_node):
    """A planner that already planned a pair of maps reuses that work for the same pair under an
    order-preserving renaming of ranks; its plan is the one a fresh planner makes, with choices
    made on the real ranks (here: nodes of ``per_node`` ranks)."""
    source, target = next(iter(pair.values()))
    rename = {r: stretch * r + offset for r in {*source.ranks, *target.ranks}}
    moved = (source.with_ranks(rename), target.with_ranks(rename))
    cost = DefaultCost(ranks_per_node=per_node)
    shared = Planner(cost, allow_inexact_scale=True)
    try:
        first = shared.plan(source, target, salt=1)
    except PlanError:
        return
    assert first == Planner(cost, allow_inexact_scale=True).plan(source, target, salt=1)
    assert shared.plan(*moved, salt=1) == Planner(cost, allow_inexact_scale=True).plan(*moved, salt=1)


def test_choices_depend_on_the_parameter_alone():
    """A parameter's plan is the planner's plan of its maps with its salt (how many earlier
    parameters have its pair of maps), whatever else the model holds."""
    source, target = _replicated_model(2, 4, 0), _replicated_model(4, 1, 8)
    whole = plan_model(source, target)
    counts: dict = {}
    for name in source:
        key = (source[name], target[name])
        counts[key] = counts.get(key, -1) + 1
        assert Planner().plan(source[name], target[name], salt=counts[key]) == whole.params[name]
    names = list(source)[len(source) // 2:]
    part = plan_model({n: source[n] for n in names}, {n: target[n] for n in names})
    first = names[0]
    assert part.params[first] == Planner().plan(source[first], target[first], salt=0)


def test_identical_layers_take_turns_over_replicas():
    """TP2 x DP4 -> TP4 on other ranks: every block has four holders; the layers rotate over
    them, so every source rank sends the same bytes."""
    source, target = _replicated_model(2, 4, 0, layers=8), _replicated_model(4, 1, 8, layers=8)
    stats = plan_model(source, target).stats()
    assert stats.local_bytes == 0
    assert set(stats.sent) == set(range(8))
    assert stats.send_balance() == 1.0, stats.sent


def test_rank_plans_execute_to_the_target_shards():
    """A receiving rank's plan alone fills its shards exactly."""
    src_topo, tgt_topo = MOE_PAIRS[0][0], MOE_PAIRS[0][1]
    source, target = moe(src_topo, 4, 2), moe(tgt_topo, 4, 2)
    rank = 5
    mine = plan_for_rank(source, target, rank)
    for name, p in mine.params.items():
        if rank not in target[name].shards:
            continue
        full = torch.randn(source[name].logical_shape)
        shards = {r: source[name].extract(full, r) for r in source[name].ranks}
        out = apply_plan(p, shards)
        assert torch.equal(out[rank], target[name].extract(full, rank)), name


@settings(max_examples=100, deadline=None)
@given(numels=st.lists(st.integers(0, 40), min_size=1, max_size=8), dp=st.integers(1, 9),
       param_alignment=st.integers(1, 4), round_robin=st.booleans())
def test_fragments_of_is_the_partition_overlap(numels, dp, param_alignment, round_robin):
    group = zero12_group_layout([(n,) for n in numels], dp, param_alignment=param_alignment, round_robin=round_robin)
    for i in range(len(numels)):
        off = group.offsets[i]
        want = [(d, lo - off, hi - off) for d in range(dp) for lo, hi in [group.overlap(i, d)] if lo < hi]
        assert list(group.fragments_of(i)) == want
