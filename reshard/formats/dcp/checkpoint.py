"""Reading a PyTorch Distributed Checkpoint (DCP) folder: ``.metadata`` plus ``__R_N.distcp`` files,
as ``torch.distributed.checkpoint`` writes them (FSDP2, FSDP x TP, torchtitan, plain ``dcp.save``).

``.metadata`` is a pickle. It is read by an unpickler that admits only DCP's inert metadata records
(and ``torch.Size``, dtypes, layouts, paths); anything else is refused before it can run. Each
tensor entry lists its chunks, boxes of the full tensor; the storage index says where each chunk's
bytes lie (file, offset, length): an embedded ``torch.save`` archive. A chunk is read by parsing
that archive's directory and pickle (again only tensor records admitted) and mapping its bytes from
the file, so only the bytes used are paged in.

Lowering (``docs/spec.md``, DCP section): a tensor's map has one piece per chunk, a box, located on
the storage rank that wrote it (the ``R`` of ``__R_N.distcp``). A rank's shard is its chunk; a rank
that wrote several chunks of one tensor holds them end to end, flat. Chunks must tile the tensor:
an overlap or a hole is a :class:`CheckpointError` naming the file and the tensor.

Keys follow DCP's flattening of ``{"model": ..., "optim": ...}``: ``model.<fqn>``,
``optim.state.<fqn>.<state>``, ``optim.param_groups.<i>.<key>``. A checkpoint of a bare state dict
(no ``model.`` prefix) is read with each tensor key as a parameter name.
"""

from __future__ import annotations

import io
import mmap
import os
import pathlib
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import Piece, View, prod, row_major_strides
from ...layouts._core import box_piece, finish
from ...storage import verified
from ...storage.safe_load import load_bytes, unpickle_with
from .chunks import read_record

__all__ = ["METADATA", "Chunk", "DcpCheckpoint", "TensorEntry", "is_dcp", "read_metadata"]

METADATA = ".metadata"
MODEL, OPTIM_STATE, PARAM_GROUPS = "model.", "optim.state.", "optim.param_groups."
OPTIMIZERS = ("optim.", "optimizer.")  # torch's get_state_dict wrapper key; Accelerate's save_fsdp_optimizer

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "ChunkStorageMetadata"),
    (_DCP, "BytesStorageMetadata"), (_DCP, "MetadataIndex"), (_DCP, "TensorProperties"),
    (_DCP, "StorageMeta"), (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}


