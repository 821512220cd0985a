"""Every format's reader and writer, dispatched through its row of the format table
(``formats.table``): the one place a path is recognised as a checkpoint (:func:`open_reader`), a
target is made (:func:`make_writer`, options it does not take refused by their flags) and the
target of ``reshard`` is chosen (:func:`reshard_target`). Every route between formats is the
engine's."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ReshardError
from .contract import Reader, Writer
from .table import DEFAULT_TARGET, FORMATS, OPTIONS, Format, reshard_targets, row, sources, target

__all__ = ["check_options", "deepspeed_writer", "is_accelerate", "is_dcp", "is_deepspeed", "is_universal", "make_writer",
           "open_reader", "reshard_target", "source_format"]


def _load(ref: str) -> Any:
    """``"module:attribute.attribute"``, imported."""
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# -- detection: from the files' names alone ------------------------------------------------------------


def is_dcp(path: Path) -> bool:
    from .dcp.checkpoint import METADATA

    return path.is_dir() and (path / METADATA).is_file()


def is_universal(path: Path) -> bool:
    from .universal.reader import universal_dir

    return path.is_dir() and universal_dir(path) is not None


def is_deepspeed(path: Path) -> bool:
    from .deepspeed.files import is_deepspeed as files_of_deepspeed

    return path.is_dir() and files_of_deepspeed(path)


def is_accelerate(path: Path) -> bool:
    from .hf.accelerate import accelerate_folders

    return accelerate_folders(path) is not None


def source_format(path: Path) -> str | None:
    """Which format the checkpoint at ``path`` is in (its row's name), from its files' names alone
    (no torch): each row's detector, in ``probe`` order."""
    for f in sorted(FORMATS, key=lambda f: f.probe):
        if f.detect is not None and _load(f.detect)(path):
            return f.name
    return None


def open_reader(path: str | Path, *, route: str | None = None, names: str | None = None,
                prefer: str | None = None) -> Reader:
    """The checkpoint at ``path`` (any format reshard reads), opened and checked: everything
    that can refuse it is refused here, before any output folder exists. ``route`` (the target
    format) picks the names a source with a choice (Megatron) is read under (the target row's
    ``names``) unless ``names`` (``"megatron"`` or ``"hf"``) or, where the source has the
    choice, ``prefer`` (the target row's ``names_with``) says."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    kind = source_format(p)
    if kind is None:
        from .hf.trainer import refuse_output_dir

        refuse_output_dir(p)
        raise CheckpointError(f"{p}: not " + ", nor ".join(f"{f.noun} ({f.hint})" for f in sources()))
    f = row(kind)
    if f.reader is None:
        raise CheckpointError(f"{p}: {f.noun}, which reshard does not read")
    if names is not None and not f.reader_names:
        them = " or ".join(g.noun for g in sources() if g.reader_names)
        raise ReshardError(f"{p}: --names chooses the names of {them}; this is {f.noun}")
    names = names or prefer or (row(route).names if route is not None else None)
    how = {"names": names} if f.reader_names and names is not None else {}
    reader: Reader = _load(f.reader)(p, **how)
    reader.check()
    return reader


# -- targets -------------------------------------------------------------------------------------------


def _goes_with(option: str) -> str:
    """The targets that take ``option``, as a user names them: ``--format dcp``, ``--to deepspeed``."""
    return " or ".join(f"--format {f.name}" if option in (f.convert or ()) else f"--to {f.name}"
                       for f in FORMATS if option in f.options)


def check_options(fmt: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options (given: not None) target ``fmt`` takes; one it does not is refused by its flag."""
    f = row(fmt)
    given = {k: v for k, v in options.items() if v is not None}
    extra = [k for k in given if k not in f.options]
    if extra:
        raise ReshardError("; ".join(f"{OPTIONS[k].flag or k if k in OPTIONS else k} goes with {_goes_with(k)}, not "
                                     f"with {f.noun} (the target)" for k in extra))
    return given


def _refuse_source(f: Format, source: str, where: Any) -> None:
    """Refused where ``f`` is not written from a ``source`` checkpoint, naming ``--to``'s choices for it."""
    if f.writes_from is None or source in f.writes_from:
        return
    them = " or ".join(row(s).noun for s in f.writes_from)
    can = [t.name for t in reshard_targets() if t.writes_from is None or source in t.writes_from]
    raise ReshardError(f"{where}: {f.noun} is written from {them}, not from {row(source).noun}; "
                       f"--to takes {', '.join(can)} for it")


def make_writer(fmt: str, reader: Reader, **options: Any) -> Writer:
    """The target of format ``fmt`` (a name or an alias) laid out from ``reader``'s source;
    options a format does not take are refused by their flags."""
    f = row(fmt)
    if f.writer is None:
        raise ReshardError(f"{f.noun} is read, not written; reshard writes {', '.join(t.name for t in FORMATS if t.writer)}")
    given = check_options(f.name, options)
    _refuse_source(f, reader.format, reader.sources[-1])
    return _load(f.writer)(reader, **given)


def deepspeed_writer(reader: Reader, **options: Any) -> Writer:
    """A DeepSpeed target; from a Trainer checkpoint, a Trainer checkpoint at the target."""
    from .deepspeed.writer import DeepSpeedWriter
    from .hf.trainer import TrainerWriter, trainer_folder

    writer = DeepSpeedWriter(reader, **options)
    folder = trainer_folder(reader) if reader.format == "deepspeed" else None
    return writer if folder is None else TrainerWriter(writer, folder)


def reshard_target(path: str | Path, to: str | None, options: Mapping[str, Any]) -> Format:
    """The format ``reshard`` writes the checkpoint at ``path`` in: ``to``; else the target that
    needs a given option (``--files``: DCP); else the source's own format where it is written at a
    topology (DeepSpeed, Megatron; DCP with ``--files``); else DeepSpeed (a source without a
    topology: universal, safetensors, Accelerate). Decided from the files' names, before the
    source is opened; a target that cannot be written from it is refused naming ``--to``'s choices."""
    p = Path(path)
    source = source_format(p) if p.exists() else None
    if to is not None:
        f = target(to, "reshard")
        if source is not None:
            _refuse_source(f, source, p)
        return f
    for f in reshard_targets():
        if f.needs is not None and options.get(f.needs) is not None:
            return f
    own = row(source) if source is not None else None
    if own is None or own.reshard is None:
        return row(DEFAULT_TARGET)
    if own.needs is not None:  # its topology is an option not given
        can = [t.name for t in reshard_targets() if t.writes_from is None or own.name in t.writes_from]
        raise ReshardError(f"{p}: {own.noun} keeps its format at {OPTIONS[own.needs].flag} N, not given here; or "
                           f"name the target: --to takes {', '.join(can)}")
    return own

