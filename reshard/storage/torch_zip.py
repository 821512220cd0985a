"""Write a ``torch.save`` file while its tensor bytes are still being produced, one chunk at a time.

``torch.save`` needs the whole object in memory: every tensor's storage is handed to torch's C++ zip
writer in one piece, so writing an 828 MB module file costs about twice that in resident memory. This
module writes the same file from a *description*: each tensor is a :class:`TensorRef` placeholder
(dtype, shape, stride, offset) into a :class:`Storage` (dtype, element count), and each storage's bytes
are supplied afterwards, in record order, from a fill callback, an iterator of chunks, a tensor or a
buffer. Peak memory is the pickled metadata plus two chunks, whatever the file size.

The output is byte for byte what ``torch.save(obj, f)`` (zip serialization, pickle protocol 2,
torch 2.13's defaults) writes for the equivalent object pickled with the same pickler (reshard's
:class:`~reshard.storage.pickling.Pickler` unless another is given, so DeepSpeed's helper classes keep
their names). Real tensors may be mixed into the object; their storages are written like torch's.

What it relies on, read from torch 2.13's ``serialization._save`` and ``caffe2/serialize/
inline_container.cc`` (``PyTorchStreamWriter``) over miniz 3.0.2, and checked by saving with torch:

* **Pickle.** A tensor reduces to ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
  requires_grad, OrderedDict())`` (``_rebuild_tensor_v3(..., dtype)`` over an ``UntypedStorage`` for
  the dtypes of ``torch.storage._new_dtypes()``). The storage's persistent id is ``('storage',
  <torch.FloatStorage etc.>, key, 'cpu', numel)``; keys are ``str(n)`` in order of first appearance,
  one per distinct storage, and the records are written in that order.
* **Records**, named ``<archive>/...`` (``archive`` for a file object, the file name's stem for a
  path): ``data.pkl``, ``.format_version`` (``1``), ``.storage_alignment`` (``64``), ``byteorder``,
  ``data/<key>`` for every storage, then what the writer adds when closing (``version``, ``3\\n``) and
  ``.data/serialization_id``. All stored (no compression), DOS time and date zero, no comments.
* **Local header**: version 0, flags 0x808 (UTF-8 names, sizes in a data descriptor; 0x800 for an
  empty record, which has no descriptor), CRC and sizes zero. Its extra field is a zip64 field (only when
  the size or the header's offset is at least 0xFFFFFFFF: the size and a compressed size of *zero*, and
  the offset, as miniz writes it) followed by torch's ``FB`` field of ``Z`` bytes that puts the data
  at a multiple of 64.
* **Data descriptor** ``PK\\x07\\x08``, CRC-32, compressed and uncompressed size: 32-bit, or 64-bit
  when the local header has a zip64 field.
* **Central directory** (version 0, the same flags, exact CRC and sizes, sizes and offset clamped to
  0xFFFFFFFF with a zip64 field holding the real ones), then always a zip64 end record (made by
  0x031E, needs 0x2D) and locator, then the classic end record.
* **Serialization id**: 20 decimal digits of a hash of the record names (libstdc++'s hash over an
  ``unordered_set``, taken from torch's own writer run over empty records of the same names) and 20 of
  ``c10::hash_combine`` folded over every data descriptor's CRC -- and over bytes 4..8 of any record
  of at least 8 bytes that itself begins with the descriptor signature, which torch's writer also takes
  for a descriptor. Should torch's writer be unavailable the name part is zeros: still a valid file.

``compute_crc32`` is always on (torch's default; with it off torch writes zero CRCs). Zip64 at the
real threshold matched torch.save byte for byte on a 4 GiB + 8 byte record followed by one past 4 GiB;
``zip64_threshold`` lowers the threshold for tests (a valid zip64 file torch reads, not torch's bytes).
"""

from __future__ import annotations

import functools
import io
import os
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import torch

