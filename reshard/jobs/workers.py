"""Run a job's independent pieces of work (one output file, one parameter) on a pool of threads,
with progress. The one pool ``reshard convert`` and ``reshard reshard`` share: the heavy parts
(strided copies, CRC, file writes) release the GIL, so threads overlap reads, copies and writes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

Job = Callable[[], None]


def run_jobs(jobs: Sequence[Job], workers: int, *, progress: Callable[[], None] | None = None,
             keep_going: tuple[type[BaseException], ...] = ()) -> None:
    """Run every job on ``workers`` threads, calling ``progress()`` as each finishes. A job that
    raises one of ``keep_going`` does not stop the others (so every drifted replica is reported at
    once); the first such error is raised at the end. Any other error stops the run."""
    held: list[BaseException] = []

    def guarded(job: Job) -> None:
        try:
            job()
        except keep_going as e:
            held.append(e)

    if workers <= 1:
        for job in jobs:
            guarded(job)
            if progress:
                progress()
    else:
        # Jobs already run in parallel; torch's own intra-op threads would only contend.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for fut in [pool.submit(guarded, job) for job in jobs]:
                    fut.result()
                    if progress:
                        progress()
        finally:
            torch.set_num_threads(threads)
    if held:
        raise held[0]


class Progress:
    """Counts finished units and reports them: to a callback ``(done, total)``, to a tqdm bar on an
    interactive terminal, or nowhere."""

    def __init__(self, progress: Callable[[int, int], None] | bool | None, total: int, unit: str, desc: str) -> None:
        self.total, self.done = total, 0
        self.callback = progress if callable(progress) else None
        self.bar = None
        if self.callback is None and (progress is True or (progress is None and sys.stderr.isatty())):
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_with_progress(jobs: Sequence[Job], workers: int, progress: Callable[[int, int], None] | bool | None,
                      unit: str, desc: str) -> None:
    """:func:`run_jobs` reporting each finished job to a :class:`Progress`."""
    bar = Progress(progress, len(jobs), unit, desc)
    try:
        run_jobs(jobs, workers, progress=bar.update)
    finally:
        bar.close()
