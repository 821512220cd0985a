"""The contract between the formats and the engine (docs/spec.md §9).

A **reader** opens a source checkpoint: it lowers its files to one map per parameter state and
says where each rank's shard of it lies (:meth:`Reader.fragment`), and it checks everything it
reads before the engine opens an output folder. A **writer** lays out a target checkpoint's
files: each file's tensors are **buffers**, flat runs of elements, and each buffer is a list of
**slots**, one target shard of one parameter state at an offset. The engine
(``reshard.jobs.engine``) plans every slot's target map against the reader's map of the state it
is made from and fills the buffers from the source fragments, window by window. Neither a reader
nor a writer plans; a new format is one reader and one writer.

A parameter's **states** are its training-dtype weights (``weight``), its fp32 master (``fp32``)
and Adam's moments. A slot names the states it may be made from, in order of preference
(``want``): a bf16 module buffer takes ``weight`` and else casts ``fp32``; a universal file the
reverse; a moment only itself, and a writer that needs one the source lacks fills zeros, as a
fresh optimizer holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..ir.param_map import ParamMap

__all__ = ["BEST", "MODULE", "MOMENTS", "OPTIMIZER", "SCALE_POWER", "STATES", "Buffer", "Reader", "Slot", "Target",
           "Writer"]

STATES = ("weight", "fp32", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER = ("fp32", "exp_avg", "exp_avg_sq")
# how a piece's scale applies to each state: Adam's moments of a pre-divided bias undo it
SCALE_POWER = {"weight": 1, "fp32": 1, "exp_avg": -1, "exp_avg_sq": -2}
BEST = ("fp32", "weight")  # the most precise weights a source holds
MODULE = ("weight", "fp32")  # the training dtype's weights, else the masters cast to it


@dataclass(frozen=True, slots=True, eq=False)
class Slot:
    """Target rank ``rank``'s shard of ``map`` (parameter ``name``), made from the first state
    in ``want`` the source holds, at element ``offset`` of a buffer."""

    offset: int
    name: str
    want: tuple[str, ...]
    map: ParamMap
    rank: int


@dataclass(frozen=True, slots=True, eq=False)
class Buffer:
    """``numel`` elements of ``dtype`` in an output file, made of ``slots``; elements no slot
    covers (padding) are zero. ``key`` names it uniquely in the job (its file and place)."""

    key: str
    dtype: torch.dtype
    numel: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True, slots=True)
class Target:
    """One (parameter, ``want``, map) a writer fills: what the engine plans before any output
    folder exists."""

    name: str
    want: tuple[str, ...]
    map: ParamMap


class Reader(Protocol):
    """A source checkpoint, lowered. ``names`` are parameters in the source's order."""

    format: str  # "deepspeed", "universal", "dcp", "safetensors"
    tag: str  # the name its target's folder takes (a DeepSpeed tag, a DCP folder's name)
    sources: tuple[Path, ...]  # every path it reads, which no output may touch
    description: str  # in words, for reports
    topology: dict[str, int]  # {"tp": .., "dp": .., ...}; {} where the format has none
    names: Sequence[str]

    def shape(self, name: str) -> tuple[int, ...]: ...  # F's valid shape
    def states(self, name: str) -> tuple[str, ...]: ...  # the STATES it holds, in STATES order
    def dtype(self, name: str, state: str) -> torch.dtype: ...
    def map(self, name: str, state: str) -> ParamMap: ...  # one object for states laid out alike
    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor: ...  # rank's shard, flat
    def tp_index(self, name: str, state: str, rank: int) -> int | None: ...  # the TP rank a rank's copy is
    def step(self, name: str) -> Any: ...  # Adam's step, or None
    def param_groups(self) -> list[dict[str, Any]]: ...  # hyper-parameters; "params": names
    def extras(self, name: str) -> dict[str, Any]: ...  # keys a universal file keeps beside F


class Writer(Protocol):
    """A target checkpoint's layout, computed (and refused where impossible) when it is made,
    before any output folder exists."""

    format: str
    tag: str | None  # the folder the target is committed as, in the output folder
    latest: str | None  # the pointer file a commit writes beside the tag folder
    keeps_replicas: bool  # each target rank keeps its own copy of a replicated block (same TP)

    def targets(self) -> list[Target]: ...
    def jobs(self, engine: Any, staging: Any) -> list: ...  # (bytes, job) or storage.staging.ArchiveJob
    def meta(self) -> dict[str, Any]: ...  # what the manifest records of the target
    def notes(self) -> list[str]: ...  # the report's words on what the target holds

    # optional: ``finish(staging, gather, rank)``, run once every process wrote its files (DCP's
    # .metadata); ``tp_index(rank)``, the TP rank of a target rank, where ``keeps_replicas``; a
    # ``tag`` of ``None`` writes the output folder itself (a model folder, a Trainer checkpoint)

