"""In-memory executor: run a plan's segments as strided copies, all at once or window by window."""

from __future__ import annotations

import copy
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping

import torch

from ..errors import ShardError
from ..ir.apply import flatten, strided_copy
from ..ir.geometry import clip_segment
from ..ir.piece import View, prod
from ..plan.values import ModelPlan, Segment, TransferPlan
from .bands import Banded, bounded
from .memory import release


def _runs(items: list) -> list[tuple[int, int]] | None:
    """The merged, sorted ``[lo, hi)`` runs the items' destinations cover, or ``None`` when some
    destination is not one contiguous run (its span then has holes the copies do not fill)."""
    runs: list[tuple[int, int]] = []
    for lo, hi, _, seg, _ in items:
        if hi - lo != seg.numel:
            return None
        if runs and lo <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
        else:
            runs.append((lo, hi))
    return runs


def _in_order(view: View, shape: tuple[int, ...]) -> bool:
    """Whether ``view`` walks its elements in row-major order, one after the next."""
    step = 1
    for n, stride in zip(reversed(shape), reversed(view.strides)):
        if n > 1 and stride != step:
            return False
        step *= n
    return True


def apply_plan(
    plan: TransferPlan,
    source_shards: Mapping[int, torch.Tensor],
    *,
    scale_power: int = 1,
    out: Mapping[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """Target shards from source shards. Target padding (``plan.unfilled``) is zero unless
    ``out`` is given, in which case segments are written into ``out`` and nothing else is."""
    flats = {}
    dtype = device = None
    for rank, t in source_shards.items():
        want = plan.source_shards.get(rank)
        if want is None:
            raise ShardError(f"rank {rank}: supplied a source shard, but the plan has no source rank {rank}")
        if t.numel() != prod(want):
            raise ShardError(f"rank {rank}: source shard has {t.numel()} elements, the plan says {prod(want)}")
        flats[rank] = flatten(t)
        dtype, device = t.dtype, t.device
    if out is None:
        targets = {r: torch.zeros(prod(s), dtype=dtype, device=device) for r, s in plan.target_shards.items()}
    else:
        targets = {r: flatten(t) for r, t in out.items()}
    for seg in plan.segments:
        src = flats.get(seg.src_rank)
        if src is None:
            raise ShardError(f"rank {seg.src_rank}: the plan reads this source shard, but it was not supplied")
        dst = targets[seg.dst_rank]
        strided_copy(dst, seg.dst, src, seg.src, seg.shape, seg.factor**scale_power)
    if out is not None:
        return dict(out)
    return {r: t.view(plan.target_shards[r]) for r, t in targets.items()}


def apply_model_plan(plan: ModelPlan, source_shards: Mapping[str, Mapping[int, torch.Tensor]], *,
                     scale_power: int = 1) -> dict[str, dict[int, torch.Tensor]]:
    """Every parameter's target shards, by name (see :func:`apply_plan`)."""
    missing = sorted(set(plan.params) - set(source_shards))
    if missing:
        raise ShardError(f"no source shards for parameter(s) {missing[:5]}")
    return {n: apply_plan(p, source_shards[n], scale_power=scale_power) for n, p in plan.params.items()}


# a segment's flat source shard, looked up when first needed: a tensor, or computed a band at a time
SourceOf = Callable[[], "torch.Tensor | Banded"]


class WindowFill:
    """A flat target buffer produced window by window, in increasing order, from plan segments:
    the ``fill(out, start)`` a streamed writer (``storage.torch_zip``) calls for each chunk.

    ``parts`` are ``(base, segment, source)``: the segment's ``dst`` view counts from element
    ``base`` of the buffer, and ``source()`` gives the flat source shard its ``src`` view reads.
    Each call runs, for every segment reaching into ``out``, the sub-copies whose destination
    falls there (``geometry.clip_segment``), scaled by ``factor ** scale_power``; so each output
    element is computed once, whatever the window size. Segments are swept in order of their
    first destination element, and the source pages a window read are released once copied
    (``memory.release``): on memory-mapped sources the resident set stays at about a window.
    Elements no segment covers are set to zero, and only those: when every segment's destination
    is one contiguous run (flat partitions), the gaps between runs are known up front and the
    writer need not zero each window first (``zeroes_gaps``); otherwise a window is zeroed whole
    before the copies. A window that starts before the previous one ended starts the sweep again
    (a buffer written twice). A source that is computed rather than stored (``bands.Banded``:
    a quantized weight decoded on the way) is read a band at a time, each copy cut so that it
    reads at most a band (``bands.bounded``): memory is a window and a band, whatever the
    tensor's width, and every element is the one the whole source holds."""

    zeroes_gaps = True  # storage.torch_zip: hand over an uninitialised buffer

    def __init__(self, parts: Iterable[tuple[int, Segment, SourceOf]], *, scale_power: int = 1) -> None:
        items = []
        for base, seg, source in parts:
            if seg.numel:
                lo, hi = seg.dst.span(seg.shape)
                items.append((base + lo, base + hi, View.trusted(base + seg.dst.offset, seg.dst.strides), seg,
                              source))
        items.sort(key=lambda x: x[0])
        self._items = items
        self._power = scale_power
        self._runs = _runs(items)
        self._run_ends = [hi for _, hi in self._runs] if self._runs is not None else []
        disjoint = self._runs is not None and all(a[1] <= b[0] for a, b in zip(items, items[1:]))
        self._ends = [x[1] for x in items] if disjoint else None  # sorted when disjoint
        self._restart()

    def fresh(self) -> WindowFill:
        """The same buffer, with a sweep of its own: fills of disjoint windows may then run in
        separate threads at once (``storage.zip_stripes``)."""
        other = copy.copy(self)
        other._restart()
        return other

    def direct(self, start: int, count: int, dtype: torch.dtype, min_bytes: int = 1 << 20
               ) -> list[torch.Tensor | int] | None:
        """Buffer elements ``start .. start + count`` as pieces to write in order, without a
        buffer: slices of flat sources and counts of zeros between them. Only where every segment
        there copies one run in order (row-major on both sides), unscaled, from a source of
        ``dtype``, and the pieces average ``min_bytes``; else ``None`` (fill a buffer instead).
        The slices are the sources' own memory: mapped files go on to the output file by a
        kernel copy (``storage.staging``)."""
        if self._ends is None:
            return None
        stop, pieces, pos = start + count, [], start
        i = bisect_right(self._ends, start)
        while i < len(self._items) and self._items[i][0] < stop:
            lo, hi, dst, seg, source = self._items[i]
            if seg.factor ** self._power != 1.0 or not (_in_order(dst, seg.shape) and _in_order(seg.src, seg.shape)):
                return None
            a, b = max(lo, start), min(hi, stop)
            if a > pos:
                pieces.append(a - pos)
            flat = source()
            if isinstance(flat, Banded) or flat.dtype != dtype or flat.device.type != "cpu" \
                    or not flat.is_contiguous():
                return None
            pieces.append(flat.narrow(0, seg.src.offset + a - lo, b - a))
            pos, i = b, i + 1
        if pos < stop:
            pieces.append(stop - pos)
        if count * dtype.itemsize < min_bytes * len(pieces):
            return None
        return pieces

    def _zero_gaps(self, out: torch.Tensor, start: int, stop: int) -> None:
        """Zero the elements of ``out`` (buffer elements ``start..stop``) no segment writes."""
        runs = self._runs
        if runs is None:
            out.zero_()
            return
        pos, i = start, bisect_right(self._run_ends, start)
        while pos < stop:
            lo = runs[i][0] if i < len(runs) else stop
            if lo <= pos:
                pos, i = runs[i][1], i + 1
                continue
            end = min(lo, stop)
            out[pos - start:end - start].zero_()
            pos = end

    def _restart(self) -> None:
        self._next, self._pos = 0, 0
        self._active: list[list] = []  # [end, dst view, segment, source, flat source or None]

    def __call__(self, out: torch.Tensor, start: int) -> None:
        if start < self._pos:
            self._restart()
        stop = start + out.numel()
        self._pos = stop
        self._zero_gaps(out, start, stop)
        while self._next < len(self._items) and self._items[self._next][0] < stop:
            _, end, dst, seg, source = self._items[self._next]
            self._active.append([end, dst, seg, source, None])
            self._next += 1
        keep = []
        for item in self._active:
            end, dst, seg, source, flat = item
            blocks = clip_segment(dst, seg.src, seg.shape, start, stop)
            if blocks and flat is None:
                flat = item[4] = source()
            factor = seg.factor ** self._power
            if isinstance(flat, Banded):
                _banded_copies(out, start, flat, blocks, factor)
                blocks = []
            for d, s, shape in blocks:
                strided_copy(out, View.trusted(d.offset - start, d.strides), flat, s, shape, factor)
                lo, hi = s.span(shape)
                release(flat.narrow(0, lo, hi - lo))  # read once for this buffer: drop the pages
            if end > stop:
                keep.append(item)
            elif flat is not None and not isinstance(flat, Banded):  # done: the pages at the edges of its blocks too
                lo, hi = seg.src.span(seg.shape)
                release(flat.narrow(0, lo, hi - lo))
        self._active = keep


def _banded_copies(out: torch.Tensor, start: int, flat: Banded, blocks: list, factor: float) -> None:
    """The window's copies from a banded source, each reading at most a band of it."""
    for d, s, shape in blocks:
        for dd, ss, sub in bounded(d, s, shape, flat.limit()):
            lo, hi = ss.span(sub)
            part, base = flat.span(lo, hi)
            strided_copy(out, View.trusted(dd.offset - start, dd.strides), part, View.trusted(ss.offset - base, ss.strides),
                         sub, factor)
            del part  # the band's only holder is the source's cache: dropped there before the next is made
