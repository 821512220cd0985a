"""derive: maps recovered from partition functions, and functions that compute refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import NotAffineError
from reshard.ir import canonicalize
from reshard.layouts.derive import derive
from tests.support.irgen import grid_map, replicated_map, segmented_map


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


# -- the index reading (views and copies read from F's element indices) pinned to the float markers


def _float_markers_only(fn):
    """``fn`` with an integer input handed over as float64: its result is then no index tensor, so
    derive takes the float-marker reading (the general one, as it was before the index reading)."""
    return lambda f, r: fn(f if f.is_floating_point() else f.double(), r)


def _outcome(fn, shape, tp, **kw):
    """The map, or the error's type and message."""
    try:
        return derive(fn, shape, tp, **kw)
    except NotAffineError as e:
        return type(e), str(e)


def _same_as_float_markers(fn, shape, tp, **kw):
    got = _outcome(fn, shape, tp, **kw)
    want = _outcome(_float_markers_only(fn), shape, tp, **kw)
    assert got == want
    return got


def _spy(fn, seen):
    def run(f, r):
        seen.append(f.dtype)
        return fn(f, r)

    return run


def test_views_read_from_index_markers_once_per_rank():
    seen = []
    derive(_spy(lambda f, r: f.chunk(2, dim=1)[r], seen), (4, 6), 2)
    assert seen == [torch.int32, torch.int32, torch.float64, torch.float64]  # index, then random data
    seen.clear()
    derive(_spy(_float_markers_only(lambda f, r: f.chunk(2, dim=1)[r]), seen), (4, 6), 2)
    assert torch.float64 in seen[2:4]  # the helper above does reach the float markers


def _tsplit(tp, dim):
    return lambda f, r: f.tensor_split(tp, dim=dim)[r]


def _cat_heads(f, r):  # Yuan-like: two column blocks per rank, a copy
    b = f.chunk(4, dim=1)
    return torch.cat([b[r], b[r + 2]], dim=1)


def _noncontiguous_copy(fn):  # a copy whose strides are not row-major
    return lambda f, r: fn(f, r).t().contiguous().t()


def _padded(f, r):  # pads with zeros it computed: no selection
    return torch.cat([f.chunk(2)[r], torch.zeros(1, f.shape[1], dtype=f.dtype)])


PARTITIONS = {
    "column view": (_tsplit(4, 1), (6, 16), 4),
    "row view": (_tsplit(4, 0), (16, 6), 4),
    "uneven rows": (_tsplit(3, 0), (10, 4), 3),
    "empty shards": (_tsplit(8, 0), (5, 3), 8),
    "strided rows": (lambda f, r: f[r::4], (32, 8), 4),
    "strided columns": (lambda f, r: f[:, r::2], (4, 8), 2),
    "column copy": (lambda f, r: f.chunk(4, dim=1)[r].clone(), (6, 16), 4),
    "row copy": (lambda f, r: f.chunk(4, dim=0)[r].contiguous(), (16, 6), 4),
    "non-contiguous copy": (_noncontiguous_copy(_tsplit(2, 1)), (6, 8), 2),
    "3-d split of the middle dim": (lambda f, r: f.chunk(2, dim=1)[r], (3, 4, 5), 2),
    "3-d permuted": (lambda f, r: f.permute(2, 0, 1)[r], (3, 4, 2), 2),
    "transposed": (lambda f, r: f.t().chunk(2)[r], (6, 4), 2),
    "transposed copy": (lambda f, r: f.t().chunk(2)[r].clone(), (6, 4), 2),
    "flat range across rows": (lambda f, r: f.reshape(-1)[5 * r: 5 * r + 5], (3, 5), 3),
    "scalar shard": (lambda f, r: f[r, 1], (2, 3), 2),
    "1-d F": (lambda f, r: f.chunk(3)[r], (9,), 3),
    "replicated": (lambda f, r: f, (5, 3), 3),
    "replicated halves": (lambda f, r: f.chunk(2, dim=1)[r % 2], (4, 6), 4),
    "partial replication": (lambda f, r: torch.cat([f[:8].chunk(2)[r], f[8:]]), (12, 2), 2),
    "partly overlapping views": (lambda f, r: f[r: r + 3], (5, 2), 3),
    "two blocks per rank": (_cat_heads, (8, 32), 2),
    "carry continues a run": (lambda f, r: f[:, ::2], (2, 3), 1),
    "carry continues a step": (lambda f, r: f[0, :, ::3, ::2], (1, 7, 4, 4), 1),
    "carry continues a row step": (lambda f, r: f[:, ::2, :], (6, 5, 3), 1),
    "carry, 4-d": (lambda f, r: f[:, ::2, ::1, 3::2], (4, 5, 3, 7), 1),
    "scaled": (lambda f, r: f / 4, (6,), 4),
    "scaled by 1/3": (lambda f, r: f / 3, (6,), 3),
    "scaled split": (lambda f, r: f.chunk(2)[r] * 2, (4, 2), 2),
    "negated": (lambda f, r: -f.chunk(2)[r], (4, 2), 2),
    "shifted": (lambda f, r: f.chunk(2)[r] + 1, (4, 2), 2),
    "needs a float input": (lambda f, r: torch.nn.Parameter(f.chunk(2)[r]).data, (4, 2), 2),
    "writes into its input": (lambda f, r: f.mul_(1).chunk(2)[r], (4, 2), 2),
    "padded with zeros": (_padded, (4, 2), 2),
    "duplicate by expand": (lambda f, r: f[:1].expand(2, 3), (2, 3), 1),
    "sum": (lambda f, r: f.chunk(2)[0] + f.chunk(2)[1], (4, 4), 2),
    "sort": (lambda f, r: f.flatten().sort().values.chunk(2)[r], (4, 4), 2),
}


