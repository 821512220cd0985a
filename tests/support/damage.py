"""Damaged copies of committed fixtures, made in a test's ``tmp_path``: one byte flipped inside a
tensor record, a central-directory offset changed, a file truncated. Each returns what it did,
so a test can assert the refusal names it."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

from reshard.storage.zip_index import Record, read_index

_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_CENTRAL_OFFSET_AT = 42  # the local-header offset's place in a central-directory entry


def copy_fixture(src: Path, tmp: Path) -> Path:
    dst = tmp / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def records(path: Path, base: int = 0, size: int | None = None) -> dict[str, Record]:
    """The records of the archive at ``base`` in ``path`` (the whole file by default)."""
    data = path.read_bytes()
    size = len(data) - base if size is None else size
    return read_index(lambda at, n: data[base + at:base + min(at + n, size)], size, str(path)).records


def largest_tensor_record(path: Path, base: int = 0, size: int | None = None) -> Record:
    recs = [r for n, r in records(path, base, size).items() if n.startswith("data/")]
    return max(recs, key=lambda r: r.size)


def flip(path: Path, at: int, bit: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << bit)]))


def flip_tensor(path: Path, base: int = 0, size: int | None = None) -> str:
    """Flip one bit in the middle of the largest tensor record of the archive at ``base``;
    returns the record's name (``data/N``)."""
    rec = largest_tensor_record(path, base, size)
    flip(path, base + rec.start + rec.size // 2)
    return rec.name


def flip_record(path: Path, name: str) -> None:
    """Flip one bit in record ``name`` (``.data/serialization_id``: read by nothing but a CRC check)."""
    rec = records(path)[name]
    flip(path, rec.start + rec.size // 2)


def shift_central_offset(path: Path, by: int = 64) -> str:
    """Move the local-header offset of the largest tensor record's central-directory entry by
    ``by`` bytes (the flipped byte that makes ``torch.load(mmap=True)`` map other bytes);
    returns the record's name."""
    data = bytearray(path.read_bytes())
    rec = largest_tensor_record(path)
    index = read_index(lambda at, n: bytes(data[at:at + n]), len(data), str(path))
    at = index.directory
    while at < len(data) and data[at:at + 4] == b"PK\x01\x02":
        fields = _CENTRAL.unpack_from(data, at)
        nlen, elen, clen, ofs = fields[10], fields[11], fields[12], fields[16]
        if ofs == rec.header:
            struct.pack_into("<I", data, at + _CENTRAL_OFFSET_AT, ofs + by)
            path.write_bytes(bytes(data))
            return rec.name
        at += _CENTRAL.size + nlen + elen + clen
    raise AssertionError(f"{path}: no central-directory entry for {rec.name}")


def truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)
