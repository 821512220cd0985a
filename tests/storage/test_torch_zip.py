"""The streaming torch.save writer: byte-identical to torch.save, loadable (mmap too), zip64, refusals,
and reshard's staging writer on top of it."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from reshard.errors import OutputError, ReshardError
from reshard.storage.pickling import save as reshard_save
from reshard.storage.safe_load import FragmentAddress, ZeroStageEnum
from reshard.storage.safe_load import load as safe_load
from reshard.storage.staging import Staging, verify
from reshard.storage.torch_zip import Storage, TorchZipWriter, save, tensor
from tests.support.zips import objects
from tests.support.zips import torch_bytes as _torch_bytes


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _stream_bytes(obj, **kw) -> bytes:
    buf = io.BytesIO()
    n = save(obj, buf, **kw)
    assert n == len(buf.getvalue())
    return buf.getvalue()


# -- a random object, built twice: with real tensors and with placeholders -----------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(objects())
def test_streamed_file_is_byte_identical_to_torch_save(case):
    real, refs, chunk = case
    ours = _stream_bytes(refs, chunk_bytes=chunk)
    assert ours == _torch_bytes(real)
    assert ours == _torch_bytes(real, reshard_pickler=False)  # torch's C pickler writes the same


def _walk(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, out)
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                   HealthCheck.function_scoped_fixture])
@given(objects())
def test_streamed_file_loads_back_exactly_with_and_without_mmap(tmp_path, case):
    real, refs, chunk = case
    path = tmp_path / "x.pt"
    save(refs, path, chunk_bytes=chunk)
    want = _walk(real, [])
    for mmap in (False, True):
        got = _walk(torch.load(path, weights_only=True, mmap=mmap), [])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert (g.dtype, g.shape, g.stride(), g.storage_offset(), g.requires_grad) == \
                   (w.dtype, w.shape, w.stride(), w.storage_offset(), w.requires_grad)
            assert _bytes_of(g) == _bytes_of(w)
        # storage sharing survives: tensors over one storage share one loaded storage, and only they
        for i, a in enumerate(want):
            for j, b in enumerate(want):
                if a.untyped_storage().nbytes() and b.untyped_storage().nbytes():
                    assert (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()) == \
                           (got[i].untyped_storage().data_ptr() == got[j].untyped_storage().data_ptr())


# -- DeepSpeed-shaped files -----------------------------------------------------------------------


def test_module_dict_of_views_of_one_flat_buffer_with_stand_ins(tmp_path):
    """A model-states dict as reshard writes it: module weights as views of one flat bf16 buffer (a
    tied weight twice), torch.Size shapes, DeepSpeed helper classes, a real fp32 buffer."""
    shapes = {"embed.weight": (16, 8), "ln.weight": (8,), "proj.weight": (4, 8), "proj.bias": (4,)}
    total = sum(torch.Size(s).numel() for s in shapes.values()) + 4  # 4 elements of padding
    flat = torch.randn(total).to(torch.bfloat16)
    flat[-4:] = 0
    ref = Storage(torch.bfloat16, total, lambda out, start: out.copy_(flat[start:start + out.numel()]), label="flat")
    real_mod, ref_mod, off = OrderedDict(), OrderedDict(), 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        real_mod[name] = flat.narrow(0, off, n).view(shape)
        ref_mod[name] = ref.view(shape, offset=off)
        off += n
    buffer = torch.arange(5, dtype=torch.float32)
    real_mod["head.weight"], ref_mod["head.weight"] = real_mod["embed.weight"], ref_mod["embed.weight"]
    real_mod["rope.inv_freq"] = ref_mod["rope.inv_freq"] = buffer

    def states(module):
        return {"module": module, "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())],
                "zero_stage": ZeroStageEnum(2), "slices": OrderedDict(w=FragmentAddress(numel=3, start=5)),
                "ds_version": "0.19.8", "dp_world_size": 2, "frozen_param_fragments": None}

    ours = _stream_bytes(states(ref_mod), chunk_bytes=10)
    assert ours == _torch_bytes(states(real_mod))
    (tmp_path / "m.pt").write_bytes(ours)
    got = safe_load(tmp_path / "m.pt")  # mmap, weights_only, DeepSpeed's classes allowed
    assert got["zero_stage"] == ZeroStageEnum(2) and got["slices"]["w"] == FragmentAddress(numel=3, start=5)
    mod = got["module"]
    assert mod["head.weight"] is mod["embed.weight"]
    assert len({mod[n].untyped_storage().data_ptr() for n in shapes}) == 1
    assert all(torch.equal(mod[n], real_mod[n]) for n in real_mod)


def test_path_save_names_the_archive_like_torch(tmp_path):
    flat = torch.arange(12, dtype=torch.float32)
    ref = Storage(torch.float32, 12, flat.clone())
    reshard_save({"w": flat.view(3, 4), "b": flat[4:8]}, tmp_path / "mp_rank_00_model_states.pt")
    (tmp_path / "out").mkdir()
    save({"w": ref.view((3, 4)), "b": ref.view((4,), offset=4)}, tmp_path / "out" / "mp_rank_00_model_states.pt")
    a = (tmp_path / "mp_rank_00_model_states.pt").read_bytes()
    b = (tmp_path / "out" / "mp_rank_00_model_states.pt").read_bytes()
    assert a == b
    assert zipfile.ZipFile(io.BytesIO(b)).namelist()[0] == "mp_rank_00_model_states/data.pkl"
    got = safe_load(tmp_path / "out" / "mp_rank_00_model_states.pt")
    assert torch.equal(got["w"], flat.view(3, 4)) and got["b"].untyped_storage().data_ptr() == \
        got["w"].untyped_storage().data_ptr()


def test_many_storages_and_data_that_looks_like_a_descriptor():
    """The serialization id hashes every record name (torch's unordered_set order) and every CRC
    torch's writer reads from a write starting with the descriptor signature -- data included."""
    tensors = [torch.full((i % 5 + 1,), i, dtype=torch.int64) for i in range(70)]
    tensors.append(torch.frombuffer(bytearray(b"PK\x07\x08\x01\x02\x03\x04tail"), dtype=torch.uint8))
    refs = [tensor(t.dtype, t.shape, t.clone()) for t in tensors]
    assert _stream_bytes(refs, chunk_bytes=5) == _torch_bytes(tensors)


def test_a_large_storage_in_many_small_chunks():
    data = torch.randn(3 << 18)  # 3 MiB
    chunks = [data[i:i + 1000] for i in range(0, data.numel(), 1000)]
    ref = tensor(torch.float32, data.shape, iter(chunks))
    assert _stream_bytes({"x": ref}) == _torch_bytes({"x": data})
    ref = tensor(torch.float32, data.shape, lambda out, s: out.copy_(data[s:s + out.numel()]))
    assert _stream_bytes({"x": ref}, chunk_bytes=4096 + 4) == _torch_bytes({"x": data})


# -- zip64 ------------------------------------------------------------------------------------------


def _write(obj, sink, **kw) -> None:
    w = TorchZipWriter(sink, **kw)
    for slot in w.dump(obj):
        w.begin()
        src = slot.storage.source if slot.storage is not None else slot.memory
        for chunk in (src if isinstance(src, list) else [src]):
            w.write(chunk)
        w.end()
    w.close()


def test_zip64_headers_with_a_lowered_threshold_load_with_torch(tmp_path):
    """Below the threshold only the fields change: a record of at least it, and every record whose
    header starts at or past it, take zip64 fields; torch, mmap and Python's zipfile all read it."""
    big = torch.randn(300)
    obj = {"small": tensor(torch.float32, (3,), torch.ones(3)), "big": Storage(torch.float32, 300, [big[:7], big[7:]])
           .view((30, 10)), "after": tensor(torch.int64, (2,), torch.tensor([5, 6]))}
    path = tmp_path / "z.pt"
    with open(path, "wb") as f:
        _write(obj, f, zip64_threshold=1000)
    data = path.read_bytes()
    z = zipfile.ZipFile(path)
    assert z.testzip() is None
    for info in z.infolist():
        start = info.header_offset
        name_len, extra_len = struct.unpack_from("<HH", data, start + 26)
        assert (start + 30 + name_len + extra_len) % 64 == 0  # data aligned as torch aligns it
        extra = data[start + 30 + name_len:start + 30 + name_len + extra_len]
        if info.file_size >= 1000 or start >= 1000:
            assert extra[:2] == b"\x01\x00"
            end = start + 30 + name_len + extra_len + info.file_size
            assert data[end:end + 4] == b"PK\x07\x08" and struct.unpack_from("<QQ", data, end + 8) == \
                   (info.file_size, info.file_size)
        else:
            assert extra[:2] == b"FB"
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert torch.equal(got["big"], big.view(30, 10)) and torch.equal(got["after"], torch.tensor([5, 6]))


class _SparseSink:
    """Keeps small writes and only the length of large ones (all zeros here): a 4 GiB archive in a
    few kilobytes, readable back as a file whose large records read as zeros."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, bytes | int]] = []
        self.size = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.parts.append((self.size, bytes(data) if n < 4096 else n))
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def read_at(self, pos: int, n: int) -> bytes:
        out = bytearray()
        for start, part in self.parts:
            length = part if isinstance(part, int) else len(part)
            lo, hi = max(pos, start), min(pos + n, start + length)
            if lo < hi:
                out += bytes(hi - lo) if isinstance(part, int) else part[lo - start:hi - start]
        return bytes(out)


class _SparseReader(io.RawIOBase):
    def __init__(self, sink: _SparseSink) -> None:
        self.sink, self.pos = sink, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.sink.size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        data = self.sink.read_at(self.pos, min(len(b), self.sink.size - self.pos))
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def test_zip64_at_the_real_threshold_without_writing_4_gib():
    """A 4 GiB + 8 byte record (zeros, streamed and CRC'd but never stored) and one after it past
    4 GiB: Python's zipfile finds every record, sizes, offsets and CRCs where the headers say."""
    n = (1 << 30) + 2
    zeros = bytes(64 << 20)
    chunks = [zeros] * 64 + [bytes(8)]
    obj = {"big": tensor(torch.float32, (n,), chunks), "after": tensor(torch.int64, (3,), [torch.tensor([1, 2, 3])])}
    sink = _SparseSink()
    _write(obj, sink)
    z = zipfile.ZipFile(_SparseReader(sink))
    infos = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
    big, after = infos["data/0"], infos["data/1"]
    assert big.file_size == 4 * n and after.header_offset > 1 << 32
    assert z.read("archive/data/1") == torch.tensor([1, 2, 3]).numpy().tobytes()
    assert z.read("archive/data.pkl")[:2] == b"\x80\x02"
    crc = 0
    for c in chunks:
        crc = zlib.crc32(c, crc)
    assert big.CRC == crc
    for info in (big, after):  # data aligned to 64, after the zip64 field and torch's padding
        head = sink.read_at(info.header_offset, 30)
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
        extra = sink.read_at(info.header_offset + 30 + name_len, extra_len)
        fields = (4 * n, 0) if info is big else (info.header_offset,)  # miniz writes a compressed size of 0
        assert extra[:4 + 8 * len(fields)] == struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields)


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks, said", [([b"\0" * 8, b"\0" * 12], "20 were supplied"),
                                          ([b"\0" * 12], "only 12 were supplied")])
