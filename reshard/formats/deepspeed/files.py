"""The files of a DeepSpeed checkpoint folder, by name alone: what can be known before any of them
is read, and without torch (the command line starts copying model-state files while torch loads:
``reshard.jobs.early_copies``)."""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import CheckpointError

MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")


def resolve_tag_dir(path: str | Path) -> Path:
    """The tag folder itself, or the one a parent's ``latest`` file names."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a folder")
    if any(p.glob("*model_states.pt")):
        return p
    latest = p / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointError(f"{latest}: does not name a tag folder ({tag!r})")
        if not (p / tag).is_dir():
            raise CheckpointError(f"{latest}: names tag {tag!r}, but {p / tag} is missing")
        return resolve_tag_dir(p / tag)
    raise CheckpointError(f"{p}: no *model_states.pt files and no 'latest' file: not a DeepSpeed checkpoint")
