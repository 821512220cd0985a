"""Load DeepSpeed's ``.pt`` files without executing anything they contain, and without reading a
byte they hold unchecked.

``torch.load(weights_only=True)`` refuses every class it does not know. DeepSpeed pickles three
small helper classes into its checkpoints; each is mapped here to an inert stand-in that only
stores the fields it is given. The stand-ins carry DeepSpeed's module and class names, so a file
reshard writes back refers to DeepSpeed's real classes and DeepSpeed loads it unchanged. Anything
else is refused with an error naming the file and the class.

The archive itself is read here, not by torch's zip reader: its structure is checked first
(``storage.zip_index``: no record is mapped from an offset the headers disagree on), the file is
mapped once and its records registered for checking (``storage.verified``), ``data.pkl`` is
checked against its CRC-32 before it is unpickled (by torch's weights-only unpickler), every
storage must be exactly its record's bytes, and small records are checked at once; large ones
are checked when the engine reads them. ``load(path, mmap=False)`` reads the file whole and
checks every record.
"""

from __future__ import annotations

import enum
import io
import mmap as _mmap
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import _weights_only_unpickler

from ..errors import CheckpointError
from . import verified
from .zip_index import ZipIndex, read_index


def _named(module: str, name: str):
    def deco(cls):
        cls.__module__ = module
        cls.__qualname__ = name
        cls.__name__ = name
        return cls

    return deco


@_named("deepspeed.utils.tensor_fragment", "fragment_address")
@dataclass
class FragmentAddress:
    """Where one parameter's fragment sits in a flat ZeRO partition."""

    numel: int
    start: int


