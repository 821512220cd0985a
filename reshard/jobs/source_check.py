"""``reshard verify SRC`` on a source checkpoint (a folder with no reshard manifest): everything
reshard can check of it, without writing anything.

* the reader's checks (``formats/*/reader``, ``formats/deepspeed/checks``): opening the source
  runs every check that can refuse it, as before any job;
* every record's CRC-32: each file of the source folder is read once, a ``torch.save`` archive
  checked as a verbatim copy is (``storage.copy_check``: structure, each record's CRC-32, what
  its pickle imports), a JSON file parsed; then every shard the reader exposes is read through
  the verified registry (``storage.verified``), which covers the records inside other files
  (DCP's ``.distcp``: one archive per record);
* the deep check (``jobs.deep_check``): module weights against their fp32 masters;
* what the source holds beside its parameter states (``Reader.unlowered``), counted by kind: what
  a route may report as not carried, or refuse.

The first fault raises a :class:`~reshard.errors.CheckpointError` naming the file (and record,
parameter, rank); nothing is printed of a source that fails."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..execute.bands import read_bands
from ..formats.contract import Held, Reader
from ..formats.registry import open_reader
from ..storage import verified
from ..storage.copy_check import digest, regular
from ..storage.crc import Crc32
from .deep_check import DeepCheck, deep_check

__all__ = ["SourceCheck", "check_source"]


@dataclass(frozen=True, slots=True)
class SourceCheck:
    """What ``check_source`` checked."""

    path: Path
    format: str
    description: str
    params: int
    files: int
    bytes_read: int
    shards: int
    deep: DeepCheck
    seconds: float
    held: tuple[Held, ...] = ()

    def lines(self) -> list[str]:
        return [f"{self.path}: {self.format} source ({self.description}) verified",
                f"  reader checks: {self.params} parameters' keys, shapes and dtypes, partitions and layouts",
                f"  records: {self.files} files read and checked ({self.bytes_read:,} bytes: archive structure, every "
                f"record's CRC-32, pickles), {self.shards} shards read through the verified reads",
                f"  {self.deep}",
                *self._held(),
                f"  {self.seconds:.2f} s"]

    def _held(self) -> list[str]:
        if not self.held:
            return []
        weights = sum(h.what == "weights" for h in self.held)
        return [f"  held beside the parameters: {len(self.held)} entries ({weights} model weights, "
                f"{len(self.held) - weights} a run's state); a route writes, reports or refuses each"]


def check_source(path: str | Path) -> SourceCheck:
    """Open the source checkpoint at ``path`` and check everything (module doc)."""
    t0 = time.perf_counter()
    with verified.verifying(True):
        verified.forget_pending()
        reader = open_reader(path)
        files, nbytes = _check_files(_folders(reader))
        shards = _read_shards(reader)
        deep = deep_check(reader)
        held = tuple(reader.unlowered())
    return SourceCheck(Path(path), reader.format, reader.description, len(reader.names), files,
                       nbytes, shards, deep, time.perf_counter() - t0, held)


def _folders(reader: Reader) -> list[Path]:
    """The folders the source's files lie in: its sources, less those holding another (a
    DeepSpeed parent with ``latest`` holds other tags too)."""
    dirs = [Path(p) for p in reader.sources if Path(p).is_dir()]
    return [d for d in dirs if not any(o != d and d in o.parents for o in dirs)]


def _check_files(folders: list[Path]) -> tuple[int, int]:
    files = nbytes = 0
    for folder in folders:
        for root, dirs, names in os.walk(folder):
            dirs.sort()
            for name in sorted(names):
                p = Path(root) / name
                try:
                    with open(p, "rb") as f:
                        size = regular(p, f.fileno())
                        digest(f.fileno(), size, Crc32(), p, verify=True)
                except OSError as e:
                    raise CheckpointError(f"{p}: cannot be read ({e.strerror or e})") from None
                files += 1
                nbytes += size
    return files, nbytes


def _read_shards(reader: Reader) -> int:
    """Every shard of every parameter state the reader exposes, its records checked; a shard the
    reader computes (a quantized weight decoded) a band at a time (``Reader.banded``: memory follows
    the band, not the weight)."""
    n = 0
    for name in reader.names:
        for state in reader.states(name):
            for rank in reader.map(name, state).ranks:
                banded = reader.banded(name, state, rank)
                if banded is not None:
                    read_bands(banded)
                else:
                    verified.touch(reader.fragment(name, state, rank), f"{name} ({state}, rank {rank})")
                n += 1
        verified.finish()
    return n
