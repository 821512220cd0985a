"""Hints to the kernel about host memory: views that own exactly their bytes, pages of mapped
files that are done with, and fresh buffers that should be backed by huge pages; and staging
memory reused across calls (:class:`Workspace`), so that its pages are touched once.

The hints are Linux ``madvise`` calls or plain pointer arithmetic; where ``madvise`` is
unavailable they do nothing (``own_bytes`` works everywhere)."""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys

import torch

_HUGE = 2 << 20  # x86-64 and arm64 transparent huge page size
# glibc serves allocations above 32 MiB (its largest mmap threshold) with a fresh mapping, never
# with reused heap memory: only those are both untouched and worth the hint.
HUGEPAGE_MIN_BYTES = 32 << 20


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty``, with large host buffers asked to be backed by transparent huge pages
    before anything touches them. First-touching fresh memory costs one page fault per 4 KiB
    page, which on a CPU-bound host can cost several times the copy that fills the buffer; a
    huge page takes one fault per 2 MiB. Where THP is disabled, the hint does nothing."""
    t = torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * t.element_size()
    if _MADVISE is not None and t.device.type == "cpu" and nbytes >= HUGEPAGE_MIN_BYTES:
        lo = -(-t.data_ptr() // _HUGE) * _HUGE
        hi = (t.data_ptr() + nbytes) // _HUGE * _HUGE
        if hi > lo:
            _MADVISE(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
    return t


_ALIGN = 16  # staging slices start aligned for any element size (complex128 is the widest)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Workspace:
    """Staging memory kept between :func:`reshard.execute.live.transfer` calls, one buffer per device,
    grown to the largest round seen. Fresh host memory costs a page fault per page on first
    touch, which on a CPU-bound job can cost as much as the copy itself; pass one ``Workspace``
    to repeated calls (optimizer states, many checkpoints) to pay it once. ``release()`` frees
    the memory."""

    def __init__(self) -> None:
        self._bufs: dict[torch.device, torch.Tensor] = {}

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < nbytes:
            self._bufs.pop(device, None)  # drop the old buffer before the new one: lower peak
            buf = self._bufs[device] = empty(nbytes, torch.uint8, device)
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())

    def release(self) -> None:
        self._bufs.clear()


class Arena:
    """One workspace allocation cut into buffers of the given ``sizes``, each starting aligned
    for any element size (the alignment padding is never sent)."""

    def __init__(self, sizes: list[int], device: torch.device, workspace: Workspace) -> None:
        total = sum(_aligned(n) for n in sizes)
        self.buf = workspace.get(total, device) if total else None
        self.at = 0

    def take(self, n: int) -> torch.Tensor:
        out = self.buf[self.at:self.at + n]
        self.at += _aligned(n)
        return out


def own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU ``tensor`` as a tensor whose storage is exactly its own bytes, sharing
    memory (no copy).

    ``torch.save`` writes a view's whole storage, so saving one parameter's fragment of a mapped
    flat partition would write the entire partition; saving this instead writes only the
    fragment. The result keeps ``tensor`` (and so its mapping) alive."""
    if not tensor.numel():
        return tensor.clone()
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("own_bytes needs a contiguous CPU tensor")
    raw = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    raw.owner = tensor  # the address stays valid while this buffer lives
    return torch.frombuffer(raw, dtype=tensor.dtype).view(tensor.shape)