def test_wrong_byte_count_names_the_storage_and_fails_the_writer(chunks, said):
    obj = {"a": tensor(torch.float32, (2,), b"\0" * 8), "b": tensor(torch.float32, (4,), iter(chunks), label="exp_avg")}
    buf = io.BytesIO()
    with pytest.raises(OutputError, match=rf"storage '1' \(exp_avg\) takes 16 bytes, {said}"):
        save(obj, buf)
    written = buf.getvalue()  # stops at the last accepted chunk: no descriptor, no central directory
    assert written.endswith(b"\0" * 8) and b"PK\x01\x02" not in written and b"PK\x05\x06" not in written
    w = TorchZipWriter(io.BytesIO())
    w.dump(obj)
    w.begin()
    w.write(b"\0" * 8)
    w.end()
    w.begin()
    with pytest.raises(OutputError, match="storage '1'"):
        for c in chunks:
            w.write(c)
        w.end()
    with pytest.raises(OutputError, match="failed earlier"):
        w.close()


def test_other_misuse_is_refused():
    with pytest.raises(OutputError, match="no source"):
        save({"x": tensor(torch.float32, (2,))}, io.BytesIO())
    with pytest.raises(ZeroDivisionError):
        save({"x": tensor(torch.float32, (2,), lambda out, start: 1 / 0)}, io.BytesIO())
    w = TorchZipWriter(io.BytesIO())
    w.dump([tensor(torch.float32, (1,), b"\0" * 4)])
    with pytest.raises(OutputError, match="closed before storage '0'"):
        w.close()
    with pytest.raises(OutputError, match="out of order"):
        TorchZipWriter(io.BytesIO()).begin()
    with pytest.raises(ReshardError, match="past the storage"):
        Storage(torch.float32, 4).view((2, 3))
    with pytest.raises(ReshardError, match="cannot require grad"):
        Storage(torch.int64, 4).view((4,), requires_grad=True)
    with pytest.raises(ReshardError, match="cannot require grad"):
        Storage(torch.float8_e4m3fn, 4).view((4,), requires_grad=True)  # torch.load could not rebuild it
    with pytest.raises(ReshardError, match="cannot store dtype"):
        Storage(torch.uint4, 4)