def is_dcp(path: Path) -> bool:
    return (path / METADATA).is_file()


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata records and the plain values they hold; nothing that can run code."""

    def __init__(self, f: Any, where: Path) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise CheckpointError(f"{self.where}: refuses to unpickle {module}.{name}: not one of DCP's metadata "
                              "classes (loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.where}: unexpected persistent reference in DCP metadata")


def read_regular(f: Path) -> bytes:
    """The bytes of ``f``, which must be a regular file (a symlink to ``/dev/zero`` or a folder
    is refused before a byte is read: it would never end, or fail unnamed)."""
    try:
        with open(f, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise CheckpointError(f"{f}: not a regular file (a folder, a device or a pipe)")
            return fh.read()
    except OSError as e:
        raise CheckpointError(f"{f}: cannot read ({e.strerror or e})") from None


def read_metadata(path: Path, unpickler: type[pickle.Unpickler] | None = None) -> Any:
    """The ``Metadata`` record of a DCP folder, read without running anything it names
    (``unpickler``: a subclass of ``_MetadataUnpickler`` that admits more, as Megatron's plans)."""
    f = path / METADATA
    md = unpickle_with((unpickler or _MetadataUnpickler)(io.BytesIO(read_regular(f)), f), f,  # type: ignore[call-arg]
                       "DCP metadata")
    if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{f}: not a DCP Metadata record (got {type(md).__name__})")
    return md


@dataclass(frozen=True, slots=True)
class Chunk:
    """One box of a tensor and where its ``torch.save`` record lies."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint folder
    offset: int
    length: int
    rank: int  # the storage rank that wrote it

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


_RANK = re.compile(r"__(\d+)_\d+\.distcp$")


def _storage_rank(rel: str, files: list[str]) -> int:
    m = _RANK.search(rel)
    return int(m.group(1)) if m else files.index(rel)


class DcpCheckpoint:
    """A DCP folder: its tensor entries (with chunk locations), its non-tensor entries, and reads."""

    def __init__(self, path: Path, tensors: dict[str, TensorEntry], objects: dict[str, tuple[str, int, int]],
                 planner_data: dict[str, tuple]) -> None:
        self.path = path
        self.tensors = tensors
        self.objects = objects
        self.planner_data = planner_data
        self._maps: dict[str, ParamMap] = {}
        self._files: dict[str, mmap.mmap | bytes] = {}
        self._checked: dict[str, verified.MappedFile] = {}
        keys = [*tensors, *objects]
        self.optim = next((o for o in OPTIMIZERS if any(k.startswith(o + "state.") or k.startswith(o + "param_groups.")
                                                        for k in keys)), OPTIMIZERS[0])

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path) -> DcpCheckpoint:
        p = Path(path)
        md = read_metadata(p)
        storage = _storage_index(p, md)
        files = sorted({rel for rel, _, _ in storage.values()})
        sizes = _file_sizes(p, files)
        tensors, objects = {}, {}
        for key, entry in md.state_dict_metadata.items():
            if type(entry).__name__ == "BytesStorageMetadata":
                loc = storage.get((key, None))
                if loc is None:
                    raise CheckpointError(f"{p / METADATA}: entry {key!r} has no storage record")
                _check_extent(p, key, loc, sizes)
                objects[key] = loc
                continue
            tensors[key] = _tensor_entry(p, key, entry, storage, sizes, files)
        planner = md.planner_data if isinstance(md.planner_data, dict) else {}
        return cls(p, tensors, objects, {k: tuple(v) for k, v in planner.items() if isinstance(v, (tuple, list))})

    # -- names -----------------------------------------------------------------------------------

    @property
    def structured(self) -> bool:
        """Whether keys follow ``{"model": ..., "optim": ...}`` (else each key is a parameter)."""
        return any(k.startswith(MODEL) for k in self.tensors)

    @property
    def params(self) -> list[str]:
        """Parameter names (fqns), in the checkpoint's order."""
        if not self.structured:  # a bare state dict; an optimizer's own entries are no parameters
            return [k for k in self.tensors if not k.startswith(f"{self.optim}state.")]
        return [k[len(MODEL):] for k in self.tensors if k.startswith(MODEL)]

    def param_key(self, fqn: str) -> str:
        return MODEL + fqn if self.structured else fqn

    def state_key(self, fqn: str, state: str) -> str | None:
        """The key of optimizer state ``state`` (``exp_avg``, ``exp_avg_sq``, ``step``) of ``fqn``."""
        key = f"{self.optim}state.{fqn}.{state}"
        return key if key in self.tensors or key in self.objects else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """``optim.param_groups.<i>.<k>`` gathered into a list of dicts."""
        groups: dict[int, dict[str, Any]] = {}
        for key in self.objects:
            prefix = f"{self.optim}param_groups."
            if not key.startswith(prefix):
                continue
            index, _, name = key[len(prefix):].partition(".")
            if not index.isdigit() or not name:
                raise CheckpointError(f"{self.path / METADATA}: malformed parameter-group key {key!r}")
            groups.setdefault(int(index), {})[name] = self.object(key)
        return [groups[i] for i in sorted(groups)]

    # -- maps and reads --------------------------------------------------------------------------

    def entry(self, key: str) -> TensorEntry:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the DCP metadata") from None

    def param_map(self, key: str) -> ParamMap:
        """``key``'s chunks as a map over the storage ranks (checked: chunks tile the tensor)."""
        m = self._maps.get(key)
        if m is None:
            m = self._maps[key] = _lower(self.path, self.entry(key))
        return m

    def chunk(self, key: str, i: int) -> torch.Tensor:
        """Chunk ``i`` of ``key``, memory-mapped from its file (read-only use)."""
        rec = self._record(key, i)
        verified.touch(rec, f"{key} chunk at {list(self.entry(key).chunks[i].offsets)}")  # checked before the commit
        return rec

    def _record(self, key: str, i: int) -> torch.Tensor:
        """Chunk ``i``'s record, its dtype and shape checked against the metadata's (nothing marked read)."""
        e = self.entry(key)
        c = e.chunks[i]
        data = self._mapped(c.file)
        rec = read_record(data, self._registered(c.file, data), c.offset, c.length,
                          f"{self.path / c.file}: {key!r} chunk at {list(c.offsets)}")
        if rec.dtype != e.dtype or tuple(rec.shape) != c.sizes:
            raise CheckpointError(f"{self.path / c.file}: {key!r} chunk at {list(c.offsets)} holds a "
                                  f"{rec.dtype} {list(rec.shape)} tensor, the metadata says {e.dtype} {list(c.sizes)}")
        return rec

    def check_records(self) -> None:
        """Every chunk's record holds the dtype and shape the metadata says (each record's index and
        pickle read, not its data): a reader's check, so that ``inspect``, which reads no tensor, and
        every route refuse a metadata that disagrees with its files before anything is planned."""
        for key, e in self.tensors.items():
            for i, c in enumerate(e.chunks):
                if c.numel:
                    self._record(key, i)

    def shard(self, key: str, rank: int) -> torch.Tensor:
        """Storage rank ``rank``'s shard of ``key``: its chunk, mapped; several chunks end to end,
        flat (a copy)."""
        idx = [i for i, c in enumerate(self.entry(key).chunks) if c.numel and c.rank == rank]
        if not idx:
            raise CheckpointError(f"{self.path}: storage rank {rank} holds no chunk of {key!r}")
        parts = [self.chunk(key, i) for i in idx]
        return parts[0] if len(parts) == 1 else torch.cat([t.reshape(-1) for t in parts])

    def shards(self, key: str) -> dict[int, torch.Tensor]:
        """Each storage rank's shard of ``key`` (:meth:`shard`)."""
        ranks = sorted({c.rank for c in self.entry(key).chunks if c.numel})
        return {r: self.shard(key, r) for r in ranks}

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``; a single chunk covering it is returned as mapped, uncopied."""
        e = self.entry(key)
        live = [i for i, c in enumerate(e.chunks) if c.numel]
        if len(live) == 1 and e.chunks[live[0]].sizes == e.shape:
            return self.chunk(key, live[0])
        if not e.shape or prod(e.shape) == 0:
            return torch.zeros(e.shape, dtype=e.dtype)
        f = self.param_map(key).rebuild(self.shards(key), verify=False)
        self.release(key)  # F is a copy: the chunks' pages are done with
        return f

    def rows(self, key: str, r0: int, r1: int) -> torch.Tensor | None:
        """Rows ``r0..r1`` (along dim 0) of ``key``, where each of its chunks spans every other dim whole
        (a dim-0 split, as FSDP and ``--files N`` write): views of the mapped chunks, a copy only where
        the rows cross chunks; ``None`` for any other chunking."""
        e = self.entry(key)
        live = sorted(((i, c) for i, c in enumerate(e.chunks) if c.numel), key=lambda ic: ic[1].offsets[0])
        if not e.shape or any(tuple(c.sizes[1:]) != tuple(e.shape[1:]) or any(c.offsets[1:]) for _, c in live):
            return None
        parts = []
        for i, c in live:
            lo, hi = max(r0, c.offsets[0]), min(r1, c.offsets[0] + c.sizes[0])
            if lo < hi:
                parts.append(self.chunk(key, i)[lo - c.offsets[0]:hi - c.offsets[0]])
        if sum(t.shape[0] for t in parts) != r1 - r0:  # the chunks tile the tensor (check()): never, but not silently
            raise CheckpointError(f"{self.path}: {key!r}: its chunks do not hold rows {r0}..{r1}")
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def release(self, key: str) -> None:
        """Drop the mapped pages of ``key``'s chunks from this process's resident set (they stay in
        the page cache), so memory stays at about one tensor however many are read."""
        for c in self.entry(key).chunks:
            m = self._files.get(c.file)
            lo, hi = -(-c.offset // mmap.PAGESIZE) * mmap.PAGESIZE, (c.offset + c.length) // mmap.PAGESIZE * mmap.PAGESIZE
            if isinstance(m, mmap.mmap) and hi > lo:  # our own mapping of the file, alive: safe to drop
                m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def object(self, key: str) -> Any:
        """A non-tensor entry (``torch.save``d by DCP), loaded weights-only."""
        try:
            rel, off, length = self.objects[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no entry {key!r} in the DCP metadata") from None
        raw = self._mapped(rel)[off:off + length]
        where = f"{self.path / rel}: entry {key!r}"
        try:  # a torch.save archive of its own: checked and loaded weights-only, as a file is
            return load_bytes(raw, where)
        except CheckpointError as e:
            detail = str(e).removeprefix(f"{where}: ")
            raise CheckpointError(f"{where} cannot be loaded weights-only ({detail})") from None

    def _mapped(self, rel: str) -> mmap.mmap | bytes:
        m = self._files.get(rel)
        if m is None:
            try:
                with open(self.path / rel, "rb") as fh:
                    st = os.fstat(fh.fileno())
                    if not stat.S_ISREG(st.st_mode):
                        raise CheckpointError(f"{self.path / rel}: not a regular file (a folder or a device)")
                    # a private mapping: pages come in as read, and nothing can write back to the file
                    m = mmap.mmap(fh.fileno(), st.st_size, access=mmap.ACCESS_COPY) if st.st_size else b""
            except OSError as e:
                raise CheckpointError(f"{self.path / rel}: cannot be read ({e.strerror or e})") from None
            self._files[rel] = m
        return m

    def _registered(self, rel: str, data: mmap.mmap | bytes) -> verified.MappedFile:
        """The file's records, registered for checking as its chunks are read."""
        f = self._checked.get(rel)
        if f is None:
            f = self._checked[rel] = verified.MappedFile(self.path / rel, data)
        return f


# -- metadata checks ---------------------------------------------------------------------------


def _storage_index(p: Path, md: Any) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    data = md.storage_data
    if not isinstance(data, dict):
        raise CheckpointError(f"{p / METADATA}: has no storage index (storage_data is {type(data).__name__})")
    out = {}
    for index, info in data.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        rel, off, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(fqn, str) or not isinstance(rel, str) or not isinstance(off, int) or not isinstance(length, int):
            raise CheckpointError(f"{p / METADATA}: malformed storage record {index!r}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{p / rel}: entry {fqn!r} is stored with transforms "
                                  f"{list(info.transform_descriptors)} (compression/extensions), which reshard does not read")
        if rel.startswith("/") or ".." in rel.replace("\\", "/").split("/"):
            raise CheckpointError(f"{p / METADATA}: storage path {rel!r} leaves the checkpoint folder")
        out[(fqn, None if offset is None else tuple(int(x) for x in offset))] = (rel, off, length)
    return out


def _file_sizes(p: Path, files: list[str]) -> dict[str, int | None]:
    sizes: dict[str, int | None] = {}
    for rel in files:
        try:
            sizes[rel] = (p / rel).stat().st_size
        except OSError:
            sizes[rel] = None
    return sizes


def _check_extent(p: Path, key: str, loc: tuple[str, int, int], sizes: dict[str, int | None]) -> None:
    rel, off, length = loc
    have = sizes.get(rel)
    if have is None:
        raise CheckpointError(f"{p / rel}: file is missing (it holds {key!r})")
    if off < 0 or length < 0 or off + length > have:
        raise CheckpointError(f"{p / rel}: truncated: {key!r} lies at bytes [{off}, {off + length}) "
                              f"but the file has {have} bytes")


def _tensor_entry(p: Path, key: str, entry: Any, storage: dict, sizes: dict[str, int | None],
                  files: list[str]) -> TensorEntry:
    props = getattr(entry, "properties", None)
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{p / METADATA}: tensor {key!r} has no dtype")
    shape = tuple(int(x) for x in entry.size)
    chunks, seen = [], set()
    for c in entry.chunks:
        offsets, csizes = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
        if (offsets, csizes) in seen:  # a replica listed twice: the storage index keeps one record of a box
            continue
        seen.add((offsets, csizes))
        if len(offsets) != len(shape) or len(csizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, csizes, shape)):
            raise CheckpointError(f"{p / METADATA}: tensor {key!r} {list(shape)} has a chunk at {list(offsets)} of "
                                  f"size {list(csizes)} outside it")
        loc = storage.get((key, offsets))
        if loc is None:
            raise CheckpointError(f"{p / METADATA}: tensor {key!r} chunk at {list(offsets)} has no storage record")
        _check_extent(p, key, loc, sizes)
        chunks.append(Chunk(offsets, csizes, loc[0], loc[1], loc[2], _storage_rank(loc[0], files)))
    return TensorEntry(key, dtype, shape, tuple(chunks))