@pytest.mark.parametrize("name", list(PARTITIONS))
def test_index_reading_equals_float_markers(name):
    fn, shape, tp = PARTITIONS[name]
    _same_as_float_markers(fn, shape, tp)


@pytest.mark.parametrize("name", ["column view", "column copy", "non-contiguous copy", "two blocks per rank"])
def test_index_reading_equals_float_markers_in_float32(name):
    fn, shape, tp = PARTITIONS[name]
    _same_as_float_markers(fn, shape, tp, dtype=torch.float32)


def test_float32_past_exact_float32_markers():
    # float32 markers are exact to 2**24 only; index markers are exact at any size and dtype
    shape = (4100, 4100)
    m = derive(lambda f, r: f.chunk(2, dim=1)[r], shape, 2, dtype=torch.float32)
    assert m == canonicalize(grid_map(shape, {1: [2050, 2050]}))


def test_replication_beyond_63_ranks():
    # the index reading's holders come from boxes, with no bitmask limit; the float markers refuse
    m = derive(lambda f, r: f.chunk(2)[r % 2], (4, 2), 70)
    assert {len(p.locations) for _, _, p in m.pieces()} == {35}


_VIEW_OPS = st.sampled_from(["slice", "slice", "step", "perm", "select", "unsqueeze", "flatten"])


def _apply(t: torch.Tensor, ops: list[tuple[str, int, int, int]]) -> torch.Tensor:
    """A chain of view operations; each op's numbers are reduced to what the tensor allows."""
    for op, a, b, c in ops:
        if t.dim() == 0:
            break
        d = a % t.dim()
        n = t.shape[d]
        if op == "slice" and n:
            lo = b % n
            t = t.narrow(d, lo, c % (n - lo + 1))
        elif op == "step" and n:
            t = t[(slice(None),) * d + (slice(b % n, None, 1 + c % 4),)]
        elif op == "perm" and t.dim() > 1:
            t = t.movedim(d, (d + 1 + b) % t.dim())
        elif op == "select" and n:
            t = t.select(d, b % n)
        elif op == "unsqueeze":
            t = t.unsqueeze(d)
        elif op == "flatten" and t.is_contiguous():
            t = t.reshape(-1)
    return t


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple),
    ops=st.lists(st.lists(st.tuples(_VIEW_OPS, st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
                          max_size=4), min_size=1, max_size=3),
    copy=st.sampled_from(["view", "clone", "non-contiguous"]),
)
def test_random_views_equal_float_markers(shape, ops, copy):
    def fn(f, r):
        t = _apply(f, ops[r])
        if copy == "clone":
            return t.clone()
        return t.t().contiguous().t() if copy == "non-contiguous" and t.dim() == 2 else t

    _same_as_float_markers(fn, shape, len(ops))
