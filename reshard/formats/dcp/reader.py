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
from ...storage import verified
from ..contract import MOMENTS, Held, Reader
from ..hf.trainer_files import trainer_held
from .checkpoint import DcpCheckpoint

__all__ = ["RAW", "DcpReader"]

RAW = "raw"  # a tensor entry by its own key


class DcpReader(Reader):
    format = "dcp"

    def __init__(self, ck: DcpCheckpoint, given: Path | None = None, optim: DcpCheckpoint | None = None) -> None:
        self.ck = ck
        self.optim = optim or ck  # where the optimizer's entries are (Accelerate keeps them in a folder of their own)
        self.tag = ck.path.name
        self.sources = (ck.path,) if given is None or Path(given) == ck.path else (Path(given), ck.path)
        if optim is not None:
            self.sources += (optim.path,)
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
        prefix = f"{self.optim.optim}state."
        for key in self.optim.tensors:
            if not key.startswith(prefix):
                continue
            fqn, _, state = key[len(prefix):].rpartition(".")
            if fqn in params:
                out[fqn].append(state)
        return {n: tuple(s) for n, s in out.items()}

    def _where(self, name: str, state: str) -> tuple[DcpCheckpoint, str]:
        """(checkpoint, key) of one state's entry."""
        if state == RAW:
            return self.ck, name
        if state == "weight":
            return self.ck, self.ck.param_key(name)
        key = f"{self.optim.optim}state.{name}.{state}"
        if key not in self.optim.tensors:
            raise CheckpointError(f"{self.optim.path}: no tensor {key!r} in the DCP metadata")
        return self.optim, key

    def check(self) -> None:
        if not self.names:
            raise CheckpointError(f"{self.ck.path}: holds no model entries, only {sorted(self.ck.tensors)[:2]}...: an "
                                  "optimizer's folder? Point at the checkpoint folder (Accelerate: the one holding "
                                  "pytorch_model_fsdp_0/ and optimizer_0/)")
        for ck in {id(self.ck): self.ck, id(self.optim): self.optim}.values():
            for key in ck.tensors:  # every entry's chunks tile its tensor
                ck.param_map(key)

    def unlowered(self) -> list[Held]:
        """Entries beside the model's parameters and their Adam states: tensors outside the model
        and the optimizer (weights), other optimizer states, and non-tensor entries but the
        parameter groups and steps (a run's state); Trainer's files beside an Accelerate checkpoint."""
        names, out = set(self.names), []
        for ck in {id(self.ck): self.ck, id(self.optim): self.optim}.values():
            where, prefix = str(ck.path / ".metadata"), f"{ck.optim}state."
            lowered = {ck.param_key(n) for n in names} if ck is self.ck else set()
            for key in ck.tensors:
                if key in lowered:
                    continue
                if key.startswith(prefix):
                    fqn, _, state = key[len(prefix):].rpartition(".")
                    if fqn in names and state in (*MOMENTS, "step"):
                        continue
                    why = f"optimizer state {state!r}, which reshard does not carry" if fqn in names else \
                        "optimizer state of no model parameter"
                    out.append(Held(key, where, "state", why))
                else:
                    out.append(Held(key, where, "weights", "a tensor entry outside the model's and the optimizer's"))
            for key in ck.objects:
                if key.startswith(f"{ck.optim}param_groups.") or (key.startswith(prefix) and key.endswith(".step")):
                    continue
                out.append(Held(key, where, "state", "a non-tensor entry"))
        for src in dict.fromkeys(self.sources):
            out += trainer_held(Path(src))
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.ck.entry(self.ck.param_key(name)).shape)

    def states(self, name: str) -> tuple[str, ...]:
        return self._states.get(name, ()) + ((RAW,) if name in self.ck.tensors else ())

    def dtype(self, name: str, state: str) -> torch.dtype:
        ck, key = self._where(name, state)
        return ck.entry(key).dtype

    def map(self, name: str, state: str) -> ParamMap:
        ck, key = self._where(name, state)
        return ck.param_map(key)

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        ck, key = self._where(name, state)
        return ck.shard(key, rank).reshape(-1)

    def tp_index(self, name: str, state: str, rank: int) -> None:
        return None

    def step(self, name: str) -> Any:
        ck = self.optim
        key = ck.state_key(name, "step")
        if key is None:
            return None
        if key not in ck.tensors:
            return ck.object(key)
        full = ck.full(key)
        verified.ensure(full, f"{key}")  # read outside the engine's fills: its record is checked now
        return full.clone()

    def extras(self, name: str) -> dict[str, Any]:
        return {}

    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    def native(self, fmt: str) -> DcpCheckpoint | None:
        """The DCP checkpoint itself (its entries, objects and chunks)."""
        return self.ck if fmt == "dcp" else None