def test_a_failed_file_in_staging_is_abandoned(tmp_path):
    staging = Staging(tmp_path, "tag", sources=())
    with pytest.raises(OutputError, match="storage '0'"), staging.open("bad.pt") as f:
        save({"x": tensor(torch.float32, (4,), [b"\0" * 4])}, f)
    staging.abandon()
    assert not (tmp_path / ".reshard-partial-tag").exists() and not (tmp_path / "tag").exists()


# -- through reshard's staging writer ---------------------------------------------------------------


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_staging_checksums_stay_right_when_chunks_reuse_buffers(tmp_path, checksum):
    """The staging writer reads a large write's bytes at the next write (or takes its CRC from the
    descriptor when the write is a whole record): the fill buffers alternate, so what it reads is
    what was written. The manifest must equal the files' real checksums."""
    big = torch.randn(7 << 17)  # 3.5 MiB: 1 MiB chunks, several per record
    one = torch.randn(3 << 17)  # 1.5 MiB in one chunk: CRC from the descriptor
    obj = {"big": tensor(torch.float32, big.shape, lambda out, s: out.copy_(big[s:s + out.numel()])),
           "one": tensor(torch.float32, one.shape, lambda out, s: out.copy_(one[s:s + out.numel()])),
           "mapped": tensor(torch.float32, big.shape, big)}
    staging = Staging(tmp_path, "tag", sources=(), checksum=checksum)
    with staging.open("m.pt") as f:
        save(obj, f, chunk_bytes=1 << 20)
    final = staging.commit({}, latest_name=None)
    verify(final)
    data = (final / "m.pt").read_bytes()
    assert data == _torch_bytes({"big": big, "one": one, "mapped": big.clone()})


