"""An Accelerate FSDP checkpoint as Trainer saves it (``save_fsdp_model`` / ``save_fsdp_optimizer``,
docs/hf-checkpoints.md §5): ``checkpoint-N/pytorch_model_fsdp_0/`` (a DCP folder of ``model.<HF
name>``) and ``checkpoint-N/optimizer_0/`` (a DCP folder of ``optimizer.state.<HF name>.<state>``
and ``optimizer.param_groups``). Read as one source: the weights from the first, Adam's moments,
step and parameter groups from the second, every entry's chunks lowered as DCP's are."""

from __future__ import annotations

import re
from pathlib import Path

from ..dcp.checkpoint import DcpCheckpoint
from ..dcp.reader import DcpReader

__all__ = ["accelerate_folders", "open_accelerate"]

MODEL_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)$")


def accelerate_folders(p: Path) -> tuple[Path, Path | None] | None:
    """(model folder, optimizer folder or ``None``) of an Accelerate FSDP checkpoint at ``p`` (the
    ``checkpoint-N`` folder, or its ``pytorch_model_fsdp_K``); ``None`` when it is not one."""
    if p.is_dir() and (m := MODEL_DIR.match(p.name)) and (p / ".metadata").is_file():
        model = p
    elif p.is_dir() and (p / "pytorch_model_fsdp_0" / ".metadata").is_file():
        model, m = p / "pytorch_model_fsdp_0", MODEL_DIR.match("pytorch_model_fsdp_0")
    else:
        return None
    optim = model.parent / f"optimizer_{m[1]}"
    return model, (optim if (optim / ".metadata").is_file() else None)


def open_accelerate(p: Path) -> DcpReader:
    model, optim = accelerate_folders(p)
    reader = DcpReader(DcpCheckpoint.open(model), p, optim=None if optim is None else DcpCheckpoint.open(optim))
    reader.tag = model.parent.name  # the checkpoint-N folder
    reader.description = "Accelerate FSDP checkpoint (DCP" + (" + optimizer)" if optim is not None else ", no optimizer)")
    return reader