from ..errors import OutputError, ReshardError
from ..execute.memory import release
from . import verified
from .crc import crc32, crc32_combine
from .pickling import Pickler

__all__ = ["DEFAULT_CHUNK_BYTES", "ZIP64_THRESHOLD", "Producer", "Storage", "StorageRecord", "TensorRef",
           "TorchZipWriter", "save", "tensor"]

ZIP64_THRESHOLD = 0xFFFFFFFF  # miniz: a size or offset at least this needs zip64 fields
DEFAULT_CHUNK_BYTES = 16 << 20
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_LOCAL, _DESCRIPTOR, _CENTRAL = b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02"
_UTF8, _HAS_DESCRIPTOR = 0x800, 0x8
_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL

# A fill callback gets a 1-D tensor of the storage's dtype (zeroed) and the index of its first element.
Producer = Callable[[torch.Tensor, int], None] | Iterable[Any] | torch.Tensor | bytes | bytearray | memoryview


@functools.cache
def _v3_dtypes() -> frozenset:
    return frozenset(torch.storage._new_dtypes())


def _storage_type(dtype: torch.dtype) -> Any:
    if dtype in _v3_dtypes():
        return torch.UntypedStorage
    try:
        return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
    except KeyError:
        raise ReshardError(f"torch.save cannot store dtype {dtype}") from None


def _ints(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)  # plain ints and tuples: torch.Size would pickle differently
    if any(v < 0 for v in out):
        raise ReshardError(f"{what} must not be negative, got {out}")
    return out


class Storage:
    """``numel`` elements of ``dtype`` that one or more :class:`TensorRef` view; written as one
    ``data/<key>`` record whose bytes come from ``source`` (see :func:`save`). ``label`` names it in
    errors."""

    __slots__ = ("dtype", "numel", "source", "label")

    def __init__(self, dtype: torch.dtype, numel: int, source: Producer | None = None, *, label: str = "") -> None:
        _storage_type(dtype)
        if isinstance(numel, bool) or int(numel) != numel or numel < 0:
            raise ReshardError(f"storage {label!r}: numel must be a non-negative integer, got {numel!r}")
        self.dtype, self.numel, self.source, self.label = dtype, int(numel), source, label

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def view(self, shape: Sequence[int], *, offset: int = 0, stride: Sequence[int] | None = None,
             requires_grad: bool = False) -> TensorRef:
        """A tensor of ``shape`` over this storage, from element ``offset`` (contiguous by default)."""
        return TensorRef(self, shape, offset=offset, stride=stride, requires_grad=requires_grad)

    def __repr__(self) -> str:
        return f"Storage({self.dtype}, numel={self.numel}{f', label={self.label!r}' if self.label else ''})"


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


class TensorRef:
    """A placeholder the pickler writes exactly as torch writes a CPU tensor with this storage,
    offset, shape, stride and ``requires_grad``. The same object placed twice is one tensor, as
    with torch; two refs over one storage share it on load."""

    __slots__ = ("storage", "shape", "stride", "offset", "requires_grad")

    def __init__(self, storage: Storage, shape: Sequence[int], *, offset: int = 0,
                 stride: Sequence[int] | None = None, requires_grad: bool = False) -> None:
        self.storage = storage
        self.shape = _ints(shape, "shape")
        self.stride = _contiguous(self.shape) if stride is None else _ints(stride, "stride")
        self.offset = int(offset)
        self.requires_grad = bool(requires_grad)
        if len(self.stride) != len(self.shape) or self.offset < 0:
            raise ReshardError(f"storage {storage.label!r}: stride {self.stride} / offset {offset} do not fit "
                               f"shape {self.shape}")
        if all(self.shape):
            last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
            if last >= storage.numel:
                raise ReshardError(f"storage {storage.label!r}: a tensor of shape {self.shape}, stride "
                                   f"{self.stride} at offset {self.offset} reaches element {last}, past the "
                                   f"storage's {storage.numel}")
        grad_ok = (storage.dtype.is_floating_point or storage.dtype.is_complex) and storage.dtype not in _v3_dtypes()
        if self.requires_grad and not grad_ok:  # torch.load cannot rebuild a v3 tensor that requires grad
            raise ReshardError(f"storage {storage.label!r}: a {storage.dtype} tensor cannot require grad")

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def __reduce_ex__(self, protocol: Any) -> tuple:
        args = (self.storage, self.offset, self.shape, self.stride, self.requires_grad, OrderedDict())
        if self.storage.dtype in _v3_dtypes():
            return torch._utils._rebuild_tensor_v3, (*args, self.storage.dtype)
        return torch._utils._rebuild_tensor_v2, args


