"""The buffers of DeepSpeed's optimizer files, as the engine fills them: one flat partition (a
ZeRO-1/2 group's, a ZeRO-3 sub-group's) is one buffer per optimizer state with the same slots."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...ir.param_map import ParamMap
from ...storage.torch_zip import Storage
from ..contract import BEST, MOMENTS, Buffer, Slot

__all__ = ["partition", "want"]


def want(state: str) -> tuple[str, ...]:
    """What an optimizer state's slot is made from: the master from the source's master, else its
    weights (a source without an optimizer); a moment only from itself (else zeros)."""
    return BEST if state == "fp32" else (state,)


def partition(engine: Any, key: str, numel: int, fragments: Sequence[tuple[int, str]],
              maps: Callable[[str], ParamMap], rank: int, states: Sequence[str]) -> tuple[Storage, dict[str, Any]]:
    """Global rank ``rank``'s partition of ``numel`` elements, ``fragments`` its parameters' places
    ``(offset, name)`` (each a slot of the parameter's composite map ``maps(name)``): the fp32
    master's storage and the moments' views (those of ``states``)."""
    bufs = {s: engine.storage(Buffer(f"{key}:{s}", torch.float32, numel,
                                     tuple(Slot(off, n, want(s), maps(n), rank) for off, n in fragments)))
            for s in states}
    return bufs["fp32"], {m: bufs[m].view((numel,)) for m in MOMENTS if m in bufs}
