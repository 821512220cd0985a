"""Memory hints: views that own their bytes, releasing mapped pages, huge-page staging."""

from __future__ import annotations

import sys

import pytest
import torch

from reshard.formats.pickling import save
from reshard.formats.safe_load import load
from reshard.memory import HUGEPAGE_MIN_BYTES, empty, own_bytes, release

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
