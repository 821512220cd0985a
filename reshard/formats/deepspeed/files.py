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
        tag = read_latest(latest)
        if not (p / tag).is_dir():
            raise CheckpointError(f"{latest}: names tag {tag!r}, but {p / tag} is missing")
        return resolve_tag_dir(p / tag)
    if latest.exists() or latest.is_symlink():
        raise CheckpointError(f"{latest}: not a regular file")
    tags = tag_folders(p)
    if tags:
        raise CheckpointError(f"{p}: no 'latest' file naming one of its tag folders ({', '.join(t.name for t in tags[:3])}):"
                              " point at the tag folder itself")
    raise CheckpointError(f"{p}: no *model_states.pt files and no 'latest' file: not a DeepSpeed checkpoint")


def tag_folders(p: Path) -> list[Path]:
    """The sub-folders of ``p`` holding model-state files (DeepSpeed tag folders), sorted."""
    return sorted(q for q in p.iterdir() if q.is_dir() and any(q.glob("*model_states.pt"))) if p.is_dir() else []


def read_latest(latest: Path) -> str:
    """The tag a ``latest`` file names: one folder name of UTF-8 text, or a :class:`CheckpointError`."""
    try:
        raw = latest.read_bytes()[:4096]
        tag = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest}: does not name a tag folder (unreadable or not UTF-8 text: {e})") from None
    if not tag or "/" in tag or "\\" in tag or "\0" in tag or tag in (".", "..") or len(tag.encode()) > 255:
        raise CheckpointError(f"{latest}: does not name a tag folder ({tag[:80]!r}{'...' if len(tag) > 80 else ''})")
    return tag


def is_deepspeed(p: Path) -> bool:
    """Whether folder ``p`` looks like a DeepSpeed checkpoint: a tag folder of ``*model_states.pt``
    files, or a parent with ``latest`` (its contents are checked when it is opened)."""
    latest = p / "latest"
    return any(p.glob("*model_states.pt")) or latest.exists() or latest.is_symlink() or bool(tag_folders(p))
