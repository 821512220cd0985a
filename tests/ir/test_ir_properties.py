"""Property tests for the IR core over random layouts."""

from __future__ import annotations

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import ParamMap
from reshard.ir import canonicalize
from tests.support.irgen import DTYPES, fragment, layouts, random_tensor

SETTINGS = settings(max_examples=int(__import__("os").environ.get("RESHARD_EXAMPLES", "150")), deadline=None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@SETTINGS
@given(m=layouts(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_rebuild_of_extract_is_bit_exact(m: ParamMap, dtype, seed):
    m.check()
    scaled = any(p.scale != 1.0 for _, _, p in m.pieces())
    if scaled and not dtype.is_floating_point:
        dtype = torch.float32
    full = random_tensor(m.logical_shape, dtype, seed)
    powers = [1, -1, -2] if dtype.is_floating_point else [1]
    for power in powers:
        shards = {r: m.extract(full, r, power) for r in m.ranks}
        for r, s in shards.items():
            assert tuple(s.shape) == m.shards[r].shape
        assert same(m.rebuild(shards, power), full)


@SETTINGS
@given(m=layouts())
def test_json_round_trip_is_identity(m: ParamMap):
    text = json.dumps(m.to_dict())
    back = ParamMap.from_dict(json.loads(text))
    assert back == m
    assert back.to_dict() == m.to_dict()


@SETTINGS
@given(m=layouts(), cuts=st.lists(st.integers(0, 50), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_canonical_form(m: ParamMap, cuts, seed):
    c = canonicalize(m)
    c.check()
    assert canonicalize(c) == c, "idempotent"
    assert c.num_pieces <= m.num_pieces, "never larger"
    for r in m.ranks:
        assert len(c.shards[r].pieces) <= len(m.shards[r].pieces)
    # the same layout described with more, reordered pieces has the same canonical form
    f = fragment(m, cuts)
    f.check()
    assert f.num_pieces >= m.num_pieces
    assert canonicalize(f) == c
    full = random_tensor(m.logical_shape, torch.float64, seed)
    for r in m.ranks:
        assert same(c.extract(full, r), m.extract(full, r))


def test_shard_views_into_larger_storage():
    """Shards that are views into a bigger buffer (what ``split`` returns) are read correctly."""
    from tests.support.irgen import grid_map

    m = grid_map((6, 4), {0: [3, 3]})
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    shards = dict(enumerate(full.split(3, dim=0)))  # shard 1 starts at storage offset 12
    assert shards[1].storage_offset() == 12
    assert torch.equal(m.rebuild(shards), full)
    col = grid_map((6, 4), {1: [2, 2]})
    parts = dict(enumerate(full.split(2, dim=1)))  # non-contiguous views
    assert torch.equal(col.rebuild(parts), full)
    assert torch.equal(col.extract(full[:, :], 1), full[:, 2:])
    assert torch.equal(m.extract(torch.cat([full, full])[6:], 1), full[3:])


def test_rebuild_verifies_replicas_and_names_the_difference():
    from reshard.errors import ReplicaMismatchError
    from tests.support.irgen import segmented_map

    m = segmented_map((8, 4), 0, [(4, False), (4, True)], 2)
    full = torch.randn(8, 4)
    shards = {r: m.extract(full, r).clone() for r in m.ranks}
    shards[1][3, 2] += 0.5
    try:
        m.rebuild(shards)
    except ReplicaMismatchError as e:
        assert e.ranks == (0, 1)
        assert abs(e.max_abs_diff - 0.5) < 1e-6
        assert "0.5" in str(e)
    else:
        raise AssertionError("drift not detected")
    # one holder suffices: rank 1's drifted copy is never read when only rank 0's... is absent
    only = {0: shards[0]}
    m2 = segmented_map((8, 4), 0, [(8, True)], 2)
    assert torch.equal(m2.rebuild({0: m2.extract(full, 0)}), full)
    assert only


def test_valid_shape_padding():
    from reshard import Shard
    from tests.support.irgen import grid_map

    g = grid_map((16, 3), {0: [4, 4, 4, 4]})
    m = ParamMap((16, 3), dict(g.shards), valid_shape=(13, 3))
    m.check()
    real = torch.randn(13, 3)
    shards = {r: m.extract(real, r) for r in m.ranks}
    assert torch.equal(shards[3][1:], torch.zeros(3, 3))
    assert torch.equal(m.rebuild(shards, valid_only=True), real)
    assert m.rebuild(shards).shape == (16, 3)
    assert ParamMap.from_dict(m.to_dict()) == m and m.to_dict()["valid_shape"] == [13, 3]
    assert isinstance(m.shards[0], Shard)


@SETTINGS
@given(m=layouts(), seed=st.integers(0, 2**31 - 1))
def test_identity_rank_means_the_shard_is_f(m: ParamMap, seed):
    """``identity_rank`` (what lets executors skip a copy) is sound on every layout, and finds
    every single-rank canonical map whose shard is F element for element."""
    full = random_tensor(m.logical_shape, torch.float64, 0) + torch.arange(m.numel, dtype=torch.float64).reshape(
        m.logical_shape) * 1e3  # distinct values, so equality means the same element
    r = m.identity_rank
    if r is not None:
        assert same(m.extract(full, r).reshape(-1), full.reshape(-1))
    c = canonicalize(m)
    if len(c.shards) == 1 and not c.is_padded:
        (rank, shard), = c.shards.items()
        unscaled = all(p.scale == 1.0 for p in shard.pieces)
        is_f = shard.numel == m.numel and same(c.extract(full, rank).reshape(-1), full.reshape(-1))
        assert (c.identity_rank == rank) == (is_f and unscaled)


def test_identity_rank_examples():
    from tests.support.irgen import grid_map, replicated_map

    assert replicated_map((4, 3), 1).identity_rank == 0
    assert replicated_map((4, 3), 2).identity_rank is None  # two ranks
    assert replicated_map((4, 3), 1, scale=0.5).identity_rank is None  # scaled
    assert grid_map((4, 3), {0: [4]}).identity_rank == 0
    assert grid_map((4, 3), {0: [2, 2]}).identity_rank is None
    from reshard import Piece, Shard, View

    t = ParamMap((2, 3), {0: Shard((3, 2), (Piece((2, 3), View(0, (3, 1)), View(0, (1, 2)), frozenset({0})),))})
    t.check()
    assert t.identity_rank is None  # a transpose holds every element, in another order


def test_rebuild_into_a_given_buffer():
    import pytest

    from reshard.errors import ShardError
    from tests.support.irgen import grid_map

    m = grid_map((6, 4), {0: [3, 3]})
    full = torch.randn(6, 4)
    shards = {r: m.extract(full, r) for r in m.ranks}
    out = torch.empty(24)
    got = m.rebuild(shards, out=out)
    assert torch.equal(got, full) and got.data_ptr() == out.data_ptr()
    for bad in (torch.empty(23), torch.empty(24, dtype=torch.float64), torch.empty(48)[::2]):
        with pytest.raises(ShardError, match="out must be"):
            m.rebuild(shards, out=bad)
