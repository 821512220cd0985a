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


def pickle_module_for(stand_ins: tuple[type, ...], name: str) -> types.SimpleNamespace:
    """A ``pickle_module`` for ``torch.save`` whose pickler writes each of ``stand_ins`` under the
    module and class names it carries (DeepSpeed's here, Megatron's in ``formats.megatron.safe``)."""
    paths = {cls: (cls.__module__, cls.__qualname__) for cls in stand_ins}

    class StandInPickler(pickle._Pickler):  # the pure-Python pickler exposes save_global
        def save_global(self, obj: Any, name: str | None = None) -> None:
            path = paths.get(obj) if isinstance(obj, type) else None
            if path is None:
                return super().save_global(obj, name)
            self.write(pickle.GLOBAL + f"{path[0]}\n{path[1]}\n".encode())
            self.memoize(obj)

    return types.SimpleNamespace(Pickler=StandInPickler, Unpickler=pickle.Unpickler, __name__=name)


pickle_module = pickle_module_for(STAND_INS, "reshard_pickle")
Pickler = pickle_module.Pickler


def save(obj: Any, path: str | Path | BinaryIO) -> None:
    """``torch.save`` that keeps DeepSpeed's class names for stand-ins."""
    torch.save(obj, path, pickle_module=pickle_module)
