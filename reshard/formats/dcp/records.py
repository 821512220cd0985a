"""Writing a PyTorch Distributed Checkpoint (DCP) folder that ``torch.distributed.checkpoint.load``
reads at any world size: ``.distcp`` files of ``torch.save`` records laid end to end, and a
``.metadata`` pickle of DCP's own records (the reader is ``formats.dcp``; the format is described in
``docs/dcp-checkpoints.md``).

Files are written independently (by any worker or process); each returns the storage records of
what it wrote, and one process writes ``.metadata`` from all of them, last.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ...storage import torch_zip

__all__ = ["DcpFile", "Record", "TensorSpec", "metadata_bytes"]


@dataclass(frozen=True, slots=True)
class Record:
    """Where one entry (a tensor chunk, or a non-tensor value) was written."""

    key: str
    offsets: tuple[int, ...] | None  # the chunk's offsets; None for a non-tensor value
    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor entry of the metadata: dtype, full shape and the chunks it is stored in."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes)


Fill = Callable[[torch.Tensor, int], None]


class DcpFile:
    """One ``.distcp`` file, written front to back: tensor chunks and values, each a ``torch.save``
    record as DCP's own writer makes them."""

    def __init__(self, out: BinaryIO, name: str) -> None:
        self.out, self.name, self.at = out, name, 0
        self.records: list[Record] = []

    def tensor(self, key: str, offsets: Sequence[int], dtype: torch.dtype, sizes: Sequence[int],
               source: torch.Tensor | Fill) -> None:
        """A chunk at ``offsets`` of tensor ``key``: a contiguous tensor, or ``fill(out, start)``
        producing it window by window (``torch_zip.save``)."""
        ref = torch_zip.tensor(dtype, tuple(sizes), source)
        n = torch_zip.save(ref, self.out)
        self.records.append(Record(key, tuple(offsets), self.name, self.at, n))
        self.at += n

    def value(self, key: str, value: Any) -> None:
        """A non-tensor entry; DCP stores these with ``torch.save`` (read back weights-only)."""
        buf = io.BytesIO()
        torch.save(value, buf)
        self.out.write(buf.getbuffer())
        n = buf.tell()
        self.records.append(Record(key, None, self.name, self.at, n))
        self.at += n


def metadata_bytes(tensors: Mapping[str, TensorSpec], values: Iterable[str], records: Iterable[Record],
                   planner_data: Mapping[str, tuple]) -> bytes:
    """The ``.metadata`` pickle: DCP's own record classes, so ``dcp.load`` reads it as its own."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    # pickle shares equal objects by identity: interned names make the bytes the same whichever
    # process built which record (a job over several processes writes what one process writes)
    tensors = {sys.intern(k): v for k, v in tensors.items()}
    values = [sys.intern(k) for k in values]
    records = [Record(sys.intern(r.key), r.offsets, sys.intern(r.file), r.offset, r.length) for r in records]
    planner_data = {sys.intern(k): tuple(sys.intern(x) if isinstance(x, str) else x for x in v)
                    for k, v in planner_data.items()}
    sd: dict[str, Any] = {}
    for key, spec in tensors.items():
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in spec.chunks]
        sd[key] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), torch.Size(spec.shape), chunks)
    for key in values:
        sd[key] = BytesStorageMetadata()
    index: dict[str, dict[tuple[int, ...], int]] = {
        k: {tuple(o): i for i, (o, _) in enumerate(s.chunks)} for k, s in tensors.items()}
    storage = {}
    for r in sorted(records, key=lambda r: (r.file, r.offset)):
        where = None if r.offsets is None else torch.Size(r.offsets)
        i = None if r.offsets is None else index[r.key][r.offsets]
        storage[MetadataIndex(r.key, where, i)] = _StorageInfo(r.file, r.offset, r.length)
    md = Metadata(state_dict_metadata=sd, planner_data=dict(planner_data), storage_data=storage, version="1.0.0")
    return pickle.dumps(md, protocol=4)
