"""ZeRO layouts against DeepSpeed 0.19.8: the stage 1/2 optimizer's own flattening, padding,
partitioning and fragment linkage; maps read back from real checkpoints' ``param_slice_mappings``;
ZeRO-3's per-parameter padded split."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from reshard.errors import MapError
from reshard.ir import prod
from reshard.layouts import (
    round_robin_order,
    zero3,
    zero3_partition_numel,
    zero12_from_slice_mappings,
    zero12_group,
    zero12_group_layout,
)
from tests.support import oracles
from tests.support.paths import DEEPSPEED

FIXTURES = DEEPSPEED

GROUPS = [
    [(5, 3), (4,), (7, 2)],
    [(64, 64), (32, 64), (64,), (128, 64)],
    [(3,), (1,), (2, 2, 2), (9, 1), (1, 1)],
    [(13, 7)],
    [(2,), (3,)],
]


def _group_tensors(shapes, seed):
    return [oracles.random_full(s, seed + i) for i, s in enumerate(shapes)]


def _verify_group(shapes, dp, *, param_alignment=1, round_robin=False, seed=0):
    tensors = _group_tensors(shapes, seed)
    parts, mappings, by_offsets = oracles.zero12(tensors, dp, param_alignment=param_alignment,
                                                 round_robin=round_robin)
    # DeepSpeed's mappings are only right for a round-robin buffer when linked by explicit offsets
    mappings_ok = not round_robin or by_offsets
    maps = zero12_group(shapes, dp, param_alignment=param_alignment, round_robin=round_robin)
    layout = zero12_group_layout(shapes, dp, param_alignment=param_alignment, round_robin=round_robin)
    assert layout.partition == parts[0].numel()
    for i, (m, full) in enumerate(zip(maps, tensors)):
        want = {r: parts[r] for r in m.ranks}
        # the ranks a parameter's map names are exactly those whose partition holds part of it
        holders = {d for d in range(dp) if i in mappings[d]}
        if mappings_ok:
            assert set(m.ranks) == holders
        oracles.verify(m, full, want, tiled=False)
        for r, s in m.shards.items():
            assert s.shape == (layout.partition,)
            for p in s.pieces:
                assert p.shape == (p.numel,) and p.source.strides == (1,) and p.dest.strides == (1,)
                assert p.locations == {r}
    # the slice mappings DeepSpeed writes say the same thing
    if mappings_ok:
        mapped = zero12_from_slice_mappings(
            {i: s for i, s in enumerate(shapes)}, mappings, _paddings(layout, shapes, dp), dp
        )
        for i, m in enumerate(maps):
            assert mapped[i] == m
    return maps


def _paddings(layout, shapes, dp):
    """group_paddings as DeepSpeedZeroOptimizer records it per rank (tail padding only)."""
    end = max((o + n for o, n in zip(layout.offsets, layout.numels)), default=0)
    out = []
    for d in range(dp):
        lo, hi = d * layout.partition, (d + 1) * layout.partition
        out.append(layout.partition if end <= lo else max(0, hi - end))
    return out


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 5, 8, 16])
def test_zero12_matches_optimizer(dp):
    for k, shapes in enumerate(GROUPS):
        _verify_group(shapes, dp, seed=k)
        _verify_group(shapes, dp, param_alignment=8, seed=k)


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_zero12_round_robin_flat_order(dp):
    for k, shapes in enumerate(GROUPS):
        _verify_group(shapes, dp, round_robin=True, seed=k)
        _verify_group(shapes, dp, round_robin=True, param_alignment=4, seed=k)
    assert round_robin_order(7, 3) == [0, 3, 6, 1, 4, 2, 5]


def test_zero12_round_robin_slice_mappings_disagree_with_buffer():
    """Surprise in DeepSpeed 0.19.8: with round_robin_gradients and no per-parameter padding,
    ``_link_all_hp_params`` passes no offsets, so fragments are computed in model order while the
    flat buffer is in round-robin order. The recorded mappings then name the wrong elements."""
    shapes = [(5,), (3,), (4,), (6,)]
    tensors = _group_tensors(shapes, 3)
    parts, mappings, by_offsets = oracles.zero12(tensors, 2, round_robin=True)
    assert not by_offsets
    flat = torch.cat(parts)
    # parameter 1 sits after parameter 0 and 2 in the round-robin buffer (order 0, 2, 1, 3)...
    assert torch.equal(flat[9:12], tensors[1])
    # ...but its fragment address says it starts right after parameter 0
    assert mappings[0][1].start == 5


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 7, 8, 16])
def test_zero3(dp):
    for shape in [(5, 3), (64,), (1,), (3, 4, 5), (16, 16)]:
        full = oracles.random_full(shape, dp)
        parts = oracles.zero3(full, dp)
        m = zero3(shape, dp)
        p = zero3_partition_numel(prod(shape), dp)
        assert all(s.shape == (p,) for s in m.shards.values())
        holders = [d for d in range(dp) if d * p < prod(shape)]
        assert list(m.ranks) == holders  # ranks holding only padding are omitted
        oracles.verify(m, full, {d: parts[d] for d in holders}, tiled=False)


def test_fragment_shards_tile_and_pass_check():
    for m in zero12_group(GROUPS[0], 4, shard="fragment"):
        m.check()
    zero3((5, 3), 4, shard="fragment").check()
    with pytest.raises(MapError):
        zero3((5, 3), 4, shard="bytes")


def test_straddling_parameter():
    # 15 + 4 + 14 elements padded to 40 (alignment 2 * dp), partitions of 10: the (7, 2)
    # parameter starts at flat 19, so ranks 1, 2 and 3 hold it; rank 2's piece starts mid-row
    # of F (rows are 2 long) and crosses five rows
    m = zero12_group(GROUPS[0], 4)[2]
    assert list(m.ranks) == [1, 2, 3]
    got = [(p.source.offset, p.numel, p.dest.offset) for r in m.ranks for p in m.shard(r).pieces]
    assert got == [(0, 1, 9), (1, 10, 0), (11, 3, 0)]


def test_random_groups():
    rng = random.Random(7)
    for _ in range(30):
        shapes = [tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
        dp = rng.randint(1, 6)
        _verify_group(shapes, dp, param_alignment=rng.choice([1, 2, 8]), seed=rng.randint(0, 99))


# -- real checkpoints ---------------------------------------------------------------------------


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _zero12_fixture(name):
    root = FIXTURES / name / "global_step3"
    if not root.exists():
        pytest.fail(f"committed fixture {root} is missing: restore it from git, or regenerate it with "
                    f"python scripts/make_fixtures.py --only {name} (a missing fixture fails, never skips)")
    return root


@pytest.mark.parametrize("name", ["llama_zero1_dp2", "llama_zero2_dp2", "llama_zero1_dp2_bf16"])
def test_zero12_maps_from_checkpoint(name):
    root = _zero12_fixture(name)
    model = _load(root / "mp_rank_00_model_states.pt")
    optim = [_load(p)["optimizer_state_dict"] for p in sorted(root.glob("*zero_pp_rank_*_optim_states.pt"))]
    dp = optim[0]["partition_count"][0]
    assert len(optim) == dp
    groups = len(optim[0]["param_slice_mappings"])
    for g in range(groups):
        shapes = {k: tuple(v) for k, v in model["param_shapes"][g].items()}
        maps = zero12_from_slice_mappings(
            shapes,
            [o["param_slice_mappings"][g] for o in optim],
            [o["group_paddings"][g] for o in optim],
            dp,
        )
        fp32 = {d: o["single_partition_of_fp32_groups"][g] for d, o in enumerate(optim)}
        assert all(m.shard(r).shape == (fp32[r].numel(),) for m in maps.values() for r in m.ranks)
        # the same layout from sizes alone (parameters in model order, DeepSpeed's alignment)
        from_sizes = zero12_group(list(shapes.values()), dp)
        for (pname, m), m2 in zip(maps.items(), from_sizes):
            assert m == m2, pname
            oracles.coverage(m)
            full = m.rebuild({r: fp32[r] for r in m.ranks})
            weight = model["module"][pname]
            # the module holds the low-precision copy of the fp32 master weights
            assert torch.equal(full.to(weight.dtype), weight), pname


def test_slice_mappings_refusals():
    from deepspeed.utils.tensor_fragment import fragment_address

    with pytest.raises(MapError, match="fragments hold"):
        zero12_from_slice_mappings({"w": (4, 4)}, [{"w": fragment_address(numel=10, start=0)}], [6], 1)
    with pytest.raises(MapError, match="one slice mapping"):
        zero12_from_slice_mappings({"w": (4,)}, [{"w": fragment_address(numel=4, start=0)}], [0, 0], 2)


@pytest.mark.parametrize("dp,shapes", list(itertools.product([2, 3], GROUPS[:3])))
def test_slice_mappings_accept_plain_pairs(dp, shapes):
    tensors = _group_tensors(shapes, 0)
    _, mappings, _ = oracles.zero12(tensors, dp)
    layout = zero12_group_layout(shapes, dp)
    plain = [{k: (f.numel, f.start) for k, f in mp.items()} for mp in mappings]
    a = zero12_from_slice_mappings(dict(enumerate(shapes)), plain, _paddings(layout, shapes, dp), dp)
    b = zero12_from_slice_mappings(dict(enumerate(shapes)), mappings, _paddings(layout, shapes, dp), dp)
    assert a == b
