"""The buffers of DeepSpeed's optimizer files, as the engine fills them: one flat partition (a
ZeRO-1/2 group's, a ZeRO-3 sub-group's) is one buffer per optimizer state with the same slots.

Every target kind declares its buffers once (``buffers()``, :class:`Declared`), before any output
folder exists; its jobs then fill the declared ones, found by key (``partition``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...ir.param_map import ParamMap
from ...storage.torch_zip import Storage
from ..contract import BEST, MOMENTS, Buffer, Slot

__all__ = ["Declared", "partition", "partition_buffers", "want"]


def want(state: str) -> tuple[str, ...]:
    """What an optimizer state's slot is made from: the master from the source's master, else its
    weights (a source without an optimizer); a moment only from itself (else zeros)."""
    return BEST if state == "fp32" else (state,)


def partition_buffers(key: str, numel: int, fragments: Sequence[tuple[int, str]], maps: Callable[[str], ParamMap],
                      rank: int, states: Sequence[str]) -> list[Buffer]:
    """Global rank ``rank``'s partition of ``numel`` elements, ``fragments`` its parameters' places
    ``(offset, name)`` (each a slot of the parameter's composite map ``maps(name)``): one buffer per
    state of ``states``, keyed ``key:state``."""
    return [Buffer(f"{key}:{s}", torch.float32, numel,
                   tuple(Slot(off, n, want(s), maps(n), rank) for off, n in fragments)) for s in states]


def partition(engine: Any, declared: Mapping[str, Buffer], key: str, numel: int,
              states: Sequence[str]) -> tuple[Storage, dict[str, Any]]:
    """The declared partition ``key`` (:func:`partition_buffers`): the fp32 master's storage and the
    moments' views (those of ``states``)."""
    bufs = {s: engine.storage(declared[f"{key}:{s}"]) for s in states}
    return bufs["fp32"], {m: bufs[m].view((numel,)) for m in MOMENTS if m in bufs}


class Declared:
    """A target kind's buffers, declared once: ``declare`` lists them all (called by ``buffers()``,
    before any output folder exists); its jobs find them by key (the same objects, which the
    engine checks)."""

    def __init__(self, declare: Callable[[], list[Buffer]]) -> None:
        self._declare = declare
        self._by_key: dict[str, Buffer] | None = None

    def by_key(self) -> dict[str, Buffer]:
        if self._by_key is None:
            self._by_key = {b.key: b for b in self._declare()}
        return self._by_key

    def buffers(self) -> list[Buffer]:
        return list(self.by_key().values())
