"""Verified reads: every byte reshard reads from a ``torch.save`` record is checked against the
record's CRC-32 before anything made from it is committed.

Source files are memory-mapped once (:class:`MappedFile`) and their records registered here by
address, so that a tensor anywhere in a mapping names its file and record. A record is checked
once, the first time its bytes are needed:

* small records (``data.pkl``, a ``step``, a bias; at most :data:`EAGER_BYTES`) when the file is
  opened: cheap, and they are read outside the engine;
* a large one when the engine reads a fragment of it (:func:`touch` marks it needed), by the
  CRC-32s the output writers compute anyway (*fused*): a writer that copies a run of mapped
  source bytes as they lie (``torch_zip``, ``zip_stripes``) takes the run's CRC once, combines it
  into the output record's and offers it here (:func:`offer`); once a record's offered runs cover
  it, it is checked without another read. What the runs leave (bytes a window fill computed
  from, padding) is read and checked by :func:`finish`, which the engine calls before it commits.

A mismatch is a :class:`CheckpointError` naming the file, the record and the tensor (its place
in the file's object and, where the engine read it, the parameter, state and rank); the job then
commits nothing. :func:`verifying` turns the checks off for a job (``--no-verify-source``);
archive structure is checked regardless (:mod:`reshard.storage.zip_index`), since a record read
from the wrong offset is never a matter of cost.

Nothing here imports torch: tensors are only asked their ``data_ptr``."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .crc import crc32, crc32_combine
from .zip_index import ZipIndex

__all__ = ["EAGER_BYTES", "Bytes", "MappedFile", "enabled", "ensure", "finish", "offer", "touch", "verifying"]

EAGER_BYTES = 1 << 20  # records at most this large are checked when their file is opened
_PIECE = 16 << 20  # a gap is read in pieces of this size, its pages released after each


class _Switch:
    def __init__(self) -> None:
        self.on = True
        self.lock = threading.Lock()


_SWITCH = _Switch()


def enabled() -> bool:
    """Whether source reads are verified now (the default)."""
    return _SWITCH.on


@contextlib.contextmanager
def verifying(on: bool) -> Iterator[None]:
    """Source CRC checks on or off for the ``with`` block (a job's ``verify_source``)."""
    with _SWITCH.lock:
        before, _SWITCH.on = _SWITCH.on, bool(on)
    try:
        yield
    finally:
        _SWITCH.on = before


class Bytes(bytearray):
    """A file's bytes read whole, which the registry can hold weakly, as it holds a mapping."""

    __slots__ = ("__weakref__",)


_UNREAD, _NEEDED, _GOOD = 0, 1, 2


@dataclass(eq=False)
class _Check:
    """One record of a mapped file: where its bytes are (absolute file offsets), what they are
    (``label``: its tensor's place in the object), and what is known of them."""

    file: MappedFile
    record: str  # the record's name in the archive (data/3)
    start: int
    size: int
    crc: int
    label: str = ""
    state: int = _UNREAD
    what: str = ""  # who read it first (parameter, state, rank), for the message
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # offered (start, size, crc), disjoint, sorted
    covered: int = 0
    error: CheckpointError | None = None

    def describe(self) -> str:
        tensor = f" ({self.label})" if self.label else ""
        read = f", read for {self.what}" if self.what else ""
        return f"{self.file.path}: record {self.record}{tensor}{read}"


class MappedFile:
    """A source file mapped once, its torch archives' records registered for checking. ``data``
    is the mapping (or the bytes, for a file read whole); the registry holds it weakly, so a
    mapping lives exactly as long as the tensors over it."""

    def __init__(self, path: Path, data: Any) -> None:
        self.path = path
        self.size = len(data)
        self._data = weakref.ref(data)
        self.lock = threading.Lock()
        self._checks: list[_Check] = []
        self._starts: list[int] = []
        self.addr = _address(data)
        if self.size:
            _register(self, data)

    def data(self) -> Any:
        return self._data()

    def add(self, base: int, index: ZipIndex, labels: dict[str, str] | None = None) -> dict[str, _Check]:
        """Register the records of the archive at file offset ``base`` (none is checked yet:
        :func:`check_small`, :func:`touch`). Returns the checks by record name."""
        out = {}
        with self.lock:
            for rec in index.in_order():
                check = _Check(self, f"{index.prefix}{rec.name}", base + rec.start, rec.size, rec.crc,
                               (labels or {}).get(rec.name, ""))
                i = bisect.bisect_left(self._starts, check.start)
                if i < len(self._starts) and self._starts[i] == check.start:
                    out[rec.name] = self._checks[i]  # registered already (a DCP archive parsed twice)
                    continue
                self._starts.insert(i, check.start)
                self._checks.insert(i, check)
                out[rec.name] = check
        return out

    def label(self, start: int, label: str) -> None:
        """Name the tensor whose storage is the record starting at file offset ``start``."""
        check = self._at(start)
        if check is not None and not check.label:
            check.label = label

    def _at(self, offset: int) -> _Check | None:
        with self.lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            if i >= 0:
                c = self._checks[i]
                if c.start <= offset < c.start + max(c.size, 1):
                    return c
        return None

    def overlapping(self, lo: int, hi: int) -> list[_Check]:
        with self.lock:
            i = max(0, bisect.bisect_right(self._starts, lo) - 1)
            out = []
            while i < len(self._checks) and self._checks[i].start < hi:
                c = self._checks[i]
                if c.start + c.size > lo:
                    out.append(c)
                i += 1
            return out

    def read(self, start: int, size: int) -> Iterator[memoryview]:
        """Bytes ``start .. start + size`` of the file, in pieces: from the mapping while it
        lives (its pages released after each piece), else from the file itself."""
        data = self.data()
        if data is None:
            with open(self.path, "rb") as f:
                f.seek(start)
                left = size
                while left:
                    piece = f.read(min(left, _PIECE))
                    if not piece:
                        raise CheckpointError(f"{self.path}: changed while being read (shorter than before)")
                    left -= len(piece)
                    yield memoryview(piece)
            return
        view = memoryview(data)
        try:
            for at in range(start, start + size, _PIECE):
                end = min(start + size, at + _PIECE)
                yield view[at:end]
                _drop(data, at, end)
        finally:
            view.release()


def _address(data: Any) -> int:
    if not len(data):
        return 0
    if isinstance(data, (bytes, memoryview)):
        import numpy as np  # a read-only buffer: ctypes cannot take its address

        return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)
    anchor = ctypes.c_char.from_buffer(data)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _drop(data: Any, lo: int, hi: int) -> None:
    """Let the pages of ``data[lo:hi]`` go (a mapping's; read once, they count as resident)."""
    if isinstance(data, mmap.mmap) and hasattr(data, "madvise"):
        a, b = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE
        if b > a:
            with contextlib.suppress(OSError, ValueError):
                data.madvise(mmap.MADV_DONTNEED, a, b - a)


