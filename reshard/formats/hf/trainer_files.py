"""The files Hugging Face ``Trainer`` saves beside a checkpoint's weights and optimizer state
(docs/hf-checkpoints.md): a run's state, which a reader of the checkpoint holds but does not lower
(``formats.contract.Held``). Plain file names: no import of any format."""

from __future__ import annotations

import re
from pathlib import Path

from ..contract import Held

__all__ = ["RNG_RE", "STATE_FILES", "trainer_held"]

RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
STATE_FILES = ("trainer_state.json", "training_args.bin", "scheduler.pt", "scaler.pt")
_WHY = {"trainer_state.json": "Trainer's state (step, log history)", "training_args.bin": "Trainer's arguments",
        "scheduler.pt": "the learning-rate scheduler's state", "scaler.pt": "the gradient scaler's state"}


def trainer_held(folder: Path) -> list[Held]:
    """Trainer's state files in ``folder`` (none where it holds none)."""
    if not folder.is_dir():
        return []
    out = [Held(f, str(folder / f), "state", _WHY[f]) for f in STATE_FILES if (folder / f).exists()]
    out += [Held(f.name, str(f), "state", "a process's RNG states") for f in sorted(folder.iterdir())
            if RNG_RE.match(f.name)]
    return out
