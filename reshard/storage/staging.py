"""Output folders that are never half-written: build in a hidden sibling, checksum, rename.

A conversion writes into ``OUT/.reshard-partial-<tag>``; only when every file is written does a
manifest of checksums go in and the folder get renamed to ``OUT/<tag>``. A killed run leaves only
the hidden folder, which the next run removes. ``verify`` re-checks a finished folder."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import queue
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CheckpointError, OutputError, ReshardError
from .copy_check import digest as checked_digest
from .copy_check import regular
from .crc import Crc32

MANIFEST = "reshard-manifest.json"


CHECKSUMS = ("crc32", "sha256")


def new_checksum(name: str):
    if name not in CHECKSUMS:
        raise ReshardError(f"checksum must be one of {list(CHECKSUMS)}, got {name!r}")
    return Crc32() if name == "crc32" else hashlib.sha256()


LATEST_NAMES = ("latest", "latest_universal")  # what a commit may write beside the tag folder


_RELATIONS = ("replace", "be written inside", "replace a folder that contains")


def _relation(written: Path, source: Path) -> str | None:
    """How an output path would destroy a source path (both resolved), or ``None`` if it would not."""
    if written == source:
        return "replace"
    if source in written.parents:
        return "be written inside"
    if written in source.parents:
        return "replace a folder that contains"
    return None


def refuse_overwriting_sources(written: Iterable[str | Path], sources: Iterable[str | Path]) -> None:
    """Refuse an output any of whose ``written`` paths is, lies inside or contains one of the
    ``sources`` a job reads (compared after resolving symbolic links), before anything is
    written: with ``--overwrite`` such an output would delete the checkpoint it is made from."""
    resolved = [(Path(s), Path(s).resolve()) for s in sources]
    clashes = [(how, w, s) for w in written for s, rs in resolved
               if (how := _relation(Path(w).resolve(), rs)) is not None]
    if clashes:  # the plainest one: 'replace' before 'inside' before 'contains'
        how, w, s = min(clashes, key=lambda c: _RELATIONS.index(c[0]))
        raise OutputError(f"{w}: the output would {how} the source {s} it is read from; choose an OUT_DIR outside "
                          "the source")


@dataclass(frozen=True, slots=True)
class ArchiveJob:
    """An output ``torch.save`` archive (``rel`` in the staging folder, about ``size`` bytes)
    written in stripes (``storage.zip_stripes``) that processes and their workers share as if each
    were a job of its own, so one large file no longer sets the pace. ``build()`` returns the
    object to save (with ``torch_zip`` placeholders); it runs after the job's planning, once in
    every process that writes a stripe of the archive or finishes it."""

    rel: str
    size: int
    build: Callable[[], Any]


class Staging:
    """The hidden folder an output is built in. ``sources``: every path the job reads from, which
    no output path may be, lie inside or contain (:func:`refuse_overwriting_sources`). ``join``:
    another process of the same job created it (``reshard.jobs.cluster``); use it as it is."""

    def __init__(self, out_dir: str | Path, tag: str, *, sources: Iterable[str | Path], overwrite: bool = False,
                 checksum: str = "crc32", join: bool = False, verify_source: bool = True) -> None:
        new_checksum(checksum)  # refuse a bad name before touching the disk
        self.checksum = checksum
        self.verify_source = verify_source  # check the files copied verbatim (storage.copy_check)
        self.out_dir = Path(out_dir)
        self.tag = tag
        self.final = self.out_dir / tag
        self.tmp = self.out_dir / f".reshard-partial-{tag}"
        refuse_overwriting_sources([self.final, self.tmp, *(self.out_dir / n for n in LATEST_NAMES)], sources)
        self.overwrite = overwrite
        self.digests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        if join:
            if not self.tmp.is_dir():
                raise OutputError(f"{self.tmp}: the job's staging folder is not visible from this process; every "
                                  "process must see the output folder at the same path (a shared file system)")
            return
        if self.final.exists() and not overwrite:
            raise CheckpointError(f"{self.final}: already exists (pass --overwrite, or overwrite=True from Python, "
                                  "to replace it)")
        try:
            # abandon() removes what this job made again (the output folder and parents it had to make), if left empty
            self.made_dirs = [d for d in (self.out_dir, *self.out_dir.parents) if not d.exists()]
            self.made_out_dir = bool(self.made_dirs)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if self.tmp.exists():  # left by a run that was killed
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
        except OSError as e:
            raise OutputError(f"{self.tmp}: cannot create the output folder ({e.strerror or e})") from None

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[BinaryIO]:
        """A file to write that checksums its bytes on the way out, so the manifest costs no
        second read. A failed write raises :class:`OutputError` naming the file and the reason
        (torch's writer would otherwise report it as an unrelated zip position error)."""
        with self.writing(rel):
            f = _HashingWriter(open(self.path(rel), "wb", buffering=0), new_checksum(self.checksum))
            try:
                yield f
                f.flush()
            except RuntimeError:
                if f.error is None:
                    raise
                raise f.error from None
            finally:
                f.raw.close()
        start_writeback(self.tmp / rel)
        self.record(rel, f.size, f.hash.hexdigest())

    def record(self, rel: str, size: int, digest: str) -> None:
        """The size and checksum of finished file ``rel``, for the manifest."""
        with self._lock:
            self.digests[rel] = {"size": size, self.checksum: digest}

    def forget(self, rel: str) -> None:
        """Drop the recorded checksum of ``rel``: the file is about to be written again."""
        with self._lock:
            self.digests.pop(rel, None)

    @contextlib.contextmanager
    def writing(self, rel: str) -> Iterator[None]:
        """Turn an OS error while writing ``rel`` (by any writer) into :class:`OutputError`."""
        try:
            yield
        except OSError as e:
            raise OutputError(f"{self.tmp / rel}: cannot write the output ({e.strerror or e}); "
                              "nothing was committed") from None

    def copy(self, src: Path, rel: str) -> None:
        """A verbatim copy of ``src``: in the kernel where it can (``copy_file_range``, no trip
        through user memory), checksummed from a read-only mapping of the source, which is checked
        on the way (``storage.copy_check``: an archive's structure, every record's CRC-32 and what
        its pickle imports; JSON that it parses) unless the job does not verify its source."""
        try:
            fin = open(src, "rb")
        except OSError as e:  # a folder where a file should be, a broken link, no permission
            raise CheckpointError(f"{src}: cannot be read ({e.strerror or e}); not copied") from None
        with fin:
            try:
                size = regular(src, fin.fileno())
                digest = checked_digest(fin.fileno(), size, new_checksum(self.checksum), src, verify=self.verify_source)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; not copied into the output") from None
            with self.writing(rel), open(self.path(rel), "wb") as fout:
                done = _kernel_copy(fin.fileno(), fout.fileno(), size)
                fin.seek(done)  # what the kernel could not copy (another file system): through user memory
                shutil.copyfileobj(fin, fout, 1 << 24)
                if fout.tell() != size:
                    raise CheckpointError(f"{src}: changed size while being copied")
        start_writeback(self.tmp / rel)
        self.record(rel, size, digest)

    made_out_dir = False

    def abandon(self) -> None:
        """Remove the staging folder, and the output folder this job made for it if nothing else
        is in it: a failed job leaves nothing behind."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        for d in getattr(self, "made_dirs", ()):  # innermost first
            try:
                d.rmdir()
            except OSError:  # not empty: someone else's files
                break

    def commit(self, meta: dict[str, Any], latest_name: str | None) -> Path:
        """Checksum, make durable, rename into place. Every file is fsynced before the rename, so
        even a power loss cannot leave a finished-looking folder with missing data."""
        with self.writing(MANIFEST):
            return self._commit(meta, latest_name)

    def _commit(self, meta: dict[str, Any], latest_name: str | None) -> Path:
        _WRITEBACK.drain()  # the hints name paths inside the folder about to be renamed
        files = {}
        for p in sorted(self.tmp.rglob("*")):
            if p.is_file():
                rel = p.relative_to(self.tmp).as_posix()
                known = self.digests.get(rel)
                if known is None:  # written by path(): checksum it now
                    known = {"size": p.stat().st_size, self.checksum: _checksum(p, self.checksum)}
                _fsync(p)  # cheap by now: writeback started when the file was closed
                files[rel] = known
        doc = dict(meta, files=files)
        (self.tmp / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        _fsync(self.tmp / MANIFEST)
        if self.final.exists():
            old = self.out_dir / f".reshard-old-{self.tag}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.final, old)
            shutil.rmtree(old)
        os.replace(self.tmp, self.final)
        if latest_name:
            _atomic_write(self.out_dir / latest_name, self.tag)
        return self.final


class Prefixed:
    """A staging folder seen from one of its sub-folders: every ``rel`` a writer gives is
    ``prefix/rel`` in the folder (a DeepSpeed tag folder inside a Trainer checkpoint)."""

    def __init__(self, staging: Staging, prefix: str) -> None:
        self.staging, self.prefix = staging, prefix.rstrip("/") + "/"
        self.checksum, self.tmp = staging.checksum, staging.tmp

    def path(self, rel: str) -> Path:
        return self.staging.path(self.prefix + rel)

    def open(self, rel: str):
        return self.staging.open(self.prefix + rel)

    def writing(self, rel: str):
        return self.staging.writing(self.prefix + rel)

    def copy(self, src: Path, rel: str) -> None:
        self.staging.copy(src, self.prefix + rel)

    @property
    def verify_source(self) -> bool:
        return self.staging.verify_source

    def record(self, rel: str, size: int, digest: str) -> None:
        self.staging.record(self.prefix + rel, size, digest)

    def forget(self, rel: str) -> None:
        self.staging.forget(self.prefix + rel)

def _checksum(p: Path, name: str) -> str:
    h = new_checksum(name)
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_file(p: Path, algo: str, want: dict[str, Any]) -> None:
    """``p`` against its manifest entry, and as an archive (``storage.copy_check``): a file that
    differs from the manifest is named as such first; one that matches it but is a corrupt
    archive was committed so (a copy made with --no-verify-source)."""
    try:
        with open(p, "rb") as f:
            size = regular(p, f.fileno())
            try:
                got, fault = checked_digest(f.fileno(), size, new_checksum(algo), p), None
            except CheckpointError as e:
                got, fault = checked_digest(f.fileno(), size, new_checksum(algo), p, verify=False), e
    except OSError as e:
        raise CheckpointError(f"{p}: cannot be read ({e.strerror or e})") from None
    if size != want["size"] or got != want[algo]:
        raise CheckpointError(f"{p}: content differs from the manifest's {algo} checksum")
    if fault is not None:
        raise CheckpointError(f"{fault} (it matches the manifest: it was committed so, copied without verification)")


def _fsync(p: Path) -> None:
    with open(p, "rb") as f:
        os.fsync(f.fileno())


def _hint_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes ``offset .. offset + nbytes`` (0: to the end) of
    ``fd`` back now, so the fsync at commit finds little left to wait for. Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` does just that; elsewhere POSIX_FADV_DONTNEED does
    it too on Linux-like kernels, at the extra cost of dropping the pages from the cache."""
    if _SYNC_FILE_RANGE is not None:
        if _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
            return
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


class _Writeback:
    """Starts the writeback of finished byte ranges from a thread of its own.

    ``sync_file_range`` submits the I/O before it returns, and waits while the device's request
    queue is full: called by the workers themselves, it held them for 0.7 s of a 2 s convert
    while they had CPU work left. Workers now hand a range over and go on. The thread opens the
    file by path (never a descriptor a worker is about to close); a file removed or renamed in
    the meantime is skipped, since the hint only saves time: commit's fsync makes every byte
    durable either way."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._pid = -1  # the thread's process; a forked child starts its own

    def submit(self, path: str, offset: int, nbytes: int) -> None:
        with self._idle:
            if self._pid != os.getpid():
                self._pid, self._pending, self._queue = os.getpid(), 0, queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._queue,), name="reshard-writeback", daemon=True).start()
            self._pending += 1
        self._queue.put((path, offset, nbytes))

    def drain(self) -> None:
        """Return once every range handed over so far has been submitted (or skipped)."""
        with self._idle:
            if self._pid == os.getpid():
                self._idle.wait_for(lambda: self._pending == 0)

    def _run(self, q: queue.SimpleQueue) -> None:
        while True:
            path, offset, nbytes = q.get()
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                pass
            else:
                try:
                    _hint_writeback(fd, offset, nbytes)
                finally:
                    os.close(fd)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


_WRITEBACK = _Writeback()


def start_writeback(path: str | Path, offset: int = 0, nbytes: int = 0) -> None:
    """Have bytes ``offset .. offset + nbytes`` (0: to the end) of finished file ``path`` start
    going to disk now, asynchronously, without waiting for the device (:class:`_Writeback`)."""
    _WRITEBACK.submit(os.fspath(path), offset, nbytes)


def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE = _sync_file_range()


_DEFER = 1 << 20  # records at least this large take their CRC from torch's data descriptor
_DIRECT = 1 << 20  # writes at least this large from a mapped file go file to file


class _HashingWriter:
    """Writes through to ``raw`` and checksums what it writes.

    torch's zip writer follows every record with a data descriptor holding the record's CRC-32
    and size. With a CRC-32 checksum, a large write is therefore not read a second time: when
    the next write is a descriptor of exactly its size, the record's CRC is combined into the
    file's (``crc.crc32_combine``); otherwise it is read as usual. ``verify`` recomputes every
    byte, so a descriptor that disagreed with the data would still be caught.

    Only a read-only buffer is held back that way (torch's writer hands over read-only views of
    the tensor it saves, unchanged until the save ends); a writable one is checksummed at once,
    so a caller may refill its buffer as soon as ``write`` returns (``torch_zip`` does)."""

    def __init__(self, raw: BinaryIO, hasher) -> None:
        self.raw = raw
        self.hash = hasher
        self.size = 0
        self.error: OSError | None = None
        self.pending: memoryview | None = None  # written, not yet checksummed
        self.combines = isinstance(hasher, Crc32)

    def write(self, data) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        try:
            done = copy_mapped(view, self.raw.fileno()) if len(view) >= _DIRECT else 0
            while done < len(view):  # an unbuffered write may be short: finish it
                done += self.raw.write(view[done:])
        except OSError as e:
            self.error = e  # torch's zip writer turns this into a RuntimeError of its own
            raise
        self._account(view)
        self.size += len(view)
        return len(view)

    def _account(self, view: memoryview) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            crc = _descriptor_crc(view, len(pending))
            if crc is None:
                self.hash.update(pending)
            else:
                self.hash.extend(crc, len(pending))
        if self.combines and len(view) >= _DEFER and view.readonly:
            self.pending = view
        else:
            self.hash.update(view)

    def flush(self) -> None:
        if self.pending is not None:
            self.hash.update(self.pending)
            self.pending = None
        self.raw.flush()


_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}


def _kernel_copy(src: int, dst: int, size: int, offset: int = 0, at: int | None = None) -> int:
    """Bytes ``offset .. offset + size`` of file ``src`` copied by the kernel to ``dst`` (at its
    position, or at offset ``at``) with ``copy_file_range``: how many it copied, fewer where it
    cannot (two file systems that do not share it, no such call) and the caller copies the rest."""
    done = 0
    if not hasattr(os, "copy_file_range"):
        return 0
    try:
        while done < size:
            n = os.copy_file_range(src, dst, min(size - done, 1 << 30), offset + done, None if at is None else at + done)
            if n == 0:
                break
            done += n
    except OSError as e:
        if e.errno not in _NO_KERNEL_COPY:
            raise
    return done


def copy_mapped(view: memoryview, dst: int, at: int | None = None) -> int:
    """Bytes of ``view`` copied by the kernel to file ``dst`` (at its position, or at offset
    ``at``) from the file they are mapped from, if they are (``memory.file_bytes``):
    ``copy_file_range`` moves them page cache to page cache, where ``write`` from the mapping
    pays a user-space copy and its page faults. 0 when not mapped or the kernel cannot (another
    file system, no such call): then the caller writes them all."""
    from ..execute.memory import (
        file_bytes,  # loads torch: not at import (``reshard.jobs.early_copies`` runs before it)
    )

    where = file_bytes(view)
    if where is None:
        return 0
    path, offset = where
    src = os.open(path, os.O_RDONLY)
    try:
        return _kernel_copy(src, dst, len(view), offset, at)
    finally:
        os.close(src)


def _descriptor_crc(view: memoryview, size: int) -> int | None:
    """The CRC-32 in a zip data descriptor (``PK\\x07\\x08``, CRC, sizes; 32- or 64-bit sizes)
    for a record of ``size`` bytes, or ``None`` if ``view`` is not one."""
    if len(view) not in (16, 24) or view[:4] != b"PK\x07\x08":
        return None
    usize = view[12:16] if len(view) == 16 else view[16:24]
    if int.from_bytes(usize, "little") != size:
        return None
    return int.from_bytes(view[4:8], "little")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def manifest_folder(folder: str | Path) -> Path | None:
    """The output tag folder ``folder`` is (it holds the manifest) or holds (its one tag folder
    with a manifest); None for anything else (a source checkpoint)."""
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        return folder
    tags = [p for p in folder.iterdir() if (p / MANIFEST).is_file()] if folder.is_dir() else []
    return tags[0] if len(tags) == 1 else None


def verify(folder: str | Path) -> dict[str, Any]:
    """Re-check every file against the manifest, and every ``torch.save`` archive in it as a copy
    is checked (structure, each record's CRC-32, what its pickle imports: ``storage.copy_check``,
    in the same pass); raise CheckpointError naming the first fault."""
    found = manifest_folder(folder)
    if found is None:
        raise CheckpointError(f"{folder}: no {MANIFEST} (not a finished reshard output)")
    folder = found
    try:
        doc = json.loads((folder / MANIFEST).read_text())
        files = doc["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder / MANIFEST}: unreadable manifest ({e})") from None
    for rel, want in files.items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: listed in the manifest but missing")
        algo = next((a for a in CHECKSUMS if a in want), None) if isinstance(want, dict) else None
        if algo is None or "size" not in want:
            raise CheckpointError(f"{folder / MANIFEST}: entry for {rel!r} has no size or known checksum "
                                  f"({list(CHECKSUMS)})")
        _check_file(p, algo, want)
    extra = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != MANIFEST and p.relative_to(folder).as_posix() not in files)
    if extra:
        raise CheckpointError(f"{folder}: files not in the manifest: {extra[:5]}")
    return doc
