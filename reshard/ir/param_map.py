"""ParamMap: how one parameter F is spread over ranks.

``logical_shape`` is F's shape, padding included; ``valid_shape`` is the real region, a prefix box
of F (padded vocabularies, docs/spec.md §1 "valid region"). Each rank's entry is a
:class:`Shard`: the shape of the tensor that rank holds and the pieces that fill it.

The methods are the IR's operations; their algorithms live in ``check``, ``apply`` and
``serial``, which read a map through ``shard.MapLike`` and so do not import this module.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import MapError
from .apply import extract, rebuild
from .check import check as check_map
from .check import uncovered as uncovered_boxes
from .geometry import Box
from .piece import Piece, is_int, prod
from .serial import decode_document, decode_map, encode_document, encode_map
from .shard import Shard, checked_shape


@dataclass(frozen=True, slots=True)
class ParamMap:
    """The map of one parameter: F's shape and, per rank, its shard.

    Immutable and hashable; rank keys are ints.
    """

    logical_shape: tuple[int, ...]
    shards: Mapping[int, Shard]
    valid_shape: tuple[int, ...] | None = None
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        logical = checked_shape(self.logical_shape, "logical_shape")
        object.__setattr__(self, "logical_shape", logical)
        valid = logical if self.valid_shape is None else checked_shape(self.valid_shape, "valid_shape")
        if len(valid) != len(logical) or any(v > n for v, n in zip(valid, logical)):
            raise MapError(f"valid_shape {list(valid)} must fit inside logical_shape {list(logical)}")
        object.__setattr__(self, "valid_shape", valid)
        shards: dict[int, Shard] = {}
        for rank in sorted(self.shards):
            if not is_int(rank) or rank < 0:
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
        def move(p: Piece) -> Piece:
            return Piece(p.shape, p.source, p.dest, frozenset(relabel[r] for r in p.locations), p.scale)

        return ParamMap(
            self.logical_shape,
            {relabel[r]: Shard(s.shape, tuple(move(p) for p in s.pieces)) for r, s in self.shards.items()},
            self.valid_shape,
        )

    # -- the IR's operations -------------------------------------------------------------------
    def check(self, path: str = "") -> None:
        """Raise :class:`reshard.MapError` unless the map is valid (docs/spec.md §2); its ``path``
        is the JSON path of the field at fault, under ``path`` (where the map sits in a document)."""
        check_map(self, path)

    def uncovered(self) -> list[Box]:
        """Regions of F that no piece covers, as boxes."""
        return uncovered_boxes(self)

    def extract(self, full: torch.Tensor, rank: int, scale_power: int = 1) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` (see ``reshard.ir.apply.extract``)."""
        return extract(self, full, rank, scale_power)

    def rebuild(self, shards: Mapping[int, torch.Tensor], scale_power: int = 1, *, verify: bool = True,
                valid_only: bool = False, prefer: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """F from shards (see ``reshard.ir.apply.rebuild``)."""
        return rebuild(self, shards, scale_power, verify=verify, valid_only=valid_only, prefer=prefer, out=out)

    def to_dict(self) -> dict[str, Any]:
        """JSON format v1 (docs/spec.md §5)."""
        return encode_map(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "") -> ParamMap:
        """Strict decoder of JSON format v1; raises :class:`reshard.MapFormatError` with a JSON path.
        Decodes the format, not the geometry: call ``check()`` for that."""
        logical, shards, valid = decode_map(d, path)
        return cls(logical, shards, valid)

    def summary(self) -> str:
        counts = {r: len(s.pieces) for r, s in self.shards.items()}
        pad = "" if not self.is_padded else f", valid {list(self.valid_shape)}"
        return f"ParamMap(F {list(self.logical_shape)}{pad}, pieces per rank {counts})"


def map_to_dict(m: ParamMap) -> dict[str, Any]:
    return m.to_dict()


def map_from_dict(d: Any, path: str = "") -> ParamMap:
    return ParamMap.from_dict(d, path)


def maps_to_document(maps: Mapping[str, ParamMap]) -> dict[str, Any]:
    """``{"version": 1, "params": {name: map}}``."""
    return encode_document(maps)


def maps_from_document(doc: Any) -> dict[str, ParamMap]:
    return {name: ParamMap(*fields) for name, fields in decode_document(doc).items()}
