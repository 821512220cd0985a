"""A file copied verbatim into an output is checked while its checksum is taken: a manifest vouches
only for what was checked.

``Staging.copy`` already reads every byte of the source once, for the manifest's checksum. For a
``torch.save`` archive (``*.pt``, ``*.pth``, ``*.bin``: checked by content) :func:`digest` makes
that one pass check it as well: the structure first (``storage.zip_index``), then each record's
bytes against its own CRC-32 as they go by, the per-record CRCs combined into the file's
(``crc.crc32_combine``), so the file is read once and CRC'd once; and ``data.pkl`` is scanned for
what it would import (``storage.pickle_scan``), since nothing unpickles a copied file. Other files
are checked for what they claim to be: JSON parses, a ``.pt``/``.pth``/``.bin`` is an archive.

Nothing here imports torch (the command's early copies run before it loads)."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .crc import Crc32, crc32, crc32_combine
from .pickle_scan import globals_in, policy_for, refused
from .zip_index import is_zip, read_index

__all__ = ["ARCHIVE_SUFFIXES", "digest"]

ARCHIVE_SUFFIXES = (".pt", ".pth", ".bin")  # names whose zip content is read as a torch.save archive
_CLAIMED = (".pt", ".pth")  # names that claim one (a .bin may be anything, but Trainer's: pickle_scan)
JSON_LIMIT = 256 << 20  # JSON files larger than this are copied without parsing (none of a checkpoint's are)
_PIECE = 16 << 20


def digest(fd: int, size: int, hasher: Any, src: Path, *, verify: bool = True) -> str:
    """The checksum (``hasher``: a ``Crc32`` or a ``hashlib`` object) of the file open as ``fd``,
    of ``size`` bytes, and with ``verify`` the file checked on the way (module doc)."""
    if not size:
        if verify and (_claims_archive(src.name) or src.name.endswith(".json")):
            raise CheckpointError(f"{src}: empty (0 bytes), not {'JSON' if src.name.endswith('.json') else 'a torch.save archive'}")
        return hasher.hexdigest()
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
        if hasattr(m, "madvise"):
            m.madvise(mmap.MADV_SEQUENTIAL)
        view = memoryview(m)
        try:
            if verify and is_zip(view[:4]) and src.name.endswith(ARCHIVE_SUFFIXES):
                _archive(view, m, size, hasher, src)
            else:
                if verify:
                    _plain(view, size, src)
                _bytes(view, m, 0, size, hasher)
        finally:
            view.release()
    return hasher.hexdigest()


def _bytes(view: memoryview, m: mmap.mmap, lo: int, hi: int, hasher: Any) -> int:
    """Feed bytes ``lo .. hi`` to ``hasher``; return their own CRC-32 (as they go by)."""
    crc = 0
    combines = isinstance(hasher, Crc32)
    for at in range(lo, hi, _PIECE):
        end = min(hi, at + _PIECE)
        piece = view[at:end]
        c = crc32(piece)
        crc = crc32_combine(crc, c, end - at)
        if combines:
            hasher.extend(c, end - at)
        else:
            hasher.update(piece)
        _release(m, at, end)
    return crc


def _release(m: mmap.mmap, lo: int, hi: int) -> None:
    """Mapped pages count as resident once read: let them go."""
    if hasattr(m, "madvise"):
        a, b = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE
        if b > a:
            m.madvise(mmap.MADV_DONTNEED, a, b - a)


def _archive(view: memoryview, m: mmap.mmap, size: int, hasher: Any, src: Path) -> None:
    index = read_index(lambda at, n: bytes(view[at:at + n]), size, str(src))
    pkl = index.record("data.pkl", str(src))
    found = globals_in(bytes(view[pkl.start:pkl.start + pkl.size]), f"{src}: {index.prefix}data.pkl")
    policy = policy_for(src.name)
    bad = refused(found, policy)
    if bad:
        raise CheckpointError(f"{src}: its pickle would import {', '.join(bad[:3])}, which a {policy} file of a "
                              "checkpoint never holds (loading it could run code)")
    at = 0
    for rec in index.in_order():
        _bytes(view, m, at, rec.start, hasher)  # headers and padding: in the file's checksum only
        got = _bytes(view, m, rec.start, rec.start + rec.size, hasher)
        if got != rec.crc:
            raise CheckpointError(f"{src}: record {index.prefix}{rec.name} fails the archive's CRC-32 check (recorded "
                                  f"{rec.crc:08x}, read {got:08x}): the file is corrupt")
        at = rec.start + rec.size
    _bytes(view, m, at, size, hasher)


def _plain(view: memoryview, size: int, src: Path) -> None:
    """A file that is not an archive: what its name claims it to be."""
    name = src.name
    if _claims_archive(name):
        raise CheckpointError(f"{src}: not a torch.save archive (no zip header): truncated, emptied or another "
                              "kind of file")
    if name.endswith(".json") and size <= JSON_LIMIT:
        try:
            json.loads(bytes(view).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{src}: not valid JSON ({e}): truncated or corrupt") from None


def _claims_archive(name: str) -> bool:
    return name.endswith(_CLAIMED) or policy_for(name) == "trainer"


def regular(src: Path, fd: int) -> int:
    """The size of ``src`` (open as ``fd``), which must be a regular file: a folder, a device or
    a pipe is refused (a copy of ``/dev/zero`` would never end)."""
    st = os.fstat(fd)
    import stat

    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{src}: not a regular file (a folder, a device or a pipe)")
    return st.st_size
