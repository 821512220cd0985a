"""Write files that refer to DeepSpeed's helper classes without importing DeepSpeed.

The stand-ins in ``safe_load`` carry DeepSpeed's module and class names. Python's pickler refuses
to write a class under a name that does not import to the same object, so this pickler writes the
stand-ins' references itself; everything else pickles as usual."""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .safe_load import STAND_INS

_PATHS = {cls: (cls.__module__, cls.__qualname__) for cls in STAND_INS}


class Pickler(pickle._Pickler):  # the pure-Python pickler exposes save_global
    def save_global(self, obj: Any, name: str | None = None) -> None:
        path = _PATHS.get(obj) if isinstance(obj, type) else None
        if path is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{path[0]}\n{path[1]}\n".encode())
        self.memoize(obj)


pickle_module = types.SimpleNamespace(Pickler=Pickler, Unpickler=pickle.Unpickler, __name__="reshard_pickle")


def save(obj: Any, path: str | Path | BinaryIO) -> None:
    """``torch.save`` that keeps DeepSpeed's class names for stand-ins."""
    torch.save(obj, path, pickle_module=pickle_module)
