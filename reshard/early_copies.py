"""Copies that start before torch is loaded.

Converting a ZeRO-1/2 checkpoint to the universal layout copies its model-state files as they are
(``mp_rank_XX_model_states.pt``): a quarter of the bytes of an fp32 checkpoint, and work that needs
nothing from torch. Importing torch takes ~0.7 s of the command's start-up, on one core. So the
``reshard convert`` command (one process, universal output) creates the staging folder and starts
these copies on a thread first; they run on the other core and on the disk while torch loads, and
the conversion then takes the folder and the finished copies over.

Nothing here imports torch. What the copies are is known from the files' names alone
(``formats.deepspeed_files``); whether the conversion keeps them is not (AutoEP checkpoints rewrite
the model states), so a copy it does not keep is dropped (:meth:`EarlyCopies.drop`), and written
again like any other file where it writes one.
"""

from __future__ import annotations

import threading
from pathlib import Path

from .errors import ReshardError
from .formats.deepspeed_files import MODEL_RE, resolve_tag_dir
from .formats.output import Staging

__all__ = ["EarlyCopies"]


class EarlyCopies:
    """The model-state files of one conversion, being copied into its staging folder."""

    def __init__(self, tag_dir: Path, staging: Staging, files: list[Path]) -> None:
        self.tag_dir, self.staging, self.files = tag_dir, staging, frozenset(files)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sorted(files),), name="reshard-early-copies",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, ckpt_dir: str | Path, out_dir: str | Path, *, overwrite: bool, checksum: str) -> EarlyCopies | None:
        """Start copying the model-state files of the DeepSpeed checkpoint in ``ckpt_dir`` into a
        new staging folder for ``out_dir``; ``None`` (nothing started, nothing created) when
        there are none, or when anything is amiss: the conversion then reports it in its own
        order, as it would have without early copies."""
        try:
            tag = resolve_tag_dir(ckpt_dir)
            files = sorted(p for p in tag.iterdir() if MODEL_RE.match(p.name) and p.is_file())
            if not files:
                return None
            staging = Staging(out_dir, tag.name, overwrite=overwrite, checksum=checksum)
        except (ReshardError, OSError):
            return None
        return cls(tag, staging, files)

    def _run(self, files: list[Path]) -> None:
        try:
            for src in files:
                self.staging.copy(src, src.name)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the copies
            self._error = e

    def take(self, src: Path) -> None:
        """Wait for the copies; raise the error that stopped them, if any. ``src``'s copy is
        then in the staging folder and its checksum recorded, as :meth:`Staging.copy` leaves it."""
        if src not in self.files:
            raise ReshardError(f"{src}: not among the early copies")
        self._thread.join()
        if self._error is not None:
            raise self._error

    def drop(self, src: Path) -> None:
        """Wait for the copies, then remove ``src``'s from the staging folder and the manifest:
        the conversion writes that file otherwise, or not at all."""
        self._thread.join()
        self.staging.forget(src.name)
        (self.staging.tmp / src.name).unlink(missing_ok=True)

    def abandon(self) -> None:
        """Wait for the copies, then remove the staging folder (the conversion failed)."""
        self._thread.join()
        self.staging.abandon()
