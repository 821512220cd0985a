"""HF-style safetensors weights written from any source: every parameter whole, by name, in files
of at most ``max_file_bytes`` (``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json``), each tensor streamed from the source fragments.

The weights are the most precise ones the source holds: a DeepSpeed checkpoint's fp32 masters
(a module weight outside the optimizer cast to fp32 beside them), a DCP or safetensors source's
weights in their stored dtype; ``dtype`` casts them all. ``with_optimizer`` adds the Adam moments
in the universal layout (``zero/<name>/{exp_avg,exp_avg_sq,step}.pt``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...errors import ReshardError
from ...ir.piece import prod
from ...layouts import replicated
from ..contract import BEST, Buffer, Reader, Slot, Target, Writer
from ..table import noun_of
from .io import DTYPES, SafetensorsFile, plan_files
from .reader import INDEX

__all__ = ["SafetensorsWriter"]


class SafetensorsWriter(Writer):
    format = "safetensors"
    latest = None
    keeps_replicas = False

    def __init__(self, reader: Reader, *, max_file_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
                 with_optimizer: bool = False, names: dict[str, str] | None = None, index: bool = True) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise ReshardError(f"--dtype {dtype} is not a safetensors dtype")
        self.reader, self.tag = reader, reader.tag
        masters = any("fp32" in reader.states(n) for n in reader.names)
        # each parameter's name in the files (``names``: a subset of the source's, renamed)
        self.names = {n: n for n in reader.names} if names is None else dict(names)
        self.source = {out: n for n, out in self.names.items()}
        self.specs = []
        for n in self.names:
            have = reader.states(n)
            state = next((s for s in BEST if s in have), None)
            if state is None:
                raise ReshardError(f"{reader.sources[-1]}: parameter {n!r} has no weights to write")
            own = torch.float32 if masters else reader.dtype(n, state)
            self.specs.append((self.names[n], reader.shape(n), dtype or own))
        self.groups = plan_files(self.specs, max_file_bytes)
        self.index = index or len(self.groups) > 1  # save_pretrained writes one only for shards
        self.fnames = ["model.safetensors"] if len(self.groups) == 1 else [
            f"model-{i + 1:05d}-of-{len(self.groups):05d}.safetensors" for i in range(len(self.groups))]
        self._maps = {out: replicated(shape, 1) for out, shape, _ in self.specs}
        self.moments = None
        if with_optimizer and not any(m in reader.states(n) for n in reader.names for m in ("exp_avg", "exp_avg_sq")):
            raise ReshardError(f"{reader.sources[-1]}: --with-optimizer, but {noun_of(reader)} holds no "
                               "optimizer state (no Adam moments) to write")
        if with_optimizer:
            from ..universal.writer import UniversalWriter

            self.moments = UniversalWriter(reader, moments_only=True)

    def targets(self) -> list[Target]:
        out = [Target(self.source[o], BEST, self._maps[o]) for o, _, _ in self.specs]
        return out + (self.moments.targets() if self.moments is not None else [])

    def meta(self) -> dict[str, Any]:
        return {"target": "safetensors weights"}

    def notes(self) -> list[str]:
        return []

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        jobs = [(_size(g), partial(self._file, engine, staging, f, g)) for f, g in zip(self.fnames, self.groups)]
        if self.index:
            jobs.append((1, partial(self._index, staging)))
        if self.moments is not None:
            jobs += self.moments.jobs(engine, staging)
        return jobs

    def _file(self, engine: Any, staging: Any, fname: str, group: list) -> None:
        with staging.open(fname) as out:
            w = SafetensorsFile(out, group)
            for name, shape, dtype in group:
                slot = Slot(0, self.source[name], BEST, self._maps[name], 0)
                w.write_fill(name, shape, dtype, engine.fill(Buffer(f"{fname}:{name}", dtype, prod(shape), (slot,))))
            w.close()

    def _index(self, staging: Any) -> None:
        weight_map = {name: f for f, g in zip(self.fnames, self.groups) for name, _, _ in g}
        doc = {"metadata": {"total_size": _size(self.specs)}, "weight_map": weight_map}
        with staging.open(INDEX) as out:
            out.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())


def _size(specs: list) -> int:
    return sum(prod(s) * d.itemsize for _, s, d in specs)
