"""The structure of a ``torch.save`` archive (a zip of stored records), read and checked before
any record is mapped.

``torch.load`` trusts the central directory: a flipped byte in a record's offset there makes it
map other bytes of the file as the tensor, with no error. :func:`read_index` reads every header
itself and refuses an archive whose parts disagree, naming the file and the record:

* the end record closes the file exactly (nothing after it: no truncation, nothing appended);
  a zip64 end record and locator, where present, are where the end record says;
* the central directory lies between the records and the end record, and lists as many entries
  as the end record says, each a stored (uncompressed) record, unencrypted, its two sizes equal;
* every record's local header is where its entry says, with the same name, method and flags;
  its data lies inside the file and before the directory; its data descriptor (or its local
  header's sizes and CRC, without one) repeats the directory's CRC-32 and size;
* no two records overlap, no name is listed twice, and all share one archive folder.

Only headers are read (a few hundred bytes per record); record data is the business of
:mod:`reshard.storage.verified`, which checks each record's CRC-32 when its bytes are read.
Nothing here imports torch: the command's early copies use it before torch loads."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CheckpointError

__all__ = ["Record", "ZipIndex", "is_zip", "read_index"]

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory
_LOC64 = struct.Struct("<4sIQI")  # zip64 end of central directory locator
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record (fixed part)
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_DESCRIPTOR_FLAG, _ENCRYPTED = 0x8, 0x1
MAX_RECORDS = 1 << 20  # far beyond any checkpoint file; bounds the work a forged count can ask for

Reader = Callable[[int, int], bytes]  # (offset, length) -> the bytes there (fewer at the end)


@dataclass(frozen=True, slots=True)
class Record:
    """One stored record: ``name`` without the archive folder, its data at ``start`` (from the
    archive's first byte) for ``size`` bytes, with CRC-32 ``crc``; ``header`` is its local
    header's offset and ``end`` the first byte after its data descriptor."""

    name: str
    header: int
    start: int
    size: int
    crc: int
    end: int


@dataclass(frozen=True, slots=True)
class ZipIndex:
    """An archive's records, checked against each other (module doc). ``prefix`` is the archive
    folder (``archive/``); ``directory`` is where the central directory starts."""

    size: int
    prefix: str
    records: dict[str, Record]
    directory: int

    def record(self, name: str, where: str) -> Record:
        rec = self.records.get(name)
        if rec is None:
            raise CheckpointError(f"{where}: the archive has no record {self.prefix}{name}")
        return rec

    def in_order(self) -> list[Record]:
        return sorted(self.records.values(), key=lambda r: r.header)


def is_zip(head: bytes) -> bool:
    """Whether a file's first bytes are a zip's first local header (every torch.save archive)."""
    return head[:4] == b"PK\x03\x04"


def read_index(read: Reader, size: int, where: str) -> ZipIndex:
    """The archive of ``size`` bytes that ``read`` reads, checked (module doc); ``where`` names
    it in errors (the file, and the chunk for a DCP record)."""
    if size < _EOCD.size or not is_zip(read(0, 4)):
        raise CheckpointError(f"{where}: not a torch.save archive (no zip header; {size} bytes): truncated, "
                              "emptied or another kind of file")
    count, cd_size, cd_ofs = _end_records(read, size, where)
    entries = _directory(read, cd_ofs, cd_size, count, where)
    records: dict[str, Record] = {}
    prefix = None
    for raw_name, entry in entries:
        name = raw_name.split("/", 1)
        folder, rel = (name[0] + "/", name[1]) if len(name) == 2 else ("", name[0])
        if prefix is None:
            prefix = folder
        if folder != prefix or not rel:
            raise CheckpointError(f"{where}: record {raw_name!r} is outside the archive folder {prefix!r}")
        if rel in records:
            raise CheckpointError(f"{where}: record {raw_name!r} is listed twice in the central directory")
        records[rel] = _local(read, raw_name, rel, entry, cd_ofs, where)
    _no_overlaps(records, cd_ofs, where, prefix or "")
    return ZipIndex(size, prefix or "", records, cd_ofs)


def _end_records(read: Reader, size: int, where: str) -> tuple[int, int, int]:
    """(entries, directory size, directory offset) from the end records, which must close the
    file exactly; the directory must end where they start."""
    tail = read(size - _EOCD.size, _EOCD.size)
    sig, disk, cd_disk, n_disk, n, cd_size, cd_ofs, comment = _EOCD.unpack(tail)
    if sig != b"PK\x05\x06" or comment:
        raise CheckpointError(f"{where}: the zip end record is not at the end of the file: truncated, or bytes were "
                              "appended")
    if disk or cd_disk or n != n_disk:
        raise CheckpointError(f"{where}: the zip end record describes a multi-disk archive")
    end = size - _EOCD.size
    loc_at = end - _LOC64.size
    if loc_at >= 0 and read(loc_at, 4) == b"PK\x06\x07":
        lsig, ldisk, eocd64, ldisks = _LOC64.unpack(read(loc_at, _LOC64.size))
        if ldisk or ldisks != 1 or eocd64 + _EOCD64.size > loc_at:
            raise CheckpointError(f"{where}: the zip64 end locator points outside the file")
        raw = read(eocd64, _EOCD64.size)
        if len(raw) != _EOCD64.size:
            raise CheckpointError(f"{where}: the zip64 end record is cut off")
        zsig, zlen, _, _, zdisk, zcd_disk, zn_disk, zn, zcd_size, zcd_ofs = _EOCD64.unpack(raw)
        if zsig != b"PK\x06\x06" or eocd64 + 12 + zlen != loc_at or zdisk or zcd_disk or zn != zn_disk:
            raise CheckpointError(f"{where}: the zip64 end record is not where its locator says, or malformed")
        for small, big, marker, what in ((n, zn, _U16, "entry count"), (cd_size, zcd_size, _U32, "directory size"),
                                         (cd_ofs, zcd_ofs, _U32, "directory offset")):
            if small not in (big, marker):  # the classic field holds the value, or says "see zip64"
                raise CheckpointError(f"{where}: the zip end records disagree on the {what} ({small} and {big})")
        n, cd_size, cd_ofs, end = zn, zcd_size, zcd_ofs, eocd64
    elif _U32 in (cd_size, cd_ofs) or n == _U16:
        raise CheckpointError(f"{where}: the zip end record needs a zip64 record, which is missing")
    if n > MAX_RECORDS or cd_ofs + cd_size != end:
        raise CheckpointError(f"{where}: the central directory ({n} entries at {cd_ofs}, {cd_size} bytes) does not end "
                              f"where the end record starts ({end}): a corrupt directory offset or size")
    return n, cd_size, cd_ofs


@dataclass(frozen=True, slots=True)
class _Entry:
    flags: int
    method: int
    crc: int
    size: int
    header: int


def _directory(read: Reader, cd_ofs: int, cd_size: int, count: int, where: str) -> list[tuple[str, _Entry]]:
    raw = read(cd_ofs, cd_size)
    if len(raw) != cd_size:
        raise CheckpointError(f"{where}: the central directory is cut off")
    out, at = [], 0
    for i in range(count):
        if at + _CENTRAL.size > cd_size:
            raise CheckpointError(f"{where}: the central directory holds fewer than the {count} entries it claims")
        (sig, _, _, flags, method, _, _, crc, csize, usize, nlen, elen, clen, disk, _, _,
         ofs) = _CENTRAL.unpack_from(raw, at)
        if sig != b"PK\x01\x02":
            raise CheckpointError(f"{where}: central directory entry {i} is corrupt (bad signature)")
        name_raw = raw[at + _CENTRAL.size:at + _CENTRAL.size + nlen]
        extra = raw[at + _CENTRAL.size + nlen:at + _CENTRAL.size + nlen + elen]
        at += _CENTRAL.size + nlen + elen + clen
        if at > cd_size:
            raise CheckpointError(f"{where}: central directory entry {i} runs past the directory")
        name = _name(name_raw, flags, where)
        usize, csize, ofs = _zip64(extra, usize, csize, ofs, name, where)
        if method != 0 or flags & _ENCRYPTED or usize != csize or disk not in (0, _U16):
            raise CheckpointError(f"{where}: record {name!r} is compressed or encrypted (method {method}, flags "
                                  f"{flags:#x}) or its sizes disagree: not a torch.save record")
        out.append((name, _Entry(flags, method, crc, usize, ofs)))
    if at != cd_size:
        raise CheckpointError(f"{where}: the central directory holds more than its {count} entries")
    return out


def _name(raw: bytes, flags: int, where: str) -> str:
    try:
        return raw.decode("utf-8" if flags & 0x800 else "cp437")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: a record name is not valid UTF-8 ({raw[:40]!r})") from None


def _zip64(extra: bytes, usize: int, csize: int, ofs: int, name: str, where: str) -> tuple[int, int, int]:
    """The real sizes and offset, from the zip64 extra field where the 32-bit ones are clamped."""
    if _U32 not in (usize, csize, ofs):
        return usize, csize, ofs
    at = 0
    while at + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, at + 4)) if n % 8 == 0 and at + 4 + n <= len(extra) \
                else None
            if vals is None:
                break
            out = []
            for v in (usize, csize, ofs):
                if v == _U32:
                    if not vals:
                        raise CheckpointError(f"{where}: record {name!r}: zip64 field too short")
                    v = vals.pop(0)
                out.append(v)
            return out[0], out[1], out[2]
        at += 4 + n
    raise CheckpointError(f"{where}: record {name!r} needs a zip64 field, which is missing or malformed")


