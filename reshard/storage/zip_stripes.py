"""One ``torch.save`` archive written in stripes, by several threads or processes at once.

Where every byte of a streamed archive lies (``torch_zip``) follows from the object's metadata
alone: the records' names and sizes fix every header and offset. Only the data descriptors, the
central directory and the serialization id depend on the storages' bytes, through their CRC-32s.
So an archive's storage bytes are cut into ``n`` stripes, each written at its place in the file
(``os.pwrite``, or ``copy_file_range`` for bytes of a mapped source file) by whichever thread or
process takes it, each stripe reporting its CRCs; then one writer, given every stripe's CRCs
(combined, ``crc.crc32_combine``), writes the headers, descriptors and directory around them.
The file is byte for byte what ``torch_zip.save`` writes front to back.

Stripes are cut at page boundaries of the file, so no two writers share a page (file systems that
cache whole pages on each client stay correct), and at whole elements of each storage. A storage
whose bytes only come in order (an iterator of chunks) goes whole into one stripe.

Writers: every process that writes a stripe builds the same object (``build()`` of the job) and
:class:`Archive` of it; :meth:`Archive.write_stripe` writes one stripe and returns its
:class:`Written` spans; :meth:`Archive.finish` takes every stripe's spans, in any order.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import OutputError
from ..execute.memory import release
from . import verified
from .crc import Crc32, crc32_combine
from .pickling import Pickler
from .staging import Staging, copy_mapped, new_checksum, start_writeback
from .torch_zip import (
    DEFAULT_CHUNK_BYTES,
    ZIP64_THRESHOLD,
    StorageRecord,
    TorchZipWriter,
    _byte_view,
    _is_buffer,
    filled,
)

__all__ = ["STRIPE_BYTES", "Archive", "Written", "stripe_count"]

STRIPE_BYTES = 64 << 20  # small enough to balance a few files over a few writers, large per call
PAGE = 4096  # stripes start at multiples of this in the file


def stripe_count(nbytes: int, stripe_bytes: int = STRIPE_BYTES) -> int:
    """How many stripes an archive of about ``nbytes`` is cut into."""
    return max(1, -(-nbytes // stripe_bytes))


@dataclass(frozen=True, slots=True)
class Written:
    """Bytes ``start .. start + nbytes`` of storage ``slot`` (in record order), written; ``crc``
    is their CRC-32 and ``head`` the storage's first 8 bytes when ``start`` is 0."""

    slot: int
    start: int
    nbytes: int
    crc: int
    head: bytes


class _Null:
    """A sink that only counts: lays the archive out."""

    def write(self, data: Any) -> int:
        return len(memoryview(data))

    def skip(self, nbytes: int, crc: int) -> None:
        pass


class _Placed:
    """A sink writing from the start of file ``fd`` at explicit offsets, skipping the spans
    the stripes wrote, and checksumming the whole file in order (when ``hasher`` combines)."""

    def __init__(self, fd: int, hasher: Any) -> None:
        self.fd, self.pos, self.hash = fd, 0, hasher

    def write(self, data: Any) -> int:
        view = memoryview(data)
        _pwrite(self.fd, view, self.pos)
        if self.hash is not None:
            self.hash.update(view)
        self.pos += len(view)
        return len(view)

    def skip(self, nbytes: int, crc: int) -> None:
        if self.hash is not None:
            self.hash.extend(crc, nbytes)
        self.pos += nbytes


def _pwrite(fd: int, view: memoryview, at: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], at + done)
        if n == 0:
            raise OSError(f"the file took no bytes at offset {at + done}")
        done += n


_LOCAL = threading.local()  # one window buffer per thread, reused across stripes


def _window(nbytes: int) -> torch.Tensor:
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _LOCAL.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes]


