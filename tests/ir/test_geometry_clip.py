"""``clip_segment``: the part of a strided copy whose destination lies in a window, against brute force."""

from __future__ import annotations

import itertools
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.ir.apply import strided_copy
from reshard.ir.geometry import clip_segment
from reshard.ir.piece import View

SETTINGS = settings(max_examples=int(os.environ.get("RESHARD_EXAMPLES", "150")) * 4, deadline=None)


def _addresses(view: View, shape: tuple[int, ...]) -> list[int]:
    return [view.offset + sum(i * s for i, s in zip(idx, view.strides))
            for idx in itertools.product(*(range(n) for n in shape))]


@st.composite
def copies(draw):
    """(dst, src, shape, lo, hi): an injective destination (a permuted row-major layout with gaps,
    so transposed and interleaved rows occur too), any source strides, a window around it."""
    nd = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(0, 5)) for _ in range(nd))
    order = draw(st.permutations(range(nd)))
    strides, step = [0] * nd, 1
    for k in reversed(order):
        strides[k] = step
        step *= shape[k] + draw(st.integers(0, 2))
    if nd >= 2 and draw(st.booleans()):  # interleaved rows: outer stride smaller than a row's extent
        k = order[0]
        inner = sum((n - 1) * s for j, (n, s) in enumerate(zip(shape, strides)) if j != k) + 1
        stride = draw(st.integers(1, max(1, inner)))
        if len(set(_addresses(View(0, tuple(strides[:k] + [stride] + strides[k + 1:])), shape))) == \
                len(_addresses(View(0, tuple(strides)), shape)):
            strides[k] = stride
    dst = View(draw(st.integers(0, 6)), tuple(strides))
    src = View(draw(st.integers(0, 6)), tuple(draw(st.integers(0, 7)) for _ in range(nd)))
    top = dst.span(shape)[1] + 4
    lo = draw(st.integers(0, top))
    hi = draw(st.integers(lo - 2, top + 3))
    return dst, src, shape, lo, hi


@SETTINGS
@given(copies())
def test_clip_segment_is_exactly_the_elements_in_the_window(case):
    dst, src, shape, lo, hi = case
    want = {d: s for d, s in zip(_addresses(dst, shape), _addresses(src, shape)) if lo <= d < hi}
    got = {}
    parts = clip_segment(dst, src, shape, lo, hi)
    for d, s, sh in parts:
        assert len(sh) == len(shape) and all(n > 0 for n in sh)
        assert lo <= d.span(sh)[0] and d.span(sh)[1] <= hi  # every part wholly inside
        for a, b in zip(_addresses(d, sh), _addresses(s, sh)):
            assert a not in got  # disjoint
            got[a] = b
    assert got == want


@SETTINGS
@given(copies(), st.integers(1, 9))
def test_windows_of_clipped_copies_rebuild_the_whole_copy(case, window):
    """Running the parts window by window, as the streamed writer does, gives the plain copy."""
    dst, src, shape, _, _ = case
    size = dst.span(shape)[1] + 3
    source = torch.arange(1, src.span(shape)[1] + 2, dtype=torch.float32)
    want = torch.zeros(size)
    strided_copy(want, dst, source, src, shape, 0.5)
    got = torch.zeros(size)
    for start in range(0, size, window):
        out = got[start:start + window]
        for d, s, sh in clip_segment(dst, src, shape, start, start + out.numel()):
            strided_copy(out, View(d.offset - start, d.strides), source, s, sh, 0.5)
    assert torch.equal(got, want)


def test_a_window_inside_a_large_matrix_takes_few_copies():
    dst, src = View(3, (1000, 1)), View(0, (1, 1000))  # a transpose into rows of 1000
    parts = clip_segment(dst, src, (1000, 1000), 2500, 700_000)
    # rows 3..698 whole, then the tail of row 2 and the head of row 699
    assert [(d.offset, s.offset, sh) for d, s, sh in parts] == [
        (3003, 3, (696, 1000)), (2500, 2 + 497 * 1000, (1, 503)), (699_003, 699, (1, 997))]
    assert clip_segment(dst, src, (1000, 1000), 0, 3) == []
    assert clip_segment(dst, src, (1000, 1000), 0, 2_000_000) == [(dst, src, (1000, 1000))]



@st.composite
def flat_parts(draw):
    """Segments into a flat buffer: contiguous runs with gaps (a ZeRO partition's fragments and
    padding), sometimes one strided destination among them."""
    parts, pos = [], draw(st.integers(0, 3))
    for _ in range(draw(st.integers(0, 4))):
        n = draw(st.integers(0, 6))
        if draw(st.integers(0, 4)) == 0 and n > 1:  # every other element: not one contiguous run
            parts.append((View(pos, (2,)), (n,)))
            pos += 2 * n
        else:
            parts.append((View(pos, (1,)), (n,)))
            pos += n
        pos += draw(st.integers(0, 3))
    return parts, pos + draw(st.integers(0, 3))


@SETTINGS
@given(flat_parts(), st.integers(1, 9))
def test_window_fill_writes_every_element_of_an_uninitialised_buffer(case, window):
    """``WindowFill`` declares ``zeroes_gaps``: fed windows full of garbage (NaN), as the streamed
    writer then does, it still yields the segments' values and zeros everywhere else."""
    from reshard.execute.local import WindowFill
    from reshard.plan.values import Segment

    dsts, size = case
    source = torch.arange(1, 40, dtype=torch.float32)
    want = torch.zeros(size)
    parts = []
    for k, (dst, shape) in enumerate(dsts):
        seg = Segment(0, View(k, (1,)), 0, dst, shape)
        strided_copy(want, dst, source, seg.src, shape, 1.0)
        parts.append((0, seg, lambda: source))
    fill = WindowFill(parts)
    assert fill.zeroes_gaps
    got = torch.full((size,), float("nan"))
    for start in range(0, size, window):
        fill(got[start:start + window], start)
    assert torch.equal(got, want)