def _local(read: Reader, full: str, rel: str, e: _Entry, cd_ofs: int, where: str) -> Record:
    """The record whose directory entry is ``e``, checked against its local header and descriptor."""
    head = read(e.header, _LOCAL.size)
    if len(head) != _LOCAL.size or e.header + _LOCAL.size > cd_ofs:
        raise CheckpointError(f"{where}: record {full!r}: its local header offset {e.header} is outside the records: "
                              "a corrupt central directory")
    sig, _, flags, method, _, _, crc, csize, usize, nlen, elen = _LOCAL.unpack(head)
    name = read(e.header + _LOCAL.size, nlen)
    if sig != b"PK\x03\x04" or name != full.encode("utf-8" if e.flags & 0x800 else "cp437"):
        raise CheckpointError(f"{where}: record {full!r}: no local header of that name at offset {e.header}: a "
                              "corrupt central directory or local header")
    if method != e.method or (flags & _DESCRIPTOR_FLAG) != (e.flags & _DESCRIPTOR_FLAG):
        raise CheckpointError(f"{where}: record {full!r}: its local header and directory entry disagree "
                              f"(method {method}/{e.method}, flags {flags:#x}/{e.flags:#x})")
    start = e.header + _LOCAL.size + nlen + elen
    data_end = start + e.size
    if data_end > cd_ofs:
        raise CheckpointError(f"{where}: record {full!r}: its {e.size} bytes at {start} run past the records (into "
                              "the central directory): truncated, or a corrupt size")
    if flags & _DESCRIPTOR_FLAG:
        end = _descriptor(read, full, e, data_end, cd_ofs, where)
    else:
        if crc != e.crc or (usize != _U32 and usize != e.size) or (csize != _U32 and csize != e.size):
            raise CheckpointError(f"{where}: record {full!r}: its local header's CRC or size disagrees with the "
                                  "central directory")
        end = data_end
    return Record(rel, e.header, start, e.size, e.crc, end)


