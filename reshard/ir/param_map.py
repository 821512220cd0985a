"""ParamMap: how one parameter F is spread over ranks.

``logical_shape`` is F's shape, padding included; ``valid_shape`` is the real region, a prefix box
of F (padded vocabularies, seed §8.1). Each rank's entry is a :class:`Shard`: the shape of the
tensor that rank holds and the pieces that fill it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..errors import MapError
from .piece import Piece, _is_int, prod


def _shape(value, what: str) -> tuple[int, ...]:
    shape = tuple(value)
    if not all(_is_int(n) and n >= 0 for n in shape):
        raise MapError(f"{what} must be non-negative ints, got {value!r}")
    return shape


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's tensor: its shape and the pieces that tile it."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape(self.shape, "shard shape"))
        pieces = tuple(self.pieces)
        if not all(isinstance(p, Piece) for p in pieces):
            raise MapError("shard pieces must be Piece values")
        object.__setattr__(self, "pieces", pieces)

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True, slots=True)
class ParamMap:
    """The map of one parameter: F's shape and, per rank, its shard.

    Immutable and hashable; rank keys are ints. Methods that do real work live in their own
    modules (``check``, ``apply``, ``canonical``, ``serial``) and are attached below.
    """

    logical_shape: tuple[int, ...]
    shards: Mapping[int, Shard]
    valid_shape: tuple[int, ...] | None = None
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        logical = _shape(self.logical_shape, "logical_shape")
        object.__setattr__(self, "logical_shape", logical)
        valid = logical if self.valid_shape is None else _shape(self.valid_shape, "valid_shape")
        if len(valid) != len(logical) or any(v > n for v, n in zip(valid, logical)):
            raise MapError(f"valid_shape {list(valid)} must fit inside logical_shape {list(logical)}")
        object.__setattr__(self, "valid_shape", valid)
        shards: dict[int, Shard] = {}
        for rank in sorted(self.shards):
            if not _is_int(rank) or rank < 0:
                raise MapError(f"rank keys must be non-negative ints, got {rank!r}")
            shard = self.shards[rank]
            if not isinstance(shard, Shard):
                raise MapError(f"rank {rank}: expected a Shard, got {type(shard).__name__}")
            shards[rank] = shard
        object.__setattr__(self, "shards", shards)
        object.__setattr__(self, "_hash", hash((logical, valid, tuple(shards.items()))))

    def __hash__(self) -> int:
        return self._hash

    # -- small accessors -------------------------------------------------------------------
    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.shards)

    @property
    def numel(self) -> int:
        return prod(self.logical_shape)

    @property
    def is_padded(self) -> bool:
        return self.valid_shape != self.logical_shape

    @property
    def identity_rank(self) -> int | None:
        """The rank whose shard is F itself, element for element in row-major order (one rank,
        one unscaled piece covering all of F), or ``None``. Executors use it to hand that shard
        on without a copy."""
        if len(self.shards) != 1 or self.is_padded:
            return None
        (rank, shard), = self.shards.items()
        live = [p for p in shard.pieces if not p.is_empty]
        if len(live) != 1 or shard.numel != self.numel or live[0].numel != self.numel or live[0].scale != 1.0:
            return None
        p = live[0]
        if p.source.offset or p.dest.offset:
            return None
        expect = 1  # both views must be the row-major strides of F (unit dims aside)
        for n, s, d in sorted(((n, s, d) for n, s, d in zip(p.shape, p.source.strides, p.dest.strides) if n != 1),
                              key=lambda x: x[1]):
            if s != d or s != expect:
                return None
            expect *= n
        return rank

    def shard(self, rank: int) -> Shard:
        try:
            return self.shards[rank]
        except KeyError:
            raise MapError(f"rank {rank} is not in this map (ranks {list(self.ranks)})") from None

    def pieces(self) -> Iterator[tuple[int, int, Piece]]:
        """Every ``(rank, index, piece)`` in rank order."""
        for rank, shard in self.shards.items():
            for i, p in enumerate(shard.pieces):
                yield rank, i, p

    @property
    def num_pieces(self) -> int:
        return sum(len(s.pieces) for s in self.shards.values())

    def with_ranks(self, relabel: Mapping[int, int]) -> ParamMap:
        """The same geometry with ranks renamed (``relabel[old] = new``), e.g. local TP rank to
        global rank."""
        from .piece import Piece as _P

        def move(p: Piece) -> Piece:
            return _P(p.shape, p.source, p.dest, frozenset(relabel[r] for r in p.locations), p.scale)

        return ParamMap(
            self.logical_shape,
            {relabel[r]: Shard(s.shape, tuple(move(p) for p in s.pieces)) for r, s in self.shards.items()},
            self.valid_shape,
        )

    def summary(self) -> str:
        counts = {r: len(s.pieces) for r, s in self.shards.items()}
        pad = "" if not self.is_padded else f", valid {list(self.valid_shape)}"
        return f"ParamMap(F {list(self.logical_shape)}{pad}, pieces per rank {counts})"


# -- operations, defined in their own modules and exposed as methods ---------------------------


def _check(self: ParamMap) -> None:
    """Raise :class:`reshard.MapError` unless the map is valid (see ``reshard.ir.check``)."""
    from .check import check

    check(self)


def _uncovered(self: ParamMap):
    """Regions of F that no piece covers, as boxes."""
    from .check import uncovered

    return uncovered(self)


def _extract(self: ParamMap, full, rank: int, scale_power: int = 1):
    """Rank ``rank``'s shard of ``full`` (see ``reshard.ir.apply.extract``)."""
    from .apply import extract

    return extract(self, full, rank, scale_power)


def _rebuild(self: ParamMap, shards, scale_power: int = 1, *, verify: bool = True, valid_only: bool = False,
             prefer: int | None = None, out=None):
    """F from shards (see ``reshard.ir.apply.rebuild``)."""
    from .apply import rebuild

    return rebuild(self, shards, scale_power, verify=verify, valid_only=valid_only, prefer=prefer, out=out)


def _to_dict(self: ParamMap) -> dict:
    """JSON format v1 (see ``reshard.ir.serial``)."""
    from .serial import map_to_dict

    return map_to_dict(self)


def _from_dict(cls, d) -> ParamMap:
    """Strict decoder of JSON format v1; raises :class:`reshard.MapFormatError` with a JSON path."""
    from .serial import map_from_dict

    return map_from_dict(d)


ParamMap.check = _check  # type: ignore[attr-defined]
ParamMap.uncovered = _uncovered  # type: ignore[attr-defined]
ParamMap.extract = _extract  # type: ignore[attr-defined]
ParamMap.rebuild = _rebuild  # type: ignore[attr-defined]
ParamMap.to_dict = _to_dict  # type: ignore[attr-defined]
ParamMap.from_dict = classmethod(_from_dict)  # type: ignore[attr-defined]
