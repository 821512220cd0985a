"""Megatron's pickles read without Megatron and without running anything they name, and written
back under Megatron's own names (docs/megatron-checkpoints.md §4).

Every object record (``common_state`` with its ``args``, ``rng_state``, the optimizer's objects)
and every legacy ``.pt`` file is loaded by torch's weights-only unpickler (``storage.safe_load``: structure and
CRC-32s checked) with an allow-list:
``argparse.Namespace``, ``signal.Signals``, numpy's array rebuild, and inert stand-ins for the
Megatron enums the files name (``ModelType``, ``AttnBackend``, ``InferenceCudaGraphScope``,
``RerunMode``, ``RerunState``, ``RerunDiagnostic``). An enum member is pickled as ``GLOBAL cls;
(value,) REDUCE``, so a stand-in only records its value; it pickles back the same way under the
Megatron name (:func:`dumps`), so Megatron's own ``weights_only`` load reads what reshard writes.
Any other global is refused with a :class:`CheckpointError` naming the file and the global.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...storage import safe_load
from ...storage.pickling import pickle_module_for
from ...storage.safe_load import AllowList

__all__ = ["PICKLER", "STAND_INS", "dumps", "load_bytes", "load_file", "safe_globals"]


class _Member:
    """A Megatron enum member, kept as its value."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        return (type(self), (self.value,))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, self.value))

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__}({self.value!r})>"


def _stand_in(module: str, name: str) -> type:
    cls = type(name, (_Member,), {"__slots__": ()})
    cls.__module__, cls.__qualname__ = module, name
    return cls


ModelType = _stand_in("megatron.core.enums", "ModelType")
AttnBackend = _stand_in("megatron.core.transformer.enums", "AttnBackend")
InferenceCudaGraphScope = _stand_in("megatron.core.transformer.enums", "InferenceCudaGraphScope")
RerunMode = _stand_in("megatron.core.rerun_state_machine", "RerunMode")
RerunState = _stand_in("megatron.core.rerun_state_machine", "RerunState")
RerunDiagnostic = _stand_in("megatron.core.rerun_state_machine", "RerunDiagnostic")
STAND_INS = (ModelType, AttnBackend, InferenceCudaGraphScope, RerunMode, RerunState, RerunDiagnostic)

_NUMPY: list[Any] = [np.ndarray, np.dtype,
                     (np._core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),  # type: ignore[attr-defined]
                     (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]  # type: ignore[attr-defined]
for _cls in (getattr(np.dtypes, "UInt32DType", None), getattr(np.dtypes, "UInt8DType", None)):
    if _cls is not None:
        _NUMPY.append(_cls)
_ALLOWED: list[Any] = [argparse.Namespace, signal.Signals, *STAND_INS, *_NUMPY]


@contextlib.contextmanager
def safe_globals() -> Iterator[None]:
    """Within: ``torch.load(weights_only=True)`` admits the allow-list above as well."""
    with torch.serialization.safe_globals(_ALLOWED):
        yield


ALLOW = AllowList(tuple(_ALLOWED), "Megatron checkpoint globals")


def load_bytes(raw: bytes | memoryview, where: str) -> Any:
    """A ``torch.save`` record (an object of a ``.distcp`` file), loaded weights-only, its
    structure and every record's CRC-32 checked (``storage.safe_load``)."""
    return safe_load.load_bytes(raw, where, allow=ALLOW)


def load_file(path: Path) -> Any:
    """A legacy ``.pt`` file, loaded weights-only with its tensors memory-mapped; its structure
    checked before anything is mapped and every record's CRC-32 as it is read
    (``storage.safe_load``, ``storage.verified``)."""
    return safe_load.load(path, allow=ALLOW)


_PICKLE = pickle_module_for(STAND_INS, "reshard_megatron_pickle")
PICKLER = _PICKLE.Pickler  # for storage.torch_zip: stand-ins under Megatron's names


def dumps(value: Any) -> bytes:
    """``torch.save(value)`` as bytes, stand-ins under Megatron's names."""
    buf = io.BytesIO()
    torch.save(value, buf, pickle_module=_PICKLE)
    return buf.getvalue()
