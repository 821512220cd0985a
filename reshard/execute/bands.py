"""Source fragments computed a band of rows at a time (docs/spec.md §1 "band"): a quantized
weight decoded on the way is produced only where a window reads it, so a fill's memory follows the
band, never the widest tensor (DeepSeek-V3's 18432 x 7168 MLP weights are 504 MiB each in float32).

A :class:`Banded` fragment stands where a flat source tensor would (``WindowFill``'s sources): its
``rows(r0, r1)`` computes rows ``r0..r1`` (``row`` elements each) as a flat tensor whose every
element is the one the whole fragment would hold there, so a banded fill equals the whole one bit
for bit. The last band computed is kept (windows read a weight in order); a read reaching past it
computes the rows it needs, from a multiple of ``align`` (a block row: no block decoded twice in a
sweep) and at least ``band`` bytes' worth.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import torch

from ..ir.piece import View
from .memory import trim_heap

__all__ = ["BAND_BYTES", "Banded", "band_bytes", "bounded", "read_bands", "window"]

BAND_BYTES = 32 << 20  # a band's size by default: about two 16 MiB windows of float32


def band_bytes() -> int:
    """The band size in bytes: ``$RESHARD_BAND_BYTES`` where set (tests lower it), else ``BAND_BYTES``."""
    raw = os.environ.get("RESHARD_BAND_BYTES")
    return max(1, int(raw)) if raw else BAND_BYTES


class Banded:
    """A flat fragment of ``numel`` elements of ``dtype``, rows of ``row`` elements, computed by
    ``rows(r0, r1)`` (a flat tensor of ``(r1 - r0) * row`` elements) a band at a time: from a
    multiple of ``align`` rows, at least ``band`` bytes (default :func:`band_bytes`)."""

    __slots__ = ("_cached", "_lock", "align", "band", "dtype", "numel", "row", "rows")

    def __init__(self, numel: int, dtype: torch.dtype, row: int, rows: Callable[[int, int], torch.Tensor], *,
                 align: int = 1, band: int | None = None) -> None:
        self.numel, self.dtype, self.row, self.rows = numel, dtype, max(1, row), rows
        self.align, self.band = max(1, align), band or band_bytes()
        self._cached: tuple[int, int, torch.Tensor] | None = None  # first row, end row, their values
        self._lock = threading.Lock()

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        """A flat tensor holding elements ``lo..hi`` and the element its first one is."""
        r0, r1 = lo // self.row, -(-hi // self.row)
        with self._lock:  # fills of disjoint windows may run in threads (storage.zip_stripes)
            c = self._cached
            if c is None or not (c[0] <= r0 and r1 <= c[1]):
                total = self.numel // self.row
                a = r0 // self.align * self.align
                b = max(r1, a + max(1, self.band // max(1, self.row * self.dtype.itemsize)))
                b = min(total, -(-b // self.align) * self.align)
                c = self._cached = None  # the last band dropped before the next is made: one in memory
                trim_heap(above=2 * self.band)  # and the heap's holes handed back once they pass two bands
                c = self._cached = (a, b, self.rows(a, b))
        return c[2], c[0] * self.row

    def limit(self) -> int:
        """Elements one copy may read of it at most (a band's, at least a row)."""
        return max(self.row, self.band // self.dtype.itemsize)


def bounded(dst: View, src: View, shape: tuple[int, ...], limit: int) -> Iterator[tuple[View, View, tuple[int, ...]]]:
    """The strided copy ``(dst, src, shape)`` as sub-copies, each reading a source span of at most
    ``limit`` elements where a single row allows (split along the outermost dimensions first)."""
    lo, hi = src.span(shape)
    k = next((j for j, n in enumerate(shape) if n > 1), None)
    if hi - lo <= limit or k is None:
        yield dst, src, shape
        return
    n = shape[k]
    chunk = max(1, n * limit // (hi - lo))
    for a in range(0, n, chunk):
        sub = (*shape[:k], min(chunk, n - a), *shape[k + 1:])
        yield from bounded(View.trusted(dst.offset + a * dst.strides[k], dst.strides),
                           View.trusted(src.offset + a * src.strides[k], src.strides), sub, limit)


def window(source: torch.Tensor | Banded, start: int, count: int) -> torch.Tensor:
    """Elements ``start..start + count`` of a flat source fragment, computed a band at a time where
    it is :class:`Banded` (a view of the band, valid until the next band is made)."""
    if not isinstance(source, Banded):
        return source[start:start + count]
    part, base = source.span(start, start + count)
    return part[start - base:start - base + count]


def read_bands(source: Banded) -> int:
    """Compute every band of ``source`` once, front to back (what reads it through: its records
    checked as they are read); returns the elements read."""
    step = source.limit()
    for lo in range(0, source.numel, step):
        window(source, lo, min(step, source.numel - lo))
    return source.numel
