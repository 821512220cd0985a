"""Output staging: checksums as written (with CRC combination), and the CRC arithmetic."""

from __future__ import annotations

import hashlib
import zlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.formats.crc import crc32_combine
from reshard.formats.output import Staging
from reshard.formats.pickling import save


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000), seed=st.integers(0, 2**32 - 1))
def test_crc32_combine_equals_crc_of_concatenation(a, b, seed):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(seed, 0, 0) == seed  # nothing appended, nothing changes


def test_combine_over_large_lengths():
    big = bytes(range(256)) * 40000  # 10 MB
    assert crc32_combine(zlib.crc32(b"head"), zlib.crc32(big), len(big)) == zlib.crc32(b"head" + big)


def _manifest_entry(staging: Staging, rel: str) -> dict:
    return staging.digests[rel]


def test_written_checksums_equal_the_files(tmp_path, monkeypatch):
    """Large torch records take their CRC from torch's data descriptor; every other write is read.
    Either way the manifest holds the CRC (or SHA-256) of the bytes on disk."""
    from reshard.formats import crc

    combined = []
    real = crc.Crc32.extend
    monkeypatch.setattr(crc.Crc32, "extend", lambda self, c, n: (combined.append(n), real(self, c, n)))
    gen = torch.Generator().manual_seed(0)
    obj = {"param": torch.randn(700_000, generator=gen), "small": torch.arange(10),
           "bf16": torch.randn(3, 600_000, generator=gen).bfloat16(), "empty": torch.empty(0), "step": 3}
    for checksum in ("crc32", "sha256"):
        staging = Staging(tmp_path / checksum, "tag", checksum=checksum)
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
