"""``compose(outer, inner_by_rank)`` against direct two-stage extraction on random data, exact
locations element by element, the stacked layouts of real jobs (TP then ZeRO, TP inside a pipeline
stage, TP replicated over DP) and a real TP=2 x ZeRO-1 DP=2 checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from reshard import ParamMap
from reshard.errors import MapError
from reshard.ir import canonicalize, prod
from reshard.layouts import (
    autotp_split,
    bigcode_mqa,
    codegen_qkv,
    compose,
    expert_placement,
    flat_ranges,
    padded_vocab,
    pipeline_stage,
    prescaled_bias,
    replicate_over,
    replicated,
    shared_qk_o_proj,
    shared_qk_value,
    split,
    sub_params,
    zero3,
    zero12_from_slice_mappings,
    zero12_group,
)
from reshard.layouts.topology import Topology
from tests.support import oracles
from tests.support.paths import DEEPSPEED

FIXTURES = DEEPSPEED


def _cuts(rng: random.Random, total: int, parts: int) -> list[int]:
    pts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *pts], [*pts, total])]


def random_outer(rng: random.Random) -> ParamMap:
    kind = rng.choice(["split", "split", "sub", "bigcode", "yuan", "replicated", "vocab", "experts", "zero",
                       "codegen"])
    n = rng.randint(1, 4)
    if kind == "split":
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        d = rng.randrange(len(shape))
        if rng.random() < 0.5:  # an inner dim: strided pieces
            d = len(shape) - 1 if len(shape) == 1 else rng.randrange(1, len(shape))
        return split(shape, d, _cuts(rng, shape[d], n))
    if kind == "sub":
        subs = [rng.randint(0, 6) for _ in range(rng.randint(1, 3))]
        shape = (sum(subs) or 1, rng.randint(1, 5))
        if not sum(subs):
            subs = [1]
        return sub_params(shape, subs, [_cuts(rng, s, n) for s in subs])
    if kind == "bigcode":
        q = rng.randint(1, 9)
        return bigcode_mqa((q + rng.randint(1, 4), rng.randint(1, 5)), n, n_embd=q)
    if kind == "yuan":
        heads = rng.choice([4, 8, 12])
        tp = rng.choice([t for t in (1, 2, 3, 4, 6) if heads % t == 0 and t <= heads // 2])
        hd = rng.randint(1, 3)
        if rng.random() < 0.5:
            return shared_qk_value((heads * hd, rng.randint(1, 4)), tp, num_heads=heads)
        return shared_qk_o_proj((rng.randint(1, 4), heads * hd), tp, num_heads=heads)
    if kind == "replicated":
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 2)))
        return prescaled_bias(shape, n) if rng.random() < 0.3 else replicated(shape, n)
    if kind == "vocab":
        return padded_vocab((rng.randint(1, 11), rng.randint(1, 4)), n, divisible_by=rng.choice([1, 2]))
    if kind == "experts":
        ne = rng.randint(1, 6)
        ex = [sorted(rng.sample(range(ne), rng.randint(0, ne))) for _ in range(n)]
        for e in range(ne):
            if not any(e in x for x in ex):
                ex[rng.randrange(n)].append(e)
        return expert_placement((ne, rng.randint(1, 3), rng.randint(1, 3)), ex)
    if kind == "zero":
        shapes = [tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 2))) for _ in range(rng.randint(1, 3))]
        return zero12_group(shapes, n, shard=rng.choice(["partition", "fragment"]))[rng.randrange(len(shapes))]
    return codegen_qkv((24, rng.choice([2, 3])), 2, num_kv_heads=8)


def random_inner(rng: random.Random, shape: tuple[int, ...], first_rank: int) -> ParamMap:
    n = rng.randint(1, 4)
    ranks = list(range(first_rank, first_rank + n))
    kind = rng.choice(["split", "zero", "zero", "zero3", "replicated", "sub", "sub", "flat"])
    if kind == "split" and shape and prod(shape):
        d = rng.randrange(len(shape))
        return split(shape, d, _cuts(rng, shape[d], n), ranks=ranks)
    if kind == "sub" and len(shape) > 1 and shape[-1]:  # blocks along the last dim: strided on S
        subs = _cuts(rng, shape[-1], rng.randint(1, 3))
        return sub_params(shape, subs, [_cuts(rng, s, n) for s in subs], dim=-1, ranks=ranks)
    if kind == "sub" and shape and shape[0]:
        subs = _cuts(rng, shape[0], rng.randint(1, 3))
        return sub_params(shape, subs, [_cuts(rng, s, n) for s in subs], ranks=ranks)
    if kind == "zero":
        others = [tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 2))) for _ in range(rng.randint(0, 2))]
        at = rng.randint(0, len(others))
        group = others[:at] + [shape] + others[at:]
        return zero12_group(group, n, ranks=ranks, shard=rng.choice(["partition", "fragment"]),
                            param_alignment=rng.choice([1, 4]))[at]
    if kind == "zero3":
        return zero3(shape, n, ranks=ranks)
    if kind == "flat" and prod(shape):
        bounds = [0, *sorted(rng.randint(0, prod(shape)) for _ in range(n - 1)), prod(shape)]
        return flat_ranges(shape, {r: (b - a, [(a, 0, b - a)]) for r, a, b in zip(ranks, bounds, bounds[1:])})
    return replicated(shape, ranks)


def two_stage(outer: ParamMap, inner: dict[int, ParamMap], full: torch.Tensor) -> dict[int, torch.Tensor]:
    out = {}
    for r in outer.ranks:
        s = oracles.extract(outer, full, r)
        for g in inner[r].ranks:
            out[g] = oracles.extract(inner[r], s, g)
    return out


def check_composed(outer: ParamMap, inner: dict[int, ParamMap], seed: int = 0) -> ParamMap:
    m = compose(outer, inner)
    assert canonicalize(m) == m
    assert m.logical_shape == outer.logical_shape and m.valid_shape == outer.valid_shape
    oracles.coverage(m)
    full = oracles.random_full(outer.logical_shape, seed)
    want = two_stage(outer, inner, full)
    assert set(m.ranks) == set(want)
    for g, t in want.items():
        assert torch.equal(oracles.extract(m, full, g), t), f"rank {g}"
    tiled = all(_tiles(outer, r) for r in outer.ranks) and all(_tiles(i, g) for i in inner.values() for g in i.ranks)
    if tiled and _covers(outer):
        m.check()
    return m


def _tiles(m: ParamMap, r: int) -> bool:
    return sum(p.numel for p in m.shard(r).pieces) == prod(m.shard(r).shape)


def _covers(m: ParamMap) -> bool:
    return not m.uncovered()


@pytest.mark.parametrize("seed", [20240601, 7, 99])
def test_random_compositions(seed):
    rng = random.Random(seed)
    for case in range(250):
        outer = random_outer(rng)
        inner, first = {}, 0
        for r in outer.ranks:
            inner[r] = random_inner(rng, outer.shard(r).shape, first)
            first += 4 + rng.randint(0, 2)  # room for the most ranks an inner map uses
        try:
            check_composed(outer, inner, seed=case)
        except AssertionError as e:  # keep the failing case readable
            raise AssertionError(f"case {case}: {outer.summary()} / {[i.summary() for i in inner.values()]}") from e


# -- the stacked layouts of real jobs -------------------------------------------------------------


def test_folded_outer_pieces():
    # CodeGen with one-row blocks: canonical pieces are folded (strided in the shard), neither
    # boxes nor flat runs of it; meeting a column split of the shard cuts them into boxes
    outer = codegen_qkv((24, 8), 2, num_kv_heads=8)
    assert any(len(p.shape) == 2 for _, _, p in outer.pieces())
    for inner_of in (lambda r, sh: split(sh, 1, [3, 5], ranks=[10 * r, 10 * r + 1]),
                     lambda r, sh: zero3(sh, 3, ranks=[10 * r, 10 * r + 1, 10 * r + 2]),
                     lambda r, sh: split(sh, 0, [5, 7], ranks=[10 * r, 10 * r + 1])):
        check_composed(outer, {r: inner_of(r, outer.shard(r).shape) for r in outer.ranks})


def test_tp_column_split_then_zero_cuts_rows_exactly():
    # a column split's shard cut by flat ZeRO ranges: a partial row, full rows, a partial row
    t = Topology(pp=1, dp=3, tp=2)
    outer = split((10, 8), 1, [3, 5], ranks=[0, 1])
    inner = {tr: zero12_group([outer.shard(tr).shape], 3, ranks=t.dp_group(tr), alignment=3)[0] for tr in (0, 1)}
    m = check_composed(outer, inner)
    for g, s in m.shards.items():
        assert 1 <= len(s.pieces) <= 3
        for p in s.pieces:
            assert p.dest.strides[-1] == 1 and p.locations == {g}
    # rank 2 (tp 0, dp 1) holds elements 10..19 of the (10, 3) shard: 2 of row 3, rows 4-5, 2 of row 6
    shapes = [(p.shape, p.source.offset, p.source.strides) for p in m.shard(2).pieces]
    assert shapes == [((2,), 25, (1,)), ((2, 3), 32, (8, 1)), ((2,), 48, (1,))]


def test_replicated_bias_then_zero_locations_span_tp_groups():
    # a TP-replicated bias, ZeRO-split over each TP rank's DP group: each block is held by one DP
    # rank of every TP group
    t = Topology(pp=1, dp=2, tp=2)
    outer = replicated((10,), [0, 1])
    inner = {tr: zero3((10,), 2, ranks=t.dp_group(tr)) for tr in (0, 1)}
    m = check_composed(outer, inner)
    assert {p.locations for _, _, p in m.pieces()} == {frozenset({0, 1}), frozenset({2, 3})}


def test_replicated_block_cut_at_different_points():
    # GPTBigCode at TP=3 with uneven query widths: the replicated kv block sits at a different
    # offset of each TP rank's flat ZeRO partition, so it is cut at different F rows per TP rank;
    # locations must follow every cut
    t = Topology(pp=1, dp=2, tp=3)
    outer = bigcode_mqa((14, 3), 3, n_embd=10)
    inner = {tr: zero12_group([outer.shard(tr).shape, (5,)], 2, ranks=t.dp_group(tr), alignment=2)[0]
             for tr in range(3)}
    m = check_composed(outer, inner)
    kv_locs = {p.locations for _, _, p in m.pieces() if p.source.offset >= 30}
    assert len(kv_locs) > 2 and all(len(loc) == 3 for loc in kv_locs)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 2), (4, 2), (2, 4), (8, 1)])
def test_tp_inside_pipeline_stage(tp, dp):
    t = Topology(pp=3, dp=dp, tp=tp)
    stage = 1
    shape = (16, 6)
    replica0 = [t.rank(stage, 0, m) for m in range(tp)]
    tp_map = autotp_split(shape, 0, tp, num_kv_heads=4, ranks=replica0)
    per_stage = replicate_over(tp_map, {r: t.dp_group(r) for r in replica0})
    m = check_composed(replicated(shape, [stage]), {stage: per_stage})
    assert set(m.ranks) == set(t.stage_ranks(stage))
    for g, s in m.shards.items():
        for p in s.pieces:
            assert p.locations == set(t.dp_group(g))  # a TP shard is held by its DP replicas
    full = oracles.random_full(shape, tp)
    dm = oracles.to_deepspeed(m)  # a composed map DeepSpeed can read
    dm.validate_coverage()
    assert torch.equal(dm.rebuild({g: oracles.extract(m, full, g) for g in m.ranks}), full)
    # a parameter with no TP split, whole on the stage: the same as pipeline_stage()
    whole = compose(replicated(shape, [stage]), {stage: replicated(shape, t.stage_ranks(stage))})
    assert whole == pipeline_stage(shape, t, stage)


def test_compose_is_associative_on_an_example():
    t = Topology(pp=1, dp=2, tp=2)
    shape = (12, 4)
    tp_map = split(shape, 0, [5, 7], ranks=[0, 1])
    zero = {tr: zero3(tp_map.shard(tr).shape, 2, ranks=t.dp_group(tr)) for tr in (0, 1)}
    a = compose(replicated(shape, [0]), {0: compose(tp_map, zero)})
    b = compose(compose(replicated(shape, [0]), {0: tp_map}), zero)
    assert a == b


def test_refusals():
    outer = split((4, 4), 0, [2, 2])
    with pytest.raises(MapError, match="keyed"):
        compose(outer, {0: replicated((2, 4), [5])})
    with pytest.raises(MapError, match="for F"):
        compose(outer, {0: replicated((4, 4), [5]), 1: replicated((2, 4), [6])})
    with pytest.raises(MapError, match="both outer rank"):
        compose(outer, {0: replicated((2, 4), [5]), 1: replicated((2, 4), [5])})
    with pytest.raises(MapError, match="pads"):
        compose(replicated((6, 4), [0]), {0: padded_vocab((4, 4), 3)})


# -- a real TP=2 x ZeRO-1 DP=2 checkpoint ------------------------------------------------------


def test_llama_tp2_dp2_checkpoint():
    root = FIXTURES / "llama_tp2_dp2" / "global_step3"
    if not root.exists():
        pytest.fail(f"committed fixture {root} is missing: restore it from git, or regenerate it with "
                    "python scripts/make_fixtures.py --only llama_tp2_dp2 (a missing fixture fails, "
                    "never skips)")
    load = lambda p: torch.load(p, map_location="cpu", weights_only=False)  # noqa: E731
    t = Topology(pp=1, dp=2, tp=2)
    models = [load(root / f"mp_rank_{tr:02d}_model_states.pt") for tr in range(2)]
    info = models[0]["universal_checkpoint_info"]["affine_map"]["params"]
    cfg = {"num_kv_heads": 2}
    checked = 0
    for g, shapes in enumerate(models[0]["param_shapes"]):
        inner = {}
        for tr in range(2):
            optim = [load(root / f"zero_pp_rank_{d}_mp_rank_{tr:02d}_optim_states.pt")["optimizer_state_dict"]
                     for d in range(2)]
            tp_shapes = {k: tuple(v) for k, v in models[tr]["param_shapes"][g].items()}
            inner[tr] = (
                zero12_from_slice_mappings(tp_shapes, [o["param_slice_mappings"][g] for o in optim],
                                           [o["group_paddings"][g] for o in optim], 2, ranks=t.dp_group(tr)),
                {t.rank(0, d, tr): o["single_partition_of_fp32_groups"][g] for d, o in enumerate(optim)},
            )
        for name in shapes:
            key = "^" + name.replace(".", r"\.") + "$"
            full_shape = _full_shape(name, models)
            if key in info:
                tp_map = ParamMap.from_dict(info[key])
            else:  # TP-replicated: DeepSpeed records it by name pattern, not as an affine map
                tp_map = replicated(full_shape, 2)
            tp_map = canonicalize(tp_map)
            mine = _our_tp_map(name, full_shape, cfg)
            assert mine == tp_map, name
            # the full weight, from the TP shards in the model files
            full = tp_map.rebuild({tr: models[tr]["module"][name] for tr in range(2)})
            m = compose(tp_map, {tr: inner[tr][0][name] for tr in range(2)})
            oracles.coverage(m)
            fp32 = {**inner[0][1], **inner[1][1]}
            assert torch.equal(m.rebuild({r: fp32[r] for r in m.ranks}), full), name
            checked += 1
    assert checked == 21


def _full_shape(name, models):
    a, b = (tuple(m["module"][name].shape) for m in models)
    if a == b and any(k in name for k in ("norm", "embed_tokens")):
        return a
    if any(k in name for k in ("o_proj", "down_proj")):
        return (a[0], a[1] + b[1])
    return (a[0] + b[0], *a[1:])


def _our_tp_map(name, shape, cfg):
    if any(k in name for k in ("norm", "embed_tokens")):
        return replicated(shape, 2)
    mlp = "mlp" in name or name.startswith("lm_head")
    dim = 1 if any(k in name for k in ("o_proj", "down_proj")) else 0
    return autotp_split(shape, dim, 2, num_kv_heads=cfg["num_kv_heads"], head_aware=not mlp)
