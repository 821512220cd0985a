"""``reshard.ir.blocks.coarsen``: the scale map derived from a payload map by the block grid, over
random TP splits (rows or columns, even or uneven, block-aligned or cutting blocks), arbitrary
per-rank block lists with replication (``dim_blocks``) and 2-D tilings replicated over DP: every
scale entry is held by exactly the shards touching its block, the map is valid (tiling,
coverage, exact locations), a shard holds each scale once; aligned splits coarsen in place."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import MapError
from reshard.ir import ParamMap, block_grid, coarsen
from reshard.layouts import dim_blocks, flat_ranges, replicated, split
from reshard.layouts._core import box_piece, finish

SETTINGS = settings(max_examples=int(os.environ.get("RESHARD_EXAMPLES", "150")), deadline=None)


@st.composite
def payloads(draw: st.DrawFn) -> tuple[ParamMap, tuple[int, int]]:
    lead = draw(st.sampled_from([(), (2,), (3,)]))
    shape = (*lead, draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    block = (draw(st.integers(1, 16)), draw(st.integers(1, 16)))
    kind = draw(st.sampled_from(["split", "blocks", "grid"]))
    if kind == "split":  # TP: contiguous, uneven, maybe cutting blocks, maybe empty ranks
        dim = draw(st.sampled_from([-2, -1]))
        n = shape[dim]
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=4)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        return split(shape, dim, sizes), block
    if kind == "blocks":  # any blocks in any order per rank, replicated in part (fused sub-params, overlaps)
        dim = draw(st.sampled_from([-2, -1] + ([0] if lead else [])))
        n = shape[dim]
        ranks = draw(st.integers(1, 4))
        spans: dict[int, list[tuple[int, int]]] = {r: [] for r in range(ranks)}
        at = 0
        while at < n:  # a cover, dealt out in order, then extra copies anywhere
            k = draw(st.integers(1, n - at))
            spans[draw(st.integers(0, ranks - 1))].append((at, k))
            at += k
        for r in range(ranks):
            for _ in range(draw(st.integers(0, 2))):
                a = draw(st.integers(0, n - 1))
                b = draw(st.integers(a + 1, n))
                if all(b <= s or a >= s + k for s, k in spans[r]):  # a shard holds an element once
                    spans[r].insert(draw(st.integers(0, len(spans[r]))), (a, b - a))
        spans = {r: s for r, s in spans.items() if s}
        return dim_blocks(shape, dim, spans), block
    rows = draw(st.integers(1, min(3, shape[-2])))
    cols = draw(st.integers(1, min(3, shape[-1])))
    dp = draw(st.integers(1, 2))
    return _grid(shape, rows, cols, dp), block


def _bounds(n: int, parts: int) -> list[int]:
    return [n * i // parts for i in range(parts + 1)]


def _grid(shape: tuple[int, ...], rows: int, cols: int, dp: int) -> ParamMap:
    """A 2-D tiling ``rows x cols`` (TP over both dims), replicated over ``dp`` copies."""
    rb, cb = _bounds(shape[-2], rows), _bounds(shape[-1], cols)
    lead = shape[:-2]
    shards = {}
    for i in range(rows):
        for j in range(cols):
            tile = (*lead, rb[i + 1] - rb[i], cb[j + 1] - cb[j])
            holders = [(i * cols + j) * dp + c for c in range(dp)]
            for r in holders:
                shards[r] = (tile, [box_piece(shape, (*(0 for _ in lead), rb[i], cb[j]), tile, tile,
                                              (0,) * len(shape), holders)])
    return finish(shape, shards)


def _block_ids(shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """F's elements labelled with the flat index of their block in S."""
    grid = block_grid(shape, block)
    idx = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    b = (1,) * (len(shape) - 2) + block
    flat = torch.zeros(shape, dtype=torch.int64)
    for i, k, g in zip(idx, b, grid):
        flat = flat * g + i // k
    return flat


def _held(m: ParamMap, full: torch.Tensor) -> dict[int, list[int]]:
    return {r: m.extract(full, r).reshape(-1).tolist() for r in m.ranks}


