"""Exact set geometry of views, without enumerating elements.

A *block* is a box plus the shard address of its elements as an affine function of the box
index: the unit both ``check`` (boxes only) and the planner (boxes and addresses) work on.

A *box* is a product of arithmetic progressions, one per dimension of a row-major space:
``((start, step, count), ...)``. Every view decomposes into a union of boxes: a view whose
strides line up with the space's dimensions is one box; a flat range crossing rows (ZeRO) is at
most ``2·ndim - 1`` boxes; only views whose strides fit no refinement of the space fall back to
one box per run of elements. Checks and the planner work on boxes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .piece import Piece, View, prod, row_major_strides

Axis = tuple[int, int, int]  # (start, step, count); step >= 1, count >= 1
Box = tuple[Axis, ...]


def unravel(offset: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for n in reversed(shape):
        offset, c = divmod(offset, n) if n else (offset, 0)
        coords.append(c)
    return tuple(reversed(coords))


def merge_dims(shape: tuple[int, ...], *strides: tuple[int, ...], key: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """A block seen through one or more views at once (one strides tuple per view), as
    ``(extent, strides per view)`` dims: extent-1 dims dropped, ordered by view ``key``'s stride
    descending (ties by the views' strides in order), neighbours contiguous in every view merged.
    The same addresses in every view. The IR's one dimension normalisation: pieces (canonical
    form), blocks and plan segments, and composition all use it."""
    dims = [k for k, n in enumerate(shape) if n != 1]
    dims.sort(key=lambda k: tuple(-st[k] for st in (strides[key], *strides)))
    merged: list[tuple[int, tuple[int, ...]]] = []
    for k in dims:
        n, st = shape[k], tuple(v[k] for v in strides)
        if merged and all(ps == x * n for ps, x in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * n, st)
        else:
            merged.append((n, st))
    return merged


def normalized_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(stride, extent)`` pairs of one view (see :func:`merge_dims`)."""
    return [(st[0], n) for n, st in merge_dims(shape, strides)]


