"""One offline job (``reshard convert``, ``reshard reshard``) run by every process of a
``torch.distributed`` launch, on one machine or many sharing a file system.

Every process opens the same source and computes the same plan (plans are deterministic), takes a
disjoint share of the output, balanced by bytes, and writes it into the one staging folder. Large
archives (``ArchiveJob``) are shared stripe by stripe (``storage.zip_stripes``): any process or
worker writes any stripe at its place in the file, and once all are written one process finishes
each archive from every process's stripe checksums.
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
import functools
import heapq
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .. import errors
from ..errors import OutputError, ReshardError
from ..storage.staging import ArchiveJob, Staging

if TYPE_CHECKING:  # zip_stripes loads torch; the command line imports this module before it may
    from ..storage.zip_stripes import Archive, Written

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
                _init_process_group(timeout)
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
        loads = [(0, r) for r in range(self.world)]  # a heap: (bytes so far, rank)
        mine = []
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            load, r = heapq.heappop(loads)
            heapq.heappush(loads, (load + sizes[i], r))
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


def _init_process_group(timeout: timedelta) -> None:
    """gloo's default group over the launcher's rendezvous. Where process 0 serves the store
    (a plain launcher, not ``torchrun``'s agent), the others wait for its port to open before
    connecting: torch's client, started first, backs off for 0.3-0.7 s per failed attempt, which
    every process paid at start-up."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not all(
            k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK")):
        dist.init_process_group("gloo", timeout=timeout)  # torch names what is missing
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        _wait_for_port(host, port, timeout.total_seconds())
    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def _wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"process 0's store at {host}:{port} did not open within {timeout_s:g} s ({e})") \
                    from None
            time.sleep(0.005)


def _describe(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error) or repr(error)


def _rebuild(name: str, message: str) -> BaseException:
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, ReshardError):
        return cls(message)
    return OutputError(message)  # anything else (a crash, a bug) stops the job as an output failure


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def open_staging(cluster: Cluster, out_dir: str | Path, tag: str, *, sources: Sequence[str | Path], overwrite: bool,
                 checksum: str, verify_source: bool = True) -> Staging:
    """The job's staging folder: process 0 creates it (clearing what a killed run left), the others
    join it once it exists. ``sources``: the paths the job reads, which the output must not touch;
    ``verify_source``: whether files copied verbatim are checked (``storage.copy_check``)."""
    staging, error = None, None
    if cluster.rank == 0:
        try:
            staging = Staging(out_dir, tag, sources=sources, overwrite=overwrite, checksum=checksum,
                              verify_source=verify_source)
        except ReshardError as e:
            error = e
    cluster.agree(error)
    if staging is None:
        staging = Staging(out_dir, tag, sources=sources, overwrite=overwrite, checksum=checksum, join=True,
                          verify_source=verify_source)
    return staging


class _Stripes:
    """One archive's stripes in this process: its layout, built on first use, and what was written."""

    def __init__(self, staging: Staging, job: ArchiveJob, stripes: int) -> None:
        self.staging, self.job, self.stripes = staging, job, stripes
        self._lock = threading.Lock()
        self._archive: Archive | None = None
        self.written: list[Written] = []

    def archive(self) -> Archive:
        with self._lock:
            if self._archive is None:
                from ..storage.zip_stripes import Archive

                self._archive = Archive(self.staging, self.job.rel, self.job.build(), self.stripes)
            return self._archive

    def write(self, i: int) -> None:
        done = self.archive().write_stripe(i)
        with self._lock:
            self.written += done


# a job of a share: ``(bytes, run)``, or an archive to write in stripes
OutputJob = tuple[int, Callable[[], None]] | ArchiveJob


def _units(staging: Staging, jobs: Sequence[OutputJob], stripe_size: int
           ) -> tuple[list[tuple[int, Callable[[], None]]], list[_Stripes]]:
    """Every job as units of work ``(bytes, run)``: an archive's stripes, taken one stripe of
    each job in turn (largest jobs first), so that workers taking units in order write different
    files at once (writers of one file queue on its lock in the kernel)."""
    from ..storage.zip_stripes import stripe_count

    groups: list[list[tuple[int, Callable[[], None]]]] = []
    archives = []
    for job in jobs:
        if isinstance(job, ArchiveJob):
            n = stripe_count(job.size, stripe_size)
            stripes = _Stripes(staging, job, n)
            archives.append(stripes)
            groups.append([(max(1, job.size // n), functools.partial(stripes.write, i)) for i in range(n)])
        else:
            groups.append([job])
    groups.sort(key=lambda g: -sum(size for size, _ in g))
    rounds = max((len(g) for g in groups), default=0)
    return [g[r] for r in range(rounds) for g in groups if r < len(g)], archives


def stripe_bytes() -> int:
    """How large the stripes of an archive are: ``RESHARD_STRIPE_BYTES`` (bytes) if set, else
    ``zip_stripes.STRIPE_BYTES``. Every process of a job must see the same value."""
    from ..storage.zip_stripes import STRIPE_BYTES

    raw = os.environ.get("RESHARD_STRIPE_BYTES")
    if raw is None:
        return STRIPE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ReshardError(f"RESHARD_STRIPE_BYTES must be a positive number of bytes, got {raw!r}")
    return value


def run_share(cluster: Cluster, staging: Staging, jobs: Sequence[OutputJob],
              run: Callable[[list[Callable[[], None]]], None]) -> None:
    """Run this process's share of ``jobs`` (``(bytes, job)``, or archives to write in stripes)
    with ``run``, then agree with the others; then each archive is finished by one process from
    every process's stripes. On any failure the staging folder is removed and every process
    raises."""
    archives: list[_Stripes] = []

    def mine() -> None:
        units, found = _units(staging, jobs, stripe_bytes())
        archives.extend(found)
        run([units[i][1] for i in cluster.share([size for size, _ in units])])

    agreed(cluster, staging, mine)
    if archives:
        agreed(cluster, staging, lambda: _finish(cluster, archives))


def _finish(cluster: Cluster, archives: list[_Stripes]) -> None:
    """Every process's spans of every archive, then this process's archives finished."""
    written = cluster.gather([a.written for a in archives])
    for j, stripes in enumerate(archives):
        if j % cluster.world == cluster.rank:
            stripes.archive().finish([w for per_process in written for w in per_process[j]])


def agreed(cluster: Cluster, staging: Staging, step: Callable[[], None]) -> None:
    """Run ``step`` here, then agree with every process on how it went: on any failure anywhere
    the staging folder is removed and every process raises the same error."""
    try:
        step()
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
