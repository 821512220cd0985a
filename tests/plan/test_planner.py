"""Planner: target ∘ source⁻¹ is exact for random layout pairs, writes every valid target element
exactly once, never reads source padding, and chooses replicas by its cost model."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import ParamMap, apply_plan, plan, plan_model
from reshard.errors import PlanError
from reshard.plan.planner import DefaultCost
from reshard.plan.values import model_plan_from_dict, model_plan_to_dict, plan_from_dict, plan_to_dict
from tests.support.irgen import (
    DTYPES,
    grid_map,
    layouts,
    padded_vocab_map,
    random_tensor,
    replicated_map,
    segmented_map,
    shapes,
)

SETTINGS = settings(max_examples=200, deadline=None)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _nan_like(shape_by_rank, dtype):
    fill = float("nan") if dtype.is_floating_point else -(2**62)
    return {r: torch.full(s, fill, dtype=dtype) for r, s in shape_by_rank.items()}


def _assert_exact(p, source: ParamMap, target: ParamMap, full: torch.Tensor, power: int = 1):
    shards = {r: source.extract(full, r, power) for r in source.ranks}
    out = _nan_like(p.target_shards, full.dtype)
    apply_plan(p, shards, out=out, scale_power=power)
    for r in target.ranks:
        want = target.extract(full, r, power)
        assert torch.equal(_bits(out[r]), _bits(want)), f"rank {r}"


@st.composite
def layout_pairs(draw):
    shape = draw(shapes())
    return draw(layouts(shape)), draw(layouts(shape))


@SETTINGS
@given(pair=layout_pairs(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_plan_apply_is_exact_and_writes_each_element_once(pair, dtype, seed):
    source, target = pair
    scaled = any(p.scale != 1 for m in pair for _, _, p in m.pieces())
    if scaled and not dtype.is_floating_point:
        dtype = torch.float64
    p = plan(source, target)
    full = random_tensor(source.logical_shape, dtype, seed)
    for power in ([1, -1, -2] if dtype.is_floating_point else [1]):
        _assert_exact(p, source, target, full, power)
    # exactly once: the segments' dest elements count up to each target shard, with no repeats
    for r, shape in p.target_shards.items():
        hits = torch.zeros(shape, dtype=torch.int64).reshape(-1)
        for s in p.segments:
            if s.dst_rank == r:
                torch.as_strided(hits, s.shape, s.dst.strides, s.dst.offset).add_(1)
        assert hits.numel() == 0 or int(hits.max()) <= 1
        assert int(hits.sum()) == hits.numel()
    # every segment reads from a rank that holds the block
    for s in p.segments:
        assert s.src_rank in source.ranks
    back = plan_from_dict(json.loads(json.dumps(plan_to_dict(p))))
    assert back == p


@pytest.mark.parametrize("vocab", [13, 32, 100, 50257, 262144])
@pytest.mark.parametrize("src_tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("tgt_tp", [1, 2, 4, 8, 16])
def test_padded_vocabulary_sweep(vocab, src_tp, tgt_tp):
    hidden = 2
    source = padded_vocab_map(vocab, hidden, src_tp)
    target = padded_vocab_map(vocab, hidden, tgt_tp)
    p = plan(source, target)
    assert len(p.segments) <= src_tp + tgt_tp
    real = torch.randn(vocab, hidden, dtype=torch.float32)
    padded = torch.full(source.logical_shape, float("nan"))
    padded[:vocab] = real
    shards = {r: source.extract(padded, r) for r in source.ranks}  # padding rows hold NaN
    out = apply_plan(p, shards)
    for r in target.ranks:
        assert torch.equal(out[r], target.extract(real, r))  # target padding zero, never NaN
    pad_rows = target.logical_shape[0] - vocab
    # unfilled regions are exactly the target's padding rows (F rows >= vocab), each element listed once
    is_pad = torch.zeros(target.logical_shape, dtype=torch.int64)
    is_pad[vocab:] = 1
    for r, shape in p.target_shards.items():
        hits = torch.zeros(_numel(shape), dtype=torch.int64)
        for u in p.unfilled:
            if u.dst_rank == r:
                torch.as_strided(hits, u.shape, u.dst.strides, u.dst.offset).add_(1)
        assert torch.equal(hits.reshape(shape), target.extract(is_pad, r)), f"rank {r}"
    assert sum(_numel(u.shape) for u in p.unfilled) == pad_rows * hidden


def _numel(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def test_valid_shapes_must_agree():
    a = padded_vocab_map(13, 2, 4)
    b = padded_vocab_map(14, 2, 2)
    with pytest.raises(PlanError, match=r"valid shape \[13, 2\] differs from target valid shape \[14, 2\]"):
        plan(a, b)


def test_scale_composes_and_refuses_rounding():
    src = replicated_map((8,), 4, 0.25)  # bias / 4 on TP=4
    tgt = replicated_map((8,), 2, 0.5)  # bias / 2 on TP=2
    p = plan(src, tgt)
    assert {s.factor for s in p.segments} == {2.0}
    full = torch.randn(8, dtype=torch.bfloat16)
    for power in (1, -1, -2):
        _assert_exact(p, src, tgt, full, power)
    three = replicated_map((8,), 3, 1 / 3)
    with pytest.raises(PlanError, match="not a power of two"):
        plan(three, tgt)
    inexact = plan(three, tgt, allow_inexact_scale=True)
    assert {s.factor for s in inexact.segments} == {1.5}


def test_local_copy_first():
    """Replicated blocks a target rank already holds are copied locally, never sent."""
    src = segmented_map((16, 4), 0, [(8, False), (8, True)], 4)
    tgt = segmented_map((16, 4), 0, [(8, False), (8, True)], 2)
    p = plan(src, tgt)
    for s in p.segments:
        if s.dst.offset >= 4 * 4:  # the replicated rows of a target shard: always a local copy
            assert s.src_rank == s.dst_rank
    # only private rows move: rank 1's two rows to rank 0, ranks 2 and 3's to rank 1
    assert p.stats().sent == {1: 8, 2: 8, 3: 8}


def _tp_model(tp: int, ranks: list[int], hidden: int = 16, layers: int = 4) -> dict[str, ParamMap]:
    """Per layer: a column-split weight and a replicated norm, on the given global ranks."""
    relabel = dict(enumerate(ranks))
    maps = {}
    for i in range(layers):
        maps[f"l{i}.w"] = grid_map((hidden, hidden), {1: [hidden // tp] * tp}).with_ranks(relabel)
        maps[f"l{i}.norm"] = replicated_map((hidden,), tp).with_ranks(relabel)
    return maps


def _tp_dp_model(tp: int, dp: int, ranks: list[int], hidden: int = 16, layers: int = 4):
    """TP inside DP replicas: DeepSpeed's order puts the model (TP) axis fastest."""
    maps = {}
    for i in range(layers):
        w = grid_map((hidden, hidden), {1: [hidden // tp] * tp})
        shards = {ranks[d * tp + t]: w.shards[t] for d in range(dp) for t in range(tp)}
        fixed = {}
        for r, sh in shards.items():
            t = ranks.index(r) % tp
            holders = frozenset(ranks[d * tp + t] for d in range(dp))
            fixed[r] = type(sh)(sh.shape, tuple(type(p)(p.shape, p.source, p.dest, holders, p.scale)
                                                 for p in sh.pieces))
        maps[f"l{i}.w"] = ParamMap(w.logical_shape, fixed)
        maps[f"l{i}.norm"] = replicated_map((hidden,), tp * dp).with_ranks(dict(enumerate(ranks)))
    return maps


def test_replica_balance_tp4_to_tp2_dp2():
    """Target ranks disjoint from the source: every byte is remote and replicated norms must
    be spread over their four holders."""
    src = _tp_model(4, [0, 1, 2, 3])
    tgt = _tp_dp_model(2, 2, [4, 5, 6, 7])
    mp = plan_model(src, tgt)
    st_ = mp.stats(element_size=4)
    assert st_.local_bytes == 0
    assert st_.send_balance() <= 1.1, st_.sent
    for name, p in mp.params.items():
        full = torch.randn(src[name].logical_shape)
        _assert_exact(p, src[name], tgt[name], full)


def test_same_node_preferred():
    src = replicated_map((8,), 4).with_ranks({0: 0, 1: 1, 2: 4, 3: 5})
    tgt = replicated_map((8,), 1).with_ranks({0: 6})
    p = plan(src, tgt, cost=DefaultCost(ranks_per_node=4))
    assert {s.src_rank for s in p.segments} <= {4, 5}


def test_default_cost_rotates_ties_by_salt():
    """Local copy, then least sent in this parameter, then rank order rotated by the salt."""
    c = DefaultCost()
    assert [c.choose([3, 5, 7], 9, 1, {}, frozenset(), k) for k in range(4)] == [3, 5, 7, 3]
    assert c.choose([3, 5, 7], 9, 1, {3: 4}, frozenset(), 0) == 5
    assert c.choose([3, 5, 7], 9, 1, {}, frozenset({7}), 0) == 7
    assert c.choose([3, 5, 7], 5, 1, {}, frozenset(), 2) == 5


def test_plans_are_deterministic_and_identical_geometry_is_planned_once():
    src = _tp_model(4, [0, 1, 2, 3], layers=3)
    tgt = _tp_dp_model(2, 2, [0, 1, 2, 3], layers=3)
    a, b = plan_model(src, tgt), plan_model(src, tgt)
    assert a == b
    assert a.params["l0.w"] is a.params["l2.w"]  # same geometry, same choices: one plan object
    assert model_plan_from_dict(json.loads(json.dumps(model_plan_to_dict(a)))) == a


def test_plan_model_names_must_match():
    src = _tp_model(4, [0, 1, 2, 3], layers=1)
    tgt = dict(src)
    tgt["extra"] = tgt.pop("l0.norm")
    with pytest.raises(PlanError, match="extra"):
        plan_model(src, tgt)


def test_plan_is_executable_without_reshard():
    """The JSON plan needs nothing but torch.as_strided."""
    src = grid_map((6, 8), {1: [2, 2, 2, 2]})
    tgt = grid_map((6, 8), {0: [3, 3]})
    doc = json.loads(json.dumps(plan_to_dict(plan(src, tgt))))
    full = torch.randn(6, 8)
    shards = {str(r): src.extract(full, r).reshape(-1) for r in src.ranks}
    out = {r: torch.zeros(torch.Size(s).numel()) for r, s in doc["target_shards"].items()}
    for seg in doc["segments"]:
        (sr, so, ss), (dr, do, ds) = seg["src"], seg["dst"]
        torch.as_strided(out[str(dr)], seg["shape"], ds, do).copy_(
            torch.as_strided(shards[str(sr)], seg["shape"], ss, so) * seg.get("factor", 1.0))
    for r in tgt.ranks:
        assert torch.equal(out[str(r)].view(tgt.shards[r].shape), tgt.extract(full, r))