def test_windows_written_straight_from_mapped_sources_are_torch_save(tmp_path):
    """A ``WindowFill`` whose segments copy runs in order hands the writer the sources' own
    (memory-mapped) slices and zero gaps instead of filling a buffer; the file is still exactly
    ``torch.save`` of the tensor the segments build, with a strided segment and a scaled one
    falling back to the buffer in their windows."""
    from reshard.execute.local import WindowFill
    from reshard.ir.piece import View
    from reshard.plan.values import Segment

    n = 7 << 20  # 28 MiB of float32
    src = torch.randn(n, generator=torch.Generator().manual_seed(1))
    torch.save(src, tmp_path / "src.pt")
    mapped = safe_load(tmp_path / "src.pt")  # memory-mapped
    segs = [Segment(0, View(0, (1,)), 0, View(0, (1,)), (1 << 20,)),  # runs in order
            Segment(0, View(2 << 20, (1,)), 0, View((1 << 20) + 16, (1,)), (1 << 20,)),  # after a gap of 16
            Segment(0, View(100, (2,)), 0, View((2 << 20) + 16, (1,)), (1000,)),  # strided source
            Segment(0, View(5 << 20, (1,)), 0, View((2 << 20) + 1016, (1,)), (1 << 20,), 0.5)]  # scaled
    total = (3 << 20) + 1016 + 7
    want = torch.zeros(total)
    for s in segs:
        want[s.dst.offset:s.dst.offset + s.numel] = src[s.src.offset:s.src.offset + s.numel * s.src.strides[0]:
                                                        s.src.strides[0]] * s.factor
    fill = WindowFill([(0, s, lambda: mapped) for s in segs])
    used = []
    direct = fill.direct
    fill.direct = lambda *a: used.append(r := direct(*a)) or r  # type: ignore[method-assign]
    staging = Staging(tmp_path / "out", "tag", sources=())
    with staging.open("x.pt") as f:
        save(tensor(torch.float32, (total,), fill), f, chunk_bytes=4 << 20)
    final = staging.commit({}, None)
    buf = io.BytesIO()
    torch.save(want, buf)
    assert (final / "x.pt").read_bytes() == buf.getvalue()
    assert [p is not None for p in used] == [True, True, False, False]  # the last two hold the odd segments
