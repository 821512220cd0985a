"""ZeRO data-parallel layouts.

ZeRO-1/2 flattens a parameter group (in order, with optional per-parameter alignment padding and
a tail padding to ``alignment``) and gives each DP rank one equal contiguous range of the flat
buffer; a parameter can straddle ranks. ZeRO-3 pads each parameter on its own to a multiple of
the DP size and splits it.

Conventions, the same in every builder here:

* A DP rank's shard is its whole flat partition, a 1-D tensor; a parameter's piece on that rank
  is a flat range (1-D, stride 1 on both sides), which may cross rows of F. The shard is shared
  by every parameter of the group, so one parameter's pieces do not tile it (``check()``'s tiling
  rule does not hold for these maps). ``shard="fragment"`` instead makes the shard just the
  parameter's own fragment (what ``ds_to_universal`` cuts out of the partition), which tiles.
* A rank whose partition holds none of the parameter is **omitted** from that parameter's map:
  the map's ranks are exactly the ranks that hold some of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MapError
from ..ir.param_map import ParamMap
from ..ir.piece import prod
from ._core import as_shape, flat_ranges, global_ranks, positive

__all__ = [
    "FlatGroup",
    "round_robin_order",
    "zero12_group",
    "zero12_group_layout",
    "zero12_from_slice_mappings",
    "zero3",
    "zero3_partition_numel",
]


def round_robin_order(count: int, dp: int) -> list[int]:
    """Flattening order under ZeRO's ``round_robin_gradients``: parameter ``i`` goes to bucket
    ``i % dp``, buckets are laid out in turn, order kept within a bucket."""
    positive(dp, "dp")
    return [i for b in range(min(dp, count)) for i in range(b, count, dp)]


@dataclass(frozen=True, slots=True)
class FlatGroup:
    """A ZeRO-1/2 parameter group's flat buffer: where each parameter sits and how the buffer is
    cut into equal DP partitions. The one description of that buffer: the builders below, the
    DeepSpeed writer and the offline resharder all read partitions through it.

    ``offsets[i]`` is parameter ``i``'s flat offset (model order), ``data_end`` the end of the last
    parameter (DeepSpeed's ``padded_group_numel``), ``total`` the aligned buffer length."""

    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    data_end: int
    total: int
    dp: int
    names: tuple[str, ...] = ()

    @property
    def partition(self) -> int:
        """Elements each DP rank holds."""
        return self.total // self.dp

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(prod(s) for s in self.shapes)

    def param_paddings(self) -> list[int]:
        """Zeros after each parameter (none after the last)."""
        ends = [o + n for o, n in zip(self.offsets, self.numels)]
        return [nxt - end for end, nxt in zip(ends, self.offsets[1:])] + ([0] if self.shapes else [])

    def tail_padding(self, d: int) -> int:
        """Padding inside partition ``d``: all of it past the data, the overhang where the data
        ends inside it, else 0 (DeepSpeed's ``group_paddings``)."""
        left, size = d * self.partition, self.partition
        return size if self.data_end <= left else max(0, left + size - self.data_end)

    def overlap(self, i: int, d: int) -> tuple[int, int]:
        """``[lo, hi)`` of parameter ``i`` inside partition ``d``, in flat-buffer coordinates
        (``lo >= hi`` when they do not meet): the one partition intersection."""
        off, n = self.offsets[i], prod(self.shapes[i])
        return max(off, d * self.partition), min(off + n, (d + 1) * self.partition)

    def fragments(self, d: int) -> list[tuple[int, int, int]]:
        """``(index, lo, hi)``: the parameters intersecting partition ``d``, in flat order."""
        spans = ((i, *self.overlap(i, d)) for i in sorted(range(len(self.shapes)), key=self.offsets.__getitem__))
        return [(i, lo, hi) for i, lo, hi in spans if lo < hi]

    def fragments_of(self, i: int) -> tuple[tuple[int, int, int], ...]:
        """``(d, lo, hi)`` for every partition ``d`` parameter ``i`` meets, in DP order: its
        fragment there is ``[lo, hi)`` of the parameter's own flattened elements. Costs one step
        per fragment, not per DP rank (composite maps at thousands of ranks ask it per parameter)."""
        off, part = self.offsets[i], self.partition
        end = off + prod(self.shapes[i])
        if end == off:
            return ()
        return tuple((d, max(off, d * part) - off, min(end, (d + 1) * part) - off)
                     for d in range(off // part, (end - 1) // part + 1))

    def param_map(self, i: int, *, ranks: Sequence[int] | None = None, shard: str = "fragment") -> ParamMap:
        """Parameter ``i``'s map over the DP ranks (``ranks`` relabels them): its fragment of each
        partition, as the shard itself (``"fragment"``) or inside the whole partition."""
        fragment = _shard_mode(shard)
        labels = global_ranks(self.dp, ranks)
        off, ranges = self.offsets[i], {}
        for d, lo, hi in self.fragments_of(i):
            ranges[labels[d]] = ((hi - lo, [(lo, 0, hi - lo)]) if fragment
                                 else (self.partition, [(lo, lo + off - d * self.partition, hi - lo)]))
        return flat_ranges(self.shapes[i], ranges)


def zero12_group_layout(
    shapes: Sequence[Sequence[int]],
    dp: int,
    *,
    alignment: int | None = None,
    param_alignment: int = 1,
    round_robin: bool = False,
    names: Sequence[str] = (),
) -> FlatGroup:
    """Flat layout of a ZeRO-1/2 group: parameters laid out in order (``round_robin`` reorders
    them), each but the last followed by zeros up to a multiple of ``param_alignment`` elements,
    the whole padded to a multiple of ``alignment`` (DeepSpeed: ``2 * dp``, i.e. 4 bytes of fp16
    per rank), then cut into ``dp`` equal partitions."""
    positive(dp, "dp")
    positive(param_alignment, "param_alignment")
    alignment = 2 * dp if alignment is None else positive(alignment, "alignment")
    shapes_t = tuple(as_shape(s) for s in shapes)
    numels = [prod(s) for s in shapes_t]
    order = round_robin_order(len(numels), dp) if round_robin else list(range(len(numels)))
    offsets = [0] * len(numels)
    cursor = 0
    for k, i in enumerate(order):
        offsets[i] = cursor
        cursor += numels[i]
        if k != len(order) - 1:
            cursor += -cursor % param_alignment
    total = cursor + (-cursor % alignment)
    if total % dp:
        raise MapError(f"aligned group of {total} elements does not split into {dp} equal partitions")
    return FlatGroup(shapes_t, tuple(offsets), cursor, total, dp, tuple(names))


def _shard_mode(shard: str) -> bool:
    if shard not in ("partition", "fragment"):
        raise MapError(f'shard must be "partition" or "fragment", got {shard!r}')
    return shard == "fragment"


def zero12_group(
    shapes: Sequence[Sequence[int]],
    dp: int,
    *,
    alignment: int | None = None,
    param_alignment: int = 1,
    round_robin: bool = False,
    ranks: Sequence[int] | None = None,
    shard: str = "partition",
) -> list[ParamMap]:
    """One map per parameter (model order) of a ZeRO-1/2 group over ``dp`` ranks (see
    :func:`zero12_group_layout`)."""
    group = zero12_group_layout(shapes, dp, alignment=alignment, param_alignment=param_alignment,
                                round_robin=round_robin)
    return [group.param_map(i, ranks=ranks, shard=shard) for i in range(len(group.shapes))]


def _fragment(frag: Any, where: str) -> tuple[int, int]:
    """``(numel, start)`` of a DeepSpeed ``fragment_address`` or an equivalent mapping/pair."""
    if isinstance(frag, Mapping):
        numel, start = frag.get("numel"), frag.get("start")
    elif hasattr(frag, "numel") and hasattr(frag, "start"):
        numel, start = frag.numel, frag.start
    elif isinstance(frag, (tuple, list)) and len(frag) == 2:
        numel, start = frag
    else:
        raise MapError(f"{where}: expected fragment_address(numel, start), got {frag!r}")
    for v in (numel, start):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise MapError(f"{where}: fragment numel/start must be non-negative ints, got {frag!r}")
    return numel, start


def zero12_from_slice_mappings(
    param_shapes: Mapping[str, Sequence[int]],
    param_slice_mappings: Sequence[Mapping[str, Any]],
    group_paddings: Sequence[int],
    partition_count: int,
    *,
    partition_size: int | None = None,
    ranks: Sequence[int] | None = None,
    shard: str = "partition",
) -> dict[str, ParamMap]:
    """Maps of one ZeRO-1/2 parameter group, read from a real checkpoint.

    ``param_slice_mappings[d]`` is DP rank ``d``'s ``{name: fragment_address(numel, start)}`` for
    this group (``start`` is into that rank's flat partition), ``group_paddings[d]`` its tail
    padding, ``partition_count`` the DP size. A parameter's fragments, taken in DP rank order,
    are consecutive ranges of its flattened elements. ``partition_size`` defaults to what the
    fragments and paddings imply: the last rank ends with the group's last fragment followed by
    its padding. Names present in ``param_shapes`` but in no mapping are left out."""
    fragment = _shard_mode(shard)
    positive(partition_count, "partition_count")
    if len(param_slice_mappings) != partition_count or len(group_paddings) != partition_count:
        raise MapError(
            f"need one slice mapping and one padding per DP rank ({partition_count}), got "
            f"{len(param_slice_mappings)} and {len(group_paddings)}"
        )
    labels = global_ranks(partition_count, ranks)
    frags: dict[str, list[tuple[int, int, int]]] = {}  # name -> [(dp rank, numel, start)]
    ends = [0] * partition_count
    for d, mapping in enumerate(param_slice_mappings):
        for name, frag in mapping.items():
            numel, start = _fragment(frag, f"dp rank {d} {name}")
            frags.setdefault(name, []).append((d, numel, start))
            ends[d] = max(ends[d], start + numel)
    if partition_size is None:
        last = partition_count - 1
        partition_size = ends[last] + group_paddings[last]
    for d in range(partition_count):
        if ends[d] > partition_size:
            raise MapError(f"dp rank {d}: a fragment ends at {ends[d]}, past the partition of {partition_size}")
    out: dict[str, ParamMap] = {}
    for name, parts in frags.items():
        if name not in param_shapes:
            raise MapError(f"{name}: in param_slice_mappings but not in param_shapes")
        shape = as_shape(param_shapes[name], f"{name} shape")
        consumed, ranges = 0, {}
        for d, numel, start in sorted(parts):
            if numel:
                ranges[labels[d]] = (numel, [(consumed, 0, numel)]) if fragment else (
                    partition_size, [(consumed, start, numel)])
            consumed += numel
        if consumed != prod(shape):
            raise MapError(f"{name}: fragments hold {consumed} elements, the parameter has {prod(shape)}")
        out[name] = flat_ranges(shape, ranges)
    return out


def zero3_partition_numel(numel: int, dp: int) -> int:
    """Elements each DP rank holds of one ZeRO-3 parameter: ``ceil(numel / dp)``."""
    positive(dp, "dp")
    return -(-numel // dp)


def zero3(
    shape: Sequence[int], dp: int, *, ranks: Sequence[int] | None = None, shard: str = "partition"
) -> ParamMap:
    """ZeRO-3: the parameter flattened, padded to ``ceil(numel/dp) * dp`` and split evenly; rank
    ``d`` holds ``[d * p, (d + 1) * p)`` of it, the tail of the last holders being padding."""
    shape = as_shape(shape)
    part = zero3_partition_numel(prod(shape), dp)
    return FlatGroup((shape,), (0,), prod(shape), part * dp, dp).param_map(0, ranks=ranks, shard=shard)
