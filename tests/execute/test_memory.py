"""Memory hints: views that own their bytes, releasing mapped pages, huge-page staging."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from reshard.execute.memory import HUGEPAGE_MIN_BYTES, empty, own_bytes, release, trim_heap
from reshard.storage.pickling import save
from reshard.storage.safe_load import load

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux")


def _vma(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``addr``."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                if entry is not None:
                    return entry
                if lo <= addr < hi:
                    entry = {}
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert entry is not None, "address not mapped"
    return entry


def test_own_bytes_saves_only_the_view_and_shares_memory(tmp_path):
    big = torch.randn(1 << 16)
    view = big.narrow(0, 1000, 64)
    own = own_bytes(view)
    assert own.data_ptr() == view.data_ptr() and torch.equal(own, view)
    save(own, tmp_path / "own.pt")
    save(view, tmp_path / "view.pt")
    assert (tmp_path / "own.pt").stat().st_size < 4096 < (tmp_path / "view.pt").stat().st_size
    assert torch.equal(load(tmp_path / "own.pt"), view)
    assert own_bytes(big[:0]).numel() == 0
    with pytest.raises(ValueError, match="contiguous"):
        own_bytes(big.view(256, 256).t())


@linux
def test_release_drops_mapped_pages_and_never_touches_anonymous_memory(tmp_path):
    data = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    save(data, tmp_path / "t.pt")
    mapped = load(tmp_path / "t.pt")  # memory-mapped
    assert torch.equal(mapped, data)  # pages now resident
    before = int(_vma(mapped.data_ptr())["Rss"].split()[0])
    release(mapped)
    after = int(_vma(mapped.data_ptr())["Rss"].split()[0])
    assert after < before // 4
    assert torch.equal(mapped, data)  # re-read from the page cache
    anon = data.clone()
    release(anon)  # anonymous memory: dropping pages would zero them, so release must not
    assert torch.equal(anon, data)


@linux
def test_large_host_buffers_ask_for_huge_pages():
    big = empty(HUGEPAGE_MIN_BYTES + (4 << 20), torch.uint8)
    assert "hg" in _vma(big.data_ptr() + (4 << 20)).get("VmFlags", "").split()
    big.fill_(7)
    assert int(big.sum()) == 7 * big.numel()
    small = empty(1024, torch.float32)
    assert small.shape == (1024,) and small.dtype == torch.float32


@linux
def test_file_bytes_finds_mapped_bytes_and_refuses_written_pages(tmp_path):
    """``file_bytes`` names the file and offset of mapped, unmodified bytes (what lets a writer
    copy file to file), and refuses anonymous memory and a private mapping's written pages (a
    copy-on-write page no longer equals the file)."""
    import mmap

    from reshard.execute.memory import file_bytes

    path = tmp_path / "data.bin"
    data = bytes(range(256)) * 64 * 1024  # 16 MiB
    path.write_bytes(data)
    with open(path, "rb") as f:
        ro = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        rw = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(ro)[12345:12345 + (3 << 20)]
    where = file_bytes(view)
    assert where is not None and where[1] == 12345 and open(where[0], "rb").read()[12345:12346] == data[12345:12346]
    assert file_bytes(memoryview(bytearray(data[:1 << 20]))) is None  # anonymous memory
    private = memoryview(rw)
    assert file_bytes(private[:1 << 20]) is not None  # read, never written: still the file
    private[5 << 20] = 7  # one page becomes a private copy
    assert file_bytes(private[4 << 20:6 << 20]) is None
    assert file_bytes(private[8 << 20:10 << 20]) == (str(path), 8 << 20)
    for v in (view, private):
        v.release()
    ro.close()
    rw.close()


@linux
def test_staged_writes_of_mapped_bytes_are_the_bytes(tmp_path, monkeypatch):
    """A staged file written from mapped memory (copied by the kernel from the source file) holds
    exactly those bytes, and its manifest checksum is theirs."""
    import mmap
    import os
    import zlib

    from reshard.storage.staging import Staging

    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a[2]) or real(*a))

    src = tmp_path / "src.bin"
    data = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    src.write_bytes(data.numpy().tobytes())
    with open(src, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    staging = Staging(tmp_path / "out", "tag", sources=())
    with staging.open("a.bin") as out:
        out.write(b"head")
        out.write(memoryview(mapped)[100:100 + (3 << 20)])
        out.write(bytearray(b"tail"))
    final = staging.commit({}, None)
    assert sum(calls) == 3 << 20  # the mapped bytes went file to file, the small writes did not
    want = b"head" + data.numpy().tobytes()[100:100 + (3 << 20)] + b"tail"
    assert (final / "a.bin").read_bytes() == want
    assert staging.digests["a.bin"]["crc32"] == f"{zlib.crc32(want):08x}"
    mapped.close()


@linux
def test_stale_entries_in_the_table_of_mappings_are_never_trusted(tmp_path):
    """The table of this process's mappings is cached, and mappings come and go at reused
    addresses. Planted stale entries: one calling anonymous memory a mapped file (trusted, it
    would have ``release`` discard live data), one calling a mapped file anonymous memory (trusted,
    it would hide the file from ``file_bytes``)."""
    import mmap

    import numpy as np

    from reshard.execute import memory
    from reshard.execute.memory import file_bytes

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * (16 << 12))  # 4 MiB
    st = path.stat()
    t = torch.full((8 << 20,), 0x5A, dtype=torch.uint8)  # private anonymous memory (malloc's own mapping)
    lo = t.data_ptr()
    memory._MAPS[:] = [(lo, lo + (8 << 20), 0, str(path), (st.st_dev, st.st_ino))]  # stale: "a file"
    release(t)
    assert bool((t == 0x5A).all())  # pages kept: the entry was checked, found stale, re-read
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(mapped)
    addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    memory._MAPS[:] = [(addr, addr + (4 << 20), 0, "", (0, 0))]  # stale: "anonymous"
    assert file_bytes(view[4096:(1 << 20) + 4096]) == (str(path), 4096)
    view.release()
    mapped.close()


def _anonymous_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:")) / 1024


@linux
@pytest.mark.skipif(any(k.startswith("MALLOC_") for k in os.environ), reason="glibc tuned by the environment")
def test_trim_heap_hands_back_the_free_pages_between_live_heap_chunks():
    """What grew the FP8 DeepSeek-V3 import by ~30 MiB a layer: band-sized temporaries served from
    glibc's heap (its mmap threshold rises to the largest mapping freed, up to 32 MiB) leave holes
    between live chunks that stay resident once freed; ``trim_heap`` (called as each band is
    replaced, ``bands.Banded``) hands them back."""
    first = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
    del first  # a freed 24 MiB mapping: glibc serves 4 MiB from its heap from now on
    chunks = [torch.empty(4 << 20, dtype=torch.uint8).fill_(1) for _ in range(16)]
    kept = chunks[1::2]  # every other chunk freed: 8 holes of 4 MiB between live chunks
    del chunks
    freed = _anonymous_mib()
    if not trim_heap():
        pytest.skip("no malloc_trim (not glibc)")
    assert freed - _anonymous_mib() >= 24, "the 32 MiB of holes between live chunks stayed resident"
    assert all(int(k[0]) == 1 for k in kept)


@linux
@pytest.mark.skipif(any(k.startswith("MALLOC_") for k in os.environ), reason="glibc tuned by the environment")
def test_trim_heap_above_a_bound_trims_only_once_the_resident_set_grew_past_it():
    """``bands.Banded`` trims only once the resident set grew by two bands since the last trim: pages
    handed back at every band are faulted in again by the next (~13 % of an FP8 export's CPU)."""
    if not trim_heap():  # the floor: the resident set right after a trim
        pytest.skip("no malloc_trim (not glibc)")
    first = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
    del first
    chunks = [torch.empty(4 << 20, dtype=torch.uint8).fill_(1) for _ in range(16)]
    kept = chunks[1::2]
    del chunks
    held = _anonymous_mib()
    trim_heap(above=1 << 40)  # grown by less than the bound: the holes stay for the next band to reuse
    assert held - _anonymous_mib() < 8
    trim_heap(above=1 << 20)  # grown past it: handed back
    assert held - _anonymous_mib() >= 24
    assert all(int(k[0]) == 1 for k in kept)
