"""Load DeepSpeed's ``.pt`` files without executing anything they contain.

``torch.load(weights_only=True)`` refuses every class it does not know. DeepSpeed pickles three
small helper classes into its checkpoints; each is mapped here to an inert stand-in that only
stores the fields it is given. The stand-ins carry DeepSpeed's module and class names, so a file
reshard writes back refers to DeepSpeed's real classes and DeepSpeed loads it unchanged. Anything
else is refused with an error naming the file and the class.
"""

from __future__ import annotations

import enum
import pickle
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
