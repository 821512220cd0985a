"""Every format's reader and writer, by name: the one place a path is recognised as a checkpoint
(:func:`open_reader`) and a target format is made (:func:`make_writer`). A new format is one
reader and one writer added here; every route between formats is the engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ReshardError
from .contract import Reader, Writer

__all__ = ["FORMATS", "make_writer", "open_reader", "source_format"]

# target formats: their names on the command line
FORMATS = ("ucp", "safetensors", "hf", "dcp", "deepspeed", "megatron")


def source_format(path: Path) -> str | None:
    """Which format the checkpoint at ``path`` is in, from its files' names alone (no torch)."""
    from .dcp.checkpoint import METADATA
    from .deepspeed.files import is_deepspeed
    from .hf.accelerate import accelerate_folders
    from .megatron.files import is_megatron
    from .safetensors.reader import is_safetensors
    from .universal.reader import universal_dir

    if is_megatron(path):  # before DCP: a torch_dist iteration folder holds a .metadata too
        return "megatron"
    if accelerate_folders(path) is not None:
        return "accelerate"
    if path.is_dir() and (path / METADATA).is_file():
        return "dcp"
    if path.is_dir() and universal_dir(path) is not None:
        return "universal"
    if path.is_dir() and is_deepspeed(path):  # before safetensors: a Trainer ZeRO-2 checkpoint holds both
        return "deepspeed"
    if is_safetensors(path):
        return "safetensors"
    return None


# the parameter names a Megatron source is read under, by target format: Hugging Face names for
# safetensors (an HF export), Megatron's own keys for every other target
MEGATRON_NAMES = {"safetensors": "hf", "hf": "hf"}


def open_reader(path: str | Path, *, route: str | None = None, names: str | None = None) -> Reader:
    """The checkpoint at ``path`` (any format reshard reads), opened and checked: everything
    that can refuse it is refused here, before any output folder exists. ``route`` (the target
    format) picks the names a Megatron source is read under (``MEGATRON_NAMES``) unless ``names``
    (``"megatron"`` or ``"hf"``) says."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    kind = source_format(p)
    if names is not None and kind != "megatron":
        raise ReshardError(f"{p}: --names chooses the names of a Megatron source; this is {kind or 'no known'} format")
    if kind == "megatron":
        from .megatron.reader import MegatronReader

        reader: Reader = MegatronReader.open(p, names=names or MEGATRON_NAMES.get(route or "", "megatron"))
    elif kind == "accelerate":
        from .hf.accelerate import open_accelerate

        reader = open_accelerate(p)
    elif kind == "dcp":
        from .dcp.reader import DcpReader

        reader = DcpReader.open(p)
    elif kind == "universal":
        from .universal.reader import UniversalReader

        reader = UniversalReader(p)
    elif kind == "safetensors":
        from .safetensors.reader import SafetensorsReader

        reader = SafetensorsReader(p)
    elif kind == "deepspeed":
        from .deepspeed.reader import DeepSpeedReader

        reader = DeepSpeedReader.open(p)
    else:
        from .hf.trainer import refuse_output_dir

        refuse_output_dir(p)
        raise CheckpointError(f"{p}: not a DeepSpeed checkpoint (no 'latest', no *model_states.pt), nor a PyTorch "
                              "DCP one (.metadata), a universal one (zero/), a Megatron one "
                              "(latest_checkpointed_iteration.txt, iter_*) or Hugging Face safetensors "
                              "(model.safetensors, model.safetensors.index.json)")
    reader.check()
    return reader


def make_writer(fmt: str, reader: Reader, **options: Any) -> Writer:
    """The target of format ``fmt`` laid out from ``reader``'s source; options a format does
    not take are refused by name."""
    if fmt == "ucp":
        from .universal.writer import UniversalWriter

        return UniversalWriter(reader, **_only(options, fmt, "early"))
    if fmt == "safetensors":
        from .safetensors.writer import SafetensorsWriter

        return SafetensorsWriter(reader, **_only(options, fmt, "max_file_bytes", "dtype", "with_optimizer"))
    if fmt == "hf":
        from .hf.writer import HfWriter

        return HfWriter(reader, **_only(options, fmt, "max_file_bytes", "dtype", "hf_config"))
    if fmt == "dcp":
        from .dcp.writer import DcpWriter

        return DcpWriter(reader, **_only(options, fmt, "files", "max_file_bytes", "rename"))
    if fmt == "deepspeed":
        from .deepspeed.writer import DeepSpeedWriter
        from .hf.trainer import TrainerWriter, trainer_folder

        writer = DeepSpeedWriter(reader, **_only(options, fmt, "tp", "dp", "pp", "zero_stage", "ep", "layout", "dtype"))
        folder = trainer_folder(reader) if reader.format == "deepspeed" else None
        return writer if folder is None else TrainerWriter(writer, folder)  # a Trainer checkpoint at the target
    if fmt == "megatron":
        from .megatron.writer import MegatronWriter

        return MegatronWriter(reader, **_only(options, fmt, "tp", "pp", "dp", "ep", "optimizer", "dtype"))
    raise ReshardError(f"unknown target format {fmt!r}; reshard writes {', '.join(FORMATS)}")


_FLAGS = {"early": "", "max_file_bytes": "--max-file-gb", "dtype": "--dtype", "with_optimizer": "--with-optimizer",
          "files": "--files", "rename": "--rename", "tp": "--tp", "dp": "--dp", "pp": "--pp",
          "zero_stage": "--zero-stage", "ep": "--ep", "layout": "--layout", "hf_config": "--hf-config",
          "optimizer": "--optimizer"}


def _only(options: dict[str, Any], fmt: str, *allowed: str) -> dict[str, Any]:
    """The options ``fmt`` takes; one it does not (given, not None) is refused by its flag."""
    options = {k: v for k, v in options.items() if v is not None}
    extra = [k for k in options if k not in allowed]
    if extra:
        flags = ", ".join(_FLAGS.get(k, k) or k for k in extra)
        raise ReshardError(f"{flags} do(es) not apply to the {fmt!r} target format")
    return {k: v for k, v in options.items() if k in allowed}