@_named("deepspeed.runtime.zero.config", "ZeroStageEnum")
class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@_named("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
class LossScaler:
    """The static loss scaler's fields, kept as data."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


@_named("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
class DynamicLossScaler(LossScaler):
    pass


@_named("deepspeed.checkpoint.universal_checkpoint", "SubparamShape")
@dataclass
class SubparamShape:
    """Sub-parameter layout metadata of legacy universal-checkpoint info."""

    patterns: list
    shape: tuple
    partition_dim: int


STAND_INS = [FragmentAddress, ZeroStageEnum, LossScaler, DynamicLossScaler, SubparamShape]


def _class_named_in(error: Exception) -> str:
    text = str(error)
    for marker in ("GLOBAL ", "Unsupported global: GLOBAL "):
        if marker in text:
            return text.split(marker, 1)[1].split()[0]
    return text.splitlines()[0] if text else type(error).__name__


@dataclass(frozen=True)
class AllowList:
    """The globals an unpickler admits beside torch's weights-only set, and their name in a
    refusal."""

    globals: tuple[Any, ...]
    name: str


DEEPSPEED = AllowList(tuple(STAND_INS), "inert DeepSpeed helper classes")


def load(path: str | Path, *, mmap: bool = True, allow: AllowList = DEEPSPEED) -> Any:
    """Load a checkpoint file safely. With ``mmap`` (the default), tensors stay on disk until
    read, so only the bytes actually used are paged in; their records are checked as they are
    read (module doc). Without it the file is read whole and every record checked now.
    ``allow``: the globals admitted (a format's stand-ins; DeepSpeed's by default)."""
    path = Path(path)
    if not path.is_file():
        kind = "missing" if not path.exists() and not path.is_symlink() else "not a regular file"
        raise CheckpointError(f"{path}: file is {kind}")
    try:
        data = _read(path, mmap)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    return load_archive(path, data, whole=not mmap, allow=allow)


def load_bytes(data: bytes | bytearray | memoryview, where: str | Path, *, allow: AllowList = DEEPSPEED) -> Any:
    """A ``torch.save`` archive held in memory (a DCP entry), loaded and checked as a file is."""
    return load_archive(Path(str(where)), verified.Bytes(data), whole=True, allow=allow)


def _read(path: Path, mapped: bool) -> Any:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not mapped or not size:
            return verified.Bytes(f.read())
        # a private mapping: pages come in as read, and nothing can write back to the file
        return _mmap.mmap(f.fileno(), size, access=_mmap.ACCESS_COPY)


def load_archive(path: Path, data: Any, *, whole: bool, allow: AllowList = DEEPSPEED) -> Any:
    """The object of the archive ``data`` (a mapping of file ``path``, or its bytes)."""
    where = str(path)
    try:
        index = read_index(lambda at, n: bytes(data[at:at + n]), len(data), where)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: cannot be read as a torch checkpoint; truncated or corrupt "
                              f"({str(e).removeprefix(where + ': ')})") from None
    mapped = verified.MappedFile(path, data)
    checks = mapped.add(0, index)
    pkl = index.record("data.pkl", where)
    if verified.enabled():  # a corrupt pickle is refused by its CRC before anything unpickles it
        verified.check_one(checks["data.pkl"])
    _byteorder(index, data, where)
    obj = _unpickle(index, data, mapped, where, bytes(data[pkl.start:pkl.start + pkl.size]), allow)
    _label(obj, mapped)
    verified.check_records(checks.values(), small_only=not whole)
    return obj


def _byteorder(index: ZipIndex, data: Any, where: str) -> None:
    rec = index.records.get("byteorder")
    if rec is not None and bytes(data[rec.start:rec.start + rec.size]) != sys.byteorder.encode():
        raise CheckpointError(f"{where}: written on a {bytes(data[rec.start:rec.start + 16])!r}-endian machine; "
                              "reshard reads little-endian archives only")


def _unpickle(index: ZipIndex, data: Any, mapped: verified.MappedFile, where: str, pkl: bytes,
              allow: AllowList = DEEPSPEED) -> Any:
    """``data.pkl`` through torch's weights-only unpickler with the stand-ins allowed; every
    storage a view of exactly its record's bytes."""
    whole = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if len(data) else None
    storages: dict[str, Any] = {}

    def persistent_load(pid: Any) -> Any:
        try:
            kind, storage_type, key, _location, numel = pid
            key = key.decode("ascii") if isinstance(key, bytes) else str(key)
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            nbytes = int(numel) * torch._utils._element_size(dtype)
        except (TypeError, ValueError, AttributeError, UnicodeDecodeError):
            raise CheckpointError(f"{where}: malformed storage reference {pid!r:.120} in data.pkl") from None
        if key in storages:
            return storages[key]
        rec = index.record(f"data/{key}", where)
        if nbytes != rec.size:
            raise CheckpointError(f"{where}: data.pkl gives storage {key} {nbytes} bytes ({numel} x {dtype}), its "
                                  f"record {index.prefix}data/{key} holds {rec.size}: corrupt")
        raw = whole[rec.start:rec.start + rec.size] if rec.size else torch.UntypedStorage(0)
        storages[key] = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
        return storages[key]

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pkl), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    try:
        with torch.serialization.safe_globals(list(allow.globals)):
            return unpickler.load()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e) or "GLOBAL" in str(e):
            raise CheckpointError(
                f"{where}: refuses to unpickle {_class_named_in(e)}, which is not on reshard's allow-list "
                f"of {allow.name} (loading it could run code)"
            ) from None
        raise CheckpointError(f"{where}: corrupt pickle ({_first_line(e)})") from None
    except Exception as e:  # noqa: BLE001 -- a corrupt pickle fails inside torch's unpickler in many ways
        raise CheckpointError(f"{where}: corrupt pickle in data.pkl ({type(e).__name__}: {_first_line(e)})") from None


def unpickle_with(unpickler: pickle.Unpickler, where: str | Path, what: str) -> Any:
    """``unpickler.load()`` for an unpickler that admits only what its ``find_class`` allows (DCP
    metadata and chunk records): a corrupt pickle raises almost anything, and all of it becomes a
    :class:`CheckpointError` naming ``where`` and ``what`` it was meant to be."""
    try:
        return unpickler.load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a corrupt pickle raises almost anything; none of it may escape raw
        raise CheckpointError(f"{where}: corrupt {what} ({type(e).__name__}: {e})") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _label(obj: Any, mapped: verified.MappedFile, limit: int = 200_000) -> None:
    """Name each record after the first place in ``obj`` a tensor over it sits (for messages)."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    seen: set[int] = set()
    while stack and limit:
        x, at = stack.pop()
        limit -= 1
        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu" and x.untyped_storage().nbytes():
                mapped.label(x.untyped_storage().data_ptr() - mapped.addr, at or "the top-level tensor")
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            stack += [(v, f"{at}.{k}" if at else str(k)) for k, v in reversed(list(x.items()))]
        elif isinstance(x, (list, tuple)):
            stack += [(v, f"{at}[{i}]") for i, v in reversed(list(enumerate(x)))]