def _lower(p: Path, e: TensorEntry) -> ParamMap:
    """One box piece per chunk on its storage rank; then the tiling check."""
    by_rank: dict[int, list[Chunk]] = {}
    for c in e.chunks:
        if c.numel:
            by_rank.setdefault(c.rank, []).append(c)
    shards = {}
    for r, cs in by_rank.items():
        if len(cs) == 1:
            c = cs[0]
            shards[r] = (c.sizes, [box_piece(e.shape, c.offsets, c.sizes, c.sizes, (0,) * len(c.sizes), (r,))])
            continue
        pieces, at = [], 0
        for c in cs:  # several chunks of one rank: end to end, each a box of F flattened
            pieces += _flat_box(e.shape, c, at, r)
            at += c.numel
        shards[r] = ((at,), pieces)
    where = f"{p / METADATA}: tensor {e.key!r} {list(e.shape)}"
    total = sum(c.numel for c in e.chunks)
    if not shards:
        if prod(e.shape):
            raise CheckpointError(f"{where}: has no chunks")
        return finish(e.shape, {0: (e.shape, [])})
    return tiling(e.shape, shards, total, where)


def tiling(shape: tuple[int, ...], shards: dict, total: int, where: str) -> ParamMap:
    """The map of chunks (``shards`` as ``layouts._core.finish`` takes them, ``total`` elements
    in all) that must tile a tensor of ``shape`` exactly: an overlap, a hole or chunks that form
    no valid map is a :class:`CheckpointError` naming ``where`` (DCP and Megatron's chunks)."""
    if total > prod(shape):  # checked first: the map check would only say "already holds"
        raise CheckpointError(f"{where}: chunks overlap ({total} elements in chunks, {prod(shape)} in the tensor)")
    try:
        m = finish(shape, shards)
        holes = m.uncovered()
    except ReshardError as err:
        raise CheckpointError(f"{where}: chunks do not form a valid map ({err})") from None
    if holes:
        raise CheckpointError(f"{where}: chunks leave a hole at {holes[0]} (of {len(holes)})")
    return m


def _flat_box(shape: tuple[int, ...], c: Chunk, at: int, rank: int) -> list[Piece]:
    """A chunk (a box of F, row-major) placed contiguously at ``at`` of a flat shard."""
    fs, cs = row_major_strides(shape), row_major_strides(c.sizes)
    return [Piece(c.sizes, View(sum(a * s for a, s in zip(c.offsets, fs)), fs), View(at, cs), frozenset((rank,)))]
