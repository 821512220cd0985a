"""One offline job (``reshard convert``, ``reshard reshard``) run by every process of a
``torch.distributed`` launch, on one machine or many sharing a file system.

Every process opens the same source and computes the same plan (plans are deterministic), takes a
disjoint share of the output files, balanced by bytes, and writes them into the one staging folder.
The commit is collective: every process reports how it did; only when all succeeded does process 0
write the manifest (with every process's checksums), rename the folder into place and write
``latest``. When any process fails, every process raises the same error and process 0 removes the
staging folder, so no output that looks finished is left. A process that dies or stops answering
makes the others' next collective fail within ``timeout_s``.

Without a launcher (no ``WORLD_SIZE``, or 1) a job runs alone, exactly as before. The collectives
are gloo's over the default group, so CPU-only nodes need nothing else.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from . import errors
from .errors import OutputError, ReshardError
from .formats.output import Staging

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Cluster:
    """This process's place in the job: ``rank`` of ``world`` processes."""

    rank: int = 0
    world: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: Any = None
    owned: bool = False  # whether this object started the process group (and so ends it)

    @classmethod
    def from_env(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> Cluster:
        """The job as the launcher set it up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``); alone when there is no launcher."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return cls(timeout_s=timeout_s)
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        owned = not dist.is_initialized()
        try:
            if owned:
                dist.init_process_group("gloo", timeout=timeout)
            # object collectives need gloo; a job that already runs NCCL gets a gloo group beside it
            group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        except (RuntimeError, ValueError) as e:
            raise OutputError(f"cannot join the launcher's process group ({e})") from None
        cluster = cls(dist.get_rank(), dist.get_world_size(), timeout_s, group, owned)
        if owned:  # a library caller that never calls close() must still not abort at exit
            atexit.register(cluster.close)
        return cluster

    def close(self) -> None:
        """End the process group this object started (gloo's threads must stop before the process
        exits, or it aborts); a group the caller started is left to the caller."""
        if self.owned:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owned = False

    @property
    def alone(self) -> bool:
        return self.world == 1

    def share(self, sizes: Sequence[int]) -> list[int]:
        """Indices of the jobs this process runs: largest first, each to the process with the fewest
        bytes so far (lowest rank on ties). The same on every process; each job runs once."""
        load = [0] * self.world
        mine = []
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            load[r] += sizes[i]
            if r == self.rank:
                mine.append(i)
        return sorted(mine)

    def gather(self, obj: T) -> list[T]:
        """Every process's ``obj`` (small, picklable values of our own processes only)."""
        if self.alone:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:  # gloo: a peer died, or did not answer within the timeout
            raise OutputError(f"process {self.rank} of {self.world}: another process of the job stopped or did not "
                              f"answer within {self.timeout_s:g} s ({_first_line(e)}); nothing was committed") from None
        return out

    def agree(self, error: BaseException | None) -> None:
        """Raise, on every process alike, the first error any process reports (``None``: this one
        succeeded). Errors travel as their class name and message, never as pickles."""
        reports = self.gather(None if error is None else _describe(error))
        failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
        if not failed:
            return
        if error is not None and failed[0][0] == self.rank:
            raise error
        rank, (name, message) = failed[0]
        raise _rebuild(name, f"process {rank} of {self.world}: {message}")


def _describe(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error) or repr(error)


def _rebuild(name: str, message: str) -> BaseException:
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, ReshardError):
        return cls(message)
    return OutputError(message)  # anything else (a crash, a bug) stops the job as an output failure


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def open_staging(cluster: Cluster, out_dir: str | Path, tag: str, *, overwrite: bool, checksum: str) -> Staging:
    """The job's staging folder: process 0 creates it (clearing what a killed run left), the others
    join it once it exists."""
    staging, error = None, None
    if cluster.rank == 0:
        try:
            staging = Staging(out_dir, tag, overwrite=overwrite, checksum=checksum)
        except ReshardError as e:
            error = e
    cluster.agree(error)
    if staging is None:
        staging = Staging(out_dir, tag, overwrite=overwrite, checksum=checksum, join=True)
    return staging


def run_share(cluster: Cluster, staging: Staging, jobs: Sequence[tuple[int, Callable[[], None]]],
              run: Callable[[list[Callable[[], None]]], None]) -> None:
    """Run this process's share of ``jobs`` (``(bytes, job)``) with ``run``, then agree with the
    others; on any failure the staging folder is removed and every process raises."""
    mine = [jobs[i][1] for i in cluster.share([size for size, _ in jobs])]
    try:
        run(mine)
    except BaseException as e:
        error: BaseException | None = e
    else:
        error = None
    try:
        cluster.agree(error)
    except BaseException:
        if cluster.rank == 0 or cluster.alone:
            staging.abandon()
        raise


def commit(cluster: Cluster, staging: Staging, meta: dict[str, Any], latest_name: str | None) -> Path:
    """Process 0 commits with every process's checksums; the others wait for it and learn whether
    it succeeded."""
    digests = cluster.gather(staging.digests)
    final, error = staging.final, None
    if cluster.rank == 0:
        for d in digests:
            staging.digests.update(d)
        try:
            final = staging.commit(meta, latest_name)
        except BaseException as e:
            staging.abandon()
            error = e
    cluster.agree(error)
    return final
