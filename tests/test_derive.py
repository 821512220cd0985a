"""derive: maps recovered from partition functions, and functions that compute refused."""

from __future__ import annotations

import pytest
import torch

from reshard import NotAffineError, canonicalize
from reshard.derive import derive
from tests.irgen import grid_map, replicated_map, segmented_map


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_even_and_uneven_splits_equal_builders(tp, dim):
    shape = (24, 10) if dim == 0 else (10, 24)
    m = derive(lambda f, r: f.tensor_split(tp, dim=dim)[r], shape, tp)
    sizes = [t.shape[dim] for t in torch.empty(shape).tensor_split(tp, dim=dim)]
    assert m == canonicalize(grid_map(shape, {dim: sizes}))


def test_replicated_and_scaled():
    assert derive(lambda f, r: f, (5, 3), 3) == canonicalize(replicated_map((5, 3), 3))
    m = derive(lambda f, r: f / 4, (6,), 4)
    assert m == canonicalize(replicated_map((6,), 4, 0.25))
    third = derive(lambda f, r: f / 3, (6,), 3)  # bias / world_size at TP=3: reproduced bit-exactly
    assert {p.scale for _, _, p in third.pieces()} == {1 / 3}


def test_partial_replication_keeps_holder_sets_apart():
    def mqa(f, r):
        return torch.cat([f[:8].chunk(2)[r], f[8:]])

    m = derive(mqa, (12, 2), 2)
    assert m == canonicalize(segmented_map((12, 2), 0, [(8, False), (4, True)], 2))
    assert all(len(m.shards[r].pieces) == 2 for r in m.ranks)


def test_strided_selection_folds_into_one_piece():
    m = derive(lambda f, r: f[r::4], (32, 8), 4)
    assert [len(s.pieces) for s in m.shards.values()] == [1, 1, 1, 1]
    assert m.shards[1].pieces[0].source.strides == (32, 1)


def test_yuan_like_two_pieces_per_rank():
    def o_proj(f, r):
        b = f.chunk(4, dim=1)
        return torch.cat([b[r], b[r + 2]], dim=1)

    m = derive(o_proj, (8, 32), 2)
    for s in m.shards.values():
        assert len(s.pieces) == 2
        assert all(p.source.strides == (32, 1) for p in s.pieces)


def test_sum_is_not_affine():
    def summed(f, r):
        return f.chunk(2)[0] + f.chunk(2)[1]

    with pytest.raises(NotAffineError, match=r"rank 0: .*shard position \[0, 0\]"):
        derive(summed, (4, 4), 2)


def test_average_is_not_affine():
    with pytest.raises(NotAffineError, match="rank 0"):
        derive(lambda f, r: (f.chunk(2)[0] + f.chunk(2)[1]) / 2, (4, 4), 2)


def test_data_dependent_choice_is_not_affine():
    with pytest.raises(NotAffineError, match="chooses by the data"):
        derive(lambda f, r: f.flatten().sort().values.chunk(2)[r], (4, 4), 2)


def test_duplicate_within_a_shard():
    with pytest.raises(NotAffineError, match="rank 0: shard position .* repeats element"):
        derive(lambda f, r: torch.cat([f, f]), (3,), 1)


def test_non_tensor_result():
    with pytest.raises(NotAffineError, match="rank 0: partition function returned list"):
        derive(lambda f, r: [f], (3,), 1)