def release(tensor: torch.Tensor) -> None:
    """Tell the kernel the pages under ``tensor`` will not be read again.

    Files are memory-mapped, and pages once read count as resident memory until the kernel
    needs them back. Dropping a fragment's pages as soon as it is consumed keeps the resident
    set at about one parameter, not the whole checkpoint; reading them again is a minor fault
    from the page cache. Only whole pages inside the tensor are released, and only where they
    lie in a file-backed mapping: on anonymous memory this would discard data. A no-op where
    madvise is unavailable."""
    if _MADVISE is None or not tensor.numel():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo = -(-start // _PAGE) * _PAGE
    hi = end // _PAGE * _PAGE
    if hi > lo and _file_backed(lo, hi):
        _MADVISE(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


# This process's mappings, as last read from /proc/self/maps: (start, end, file offset, file
# path or "", (device, inode) of the file), sorted. Mappings come and go (torch maps and unmaps
# files, the allocator maps anonymous memory), so a cached entry may be stale: an answer that a
# range is file-backed is acted on (pages dropped, bytes copied from the file) only after
# checking that exactly this mapping of exactly this file is still in place.
_MAPS: list[tuple[int, int, int, str, tuple[int, int]]] = []


def _mapping(lo: int, hi: int, *, fresh: bool = False) -> tuple[int, int, int, str, tuple[int, int]] | None:
    """The mapping holding addresses ``[lo, hi)`` whole, if any. A file-backed answer is always
    checked current; an anonymous one (or none) is taken from the cached table unless ``fresh``
    asks for the table to be read again first (a file may have been mapped there since)."""
    for refresh in (False, True):
        if refresh or not _MAPS:
            _MAPS[:] = _read_maps()
        i = bisect.bisect_right(_MAPS, (lo, float("inf"))) - 1
        m = _MAPS[i] if i >= 0 and _MAPS[i][0] <= lo and hi <= _MAPS[i][1] else None
        if m is not None and m[3] and _current(m):
            return m
        if m is not None and not m[3] and (refresh or not fresh):
            return m
    return None


def _current(m: tuple[int, int, int, str, tuple[int, int]]) -> bool:
    """Whether mapping ``m`` (file-backed) is still this process's mapping of the same file."""
    try:
        st = os.stat(f"/proc/self/map_files/{m[0]:x}-{m[1]:x}")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == m[4]


def _file_backed(lo: int, hi: int) -> bool:
    # a large range the table calls anonymous is looked up afresh: a file mapped there since
    # would otherwise keep its pages resident for the rest of the run
    m = _mapping(lo, hi, fresh=hi - lo >= _FRESH_BYTES)
    return m is not None and bool(m[3])


_FRESH_BYTES = 1 << 20


def _read_maps() -> list[tuple[int, int, int, str, tuple[int, int]]]:
    out, idents = [], {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                a, b = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5].strip() if len(parts) > 5 else ""
                if path.startswith("/") and "(deleted)" not in path and path not in idents:
                    try:  # identified as the VFS sees it (the maps line's device can be an overlay's lower one)
                        st = os.stat(path)
                        idents[path] = (st.st_dev, st.st_ino)
                    except OSError:
                        idents[path] = None
                ident = idents.get(path)
                out.append((a, b, int(parts[2], 16), path if ident else "", ident or (0, 0)))
    except (OSError, ValueError, IndexError):
        return []
    return sorted(out)


_PRESENT, _SWAPPED, _FILE_PAGE = 1 << 63, 1 << 62, 1 << 61


def file_bytes(view: memoryview) -> tuple[str, int] | None:
    """``(path, offset)`` of a file holding exactly the bytes of ``view`` when they lie in a
    memory-mapped file, unmodified: inside one file-backed mapping of this process (checked
    still in place, of the same file) and no page of it written since it was mapped (a written
    private page is an anonymous copy that differs from the file: ``/proc/self/pagemap``).
    ``None`` otherwise, or off Linux. Lets a writer have the kernel copy file to file
    (``os.copy_file_range``) instead of pushing the mapped bytes through ``write``."""
    if _MADVISE is None or not len(view):
        return None
    import numpy as np

    addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    m = _mapping(addr, addr + len(view), fresh=True)
    if m is None or not m[3]:
        return None
    start, _, offset, path, ident = m
    try:
        named = os.stat(path)  # the path still names the mapped file (not one renamed over it)
        if (named.st_dev, named.st_ino) != ident:
            return None
        first, last = addr // _PAGE, (addr + len(view) - 1) // _PAGE
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            f.seek(first * 8)
            flags = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return None
    if len(flags) != last - first + 1:
        return None
    present = (flags & np.uint64(_PRESENT)) != 0
    if np.any((flags & np.uint64(_SWAPPED)) != 0) or np.any(present & ((flags & np.uint64(_FILE_PAGE)) == 0)):
        return None
    return path, offset + addr - start


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return fn
    except (OSError, AttributeError):
        return None


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADVISE = _madvise() if sys.platform.startswith("linux") else None


def _malloc_trim():
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc only (musl, macOS: absent)
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim() if sys.platform.startswith("linux") else None
_TRIMMED_AT = [0]  # the process's resident bytes right after the last trim


def resident_bytes() -> int | None:
    """The process's resident set in bytes (``/proc/self/statm``), ``None`` where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def trim_heap(above: int = 0) -> bool:
    """Hand the allocator's free heap pages back to the kernel (glibc ``malloc_trim(0)``); ``False``
    where there is no such call. Why: glibc serves a freed size of up to 32 MiB from its heap ever
    after (its mmap threshold follows the largest freed mapping), and a heap's free pages between
    live chunks stay resident; a job that makes and drops band-sized temporaries (a decoded weight,
    ``bands.Banded``) then grows by the holes, parameter after parameter (DeepSeek-V3's FP8 import:
    ~30 MiB a layer). ``malloc_trim`` releases every free whole page, not only the heap's top.

    ``above``: trim only once the resident set has grown by more than that many bytes since the last
    trim. Pages handed back are faulted in again, zero-filled, when the next band takes them: trimming
    at every band cost the 1.1B FP8 export ~13 % of its CPU time, while below the bound the next
    band of the same size reuses the hole; growth stays bounded by ``above``."""
    if _MALLOC_TRIM is None:
        return False
    if above:
        rss = resident_bytes()
        if rss is not None and rss - _TRIMMED_AT[0] <= above:
            return True
    _MALLOC_TRIM(0)
    _TRIMMED_AT[0] = resident_bytes() or 0
    return True