@SETTINGS
@given(case=payloads())
def test_each_scale_is_held_by_every_shard_touching_its_block(case: tuple[ParamMap, tuple[int, int]]) -> None:
    payload, block = case
    scales = coarsen(payload, block)
    scales.check()
    grid = block_grid(payload.logical_shape, block)
    assert scales.logical_shape == grid and scales.ranks == payload.ranks
    touched = _held(payload, _block_ids(payload.logical_shape, block))
    held = _held(scales, torch.arange(torch.Size(grid).numel()).reshape(grid))
    for r in payload.ranks:
        assert len(held[r]) == len(set(held[r]))  # each scale once per shard
        assert set(held[r]) == set(touched[r]), r
    holders = {e: frozenset(r for r in held if e in held[r]) for e in range(torch.Size(grid).numel())}
    flat = torch.arange(torch.Size(grid).numel())
    for _, _, p in scales.pieces():  # locations exact: every element's holder set
        elems = torch.as_strided(flat, p.shape, p.source.strides, p.source.offset).reshape(-1).tolist()
        assert all(holders[e] == p.locations for e in elems)


@SETTINGS
@given(rows=st.integers(1, 5), cols=st.integers(1, 5), bm=st.integers(1, 8), bn=st.integers(1, 8),
       tp=st.integers(1, 4), dim=st.sampled_from([0, 1]))