# -- the registry: mappings by address ------------------------------------------------------------

_LOCK = threading.Lock()
_LOWS: list[int] = []
_FILES: list[tuple[int, int, MappedFile]] = []
_PENDING: dict[int, _Check] = {}  # needed, not yet checked (by id): finish() checks them


def _register(f: MappedFile, data: Any) -> None:
    lo, hi = f.addr, f.addr + f.size

    def gone(_ref: Any, lo: int = lo, f: MappedFile = f) -> None:
        with _LOCK:
            i = bisect.bisect_left(_LOWS, lo)
            while i < len(_FILES) and _FILES[i][0] == lo:
                if _FILES[i][2] is f:
                    del _FILES[i], _LOWS[i]
                    break
                i += 1

    f._ref = weakref.ref(data, gone)  # type: ignore[attr-defined]
    with _LOCK:
        i = bisect.bisect_left(_LOWS, lo)
        _LOWS.insert(i, lo)
        _FILES.insert(i, (lo, hi, f))


def _lookup(addr: int, nbytes: int) -> tuple[MappedFile, int] | None:
    with _LOCK:
        i = bisect.bisect_right(_LOWS, addr) - 1
        if i < 0:
            return None
        lo, hi, f = _FILES[i]
    if lo <= addr and addr + nbytes <= hi:
        return f, addr - lo
    return None


def _span(t: Any) -> tuple[int, int]:
    """(first address, bytes) a tensor's elements reach."""
    n = t.numel()
    if not n:
        return t.data_ptr(), 0
    reach = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s)
    return t.data_ptr(), reach * t.element_size()


# -- checks ---------------------------------------------------------------------------------------


def touch(t: Any, what: str = "") -> None:
    """The bytes of tensor ``t`` are being read: the records they lie in are checked before the
    job commits (:func:`finish`), by offered runs or a read of their own. A record already found
    corrupt raises here."""
    if not _SWITCH.on:
        return
    for check in _checks_of(t):
        _need(check, what)


def ensure(t: Any, what: str = "") -> None:
    """As :func:`touch`, and check them now (a read outside the engine's fills)."""
    if not _SWITCH.on:
        return
    for check in _checks_of(t):
        _need(check, what)
        if check.state != _GOOD:
            _verify(check)


def _checks_of(t: Any) -> list[_Check]:
    addr, nbytes = _span(t)
    found = _lookup(addr, nbytes) if nbytes else None
    if found is None:
        return []
    f, off = found
    return f.overlapping(off, off + nbytes)