def _descriptor(read: Reader, full: str, e: _Entry, at: int, cd_ofs: int, where: str) -> int:
    """The end of the data descriptor at ``at``, which must repeat the entry's CRC and size
    (with or without its signature; 32- or 64-bit sizes)."""
    raw = read(at, 24)
    for sig_len in (4, 0):
        if sig_len and raw[:4] != b"PK\x07\x08":
            continue
        body = raw[sig_len:]
        for fmt, n in (("<IQQ", 20), ("<III", 12)):
            if len(body) >= n and at + sig_len + n <= cd_ofs:
                crc, csize, usize = struct.unpack_from(fmt, body)
                if crc == e.crc and csize == usize == e.size:
                    return at + sig_len + n
    raise CheckpointError(f"{where}: record {full!r}: its data descriptor does not repeat the central directory's "
                          f"CRC-32 {e.crc:08x} and size {e.size}: a corrupt record or directory")


def _no_overlaps(records: dict[str, Record], cd_ofs: int, where: str, prefix: str) -> None:
    ordered = sorted(records.values(), key=lambda r: r.header)
    for a, b in zip(ordered, ordered[1:]):
        if b.header < a.end:
            raise CheckpointError(f"{where}: records {prefix}{a.name!r} and {prefix}{b.name!r} overlap: a corrupt "
                                  "central directory")
    if ordered and ordered[-1].end > cd_ofs:
        raise CheckpointError(f"{where}: record {prefix}{ordered[-1].name!r} overlaps the central directory")
