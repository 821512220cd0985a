"""Archives written in stripes (``storage.zip_stripes``): whatever the number of stripes, the order they
are written in and the order their reports arrive in, the file is byte for byte ``torch.save``'s,
and the checksum recorded for the manifest is the file's. A stripe that was not written is named."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.errors import OutputError
from reshard.storage.staging import Staging
from reshard.storage.torch_zip import Storage
from reshard.storage.zip_stripes import Archive
from tests.support.zips import objects
from tests.support.zips import torch_bytes as _torch_bytes


class _Fill:
    """A fill callable that may be cut (``fresh``), as ``execute.WindowFill`` may."""

    def __init__(self, fill) -> None:
        self.fill = fill

    def __call__(self, out, start) -> None:
        self.fill(out, start)

    def fresh(self) -> _Fill:
        return _Fill(self.fill)


def _cuttable(obj, seen=None):
    """Give every callable source in ``obj`` a ``fresh``, so its storage may be cut."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    storage = getattr(obj, "storage", None)
    if isinstance(storage, Storage) and callable(storage.source) and not hasattr(storage.source, "fresh"):
        storage.source = _Fill(storage.source)
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in items:
        _cuttable(v, seen)


def _in_stripes(tmp_path, obj, stripes: int, seed: int, **kw) -> bytes:
    staging = Staging(tmp_path / f"out{seed}-{stripes}", "tag", sources=())
    archive = Archive(staging, "f.pt", obj, stripes, **kw)
    order = list(range(archive.stripes))
    rng = random.Random(seed)
    rng.shuffle(order)
    written = [w for i in order for w in archive.write_stripe(i)]
    rng.shuffle(written)
    archive.finish(written)
    data = staging.path("f.pt").read_bytes()
    assert len(data) == archive.size
    assert staging.digests["f.pt"] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    return data


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(objects(), st.integers(1, 9), st.sampled_from([1, 2, 8, 64]), st.integers(0, 10**6), st.booleans())
def test_written_in_any_stripes_in_any_order_is_torch_save(tmp_path, case, stripes, align, seed, cuttable):
    real, refs, chunk = case
    if cuttable:
        _cuttable(refs)
    assert _in_stripes(tmp_path, refs, stripes, seed, align=align, chunk_bytes=chunk) == _torch_bytes(real)


def _big(n: int = 5000):
    """Storages of several dtypes over many pages, one beginning like a data descriptor."""
    g = torch.Generator().manual_seed(n)
    flats = [torch.randn(n, generator=g), torch.randn(3 * n, generator=g).to(torch.bfloat16),
             torch.randint(0, 2**31, (n,), generator=g, dtype=torch.int64)]
    flats[2][0] = int.from_bytes(b"PK\x07\x08\x01\x02\x03\x04", "little")  # torch's writer takes it for a descriptor
    refs = {f"t{i}": Storage(f.dtype, f.numel(), _Fill(lambda out, start, f=f: out.copy_(f[start:start + out.numel()])),
                                  label=f"t{i}")
            .view((f.numel(),)) for i, f in enumerate(flats)}
    refs["whole"] = Storage(torch.float32, n, iter([flats[0]])).view((n,))  # only in order: one stripe
    refs["real"] = flats[1].clone()
    real = {f"t{i}": f for i, f in enumerate(flats)} | {"whole": flats[0].clone(), "real": flats[1].clone()}
    return real, refs


@pytest.mark.parametrize("stripes", [1, 2, 5, 40])
def test_large_storages_cut_at_pages_are_torch_save(tmp_path, stripes):
    real, refs = _big()
    assert _in_stripes(tmp_path, refs, stripes, stripes, chunk_bytes=3000) == _torch_bytes(real)
    archive = Archive(Staging(tmp_path / "layout", "tag", sources=()), "f.pt", _big()[1], stripes)
    inner = [(archive.offsets[k] + c) for k, row in enumerate(archive.cuts) for c in row
             if 0 < c < archive.slots[k].nbytes]
    assert all(at % 4096 == 0 for at in inner)  # no two stripes share a page of the file
    if stripes > 1:
        assert inner  # and the storages are cut


def test_a_stripe_not_written_is_named(tmp_path):
    real, refs = _big()
    staging = Staging(tmp_path / "out", "tag", sources=())
    archive = Archive(staging, "f.pt", refs, 4)
    written = [w for i in (0, 1, 3) for w in archive.write_stripe(i)]
    with pytest.raises(OutputError, match=r"f\.pt: storage '\d' \(t\d\): bytes from \d+ on were not written"):
        archive.finish(written)


def test_a_stripe_written_twice_is_refused(tmp_path):
    real, refs = _big()
    staging = Staging(tmp_path / "out", "tag", sources=())
    archive = Archive(staging, "f.pt", refs, 3)
    written = [w for i in (0, 1, 1, 2) for w in archive.write_stripe(i)]
    with pytest.raises(OutputError, match=r"f\.pt: storage '\d' \(\w+\): bytes from \d+ on were written twice"):
        archive.finish(written)
