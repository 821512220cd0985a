"""A DCP chunk's bytes: the ``torch.save`` archive DCP embeds for each chunk in a ``.distcp`` file
(at the offset and length ``.metadata`` gives), read as a view of the mapped file and checked.

The archive's structure is checked inside its window of the file (``storage.zip_index``: its
headers agree, its records lie inside the window), its records are registered for checking
(``storage.verified``): ``data.pkl`` is checked against its CRC-32 before it is unpickled, by an
unpickler that admits only tensor records; the storage record must hold exactly the bytes the
pickle says, and is checked when its bytes are read (small ones at once)."""

from __future__ import annotations

import collections
import io
import mmap
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointError
from ...storage import verified
from ...storage.safe_load import unpickle_with
from ...storage.zip_index import read_index

__all__ = ["read_record"]


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    nbytes_or_numel: int
    untyped: bool


@dataclass(frozen=True, slots=True)
class _TensorRecord:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


# the legacy typed-storage names torch.save writes for each dtype (``_rebuild_tensor_v2`` records)
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


def _rebuild_v2(storage: _StorageRef, offset: int, size: Any, stride: Any, *_: Any) -> _TensorRecord:
    return _TensorRecord(storage, int(offset), tuple(int(x) for x in size), tuple(int(x) for x in stride), storage.dtype)


def _rebuild_v3(storage: _StorageRef, offset: int, size: Any, stride: Any, _grad: Any, _hooks: Any,
                dtype: torch.dtype, *_: Any) -> _TensorRecord:
    return _TensorRecord(storage, int(offset), tuple(int(x) for x in size), tuple(int(x) for x in stride), dtype)


class _RecordUnpickler(pickle.Unpickler):
    """The ``data.pkl`` of a one-tensor ``torch.save`` archive, admitting only tensor records."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return ("typed", _STORAGE_DTYPES[name])
        if module in ("torch", "torch.storage") and name == "UntypedStorage":  # torch.save: the latter (FP8)
            return ("untyped", torch.uint8)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.where}: refuses to unpickle {module}.{name} in a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        try:
            _, (kind, dtype), key, _, n = pid
        except (TypeError, ValueError):
            raise CheckpointError(f"{self.where}: malformed storage reference {pid!r:.120}") from None
        return _StorageRef(str(key), dtype, int(n), kind == "untyped")


def _safetensors_file(data: mmap.mmap | bytes) -> bool:
    """Whether a file starts as safetensors does: a little-endian header length, then JSON."""
    if len(data) < 9:
        return False
    n = int.from_bytes(data[:8], "little")
    return 0 < n <= len(data) - 8 and data[8:9] == b"{"


def read_record(data: mmap.mmap | bytes, mapped: verified.MappedFile, offset: int, length: int,
                where: str) -> torch.Tensor:
    """The tensor of the ``torch.save`` archive at bytes ``offset .. offset + length`` of the mapped
    file ``data`` (registered as ``mapped``), as a view of the mapping."""
    end = offset + length

    def read(at: int, n: int) -> bytes:
        return bytes(data[offset + at:min(offset + at + n, end)])

    try:
        index = read_index(read, length, where)
    except CheckpointError as e:
        if _safetensors_file(data):
            raise CheckpointError(f"{where}: the file is a safetensors file (DCP's serialization_format="
                                  "SAFETENSORS, read by Hugging Face storage readers), which reshard does not read; "
                                  "save with the default TORCH_SAVE format") from None
        raise CheckpointError(f"{where}: not a torch.save record ({str(e).removeprefix(where + ': ')})") from None
    checks = mapped.add(offset, index)
    pkl = index.record("data.pkl", where)
    if verified.enabled():  # a corrupt pickle is refused by its CRC before anything unpickles it
        verified.check_one(checks["data.pkl"])
    rec = _unpickle(read(pkl.start, pkl.size), where)
    store = index.records.get(f"data/{rec.storage.key}")
    if store is None:
        raise CheckpointError(f"{where}: storage {rec.storage.key!r} is missing")
    itemsize = torch.empty((), dtype=rec.dtype).element_size()
    want = rec.storage.nbytes_or_numel * (1 if rec.storage.untyped else itemsize)
    if store.size != want or store.size % itemsize:
        raise CheckpointError(f"{where}: storage {rec.storage.key!r} holds {store.size} bytes, its record says {want}")
    verified.check_records([checks[f"data/{rec.storage.key}"]], small_only=True)
    # torch's archives align storages within the archive, but DCP packs archives end to end, so the
    # bytes may sit at any file offset: frombuffer takes a byte offset and needs no alignment
    flat = torch.frombuffer(data, dtype=rec.dtype, count=store.size // itemsize, offset=offset + store.start) \
        if store.size else torch.empty(0, dtype=rec.dtype)
    try:
        return flat.as_strided(rec.size, rec.stride, rec.offset)
    except RuntimeError as e:
        raise CheckpointError(f"{where}: tensor {list(rec.size)} does not fit its storage ({e})") from None


def _unpickle(pkl: bytes, where: str) -> _TensorRecord:
    rec = unpickle_with(_RecordUnpickler(io.BytesIO(pkl), where), where, "tensor record")
    if not isinstance(rec, _TensorRecord):
        raise CheckpointError(f"{where}: holds a {type(rec).__name__}, not a tensor")
    return rec