class Archive:
    """``obj`` (holding ``torch_zip`` placeholders) laid out as file ``rel`` of ``staging``,
    its storage bytes cut into ``stripes`` stripes starting at multiples of ``align`` in the file
    (``zip64_threshold`` and ``chunk_bytes`` as for ``torch_zip``)."""

    def __init__(self, staging: Staging, rel: str, obj: Any, stripes: int, *, pickler: type = Pickler,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, zip64_threshold: int = ZIP64_THRESHOLD,
                 align: int = PAGE) -> None:
        self.staging, self.rel, self.obj, self.pickler = staging, rel, obj, pickler
        self.limit, self.align = zip64_threshold, align
        self.archive_name = "archive"  # what torch_zip.save names records written to a file object
        self.chunk_bytes = chunk_bytes
        w = TorchZipWriter(_Null(), archive_name=self.archive_name, pickler=pickler, zip64_threshold=self.limit)
        self.slots: list[StorageRecord] = w.dump(obj)
        self.offsets: list[int] = []  # each storage's first byte in the file
        for slot in self.slots:
            w.begin()
            self.offsets.append(w.size)
            w.put(slot.nbytes, 0, b"")
            w.end()
        w.close()
        self.size = w.size
        self.cuts = self._cuts(max(1, stripes))

    # -- cutting ---------------------------------------------------------------------------------

    def _cuts(self, stripes: int) -> list[list[int]]:
        """For each storage, its ``stripes + 1`` cut points (bytes into the storage): stripe ``i``
        writes ``cuts[k][i] .. cuts[k][i + 1]`` of storage ``k``. The storages' bytes, end to
        end, are cut into equal shares, each cut moved back to a page of the file (``align``)
        and a whole element."""
        total = sum(s.nbytes for s in self.slots)
        bounds = [total * i // stripes for i in range(stripes + 1)]
        cuts, base = [], 0
        for slot, ofs in zip(self.slots, self.offsets):
            item = _item(slot)
            unit = math.lcm(self.align, item) if item else 0
            row = []
            for b in bounds:
                x = min(max(b - base, 0), slot.nbytes)
                if 0 < x < slot.nbytes:  # data starts element-aligned: a unit of the file is whole elements
                    x = max(0, x - (ofs + x) % unit) if unit else 0
                row.append(x)
            cuts.append(row)
            base += slot.nbytes
        return cuts

    @property
    def stripes(self) -> int:
        return len(self.cuts[0]) - 1 if self.cuts else 1

    def stripe_bytes(self, i: int) -> int:
        return sum(row[i + 1] - row[i] for row in self.cuts)

    # -- writing ---------------------------------------------------------------------------------

    def write_stripe(self, i: int) -> list[Written]:
        """Write stripe ``i`` into the file (created if it is not there yet; never truncated, as
        other writers fill other stripes) and return what it wrote."""
        out: list[Written] = []
        if not self.stripe_bytes(i):
            return out
        with self.staging.writing(self.rel):
            fd = os.open(self.staging.path(self.rel), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                lo, hi = None, 0
                for k, row in enumerate(self.cuts):
                    a, b = row[i], row[i + 1]
                    if b > a:
                        out.append(self._write_span(fd, k, a, b))
                        lo = self.offsets[k] + a if lo is None else lo
                        hi = self.offsets[k] + b
                if lo is not None:
                    start_writeback(self.staging.tmp / self.rel, lo, hi - lo)
            finally:
                os.close(fd)
        return out

    def _write_span(self, fd: int, k: int, a: int, b: int) -> Written:
        slot, at = self.slots[k], self.offsets[k] + a
        crc, head = 0, b""
        for view, keep in self._pieces(slot, a, b):
            if len(head) < 8 and a == 0:
                head += bytes(view[: 8 - len(head)])
            crc = verified.extend(crc, view, keep)  # a mapped source's bytes: their CRC checks it too
            done = copy_mapped(view, fd, at) if len(view) >= (1 << 20) else 0
            if done < len(view):
                _pwrite(fd, view[done:], at + done)
            at += len(view)
            if keep is not None:
                release(keep)
        return Written(k, a, b - a, crc, head)

    def _pieces(self, slot: StorageRecord, a: int, b: int):
        """Bytes ``a .. b`` of ``slot`` as ``(buffer, mapped tensor to release or None)``, in order."""
        storage = slot.storage
        src = slot.memory if slot.memory is not None else storage.source if storage is not None else None
        if src is None:
            raise OutputError(f"{self.staging.path(self.rel)}: {slot!r} has no source of bytes")
        if callable(src):
            size = storage.itemsize
            fill = src.fresh() if hasattr(src, "fresh") else src  # a sweep of this stripe's own
            for chunk, mapped in filled(storage, fill, a // size, b // size, self.chunk_bytes,
                                        lambda i, nbytes: _window(nbytes)):
                yield _byte_view(chunk), mapped
        elif isinstance(src, torch.Tensor) or _is_buffer(src):
            view = _byte_view(src)
            flat = src.detach().reshape(-1).view(torch.uint8) if isinstance(src, torch.Tensor) else None
            for off in range(a, b, self.chunk_bytes):
                end = min(b, off + self.chunk_bytes)
                yield view[off:end], None if flat is None else flat[off:end]  # a tensor's bytes: offered, released
        else:  # an iterator of chunks: only ever whole (see _item)
            for chunk in src:
                yield _byte_view(chunk), None

    # -- finishing -------------------------------------------------------------------------------

    def finish(self, written: list[Written]) -> None:
        """Write everything but the storages, given every stripe's spans; record the file's digest
        (when the checksum is CRC-32; otherwise the commit reads the file)."""
        by_slot: list[list[Written]] = [[] for _ in self.slots]
        for w in written:
            by_slot[w.slot].append(w)
        with self.staging.writing(self.rel):
            fd = os.open(self.staging.path(self.rel), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                hasher = new_checksum(self.staging.checksum)
                sink = _Placed(fd, hasher if isinstance(hasher, Crc32) else None)
                w = TorchZipWriter(sink, archive_name=self.archive_name, pickler=self.pickler, zip64_threshold=self.limit)
                for slot, spans in zip(w.dump(self.obj), by_slot):
                    w.begin()
                    crc, head = self._combined(slot, spans)
                    w.put(slot.nbytes, crc, head)
                    w.end()
                w.close()
                os.ftruncate(fd, self.size)  # the file is exactly the archive
                start_writeback(self.staging.tmp / self.rel)
            finally:
                os.close(fd)
        if sink.hash is not None:
            self.staging.record(self.rel, self.size, sink.hash.hexdigest())

    def _combined(self, slot: StorageRecord, spans: list[Written]) -> tuple[int, bytes]:
        crc, at, head = 0, 0, b""
        for w in sorted(spans, key=lambda w: w.start):
            if w.start != at:
                fault = "written twice" if w.start < at else "not written"
                raise OutputError(f"{self.staging.path(self.rel)}: {slot!r}: bytes from {min(at, w.start)} on were "
                                  f"{fault} by its stripes")
            crc, at = crc32_combine(crc, w.crc, w.nbytes), at + w.nbytes
            head = head or w.head
        if at != slot.nbytes:
            raise OutputError(f"{self.staging.path(self.rel)}: {slot!r}: bytes from {at} on were not written by its "
                              f"stripes ({slot.nbytes} in all)")
        return crc, head


def _item(slot: StorageRecord) -> int:
    """The unit a storage's bytes may be cut at: its element size (a byte for a real tensor's
    storage), or 0 when they only come in order, whole."""
    if slot.memory is not None:
        return 1
    storage = slot.storage
    if storage is None:  # a record is its memory or its storage: one of the two is set
        raise OutputError(f"{slot!r} has neither bytes in memory nor a storage")
    src = storage.source
    if callable(src):
        return storage.itemsize if hasattr(src, "fresh") else 0
    return storage.itemsize if isinstance(src, torch.Tensor) or _is_buffer(src) else 0
