"""Shard: one rank's tensor of a parameter, and ``MapLike``: what the IR's algorithms read of a map.

``ParamMap`` (``param_map.py``) is the one map class. Its methods call the algorithms in
``check``, ``apply``, ``canonical`` and ``serial``; those modules therefore see a map only through
the ``MapLike`` protocol below and never import ``ParamMap`` (dependencies point one way).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from ..errors import MapError
from .piece import Piece, is_int, prod


def checked_shape(value, what: str) -> tuple[int, ...]:
    """``value`` as a shape of non-negative ints, else :class:`MapError` naming ``what``."""
    shape = tuple(value)
    if not all(is_int(n) and n >= 0 for n in shape):
        raise MapError(f"{what} must be non-negative ints, got {value!r}")
    return shape


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's tensor: its shape and the pieces that tile it."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", checked_shape(self.shape, "shard shape"))
        pieces = tuple(self.pieces)
        if not all(isinstance(p, Piece) for p in pieces):
            raise MapError("shard pieces must be Piece values")
        object.__setattr__(self, "pieces", pieces)

    @property
    def numel(self) -> int:
        return prod(self.shape)


class MapLike(Protocol):
    """The read-only face of a ``ParamMap`` that the algorithms use."""

    @property
    def logical_shape(self) -> tuple[int, ...]: ...

    @property
    def valid_shape(self) -> tuple[int, ...]: ...

    @property
    def shards(self) -> Mapping[int, Shard]: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    @property
    def numel(self) -> int: ...

    @property
    def is_padded(self) -> bool: ...

    def shard(self, rank: int) -> Shard: ...

    def pieces(self) -> Iterator[tuple[int, int, Piece]]: ...
