"""Output staging: checksums as written (with CRC combination), and the CRC arithmetic."""

from __future__ import annotations

import hashlib
import zlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.storage.crc import crc32, crc32_combine
from reshard.storage.pickling import save
from reshard.storage.staging import Staging


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000), seed=st.integers(0, 2**32 - 1))
def test_crc32_combine_equals_crc_of_concatenation(a, b, seed):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(seed, 0, 0) == seed  # nothing appended, nothing changes


@settings(max_examples=100, deadline=None)
@given(a=st.binary(max_size=5000), seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 5000))
def test_fast_crc32_is_zlibs(a, seed, cut):
    """The CRC-32 reshard writes with (ISA-L's where installed) is zlib's, continued or not, on
    bytes and on the memory views and tensors the writers hand it."""
    assert crc32(a) == zlib.crc32(a)
    assert crc32(a[cut:], crc32(a[:cut], seed)) == zlib.crc32(a, seed)
    t = torch.frombuffer(bytearray(a), dtype=torch.uint8) if a else torch.empty(0, dtype=torch.uint8)
    assert crc32(memoryview(t.numpy())) == zlib.crc32(a)


def test_combine_over_large_lengths():
    big = bytes(range(256)) * 40000  # 10 MB
    assert crc32_combine(zlib.crc32(b"head"), zlib.crc32(big), len(big)) == zlib.crc32(b"head" + big)


def _manifest_entry(staging: Staging, rel: str) -> dict:
    return staging.digests[rel]


def test_written_checksums_equal_the_files(tmp_path, monkeypatch):
    """Large torch records take their CRC from torch's data descriptor; every other write is read.
    Either way the manifest holds the CRC (or SHA-256) of the bytes on disk."""
    from reshard.storage import crc

    combined = []
    real = crc.Crc32.extend
    monkeypatch.setattr(crc.Crc32, "extend", lambda self, c, n: (combined.append(n), real(self, c, n)))
    gen = torch.Generator().manual_seed(0)
    obj = {"param": torch.randn(700_000, generator=gen), "small": torch.arange(10),
           "bf16": torch.randn(3, 600_000, generator=gen).bfloat16(), "empty": torch.empty(0), "step": 3}
    for checksum in ("crc32", "sha256"):
        staging = Staging(tmp_path / checksum, "tag", sources=(), checksum=checksum)
        with staging.open("torch.pt") as f:
            save(obj, f)
        with staging.open("raw.bin") as f:  # large writes with no descriptor after them
            f.write(b"x" * (3 << 20))
            f.write(b"PK\x07\x08" + bytes(12))  # looks like a descriptor, wrong size
            f.write(bytes(range(256)) * 8000)  # large, and the last write
        for rel in ("torch.pt", "raw.bin"):
            data = (staging.tmp / rel).read_bytes()
            want = f"{zlib.crc32(data):08x}" if checksum == "crc32" else hashlib.sha256(data).hexdigest()
            assert _manifest_entry(staging, rel) == {"size": len(data), checksum: want}, (checksum, rel)
        staging.abandon()
    assert sorted(combined) == [2_800_000, 3_600_000]  # the two large records, CRC from torch


def test_a_reused_writable_buffer_is_checksummed_as_written(tmp_path, monkeypatch):
    """A caller may refill a writable buffer as soon as ``write`` returns: it is checksummed at
    once, never held back for a later descriptor. Read-only views (torch's) still take the
    record's CRC from the descriptor."""
    from reshard.storage import crc

    combined = []
    real = crc.Crc32.extend
    monkeypatch.setattr(crc.Crc32, "extend", lambda self, c, n: (combined.append(n), real(self, c, n)))
    for checksum in ("crc32", "sha256"):
        staging = Staging(tmp_path / checksum, "tag", sources=(), checksum=checksum)
        buf = bytearray(3 << 20)
        with staging.open("reused.bin") as f:
            for fill in (1, 2, 3):
                buf[:] = bytes([fill]) * len(buf)
                f.write(buf)  # then overwritten by the next round
            record = memoryview(bytes(range(256)) * 8192).toreadonly()  # 2 MiB, like torch's
            f.write(record)
            f.write(b"PK\x07\x08" + zlib.crc32(record).to_bytes(4, "little") + len(record).to_bytes(4, "little") * 2)
            buf[:] = b"\xff" * len(buf)
            f.write(buf)
            buf[:] = b"\0" * len(buf)  # changed after the last write, before the file is closed
        data = (staging.tmp / "reused.bin").read_bytes()
        want = f"{zlib.crc32(data):08x}" if checksum == "crc32" else hashlib.sha256(data).hexdigest()
        assert _manifest_entry(staging, "reused.bin") == {"size": len(data), checksum: want}
        staging.abandon()
    assert combined == [2 << 20]  # only the read-only record, under crc32


def test_writeback_is_started_off_the_workers_thread(tmp_path, monkeypatch):
    """Starting a finished file's writeback may wait on the device; the writer must not. The
    range reaches the writeback thread as it was given, a file gone meanwhile is skipped, and
    commit waits for what is queued before it renames the folder."""
    import os
    import threading

    from reshard.storage import staging as output

    release, seen = threading.Event(), []

    def slow_hint(fd, offset, nbytes):
        release.wait(30)
        seen.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, nbytes))

    monkeypatch.setattr(output, "_hint_writeback", slow_hint)
    staging = Staging(tmp_path / "out", "t", sources=())
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 16))
    staging.copy(src, "a.bin")  # returns although the hint is held
    with staging.open("b.bin") as f:
        f.write(b"x" * 100)
    (staging.tmp / "gone.bin").write_bytes(b"y")
    output.start_writeback(staging.tmp / "gone.bin", 5, 7)
    (staging.tmp / "gone.bin").unlink()
    output.start_writeback(staging.tmp / "b.bin", 64, 36)
    assert seen == []
    committed = threading.Thread(target=staging.commit, args=({}, None))
    committed.start()
    committed.join(0.3)
    assert committed.is_alive() and not (tmp_path / "out" / "t").exists()  # waits for the queue
    release.set()
    committed.join(30)
    assert sorted(seen) == [("a.bin", 0, 0), ("b.bin", 0, 0), ("b.bin", 64, 36)]
    assert (tmp_path / "out" / "t" / "a.bin").read_bytes() == src.read_bytes()