def _need(check: _Check, what: str) -> None:
    if check.error is not None:
        raise check.error
    if check.state == _UNREAD:
        with check.file.lock:
            if check.state == _UNREAD:
                check.state, check.what = _NEEDED, what
                with _LOCK:
                    _PENDING[id(check)] = check


def offer(t: Any, crc: int) -> None:
    """``crc`` is the CRC-32 of the bytes of contiguous tensor ``t``, which a writer has just
    copied as they lie: where they are mapped source bytes, they count towards their record's
    check; a record they complete is checked now, without reading it again."""
    if not _SWITCH.on:
        return
    addr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    found = _lookup(addr, nbytes) if nbytes else None
    if found is None:
        return
    f, off = found
    checks = f.overlapping(off, off + nbytes)
    if len(checks) != 1 or checks[0].start > off or off + nbytes > checks[0].start + checks[0].size:
        return  # not within one record (never for a view of one storage): its bytes are checked as read
    check = checks[0]
    _need(check, "")
    complete = False
    with f.lock:
        if check.state == _GOOD:
            return
        starts = [r[0] for r in check.runs]
        i = bisect.bisect_left(starts, off)
        if (i and check.runs[i - 1][0] + check.runs[i - 1][1] > off) or (i < len(starts) and starts[i] < off + nbytes):
            return  # read twice: the first reading counts
        check.runs.insert(i, (off, nbytes, crc))
        check.covered += nbytes
        complete = check.covered == check.size
    if complete:
        _verify(check)


def extend(running: int, view: Any, source: Any = None) -> int:
    """``crc32(view, running)``, for a writer that copies ``view`` into an output record. When
    ``source`` (the tensor ``view`` is the bytes of) lies in a mapped source record, the view's
    own CRC is taken and offered to that record's check (:func:`offer`), then combined: one
    pass over the bytes serves both the output's CRC and the source's check."""
    if source is None or not _SWITCH.on or not _FILES:
        return crc32(view, running)
    addr = source.data_ptr()
    if _lookup(addr, 1) is None:
        return crc32(view, running)
    own = crc32(view)
    offer(source, own)
    return crc32_combine(running, own, len(view))


def finish() -> None:
    """Check every record read since the last call and not yet checked; raise the first
    mismatch (a :class:`CheckpointError`). The engine calls it before it commits."""
    with _LOCK:
        pending = list(_PENDING.values())
    first: CheckpointError | None = None
    for check in sorted(pending, key=lambda c: (str(c.file.path), c.start)):
        try:
            if check.state != _GOOD:
                _verify(check)
        except CheckpointError as e:
            first = first or e
    if first is not None:
        raise first


def forget_pending() -> None:
    """Forget what earlier jobs marked as read and left unchecked (a job that failed midway):
    each job checks what it reads."""
    with _LOCK:
        _PENDING.clear()


def _verify(check: _Check) -> None:
    """The record's CRC-32, from its offered runs and a read of what they leave; a mismatch
    marks it (later reads raise at once) and raises."""
    if check.error is not None:
        raise check.error
    with check.file.lock:
        runs = list(check.runs)
    crc, at, end = 0, check.start, check.start + check.size
    for r_start, r_size, r_crc in runs + [(end, 0, 0)]:
        if r_start > at:
            for piece in check.file.read(at, r_start - at):
                crc = crc32_combine(crc, crc32(piece), len(piece))
        if r_size:
            crc = crc32_combine(crc, r_crc, r_size)
        at = r_start + r_size
    with check.file.lock:
        if crc == check.crc:
            check.state = _GOOD
            check.runs = []
        else:
            check.error = CheckpointError(
                f"{check.describe()}: its bytes fail the archive's CRC-32 check (recorded {check.crc:08x}, read "
                f"{crc:08x}): the file is corrupt")
    with _LOCK:
        _PENDING.pop(id(check), None)
    if check.error is not None:
        raise check.error


def check_records(checks: Iterable[_Check], *, small_only: bool = False) -> None:
    """Check records now: those of at most :data:`EAGER_BYTES` (``small_only``: what a file's
    opening checks), or all of them (a file read whole, ``reshard verify SRC``). Nothing when
    checks are off."""
    if not _SWITCH.on:
        return
    for check in checks:
        if check.state != _GOOD and (not small_only or check.size <= EAGER_BYTES):
            _verify(check)


def check_one(check: _Check) -> None:
    """Check one record now, whatever the switch says (``data.pkl`` before it is unpickled is
    checked only when checks are on: the caller asks)."""
    if check.state != _GOOD:
        _verify(check)


def status() -> dict[str, int]:
    """How many records are pending and how many mappings are registered (for tests)."""
    with _LOCK:
        return {"pending": len(_PENDING), "files": len(_FILES)}

