"""Exact set geometry of views, without enumerating elements.

A *box* is a product of arithmetic progressions, one per dimension of a row-major space:
``((start, step, count), ...)``. Every view decomposes into a union of boxes: a view whose
strides line up with the space's dimensions is one box; a flat range crossing rows (ZeRO) is at
most ``2·ndim - 1`` boxes; only views whose strides fit no refinement of the space fall back to
one box per run of elements. Checks and the planner work on boxes.
"""

from __future__ import annotations

from .piece import View, prod, row_major_strides

Axis = tuple[int, int, int]  # (start, step, count); step >= 1, count >= 1
Box = tuple[Axis, ...]


def unravel(offset: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for n in reversed(shape):
        offset, c = divmod(offset, n) if n else (offset, 0)
        coords.append(c)
    return tuple(reversed(coords))


def normalized_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(stride, extent)`` pairs, extent-1 dims dropped, sorted by stride descending,
    contiguous neighbours merged. Describes the same set of addresses."""
    dims = sorted(((s, n) for s, n in zip(strides, shape) if n != 1), key=lambda d: -d[0])
    merged: list[tuple[int, int]] = []
    for s, n in dims:
        if merged and merged[-1][0] == s * n:
            merged[-1] = (s, merged[-1][1] * n)
        else:
            merged.append((s, n))
    return merged


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

    addrs = torch.as_strided(torch.arange(reach + sum((n - 1) * s for s, n in dims) + 1), shape, strides)
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


def view_boxes(view: View, shape: tuple[int, ...], space: tuple[int, ...]) -> list[Box]:
    """The addresses of ``view`` (in bounds, injective) as disjoint boxes of ``space``."""
    if any(n == 0 for n in shape):
        return []
    return _boxes(view.offset, normalized_dims(shape, view.strides), space, row_major_strides(space))


def _boxes(offset: int, dims: list[tuple[int, int]], space: tuple[int, ...], S: tuple[int, ...]) -> list[Box]:
    box = _as_one_box(offset, dims, space, S)
    if box is not None:
        return box
    # Fallback: peel the outermost dim. Real layouts rarely get here (a stride that is no
    # multiple of any dimension's stride); the cost is one recursion per peeled index.
    (s0, n0), rest = dims[0], dims[1:]
    out: list[Box] = []
    for i in range(n0):
        out += _boxes(offset + i * s0, rest, space, S)
    return out


def _as_one_box(
    offset: int, dims: list[tuple[int, int]], space: tuple[int, ...], S: tuple[int, ...]
) -> list[Box] | None:
    """Boxes for the view when its dims map onto distinct space dims (allowing one carry of a
    unit-step run across rows); ``None`` when it needs the fallback."""
    ndim = len(space)
    coords = unravel(offset, space)
    axes: list[Axis | None] = [None] * ndim
    carry_dim = None
    for s, n in dims:
        d = next(k for k in range(ndim) if S[k] <= s)  # S[-1] == 1 <= s
        if s % S[d] or axes[d] is not None:
            return None
        step = s // S[d]
        if coords[d] + (n - 1) * step >= space[d]:
            if step != 1 or carry_dim is not None:
                return None
            carry_dim = d
        axes[d] = (coords[d], step, n)
    if carry_dim is None:
        return [tuple(a if a is not None else (coords[k], 1, 1) for k, a in enumerate(axes))]
    # A unit-step run over dim d that carries into outer dims: the outer dims must be free, and
    # the run is then a flat range over the prefix space space[:d+1].
    d = carry_dim
    if any(axes[k] is not None for k in range(d)):
        return None
    prefix = space[: d + 1]
    lo = offset // S[d]
    tail = tuple(a if a is not None else (coords[k], 1, 1) for k, a in enumerate(axes) if k > d)
    return [b + tail for b in range_boxes(lo, lo + axes[d][2], prefix)]


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
