"""Where a Megatron-LM checkpoint's files are (docs/megatron-checkpoints.md §1), from names alone
(no torch): the save folder with ``latest_checkpointed_iteration.txt``, the iteration folder it
names (``iter_NNNNNNN`` or ``release``), and which of the two formats that folder holds.

A path may be the save folder (the tracker decides the iteration; an ``iter_*`` folder it does not
name is refused with the tracker named) or one ``iter_*`` / ``release`` folder itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import CheckpointError

__all__ = ["TRACKER", "Location", "is_megatron", "iteration_folder", "locate"]

TRACKER = "latest_checkpointed_iteration.txt"
METADATA_JSON = "metadata.json"
_ITER = re.compile(r"^iter_(\d{7,})$")
LEGACY_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def iteration_folder(iteration: int | None) -> str:
    """``iter_0000003``, or ``release`` for a release checkpoint (``None``)."""
    return "release" if iteration is None else f"iter_{iteration:07d}"


@dataclass(frozen=True, slots=True)
class Location:
    """A Megatron checkpoint on disk: the save folder, the iteration folder, the iteration
    (``None`` for ``release``) and the format (``torch_dist`` or ``torch``)."""

    save_dir: Path
    iter_dir: Path
    iteration: int | None
    fmt: str


def _format_of(d: Path) -> str | None:
    """Megatron's own rule (``_get_checkpoint_format``): ``metadata.json`` naming a sharded
    backend is ``torch_dist``; an ``mp_rank_*`` entry the legacy ``torch`` format."""
    meta = d / METADATA_JSON
    if meta.is_file():
        try:
            doc = json.loads(meta.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{meta}: unreadable ({e})") from None
        if isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist":
            return "torch_dist"
        if isinstance(doc, dict) and "sharded_backend" in doc:
            raise CheckpointError(f"{meta}: sharded backend {doc['sharded_backend']!r}; reshard reads 'torch_dist'")
    if d.is_dir() and any(p.name.startswith("mp_rank_") for p in d.iterdir()):
        return "torch"
    return None


def _is_iter_name(name: str) -> bool:
    return name == "release" or _ITER.match(name) is not None


def is_megatron(path: Path) -> bool:
    """Whether ``path`` looks like a Megatron save folder or one of its iteration folders."""
    if not path.is_dir():
        return False
    if (path / TRACKER).is_file():
        return True
    try:
        return _is_iter_name(path.name) and _format_of(path) is not None
    except CheckpointError:
        return True  # a malformed metadata.json is still Megatron's: the reader says what is wrong


def _read_tracker(f: Path) -> int | None:
    try:
        text = f.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    if text == "release":
        return None
    if not text.isdigit():
        raise CheckpointError(f"{f}: holds {text[:40]!r}, not an iteration number or 'release'")
    return int(text)


def locate(path: Path) -> Location:
    """The checkpoint at ``path`` (a save folder or an iteration folder), checked to exist."""
    if (path / TRACKER).is_file():
        iteration = _read_tracker(path / TRACKER)
        save, it = path, path / iteration_folder(iteration)
        if not it.is_dir():
            raise CheckpointError(f"{path / TRACKER}: names iteration folder {it.name}, which is missing")
    elif _is_iter_name(path.name):
        save, it = path.parent, path
        iteration = None if path.name == "release" else int(_ITER.match(path.name).group(1))  # type: ignore[union-attr]
        tracker = save / TRACKER
        if tracker.is_file() and _read_tracker(tracker) != iteration:
            named = iteration_folder(_read_tracker(tracker))
            raise CheckpointError(f"{path}: {tracker} names {named}, not this iteration folder; give the save "
                                  f"folder {save} (or the folder the tracker names)")
    else:
        raise CheckpointError(f"{path}: no {TRACKER} and not an iter_NNNNNNN folder: not a Megatron checkpoint")
    fmt = _format_of(it)
    if fmt is None:
        raise CheckpointError(f"{it}: neither {METADATA_JSON} (torch_dist) nor mp_rank_* folders (legacy torch "
                              "format): not a Megatron checkpoint iteration folder")
    return Location(save, it, iteration, fmt)
