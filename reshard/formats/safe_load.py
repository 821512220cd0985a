"""Load DeepSpeed's ``.pt`` files without executing anything they contain.

``torch.load(weights_only=True)`` refuses every class it does not know. DeepSpeed pickles three
small helper classes into its checkpoints; each is mapped here to an inert stand-in that only
stores the fields it is given. The stand-ins carry DeepSpeed's module and class names, so a file
reshard writes back refers to DeepSpeed's real classes and DeepSpeed loads it unchanged. Anything
else is refused with an error naming the file and the class.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import mmap
import pickle
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError


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


def load(path: str | Path, *, mmap: bool = True) -> Any:
    """Load a checkpoint file safely. With ``mmap`` (the default), tensors stay on disk until
    read, so only the bytes actually used are paged in."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        with torch.serialization.safe_globals(STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e) or "GLOBAL" in str(e):
            raise CheckpointError(
                f"{path}: refuses to unpickle {_class_named_in(e)}, which is not on reshard's allow-list "
                "of inert DeepSpeed helper classes (loading it could run code)"
            ) from None
        raise CheckpointError(f"{path}: corrupt pickle ({e})") from None
    except (zipfile.BadZipFile, RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as a torch checkpoint; truncated or corrupt ({e})") from None


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


_MAPS: list[tuple[int, int, bool]] = []  # (start, end, backed by a file), sorted


def _file_backed(lo: int, hi: int) -> bool:
    for refresh in (False, True):
        if refresh or not _MAPS:
            _MAPS[:] = _read_maps()
        i = bisect.bisect_right(_MAPS, (lo, float("inf"), True)) - 1
        if i >= 0 and _MAPS[i][0] <= lo and hi <= _MAPS[i][1]:
            return _MAPS[i][2]
    return False


def _read_maps() -> list[tuple[int, int, bool]]:
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                a, b = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5].strip() if len(parts) > 5 else ""
                out.append((a, b, path.startswith("/") and "(deleted)" not in path))
    except OSError:
        return []
    return sorted(out)


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
_MADVISE = _madvise() if sys.platform.startswith("linux") else None
