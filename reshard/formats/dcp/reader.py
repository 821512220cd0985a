"""A PyTorch DCP checkpoint as the engine reads it: each tensor entry's chunks are its map over
the storage ranks that wrote them (``formats.dcp.checkpoint``), each rank's shard its chunk, as
mapped. ``model.<fqn>`` is a parameter's ``weight``, ``optim.state.<fqn>.<s>`` its state ``s``
(Adam's ``exp_avg``, ``exp_avg_sq``, ``step``, or any other the optimizer keeps); every tensor
entry is also readable by its own key as the state ``raw``, which a DCP target laid out again
uses to keep every entry exactly (``formats.dcp.writer``)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from .checkpoint import MODEL, OPTIM_STATE, DcpCheckpoint

__all__ = ["RAW", "DcpReader"]

RAW = "raw"  # a tensor entry by its own key


class DcpReader:
    format = "dcp"

    def __init__(self, ck: DcpCheckpoint, given: Path | None = None) -> None:
        self.ck = ck
        self.tag = ck.path.name
        self.sources = (ck.path,) if given is None or Path(given) == ck.path else (Path(given), ck.path)
        ranks = {c.rank for e in ck.tensors.values() for c in e.chunks}
        self.description = f"PyTorch DCP checkpoint, {len(ranks)} storage ranks"
        self.topology: dict[str, int] = {}
        self.names = ck.params

    @classmethod
    def open(cls, path: str | Path) -> DcpReader:
        return cls(DcpCheckpoint.open(path), Path(path))

    @cached_property
    def _states(self) -> dict[str, tuple[str, ...]]:
        """Each parameter's states, in the checkpoint's key order after ``weight``."""
        params = set(self.names)
        out: dict[str, list[str]] = {n: ["weight"] for n in self.names}
        for key in self.ck.tensors:
            if not key.startswith(OPTIM_STATE):
                continue
            fqn, _, state = key[len(OPTIM_STATE):].rpartition(".")
            if fqn in params:
                out[fqn].append(state)
        return {n: tuple(s) for n, s in out.items()}

    def key(self, name: str, state: str) -> str:
        if state == RAW:
            return name
        if state == "weight":
            return self.ck.param_key(name)
        key = f"{OPTIM_STATE}{name}.{state}"
        if key not in self.ck.tensors:
            raise CheckpointError(f"{self.ck.path}: no tensor {key!r} in the DCP metadata")
        return key

    def check(self) -> None:
        for key in self.ck.tensors:  # every entry's chunks tile its tensor
            self.ck.param_map(key)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ck.entry(self.ck.param_key(name)).shape)

    def states(self, name: str) -> tuple[str, ...]:
        return self._states.get(name, ()) + ((RAW,) if name in self.ck.tensors else ())

    def dtype(self, name: str, state: str) -> torch.dtype:
        return self.ck.entry(self.key(name, state)).dtype

    def map(self, name: str, state: str) -> ParamMap:
        return self.ck.param_map(self.key(name, state))

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        return self.ck.shard(self.key(name, state), rank).reshape(-1)

    def tp_index(self, name: str, state: str, rank: int) -> None:
        return None

    def step(self, name: str) -> Any:
        key = self.ck.state_key(name, "step")
        if key is None:
            return None
        return self.ck.full(key).clone() if key in self.ck.tensors else self.ck.object(key)

    def extras(self, name: str) -> dict[str, Any]:
        return {}

    def param_groups(self) -> list[dict[str, Any]]:
        return self.ck.param_groups

    @property
    def structured(self) -> bool:
        return self.ck.structured

    def raw_keys(self) -> list[str]:
        """Every tensor entry, in the checkpoint's order."""
        return list(self.ck.tensors)

    def weight_key_prefix(self) -> str:
        return MODEL if self.ck.structured else ""
