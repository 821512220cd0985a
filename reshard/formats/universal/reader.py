"""A universal checkpoint (DeepSpeed's ``ds_to_universal`` layout, or reshard's) as the engine
reads it: ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` each hold F whole (bare, or as
``{"param": F, ...}``), so every state's map is F on one rank; ``step.pt`` and
``zero/optimizer_state.pt`` give Adam's step and the parameter groups.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import replicated
from ...storage.safe_load import load

__all__ = ["STATE_FILES", "UniversalReader", "universal_dir"]

STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq")
LATEST = "latest_universal"


def universal_dir(p: Path) -> Path | None:
    """The tag folder of a universal checkpoint at ``p`` (the folder itself, or the one its
    ``latest_universal`` names); ``None`` when ``p`` is not one."""
    if (p / "zero").is_dir():
        return p
    latest = p / LATEST
    if latest.is_file():
        try:
            tag = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{latest}: unreadable ({e})") from None
        if tag and "/" not in tag and len(tag) < 256 and (p / tag / "zero").is_dir():
            return p / tag
        raise CheckpointError(f"{latest}: names tag {tag[:80]!r}, but {p / tag[:80] / 'zero'} is missing")
    return None


class UniversalReader:
    format = "universal"

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        tag_dir = universal_dir(p)
        if tag_dir is None:
            raise CheckpointError(f"{p}: no zero/ folder and no {LATEST}: not a universal checkpoint")
        self.tag_dir, self.root = tag_dir, tag_dir / "zero"
        found = {d.name for d in self.root.iterdir() if (d / "fp32.pt").is_file()}
        # the model's order (what a DeepSpeed target flattens in): the model states' param_shapes
        ordered = [n for n in self._recorded if n in found]
        self.names = ordered + sorted(found - set(ordered))
        if not self.names:
            raise CheckpointError(f"{tag_dir}: no zero/<param>/fp32.pt files: not a universal checkpoint")
        self.tag = tag_dir.name
        self.sources = (p, tag_dir) if p != tag_dir else (tag_dir,)
        self.description = "universal checkpoint"
        self.topology: dict[str, int] = {}
        self._maps: dict[str, ParamMap] = {}

    def check(self) -> None:
        for name in self.names:
            n = prod(self.shape(name))
            for state in self.states(name):
                t = self._tensor(name, state)
                if t.numel() != n:
                    raise CheckpointError(f"{self.root / name / (state + '.pt')}: {t.numel()} elements, the "
                                          f"parameter has {n} ({list(self.shape(name))})")

    @cached_property
    def _recorded(self) -> dict[str, tuple[int, ...]]:
        """Shapes the model-state files beside ``zero/`` record (``param_shapes``): a universal
        checkpoint of a ZeRO-3 job stores each F flat, and only these say its shape."""
        for f in sorted(self.tag_dir.glob("*model_states.pt")):
            groups = load(f).get("param_shapes") if f.is_file() else None
            groups = groups if isinstance(groups, list) else [groups] if isinstance(groups, dict) else []
            return {n: tuple(int(x) for x in s) for g in groups if isinstance(g, dict) for n, s in g.items()}
        return {}

    def _tensor(self, name: str, state: str) -> torch.Tensor:
        f = self.root / name / f"{state}.pt"
        obj = load(f)
        t = obj.get("param") if isinstance(obj, dict) else obj
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{f}: expected a tensor or a dict with 'param', got {type(obj).__name__}")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        stored = tuple(self._tensor(name, "fp32").shape)  # memory-mapped: the shape costs no read of the data
        recorded = self._recorded.get(name)
        if len(stored) == 1 and recorded is not None and prod(recorded) == stored[0]:
            return recorded  # stored flat (ZeRO-3)
        return stored

    def states(self, name: str) -> tuple[str, ...]:
        return tuple(s for s in STATE_FILES if (self.root / name / f"{s}.pt").is_file())

    def dtype(self, name: str, state: str) -> torch.dtype:
        return self._tensor(name, state).dtype

    def map(self, name: str, state: str) -> ParamMap:
        m = self._maps.get(name)
        if m is None:
            m = self._maps[name] = replicated(self.shape(name), 1)
        return m

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        t = self._tensor(name, state)
        if t.numel() != self.map(name, state).numel:
            raise CheckpointError(f"{self.root / name / (state + '.pt')}: {t.numel()} elements, fp32.pt has "
                                  f"{self.map(name, state).numel}")
        return t.detach().reshape(-1)

    def tp_index(self, name: str, state: str, rank: int) -> None:
        return None

    def step(self, name: str) -> Any:
        f = self.root / name / "step.pt"
        return load(f) if f.is_file() else None

    def extras(self, name: str) -> dict[str, Any]:
        obj = load(self.root / name / "fp32.pt")
        return {k: v for k, v in obj.items() if k != "param"} if isinstance(obj, dict) else {}

    @cached_property
    def optimizer_state(self) -> dict:
        f = self.root / "optimizer_state.pt"
        obj = load(f) if f.is_file() else {}
        if not isinstance(obj, dict):
            raise CheckpointError(f"{f}: expected a dict, got {type(obj).__name__}")
        return obj

    def param_groups(self) -> list[dict[str, Any]]:
        groups = self.optimizer_state.get("param_groups", [])
        if len(groups) > 1:
            raise CheckpointError(f"{self.root / 'optimizer_state.pt'}: {len(groups)} parameter groups, and a "
                                  "universal checkpoint does not record which parameter belongs to which")
        return [{**groups[0], "params": list(self.names)}] if groups else []
