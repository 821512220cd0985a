"""Hugging Face ``Trainer`` checkpoints as they are on disk (docs/hf-checkpoints.md).

A Trainer + DeepSpeed ``checkpoint-N`` is a DeepSpeed checkpoint (``latest``, ``global_stepN/``)
with Trainer's files beside it; the DeepSpeed reader reads it as it stands. Written at another
world size (``reshard reshard checkpoint-N OUT/checkpoint-N --dp D``), the folder is one Trainer
resumes as it stands (:class:`TrainerWriter`): the DeepSpeed files at the target topology in
``global_stepN/`` with ``latest``, and beside them ``trainer_state.json``, ``training_args.bin``,
``scheduler.pt``, the config and tokenizer files, carried as they are, and the RNG states laid out
for the new world under Trainer's names (``rng_state.pth`` at world 1, ``rng_state_{r}.pth``
otherwise; new rank ``r`` takes old rank ``r % old world``'s). The report says which, and the
per-device batch × accumulation that keeps the old global batch.

A Trainer ``output_dir`` (several ``checkpoint-N``) is answered with the list of its checkpoints.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...storage.staging import ArchiveJob, Prefixed
from ..contract import Buffer, Held, Reader, Writer
from ..deepspeed.writer import DeepSpeedWriter
from .trainer_files import RNG_RE, STATE_FILES
from .writer import CARRIED

__all__ = ["TrainerWriter", "checkpoints_of", "trainer_folder"]

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def trainer_folder(reader: Reader) -> Path | None:
    """The Trainer checkpoint folder (it holds ``trainer_state.json``) the source was read from."""
    for src in reader.sources:
        state = Path(src) / "trainer_state.json"
        if state.exists() or state.is_symlink():  # not a regular file: its copy refuses it, never dropped
            return Path(src)
    for src in reader.sources:  # Trainer's other files without its state: written as DeepSpeed, they would be lost
        p = Path(src)
        held = [f for f in STATE_FILES[1:] if (p / f).exists() or (p / f).is_symlink()]
        held += sorted(f.name for f in p.iterdir() if RNG_RE.match(f.name)) if p.is_dir() else []
        if held:
            raise CheckpointError(f"{p / 'trainer_state.json'}: missing, beside Trainer's {', '.join(held[:3])}: a "
                                  "Trainer checkpoint without its state (restore it, or point at the DeepSpeed tag "
                                  "folder to write the DeepSpeed files alone)")
    return None


def checkpoints_of(p: Path) -> list[Path]:
    """A Trainer ``output_dir``'s ``checkpoint-N`` folders, in step order (none: not one)."""
    found = [q for q in p.iterdir() if q.is_dir() and CHECKPOINT_RE.match(q.name)] if p.is_dir() else []
    return sorted(found, key=lambda q: int(CHECKPOINT_RE.match(q.name)[1]))


def refuse_output_dir(p: Path) -> None:
    """A Trainer ``output_dir`` is not one checkpoint: say which it holds."""
    found = checkpoints_of(p)
    if found and not (p / "trainer_state.json").is_file():
        names = ", ".join(q.name for q in found)
        raise CheckpointError(f"{p}: a Trainer output_dir holding {names}: give one checkpoint folder (the last is "
                              f"{found[-1]})")


class TrainerWriter(Writer):
    """A Trainer checkpoint folder at the target topology of ``inner`` (a DeepSpeed writer)."""

    latest = None
    tag = None  # the output folder is the checkpoint folder itself

    def __init__(self, inner: DeepSpeedWriter, folder: Path) -> None:
        self.inner, self.folder = inner, folder
        self.format = inner.format
        self.keeps_replicas = inner.keeps_replicas
        self.extra_sources = inner.extra_sources
        target = inner.meta()["target_topology"]
        self.world = target["tp"] * target["dp"] * target.get("pp", 1)
        old = sorted((int(m[1] or 0), f) for f in folder.iterdir() if (m := RNG_RE.match(f.name)))
        self.rng = [] if not old else [(("rng_state.pth" if self.world == 1 else f"rng_state_{r}.pth"),
                                        old[r % len(old)][1]) for r in range(self.world)]
        # a name that is there but no regular file is carried too: its copy refuses it (never a silent omission)
        self.carried = [f for f in (*STATE_FILES, *CARRIED) if (folder / f).exists() or (folder / f).is_symlink()]

    def tp_index(self, rank: int) -> int:
        return self.inner.tp_index(rank)

    def buffers(self) -> list[Buffer]:
        return self.inner.buffers()

    def carries(self, held: Held) -> bool:
        """Trainer's files (copied, the RNG states laid out for the new world) and what the
        DeepSpeed files carry."""
        return Path(held.file).parent == self.folder or self.inner.carries(held)

    def meta(self) -> dict[str, Any]:
        return {**self.inner.meta(), "target": "Hugging Face Trainer checkpoint (DeepSpeed)"}

    def notes(self) -> list[str]:
        notes = list(self.inner.notes())
        if self.rng:
            notes.append("RNG states: " + ", ".join(f"{dst} <- {src.name}" for dst, src in self.rng))
        notes.append(self._batch())
        return notes

    def _batch(self) -> str:
        """The per-device batch x accumulation that keeps the source's global batch."""
        if self.inner.own is None:  # a Trainer checkpoint is written from a DeepSpeed source only
            return "the batch size is not recorded: keep the global batch as before"
        ck = self.inner.own.ck
        cfg = ck.model_state(0).get("ds_config") or {}
        micro, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps", 1)
        old_world = ck.dp  # DeepSpeed's data-parallel world
        if not isinstance(micro, int) or not isinstance(gas, int):
            return "the batch size is not recorded in ds_config: keep per_device_train_batch_size x " \
                   "gradient_accumulation_steps x world size as before"
        total = micro * gas * old_world
        dp = self.inner.meta()["target_topology"]["dp"]
        ways = [f"{m} x {total // (m * dp)}" for m in range(1, total + 1) if total % (m * dp) == 0][:3]
        keep = ("; e.g. per_device_train_batch_size x gradient_accumulation_steps = " + " or ".join(ways)) if ways \
            else f"; {total} is not a multiple of {dp}: the global batch cannot be kept"
        return f"global batch {total} (per device {micro} x accumulation {gas} x {old_world} ranks) at DP={dp}{keep}"

    def jobs(self, engine: Any, staging: Any) -> list:
        prefix = self.inner.tag
        jobs = []
        for job in self.inner.jobs(engine, Prefixed(staging, prefix)):
            jobs.append(ArchiveJob(f"{prefix}/{job.rel}", job.size, job.build) if isinstance(job, ArchiveJob) else job)
        jobs.append((1, partial(_write_text, staging, "latest", prefix)))
        jobs += [(1, partial(staging.copy, self.folder / f, f)) for f in self.carried]
        jobs += [(src.stat().st_size, partial(staging.copy, src, dst)) for dst, src in self.rng]
        return jobs


def _write_text(staging: Any, rel: str, text: str) -> None:
    with staging.open(rel) as out:
        out.write(text.encode())
