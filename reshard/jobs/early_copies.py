"""Copies that start before torch is loaded.

Converting a ZeRO-1/2 checkpoint to the universal layout copies its model-state files as they are
(``mp_rank_XX_model_states.pt``): a quarter of the bytes of an fp32 checkpoint, and work that needs
nothing from torch. Importing torch takes ~0.7 s of the command's start-up, on one core. So the
``reshard convert`` command (one process, universal output) creates the staging folder and starts
these copies on a thread first; they run on the other core and on the disk while torch loads, and
the conversion then takes the folder over. The thread only has a head start: a worker that comes
to a file the thread has not begun copies it itself (:meth:`EarlyCopies.take`), so a checkpoint
with many large model-state files is copied at the workers' full parallelism, as without it.

Nothing here imports torch. What the copies are is known from the files' names alone
(``formats.deepspeed.files``); whether the conversion keeps them is not (AutoEP checkpoints rewrite
the model states), so a copy it does not keep is dropped (:meth:`EarlyCopies.drop`), and written
again like any other file where it writes one.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from ..errors import ReshardError
from ..formats.deepspeed.files import MODEL_RE, resolve_tag_dir
from ..storage.staging import Staging

__all__ = ["EarlyCopies"]

_PENDING, _COPYING, _DONE, _DROPPED = "pending", "copying", "done", "dropped"  # a file's state


class EarlyCopies:
    """The model-state files of one conversion, copied into its staging folder by a thread that
    started before torch loaded, or by whoever asks for one first."""

    def __init__(self, tag_dir: Path, staging: Staging, files: list[Path], *, made_out_dir: bool = False) -> None:
        self.tag_dir, self.staging, self.files = tag_dir, staging, frozenset(files)
        self._made_out_dir = made_out_dir  # the staging created the output folder: abandon() removes it if empty
        self._state = dict.fromkeys(sorted(files), _PENDING)
        self._errors: dict[Path, BaseException] = {}
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="reshard-early-copies", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, ckpt_dir: str | Path, out_dir: str | Path, *, overwrite: bool, checksum: str,
              verify_source: bool = True) -> EarlyCopies | None:
        """Start copying the model-state files of the DeepSpeed checkpoint in ``ckpt_dir`` into a
        new staging folder for ``out_dir``; ``None`` (nothing started, nothing created) when
        there are none, or when anything is amiss: the conversion then reports it in its own
        order, as it would have without early copies."""
        try:
            tag = resolve_tag_dir(ckpt_dir)
            files = sorted(p for p in tag.iterdir() if MODEL_RE.match(p.name) and p.is_file())
            if not files:
                return None
            made = not Path(out_dir).exists()
            staging = Staging(out_dir, tag.name, sources=(ckpt_dir, tag), overwrite=overwrite, checksum=checksum,
                              verify_source=verify_source)
        except (ValueError, OSError):  # reshard's errors, and a 'latest' that is not text
            return None
        return cls(tag, staging, files, made_out_dir=made)

    def _claim(self, src: Path | None = None) -> Path | None:
        """Mark ``src`` (or the next pending file) as being copied by the caller; ``None`` if
        there is no such file pending."""
        with self._changed:
            todo = [src] if src is not None else list(self._state)
            for f in todo:
                if self._state[f] == _PENDING:
                    self._state[f] = _COPYING
                    return f
        return None

    def _copy(self, src: Path) -> None:
        try:
            self.staging.copy(src, src.name)
        except BaseException as e:  # noqa: BLE001 - raised by take(), in the job that needs the file
            self._errors[src] = e
        with self._changed:
            self._state[src] = _DONE
            self._changed.notify_all()

    def _run(self) -> None:
        while (src := self._claim()) is not None:
            self._copy(src)

    def _settle(self, src: Path) -> None:
        """Return once ``src`` is not being copied (copying it here if no one has begun)."""
        if src not in self.files:
            raise ReshardError(f"{src}: not among the early copies")
        if self._claim(src) is not None:
            self._copy(src)
        with self._changed:
            self._changed.wait_for(lambda: self._state[src] != _COPYING)

    def take(self, src: Path) -> None:
        """``src``'s copy, in the staging folder with its checksum recorded (as
        :meth:`Staging.copy` leaves it): copied here if the thread has not begun it, else
        waited for. Raises the error that stopped it."""
        self._settle(src)
        error = self._errors.get(src)
        if error is not None:
            raise error

    def drop(self, src: Path) -> None:
        """Make sure ``src`` is not copied, or remove its copy from the staging folder and the
        manifest: the conversion writes that file otherwise, or not at all."""
        with self._changed:
            if self._state.get(src) == _PENDING:
                self._state[src] = _DROPPED
                return
        self._settle(src)
        self.staging.forget(src.name)
        (self.staging.tmp / src.name).unlink(missing_ok=True)

    def abandon(self) -> None:
        """Copy nothing more, wait for the copy under way, remove the staging folder (the
        conversion failed, or is not the one these copies were started for)."""
        with self._changed:
            for f, state in self._state.items():
                if state == _PENDING:
                    self._state[f] = _DROPPED
            self._changed.wait_for(lambda: _COPYING not in self._state.values())
        self.staging.abandon()
        if self._made_out_dir:
            with contextlib.suppress(OSError):  # not empty: another run's output, or the user's
                self.staging.out_dir.rmdir()