def is_injective(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a view touches each address at most once. Exact: a nested-stride test covers
    the views real layouts produce; anything else is decided by enumeration."""
    dims = sorted(normalized_dims(shape, strides))
    if any(n == 0 for n in shape):
        return True
    reach = 0  # largest address offset reachable by the smaller dims
    nested = True
    for s, n in dims:
        if s <= reach:
            nested = False
            break
        reach += (n - 1) * s
    if nested:
        return True
    import torch

    # The view's addresses, one per element (not one per address of its span, which a stretched
    # stride makes arbitrarily large).
    addrs = torch.zeros(1, dtype=torch.int64)
    for s, n in dims:
        addrs = (addrs[:, None] + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
    return addrs.unique().numel() == addrs.numel()


def range_boxes(lo: int, hi: int, space: tuple[int, ...]) -> list[Box]:
    """The flat address range ``[lo, hi)`` of a row-major space as at most ``2·ndim - 1`` boxes."""
    if lo >= hi:
        return []
    if len(space) == 1:
        return [((lo, 1, hi - lo),)]
    inner = prod(space[1:])
    ra, ia = divmod(lo, inner)
    rb, ib = divmod(hi, inner)
    if ra == rb:
        return [((ra, 1, 1),) + b for b in range_boxes(ia, ib, space[1:])]
    out: list[Box] = []
    if ia:
        out += [((ra, 1, 1),) + b for b in range_boxes(ia, inner, space[1:])]
        ra += 1
    if ra < rb:
        out.append(((ra, 1, rb - ra),) + tuple((0, 1, n) for n in space[1:]))
    if ib:
        out += [((rb, 1, 1),) + b for b in range_boxes(0, ib, space[1:])]
    return out


def box_numel(box: Box) -> int:
    return prod(tuple(a[2] for a in box))


def axis_intersect(a: Axis, b: Axis) -> Axis | None:
    """Intersection of two arithmetic progressions (exact, via the CRT)."""
    s1, t1, n1 = a
    s2, t2, n2 = b
    lo = max(s1, s2)
    hi = min(s1 + (n1 - 1) * t1, s2 + (n2 - 1) * t2)
    if lo > hi:
        return None
    if t1 == 1 and t2 == 1:
        return (lo, 1, hi - lo + 1)
    # x ≡ s1 (mod t1), x ≡ s2 (mod t2)
    from math import gcd

    g = gcd(t1, t2)
    if (s2 - s1) % g:
        return None
    lcm = t1 // g * t2
    # solve s1 + t1*k ≡ s2 (mod t2)
    m = t2 // g
    k = ((s2 - s1) // g * pow(t1 // g, -1, m)) % m if m > 1 else 0
    x0 = s1 + t1 * k
    # smallest x >= lo with x ≡ x0 (mod lcm)
    first = x0 + ((lo - x0 + lcm - 1) // lcm) * lcm if x0 < lo else x0 - ((x0 - lo) // lcm) * lcm
    if first > hi:
        return None
    return (first, lcm, (hi - first) // lcm + 1)


def box_intersect(a: Box, b: Box) -> Box | None:
    out = []
    for x, y in zip(a, b):
        z = axis_intersect(x, y)
        if z is None:
            return None
        out.append(z)
    return tuple(out)


def box_str(box: Box) -> str:
    """``[0:8, 4:6]`` style (``a:b:step`` when strided)."""
    parts = []
    for s, t, n in box:
        stop = s + (n - 1) * t + 1
        parts.append(f"{s}:{stop}" if t == 1 else f"{s}:{stop}:{t}")
    return "[" + ", ".join(parts) + "]"


@dataclass(frozen=True, slots=True)
class Block:
    """A box of F whose elements sit at shard address ``base + sum(i_k * strides[k])`` for the
    box index ``i`` (the ``i_k``-th element along axis ``k``)."""

    box: Box
    base: int
    strides: tuple[int, ...]

    def sub(self, box: Box) -> Block:
        """The block restricted to ``box`` (a sub-lattice of ``self.box`` on every axis)."""
        base = self.base
        h = []
        for (s0, t0, _), (s1, t1, _), hd in zip(self.box, box, self.strides):
            base += (s1 - s0) // t0 * hd
            h.append(t1 // t0 * hd)
        return Block(box, base, tuple(h))


def joint_dims(shape, sstrides, dstrides) -> list[tuple[int, int, int]]:
    """``(source stride, extent, dest stride)`` of a block seen through a source and a dest view
    (see :func:`merge_dims`; the dest stays affine in each merged dim)."""
    return [(st[0], n, st[1]) for n, st in merge_dims(shape, sstrides, dstrides)]


def piece_blocks(p: Piece, space: tuple[int, ...]) -> list[Block]:
    """The piece as disjoint blocks of F (``space``), dest addresses affine in each."""
    if p.is_empty:
        return []
    dims = joint_dims(p.shape, p.source.strides, p.dest.strides)
    return _blocks(p.source.offset, p.dest.offset, dims, space, row_major_strides(space))


def view_boxes(view: View, shape: tuple[int, ...], space: tuple[int, ...]) -> list[Box]:
    """The addresses of ``view`` (in bounds, injective) as disjoint boxes of ``space``."""
    if any(n == 0 for n in shape):
        return []
    dims = joint_dims(shape, view.strides, (0,) * len(shape))
    return [b.box for b in _blocks(view.offset, 0, dims, space, row_major_strides(space))]


def one_box(view: View, shape: tuple[int, ...], space: tuple[int, ...]) -> bool:
    """Whether the view is exactly one box of ``space``."""
    if not space:
        return True
    dims = joint_dims(shape, view.strides, (0,) * len(shape))
    blocks = _one(view.offset, 0, dims, space, row_major_strides(space))
    return blocks is not None and len(blocks) == 1


def _blocks(off: int, base: int, dims, space, S) -> list[Block]:
    one = _one(off, base, dims, space, S)
    if one is not None:
        return one
    (s0, n0, d0), rest = dims[0], dims[1:]
    out: list[Block] = []
    for i in range(n0):
        out += _blocks(off + i * s0, base + i * d0, rest, space, S)
    return out


def _refine(off: int, dims, space, S):
    """Split a unit-step run that starts a row and spans whole rows of dim k into (rows, row):
    the same addresses, now one view dim per space dim."""
    coords = unravel(off, space)
    changed = True
    while changed:
        changed = False
        for i, (s, n, d) in enumerate(dims):
            k = next(j for j in range(len(space)) if S[j] <= s)
            if k > 0 and s == S[k] and coords[k] == 0 and n > space[k] and n % space[k] == 0:
                dims = dims[:i] + [(S[k - 1], n // space[k], d * space[k]), (s, space[k], d)] + dims[i + 1 :]
                changed = True
                break
    return dims


def _one(off: int, base: int, dims, space, S) -> list[Block] | None:
    ndim = len(space)
    coords = unravel(off, space)
    dims = _refine(off, dims, space, S)
    axes: list[Axis | None] = [None] * ndim
    h = [0] * ndim
    carry = None
    for s, n, d in dims:
        k = next(j for j in range(ndim) if S[j] <= s)
        if s % S[k] or axes[k] is not None:
            return None
        step = s // S[k]
        if coords[k] + (n - 1) * step >= space[k]:
            if step != 1 or carry is not None:
                return None
            carry = k
        axes[k] = (coords[k], step, n)
        h[k] = d
    if carry is None:
        box = tuple(a if a is not None else (coords[j], 1, 1) for j, a in enumerate(axes))
        return [Block(box, base, tuple(h))]
    k = carry
    if any(axes[j] is not None for j in range(k)):
        return None
    prefix = space[: k + 1]
    pstr = row_major_strides(prefix)
    lo = off // S[k]
    tail = tuple(a if a is not None else (coords[j], 1, 1) for j, a in enumerate(axes) if j > k)
    out = []
    for b in range_boxes(lo, lo + axes[k][2], prefix):
        flat = sum(a[0] * ps for a, ps in zip(b, pstr))
        hk = h[k]
        out.append(Block(b + tail, base + (flat - lo) * hk, tuple(hk * ps for ps in pstr) + tuple(h[k + 1 :])))
    return out


def clip(b: Block, limit: tuple[int, ...]) -> Block | None:
    """``b`` restricted to the prefix box ``[0, limit)``; ``None`` when nothing is left."""
    box = []
    for (s, t, n), lim in zip(b.box, limit):
        if s >= lim:
            return None
        box.append((s, t, min(n, (lim - 1 - s) // t + 1)))
    return b.sub(tuple(box))


def outside(b: Block, limit: tuple[int, ...]) -> list[Block]:
    """The parts of ``b`` outside ``[0, limit)``, as disjoint blocks."""
    out = []
    rest = list(b.box)
    for d, ((s, t, n), lim) in enumerate(zip(b.box, limit)):
        keep = 0 if s >= lim else min(n, (lim - 1 - s) // t + 1)
        if keep < n:
            part = rest.copy()
            part[d] = (s + keep * t, t, n - keep)
            out.append(b.sub(tuple(part)))
        if keep == 0:
            return out
        rest[d] = (s, t, keep)
    return out


StridedCopy = tuple[View, View, tuple[int, ...]]  # (dest view, source view, shape)


def clip_segment(dst: View, src: View, shape: tuple[int, ...], lo: int, hi: int) -> list[StridedCopy]:
    """The part of a strided copy (a plan segment's: ``shape`` elements from ``src`` to ``dst``)
    whose destination addresses lie in ``[lo, hi)``, as disjoint sub-copies wholly inside it
    (``dst`` injective). Rows that interleave in the destination (a dimension whose stride is
    less than a row's extent) are clipped one row at a time.

    Splits along the outermost destination dimension (largest stride): the rows wholly inside
    are one sub-copy, and only the at most two rows across an edge are clipped further, so a
    window of a flat buffer costs a handful of copies, not one per row. Each sub-copy has the
    copy's rank (a clipped dimension keeps a count of 1)."""
    out: list[StridedCopy] = []
    _clip(dst.offset, tuple(dst.strides), src.offset, tuple(src.strides), tuple(shape), lo, hi, out)
    return out


def _clip(d0: int, ds: tuple[int, ...], s0: int, ss: tuple[int, ...], shape: tuple[int, ...], lo: int, hi: int,
          out: list[StridedCopy]) -> None:
    if lo >= hi or any(n == 0 for n in shape):
        return
    end = d0 + sum((n - 1) * s for n, s in zip(shape, ds)) + 1
    if end <= lo or d0 >= hi:
        return
    if lo <= d0 and end <= hi:
        out.append((View.trusted(d0, ds), View.trusted(s0, ss), shape))
        return
    # more than one element (a single one is wholly in or out): split the outermost dimension
    k = max((j for j, n in enumerate(shape) if n > 1), key=lambda j: ds[j])
    n, step = shape[k], ds[k]
    inner = end - d0 - (n - 1) * step  # extent of one row (the other dimensions)
    # rows overlapping [lo, hi): start < hi and start + inner > lo
    first_in = max(0, (lo - d0 - inner) // step + 1)
    past_in = min(n, -(-(hi - d0) // step))
    edges = [range(first_in, past_in)]
    if step >= inner:  # rows disjoint and in address order: the ones wholly inside form one block
        a, b = max(0, -(-(lo - d0) // step)), min(n, (hi - inner - d0) // step + 1)
        if b > a:  # then at most one row straddles each edge
            out.append((View.trusted(d0 + a * step, ds), View.trusted(s0 + a * ss[k], ss),
                        shape[:k] + (b - a,) + shape[k + 1:]))
            edges = [range(first_in, a), range(b, past_in)]
    row = shape[:k] + (1,) + shape[k + 1:]
    for i in (i for r in edges for i in r):
        _clip(d0 + i * step, ds, s0 + i * ss[k], ss, row, lo, hi, out)
