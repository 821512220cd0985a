"""A checkpoint's shards for a weight sync, read when a push reads them (docs/spec.md §6.1 "lazy source").

:func:`reshard.execute.sources.reader_sources` used to hand a sync every shard of a rank at once,
and a quantized weight's shard (FP8 block scales, MXFP4) decoded whole in float32: a push from an
FP8 DeepSeek-V3 folder held the decoded model. :class:`LazyShards` is the same mapping (name ->
this rank's shard) whose values are produced only where read:

* a :class:`~reshard.execute.sync.WeightSync` push (and the vLLM trainer engine's pack) reads a
  parameter through :meth:`LazyShards.open`: a :class:`~reshard.execute.bands.Banded` fragment,
  computed a band of rows at a time (a quantized weight decoded band by band, ``Reader.banded``;
  any other fragment as the reader stores it), and the parameter opened before it is dropped. So a
  push holds one band of one parameter beside its staging, whatever the checkpoint's size;
* ``lazy[name]`` (what any other caller reads) is the whole shard, as ``reader_sources`` gave it
  before: the values are the same element for element;
* :meth:`LazyShards.problems` asks the reader again what a read would find wrong
  (``Reader.check_fragment``: a quantized weight's scales) before a push moves anything, since the
  fragments are read long after ``reshard.open`` checked the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ..errors import ReshardError
from ..ir.piece import View, prod
from .bands import Banded, bounded

__all__ = ["LazyShards", "lazy_copy", "read_labels"]

Labels = int | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Entry:
    state: str
    rank: Labels  # the map key whose fragment this is, or several whose fragments lie back to back
    shape: tuple[int, ...]  # the shard's (its map's ``shard(rank)``)


def read_labels(reader, name: str, state: str, labels: Labels) -> torch.Tensor:
    """The fragment of map key ``labels`` (flat), or several keys' fragments back to back: the runs
    of one storage rank's files that a live rank holds as one shard (``sources.reader_sources``)."""
    if isinstance(labels, int):
        return reader.fragment(name, state, labels)
    return torch.cat([reader.fragment(name, state, k).reshape(-1) for k in labels])


def _labels(labels: Labels) -> tuple[int, ...]:
    return (labels,) if isinstance(labels, int) else labels


class LazyShards(Mapping[str, torch.Tensor]):
    """This rank's shards of ``reader``'s parameters (name -> state, storage rank, shard shape),
    read when read (module docstring). ``lazy[name]`` is the whole shard (a view of the reader's
    fragment); :meth:`open` the shard a band at a time, one parameter open at once."""

    def __init__(self, reader, entries: Mapping[str, tuple[str, Labels, tuple[int, ...]]]) -> None:
        self.reader = reader
        self._entries = {n: _Entry(s, k, tuple(shape)) for n, (s, k, shape) in entries.items()}
        self._open: tuple[str, Banded] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        return read_labels(self.reader, name, e.state, e.rank).view(e.shape)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the shard
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        e = self._entries[name]
        return self.reader.dtype(name, e.state)

    def problems(self, names) -> list[str]:
        """What reading ``names`` would refuse (``Reader.check_fragment``), one line each, read now."""
        out = []
        for n in names:
            e = self._entries[n]
            try:
                for k in _labels(e.rank):
                    self.reader.check_fragment(n, e.state, k)
            except ReshardError as err:
                out.append(f"{type(err).__name__}: {err}")
        return out

    def open(self, name: str) -> Banded:
        """Parameter ``name``'s shard as a flat :class:`Banded` fragment; the one open before is dropped."""
        if self._open is not None and self._open[0] == name:
            return self._open[1]
        self.close()
        e = self._entries[name]
        # several keys' runs (one storage rank's, joined): read whole, one parameter at a time
        banded = self.reader.banded(name, e.state, e.rank) if isinstance(e.rank, int) else None
        if banded is None:  # stored as it is read: the reader's own fragment (memory-mapped), read when a band is
            banded = _Stored(self.reader, name, e).banded()
        self._open = (name, banded)
        return banded

    def close(self) -> None:
        """Drop the open parameter (its band, and a fragment it holds)."""
        self._open = None


class _Stored:
    """A fragment the reader stores as it is, behind :class:`Banded`'s interface: fetched when a band
    is first read, held until the parameter is closed."""

    __slots__ = ("e", "flat", "name", "reader")

    def __init__(self, reader, name: str, e: _Entry) -> None:
        self.reader, self.name, self.e, self.flat = reader, name, e, None

    def banded(self) -> Banded:
        row = self.e.shape[-1] if self.e.shape and self.e.shape[-1] else 1
        return Banded(prod(self.e.shape), self.reader.dtype(self.name, self.e.state), row, self.rows)

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        if self.flat is None:
            self.flat = read_labels(self.reader, self.name, self.e.state, self.e.rank).reshape(-1)
        row = self.e.shape[-1] if self.e.shape and self.e.shape[-1] else 1
        return self.flat[r0 * row:r1 * row]


def lazy_copy(dst: torch.Tensor, dst_view: View, src: Banded, src_view: View, shape: tuple[int, ...],
              fn=None) -> None:
    """``dst[dst_view] = src[src_view]`` (``shape``) from a banded source, each part reading at most a
    band of it; ``fn(block)`` (e.g. a scaling) applied to each part's source block first."""
    from ..ir.apply import view_of

    for dd, ss, sub in bounded(dst_view, src_view, shape, src.limit()):
        lo, hi = ss.span(sub)
        part, base = src.span(lo, hi)
        block = view_of(part, sub, View.trusted(ss.offset - base, ss.strides))
        view_of(dst, sub, dd).copy_(block if fn is None else fn(block))
        del part, block