def tensor(dtype: torch.dtype, shape: Sequence[int], source: Producer | None = None, *,
           requires_grad: bool = False, label: str = "") -> TensorRef:
    """A contiguous tensor with a storage of its own (as ``torch.empty(shape)`` has)."""
    shape = _ints(shape, "shape")
    numel = 1
    for n in shape:
        numel *= n
    return Storage(dtype, numel, source, label=label).view(shape, requires_grad=requires_grad)


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)


@functools.lru_cache(maxsize=32)
def _torch_tail(names: tuple[str, ...], alignment: int) -> tuple[tuple[tuple[str, bytes], ...], str]:
    """The records torch's writer adds when closing an archive holding ``names``, and the name half
    of its serialization id, learnt by running that writer over empty records of those names."""
    buf = io.BytesIO()
    try:
        w = torch._C.PyTorchFileWriter(buf, True, alignment)
        for n in names:
            w.write_record(n, b"", 0)
        w.write_end_of_file()
        name_hash = w.serialization_id()[:20]
        with zipfile.ZipFile(buf) as z:
            tail = tuple((i.filename.split("/", 1)[1], z.read(i)) for i in z.infolist())
    except Exception:  # another torch: a valid file, its serialization id not torch's
        return (("version", b"3\n"),), "0" * 20
    return tuple((n, d) for n, d in tail if n not in names and n != ".data/serialization_id"), name_hash


def _zip64_field(*values: int) -> bytes:
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)


class StorageRecord:
    """One ``data/<key>`` record to write, ``nbytes`` long: a placeholder ``storage``, or the bytes
    (``memory``) of a real tensor's storage found in the object."""

    __slots__ = ("key", "nbytes", "storage", "memory")

    def __init__(self, key: str, nbytes: int, storage: Storage | None, memory: torch.Tensor | None) -> None:
        self.key, self.nbytes, self.storage, self.memory = key, nbytes, storage, memory

    def __repr__(self) -> str:
        label = self.storage.label if self.storage is not None else ""
        return f"storage {self.key!r}" + (f" ({label})" if label else "")