def test_aligned_split_coarsens_in_place(rows: int, cols: int, bm: int, bn: int, tp: int, dim: int) -> None:
    """A split on block boundaries: rank r's scales are its payload shard's blocks, in place
    (vLLM's ``weight_scale_inv`` narrow at ``offset / block``)."""
    shape = (rows * bm * tp, cols * bn) if dim == 0 else (rows * bm, cols * bn * tp)
    payload = split(shape, dim, [shape[dim] // tp] * tp)
    scales = coarsen(payload, (bm, bn))
    ids = _block_ids(shape, (bm, bn))
    for r in payload.ranks:
        assert torch.equal(scales.extract(torch.arange(ids.max() + 1).reshape(block_grid(shape, (bm, bn))), r),
                           payload.extract(ids, r)[::bm, ::bn])


def test_cut_block_replicated_on_both_sides() -> None:
    """DeepSeek-V3 ``kv_a_proj_with_mqa`` (576 rows) at TP 2 in 128-row blocks: row 288 cuts block 2,
    which both ranks hold (scale rows [0, 3) and [2, 5))."""
    scales = coarsen(split((576, 256), 0, [288, 288]), (128, 128))
    assert scales.logical_shape == (5, 2) and [scales.shards[r].shape for r in (0, 1)] == [(3, 2), (3, 2)]
    grid = torch.arange(10).reshape(5, 2)
    assert scales.extract(grid, 0).tolist() == grid[0:3].tolist() and scales.extract(grid, 1).tolist() == grid[2:5].tolist()
    assert {p.locations for _, _, p in scales.pieces()} == {frozenset({0}), frozenset({0, 1}), frozenset({1})}


def test_replicated_payload_replicated_scales() -> None:
    scales = coarsen(replicated((4, 300, 130), 3), (128, 128))
    assert scales.logical_shape == (4, 3, 2)
    assert all(p.locations == frozenset({0, 1, 2}) for _, _, p in scales.pieces())


@pytest.mark.parametrize(("payload", "match"), [
    (flat_ranges((8, 8), {0: (32, [(0, 0, 32)]), 1: (32, [(32, 0, 32)])}), "flat partition"),
    (replicated((8, 8), 1), "block"),
])
def test_refused(payload: ParamMap, match: str) -> None:
    with pytest.raises(MapError, match=match):
        coarsen(payload, (4, 4) if match != "block" else (0, 4))


def test_not_a_product_refused() -> None:
    """A shard whose dest row holds different F rows in different columns has no per-dim index maps."""
    shape = (8, 8)
    pieces = [box_piece(shape, (0, 0), (4, 4), (4, 8), (0, 0), {0}), box_piece(shape, (4, 4), (4, 4), (4, 8), (0, 4), {0})]
    rest = [box_piece(shape, (0, 4), (4, 4), (4, 8), (0, 0), {1}), box_piece(shape, (4, 0), (4, 4), (4, 8), (0, 4), {1})]
    m = finish(shape, {0: ((4, 8), pieces), 1: ((4, 8), rest)})
    with pytest.raises(MapError, match="not a product of per-dim index maps"):
        coarsen(m, (2, 2))


@SETTINGS
@given(rows=st.integers(1, 70), cols=st.integers(1, 70), bm=st.integers(1, 16), bn=st.integers(1, 16),
       dim=st.sampled_from([0, 1]), cuts=st.lists(st.integers(0, 70), max_size=3), seed=st.integers(0, 2**16))
def test_fp8_tp_shards_and_back(rows: int, cols: int, bm: int, bn: int, dim: int, cuts: list[int], seed: int) -> None:
    """An FP8 weight split at any TP boundaries (cutting blocks): each rank's payload shard with its
    scale shard dequantizes to exactly its rows/columns of the whole dequantized weight, and the
    shards rebuild the payload and the scales byte for byte (cut blocks' scales agree on every rank)."""
    from reshard.ir.codec import fp8_block_decode, fp8_block_encode

    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    q, s = fp8_block_encode(x, (bm, bn))
    n = (rows, cols)[dim]
    bounds = sorted({0, n, *(c for c in cuts if c <= n)})
    payload = split((rows, cols), dim, [b - a for a, b in zip(bounds, bounds[1:])])
    scales = coarsen(payload, (bm, bn))
    whole = fp8_block_decode(q, s, (bm, bn))
    qs = {r: payload.extract(q.view(torch.uint8), r).view(torch.float8_e4m3fn) for r in payload.ranks}
    ss = {r: scales.extract(s, r) for r in payload.ranks}
    b = (bm, bn)[dim]
    for r, o in zip(payload.ranks, bounds):
        width = qs[r].shape[dim]
        if not width:
            continue
        # a rank-local block index: the shard's index i is F's o + i, its block (o + i) // b, which sits at
        # row (o + i) // b - o // b of the rank's scales
        local = torch.arange(width)
        pick = (o + local) // b - o // b
        per = ss[r].index_select(dim, pick)  # the other dim is whole: its blocks as in F
        mine = per.repeat_interleave(bn, 1)[:, :cols] if dim == 0 else per.repeat_interleave(bm, 0)[:rows]
        assert torch.equal(qs[r].float() * mine, whole.narrow(dim, o, width))
    back_q = payload.rebuild({r: t.view(torch.uint8) for r, t in qs.items()}).view(torch.float8_e4m3fn)
    assert torch.equal(back_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales.rebuild(ss), s)  # rebuild verifies every replicated scale bitwise (P2)


@SETTINGS
@given(rows=st.integers(1, 70), cols=st.integers(1, 70), bm=st.integers(1, 16), bn=st.integers(1, 16),
       dim=st.sampled_from([0, 1]), cuts=st.lists(st.integers(0, 70), max_size=3))
def test_cut_blocks_counts_what_a_rank_does_not_hold(rows: int, cols: int, bm: int, bn: int, dim: int,
                                                     cuts: list[int]) -> None:
    """``cut_blocks``: a rank's count is the elements of its scales' blocks it does not hold (blocks
    clipped to the tensor); all zero exactly where every TP boundary falls on a block boundary."""
    from reshard.ir.blocks import cut_blocks

    n, b = (rows, cols)[dim], (bm, bn)[dim]
    bounds = sorted({0, n, *(c for c in cuts if c <= n)})
    payload = split((rows, cols), dim, [z - a for a, z in zip(bounds, bounds[1:])])
    got = cut_blocks(payload, (bm, bn))
    other = (cols, rows)[dim]
    for r, (a, z) in zip(payload.ranks, zip(bounds, bounds[1:])):
        held = (min(n, -(-z // b) * b) - a // b * b) if z > a else 0  # its blocks' indices along dim, clipped
        assert got[r] == (held - (z - a)) * other
    assert any(got.values()) == any(c % b for c in bounds[1:-1])
