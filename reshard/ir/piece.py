"""Piece: one affine block of a parameter F as it sits in one rank's shard.

A view is ``(offset, strides)`` into a row-major flat storage, exactly the ``storage_offset`` and
``stride`` arguments of ``torch.as_strided``; ``shape`` is shared by the source view (into F) and
the dest view (into the shard). See docs/spec.md for the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import MapError


def prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    return tuple(strides)


def is_int(x: object) -> bool:
    """An ``int`` that is not a ``bool`` (JSON's ``true`` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def scale_problem(x: object) -> str | None:
    """Why ``x`` cannot be a piece's scale or a segment's factor (finite, non-zero, a number),
    or ``None`` when it can. One rule for pieces, map documents and plan documents."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return f"expected a number, got {type(x).__name__} {x!r}"
    if not math.isfinite(x) or x == 0:
        return f"must be finite and non-zero, got {x!r}"
    return None


@dataclass(frozen=True, slots=True)
class View:
    """``(offset, strides)`` into a row-major flat storage."""

    offset: int
    strides: tuple[int, ...]

    def __post_init__(self) -> None:
        if not is_int(self.offset) or self.offset < 0:
            raise MapError(f"view offset must be a non-negative int, got {self.offset!r}")
        strides = tuple(self.strides)
        if not all(is_int(s) and s >= 0 for s in strides):
            raise MapError(f"view strides must be non-negative ints, got {self.strides!r}")
        object.__setattr__(self, "strides", strides)

    @classmethod
    def trusted(cls, offset: int, strides: tuple[int, ...]) -> View:
        """Construct without validation, for values computed from already valid views."""
        v = object.__new__(cls)
        object.__setattr__(v, "offset", offset)
        object.__setattr__(v, "strides", strides)
        return v

    def span(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``[lo, hi)``: the smallest and one past the largest address the view touches
        (``(offset, offset)`` when the shape is empty)."""
        if any(n == 0 for n in shape):
            return self.offset, self.offset
        return self.offset, self.offset + sum((n - 1) * s for n, s in zip(shape, self.strides)) + 1


@dataclass(frozen=True, slots=True)
class Piece:
    """A block of F held by a shard: ``shard[dest view] == F[source view] * scale``.

    ``locations`` is the exact set of ranks whose shards hold this block (homogeneity: every
    element of the block has exactly these holders). ``scale`` is finite and non-zero.
    """

    shape: tuple[int, ...]
    source: View
    dest: View
    locations: frozenset[int]
    scale: float = 1.0

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(is_int(n) and n >= 0 for n in shape):
            raise MapError(f"piece shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        for side, view in (("source", self.source), ("dest", self.dest)):
            if not isinstance(view, View):
                raise MapError(f"piece {side} must be a View, got {type(view).__name__}")
            if len(view.strides) != len(shape):
                raise MapError(
                    f"piece {side} has {len(view.strides)} strides for a {len(shape)}-d shape {shape}"
                )
        locs = frozenset(self.locations)
        if not locs or not all(is_int(r) and r >= 0 for r in locs):
            raise MapError(f"piece locations must be a non-empty set of ranks, got {sorted(locs)!r}")
        object.__setattr__(self, "locations", locs)
        problem = scale_problem(self.scale)
        if problem:
            raise MapError(f"piece scale {problem}")
        object.__setattr__(self, "scale", float(self.scale))

    @classmethod
    def trusted(cls, shape: tuple[int, ...], source: View, dest: View, locations: frozenset[int],
                scale: float) -> Piece:
        """Construct without validation, for pieces derived from already valid ones (hot paths
        of canonicalisation and planning)."""
        p = object.__new__(cls)
        for name, value in (("shape", shape), ("source", source), ("dest", dest), ("locations", locations),
                            ("scale", scale)):
            object.__setattr__(p, name, value)
        return p

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def is_empty(self) -> bool:
        return self.numel == 0

    def describe(self) -> str:
        """Compact one-line form used in messages and ``inspect``."""
        s = f"{list(self.shape)} F@{self.source.offset}{list(self.source.strides)}"
        s += f" -> shard@{self.dest.offset}{list(self.dest.strides)} on {sorted(self.locations)}"
        if self.scale != 1.0:
            s += f" x{self.scale:g}"
        return s


def piece(
    shape: tuple[int, ...] | list[int],
    source: tuple[int, tuple[int, ...] | list[int]],
    dest: tuple[int, tuple[int, ...] | list[int]],
    locations,
    scale: float = 1.0,
) -> Piece:
    """Convenience constructor: ``piece((2, 4), (0, (8, 1)), (0, (4, 1)), {0})``."""
    return Piece(
        tuple(shape),
        View(source[0], tuple(source[1])),
        View(dest[0], tuple(dest[1])),
        frozenset(locations),
        scale,
    )