def _byte_view(data: Any) -> memoryview:
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ReshardError(f"a chunk must be a contiguous CPU tensor, got {data.device} stride {data.stride()}")
        data = data.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(data)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class TorchZipWriter:
    """The archive, written front to back to ``f`` (anything with ``write``; ``tell``/``seek`` are
    not needed). :meth:`dump` pickles the object and returns its storages in record order; then, for
    each, :meth:`begin`, any number of :meth:`write`, :meth:`end`; finally :meth:`close`.

    A wrong byte count raises :class:`OutputError` naming the storage and leaves the writer failed:
    every later call raises, nothing more is written, and the caller abandons the file."""

    def __init__(self, f: BinaryIO, *, archive_name: str = "archive", pickler: type = Pickler,
                 zip64_threshold: int = ZIP64_THRESHOLD) -> None:
        if not archive_name or "/" in archive_name:
            raise ReshardError(f"invalid archive name {archive_name!r}")
        self.f = f
        self.archive_name = archive_name
        self.pickler = pickler
        self.limit = zip64_threshold
        self.alignment = int(getattr(torch.serialization, "_get_storage_alignment", lambda: 64)())
        self.size = 0  # bytes written
        self._entries: list[bytes] = []
        self._names: list[str] = []
        self._sid_crc = 0
        self._slots: list[StorageRecord] = []
        self._next = 0
        self._current: StorageRecord | None = None
        self._local: tuple[int, bool] = (0, False)  # header offset, zip64 field present
        self._done = 0
        self._crc = 0
        self._head = b""
        self._failed: BaseException | None = None
        self._state = "new"

    # -- pickling --------------------------------------------------------------------------------

    def dump(self, obj: Any) -> list[StorageRecord]:
        """Pickle ``obj`` and write the records before the storages; return those in order."""
        self._check("new")
        keys: dict[tuple, str] = {}
        slots: dict[str, StorageRecord] = {}
        dtypes: dict[int, torch.dtype] = {}

        def persistent_id(o: Any) -> tuple | None:
            if isinstance(o, Storage):
                key = keys.setdefault(("ref", id(o)), str(len(keys)))
                slots.setdefault(key, StorageRecord(key, o.nbytes, o, None))
                v3 = o.dtype in _v3_dtypes()
                return "storage", _storage_type(o.dtype), key, "cpu", o.nbytes if v3 else o.numel
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                return self._real_storage(o, keys, slots, dtypes)
            return None

        pickler_cls = self.pickler

        class _StreamPickler(pickler_cls):  # type: ignore[valid-type,misc]
            def persistent_id(self, o: Any) -> tuple | None:
                return persistent_id(o)

        buf = io.BytesIO()
        _StreamPickler(buf, protocol=_PROTOCOL).dump(obj)
        self._slots = list(slots.values())
        self._state = "records"
        self._record("data.pkl", buf.getvalue())
        self._record(".format_version", b"1")
        self._record(".storage_alignment", str(self.alignment).encode())
        self._record("byteorder", sys.byteorder.encode())
        return list(self._slots)

    @staticmethod
    def _real_storage(o: Any, keys: dict, slots: dict, dtypes: dict) -> tuple:
        """torch's own persistent id for a real storage (``serialization._save``)."""
        if isinstance(o, torch.storage.TypedStorage):
            storage, dtype = o._untyped_storage, o.dtype
            storage_type, numel = getattr(torch, o._pickle_storage_type()), o._size()
        else:
            storage, dtype = o, torch.uint8
            storage_type, numel = torch.serialization.normalize_storage_type(type(o)), o.nbytes()
        if str(storage.device) != "meta" and storage.data_ptr() != 0:
            if dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
                raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = keys.setdefault(("real", storage._cdata), str(len(keys)))
        if key not in slots:
            cpu = storage if storage.device.type == "cpu" else storage.cpu()
            slots[key] = StorageRecord(key, storage.nbytes(), None, torch.empty(0, dtype=torch.uint8).set_(cpu))
        return "storage", storage_type, key, torch.serialization.location_tag(storage), numel

    # -- records ---------------------------------------------------------------------------------

    def begin(self) -> StorageRecord:
        """Start the next storage's record and return it."""
        self._check("records")
        if self._next >= len(self._slots):
            self._fail(OutputError(f"{self._where()}: every storage is written already"))
        slot = self._slots[self._next]
        self._next += 1
        self._header(f"data/{slot.key}", slot.nbytes)
        self._current, self._state = slot, "storage"
        return slot

    def write(self, data: Any, source: torch.Tensor | None = None) -> None:
        """Append bytes (a buffer or a contiguous CPU tensor; ``source``: the tensor a buffer views)."""
        slot = self._open_slot()
        view = _byte_view(data)
        if self._done + len(view) > slot.nbytes:
            self._fail(OutputError(f"{self._where()}: {slot!r} takes {slot.nbytes} bytes, "
                                   f"{self._done + len(view)} were supplied"))
        if len(self._head) < 8:
            self._head += view[: 8 - len(self._head)].tobytes()
        self._crc = verified.extend(self._crc, view, data if isinstance(data, torch.Tensor) else source)
        self._emit(view)
        self._done += len(view)

    def put(self, nbytes: int, crc: int, head: bytes) -> None:
        """Account for the current storage's next ``nbytes``, written at their place by someone
        else (``zip_stripes``): ``crc`` is their CRC-32, ``head`` their first 8 bytes when they
        start the storage. The sink's ``skip(nbytes, crc)`` moves past them."""
        slot = self._open_slot()
        if self._done + nbytes > slot.nbytes:
            self._fail(OutputError(f"{self._where()}: {slot!r} takes {slot.nbytes} bytes, "
                                   f"{self._done + nbytes} were supplied"))
        if len(self._head) < 8:
            self._head += head[: 8 - len(self._head)]
        self._crc = crc32_combine(self._crc, crc, nbytes)
        try:
            self.f.skip(nbytes, crc)
        except BaseException as e:
            self._failed = e
            raise
        self.size += nbytes
        self._done += nbytes

    def end(self) -> None:
        """Finish the current storage: refuse a short one, write its data descriptor."""
        slot = self._open_slot()
        if self._done != slot.nbytes:
            self._fail(OutputError(f"{self._where()}: {slot!r} takes {slot.nbytes} bytes, only {self._done} "
                                   "were supplied"))
        self._finish_record()
        self._current, self._state = None, "records"

    def close(self) -> None:
        """Write the closing records and the central directory; flush ``f`` (not close it)."""
        self._check("records")
        if self._next != len(self._slots):
            missing = ", ".join(repr(s) for s in self._slots[self._next:][:3])
            self._fail(OutputError(f"{self._where()}: closed before {missing} was written"))
        tail, name_hash = _torch_tail(tuple(self._names), self.alignment)
        for name, data in tail:
            self._record(name, data)
        self._record(".data/serialization_id", f"{name_hash}{self._sid_crc:020d}".encode())
        cd_ofs, cd = self.size, b"".join(self._entries)
        self._emit(cd)
        n, eocd64 = len(self._entries), self.size
        self._emit(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), cd_ofs)
                   + struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64, 1)
                   + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                 min(len(cd), _U32), min(cd_ofs, _U32), 0))
        if hasattr(self.f, "flush"):
            self.f.flush()
        self._state = "closed"

    def _record(self, name: str, data: bytes) -> None:
        self._header(name, len(data))
        self._head = data[:8]
        self._crc = crc32(data)
        self._emit(data)
        self._done = len(data)
        self._finish_record()

    def _header(self, name: str, size: int) -> None:
        full = f"{self.archive_name}/{name}".encode()
        ofs = self.size
        big_size, big_ofs = size >= self.limit, ofs >= self.limit
        zip64 = b""
        if big_size or big_ofs:  # miniz's local zip64 field: the size, a compressed size of 0, the offset
            zip64 = _zip64_field(*((size, 0) if big_size else ()), *((ofs,) if big_ofs else ()))
        pad = -(ofs + 30 + len(full) + len(zip64) + 4) % self.alignment  # torch's getPadding
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = _UTF8 | (_HAS_DESCRIPTOR if size else 0)
        self._emit(struct.pack("<4sHHHHHIIIHH", _LOCAL, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra))
                   + full + extra)
        self._names.append(name)
        self._local = (ofs, bool(zip64))
        self._crc, self._done, self._head = 0, 0, b""

    def _finish_record(self) -> None:
        ofs, zip64 = self._local
        size, crc, name = self._done, self._crc, self._names[-1]
        if size:
            if size >= 8 and self._head[:4] == _DESCRIPTOR:  # torch's writer mistakes such data for a descriptor
                self._sid_crc = _hash_combine(self._sid_crc, int.from_bytes(self._head[4:8], "little"))
            fmt = "<4sIQQ" if zip64 else "<4sIII"
            self._emit(struct.pack(fmt, _DESCRIPTOR, crc, size, size))
            self._sid_crc = _hash_combine(self._sid_crc, crc)
        big_size, big_ofs = size >= self.limit, ofs >= self.limit
        extra = b""
        if big_size or big_ofs:
            extra = _zip64_field(*((size, size) if big_size else ()), *((ofs,) if big_ofs else ()))
        full = f"{self.archive_name}/{name}".encode()
        flags = _UTF8 | (_HAS_DESCRIPTOR if size else 0)
        clamp = (lambda v: _U32 if v >= self.limit else v)
        self._entries.append(struct.pack("<4sHHHHHHIIIHHHHHII", _CENTRAL, 0, 0, flags, 0, 0, 0, crc, clamp(size),
                                         clamp(size), len(full), len(extra), 0, 0, 0, 0, clamp(ofs)) + full + extra)

    def _emit(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        done = 0
        try:
            while done < len(view):  # a raw file may take less than it is given
                n = self.f.write(view[done:] if done else view)
                if n == 0:
                    raise OSError(f"{self._where()}: the file took no bytes")
                done = len(view) if n is None else done + n
        except BaseException as e:
            self._failed = e
            raise
        self.size += len(view)

    def _where(self) -> str:
        name = getattr(self.f, "name", None) or getattr(getattr(self.f, "raw", None), "name", None)
        return str(name or self.archive_name)

    def _check(self, state: str) -> None:
        if self._failed is not None:
            raise OutputError(f"{self._where()}: the torch zip writer failed earlier ({self._failed}); abandon "
                              "the file") from None
        if self._state != state:
            raise OutputError(f"{self._where()}: torch zip writer used out of order (in state {self._state!r}, "
                              f"expected {state!r})")

    def _open_slot(self) -> StorageRecord:
        """The storage being written (the state is "storage" exactly while one is open)."""
        self._check("storage")
        if self._current is None:
            raise OutputError(f"{self._where()}: torch zip writer in state 'storage' with no storage open")
        return self._current

    def _fail(self, error: OutputError) -> None:
        self._failed = error
        raise error


def _archive_name(path: str) -> str:
    """The record prefix torch's writer derives from a path: the file name without its extension
    (``archive`` when the name is not ASCII: torch then writes through a Python file object)."""
    try:
        path.encode("ascii")
    except UnicodeEncodeError:
        return "archive"
    base = path.replace("\\", "/").rsplit("/", 1)[-1]
    stem = base.rsplit(".", 1)[0] if "." in base else base
    if not stem:
        raise ReshardError(f"{path}: invalid file name for a torch archive")
    return stem


def _stream(w: TorchZipWriter, slot: StorageRecord, chunk_bytes: int, buffers: list[torch.Tensor]) -> None:
    if slot.memory is not None:  # already in memory: one write, read-only as torch's (a sink may defer its CRC)
        w.write(_byte_view(slot.memory).toreadonly(), slot.memory)
        return
    storage = slot.storage  # a record is its memory or its storage: without either, no source of bytes
    src = None if storage is None else storage.source
    if src is None:
        w._fail(OutputError(f"{w._where()}: {slot!r} has no source of bytes"))
    elif callable(src):
        for chunk, mapped in filled(storage, src, 0, storage.numel, chunk_bytes,
                                    lambda i, nbytes: _buffer(buffers, i % 2, nbytes)):
            w.write(chunk)
            if mapped is not None:
                release(mapped)
    elif isinstance(src, torch.Tensor) or _is_buffer(src):
        view = _byte_view(src)
        for off in range(0, len(view), chunk_bytes):
            w.write(view[off:off + chunk_bytes])
    else:
        for chunk in src:
            w.write(chunk)


def filled(storage: Storage, fill: Callable, start: int, stop: int, chunk_bytes: int,
           buffer: Callable[[int, int], torch.Tensor]) -> Iterator[tuple[Any, torch.Tensor | None]]:
    """Elements ``start .. stop`` of ``storage`` from its fill callable, in order, as chunks of
    at most ``chunk_bytes``: ``(bytes, None)`` for a window filled into ``buffer(i, nbytes)``
    (the ``i``-th window), ``(tensor, tensor)`` for a slice of a source's own memory that
    ``fill.direct`` hands over (to release once written). A chunk is written before the next
    is asked for."""
    size = storage.itemsize
    per = max(1, chunk_bytes // size)
    direct = getattr(fill, "direct", None)
    for i, at in enumerate(range(start, stop, per)):
        count = min(per, stop - at)
        pieces = direct(at, count, storage.dtype) if direct is not None else None
        if pieces is not None:  # the source's own memory, written as it lies
            for piece in pieces:
                yield (bytes(piece * size), None) if isinstance(piece, int) else (piece, piece)
            continue
        raw = buffer(i, count * size)
        if not getattr(fill, "zeroes_gaps", False):
            raw.zero_()
        fill(raw.view(storage.dtype), at)
        yield raw, None


def _buffer(buffers: list[torch.Tensor], i: int, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of buffer ``i`` of two used in turn: a sink may read the bytes of a
    write only at the next write (reshard's staging writer defers checksumming large writes)."""
    while len(buffers) <= i:
        buffers.append(torch.empty(0, dtype=torch.uint8))
    if buffers[i].numel() < nbytes:
        buffers[i] = torch.empty(nbytes, dtype=torch.uint8)
    return buffers[i][:nbytes]


def _is_buffer(obj: Any) -> bool:
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def save(obj: Any, f: str | os.PathLike | BinaryIO, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         pickler: type = Pickler) -> int:
    """``torch.save(obj, f)`` where ``obj`` may hold :class:`TensorRef` placeholders; returns the
    bytes written. Each placeholder storage's ``source`` is read once, in record order:

    * a callable ``fill(out, start)``: called for consecutive windows of at most ``chunk_bytes``;
      ``out`` is a zeroed 1-D tensor of the storage's dtype to fill with elements ``start`` onward
      (uninitialised when the callable has ``zeroes_gaps = True``: it then writes every element).
      A callable with ``direct(start, count, dtype)`` may instead return a window as pieces written
      in order (tensors, and ints counting zero elements), or ``None`` to be called with a buffer
      (a mapped piece's pages are released once written). The writer alternates two such buffers
      (peak memory: two chunks);
    * a tensor (contiguous, CPU) or a buffer holding all the bytes: written in ``chunk_bytes`` slices;
    * any other iterable of chunks (buffers or contiguous CPU tensors) of any sizes; a chunk must not
      change until the one after the next is asked for (a sink may read a write late).

    Wrong byte counts raise :class:`OutputError` naming the storage; the file is then incomplete (a
    path is left as it is, for the caller to remove, like ``torch.save``)."""
    if chunk_bytes < 1:
        raise ReshardError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        with open(path, "wb") as fh:
            return _save(obj, fh, _archive_name(str(path)), chunk_bytes, pickler)
    return _save(obj, f, "archive", chunk_bytes, pickler)


def _save(obj: Any, f: BinaryIO, archive_name: str, chunk_bytes: int, pickler: type) -> int:
    w = TorchZipWriter(f, archive_name=archive_name, pickler=pickler)
    buffers: list[torch.Tensor] = []
    for _ in w.dump(obj):
        slot = w.begin()
        try:
            _stream(w, slot, chunk_bytes, buffers)
        except BaseException as e:  # a source that failed: nothing more is written
            if w._failed is None:
                w._failed = e
            raise
        w.end()
    w.close()
    return w.size

