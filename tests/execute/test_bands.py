"""Banded fills (``execute.bands``): a fragment computed a band of rows at a time (a quantized
weight decoded on the way) fills every buffer bit for bit as the whole fragment does, each band
bounded by the band size, whatever the tensor's width: the decoders' row ranges equal the whole
decode's rows, a ``WindowFill`` from a ``Banded`` source equals one from the tensor at every window
size and target layout, and a whole convert / reshard with the band lowered below every weight
(``$RESHARD_BAND_BYTES``) writes the same bytes as with one band per weight."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from reshard import convert, reshard
from reshard.execute.bands import Banded, bounded
from reshard.execute.local import WindowFill
from reshard.formats.safetensors.reader import SafetensorsReader
from reshard.ir.codec import fp8_block_decode, mxfp4_decode
from reshard.ir.piece import View
from reshard.layouts import replicated, split
from reshard.plan.planner import plan
from tests.support.paths import HF


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("shape,block", [((130, 200), (16, 32)), ((3, 37, 50), (8, 16)), ((64, 64), (16, 16))])
def test_fp8_rows_equal_the_whole_decode(shape, block):
    """Any row range, across block rows, partial last blocks and leading (expert) indices."""
    g = torch.Generator().manual_seed(sum(shape))
    q = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    s = torch.rand(grid, generator=g) * 1e-2 + 1e-5
    whole = fp8_block_decode(q, s, block).reshape(-1, shape[-1])
    n = whole.shape[0]
    for r0, r1 in [(0, n), (0, 1), (5, 29), (block[0], 2 * block[0]), (n - 1, n), (7, n), (shape[-2] - 3, shape[-2] + 4)]:
        r0, r1 = min(r0, n), min(r1, n)
        got = fp8_block_decode(q, s, block, (r0, r1))
        assert torch.equal(_bits(got), _bits(whole[r0:r1].reshape(-1))), (r0, r1)


def test_mxfp4_rows_equal_the_whole_decode():
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 5, 4), generator=g, dtype=torch.uint8)
    whole = mxfp4_decode(blocks, scales).reshape(-1, 5)  # [E * in, out]
    for r0, r1 in [(0, 384), (0, 32), (31, 33), (100, 290), (127, 129), (383, 384)]:
        assert torch.equal(_bits(mxfp4_decode(blocks, scales, (r0, r1))), _bits(whole[r0:r1].reshape(-1))), (r0, r1)


def _fill(parts, numel: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    out, fill = torch.empty(numel, dtype=dtype), WindowFill(parts)
    for at in range(0, numel, window):
        fill(out[at:at + window], at)
    return out


@pytest.mark.parametrize("window", [7, 64, 1000])
@pytest.mark.parametrize("dim", [0, 1])
def test_window_fill_from_bands_equals_the_tensor(window, dim):
    """A [40, 24] source to a split along rows or columns (strided reads), cast to bf16, window by
    window: the banded source (bands of 3 rows, aligned to 4) gives the tensor's bytes, and no
    band it computes is wider than the band (or one aligned run past the rows asked for)."""
    full = torch.randn(40, 24, generator=torch.Generator().manual_seed(1))
    flat = full.reshape(-1)
    calls = []

    def rows(r0: int, r1: int) -> torch.Tensor:
        calls.append((r0, r1))
        return flat[r0 * 24:r1 * 24].clone()

    target = split((40, 24), dim, [10, 30] if dim == 0 else [8, 16])
    p = plan(replicated((40, 24), 1), target)
    for rank in target.shards:
        segs = [s for s in p.segments if s.dst_rank == rank]
        numel = target.shard(rank).numel
        want = _fill([(0, s, lambda: flat) for s in segs], numel, window, torch.bfloat16)
        banded = Banded(flat.numel(), torch.float32, 24, rows, align=4, band=3 * 24 * 4)
        got = _fill([(0, s, lambda: banded) for s in segs], numel, window, torch.bfloat16)
        assert torch.equal(_bits(got), _bits(want)), rank
    assert calls and all(r1 - r0 <= 4 + 4 for r0, r1 in calls), calls  # a band: 3 rows, to a multiple of 4


def test_bounded_cuts_a_copy_to_the_limit():
    pieces = list(bounded(View(0, (24, 1)), View(0, (24, 1)), (40, 24), 100))
    assert sum(s[0] * s[1] for _, _, s in pieces) == 40 * 24
    assert all(src.span(shape)[1] - src.span(shape)[0] <= 100 for _, src, shape in pieces)


def _sums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix in (".safetensors", ".distcp")}


@pytest.mark.parametrize("name,fmt", [("fp8_qwen2", "safetensors"), ("mxfp4_gpt_oss", "safetensors"),
                                      ("fp8_qwen2_sharded", "megatron")])
def test_convert_with_small_bands_writes_the_same_bytes(tmp_path, monkeypatch, name, fmt):
    """Bands of 512 bytes (every quantized weight is several) and of 1 GiB (each weight one band,
    the whole decode) write byte-identical files; each decoded tensor of the safetensors output
    is the reader's whole decode (``fragment``)."""
    outs = []
    for band in ("512", str(1 << 30)):
        monkeypatch.setenv("RESHARD_BAND_BYTES", band)
        out = tmp_path / band
        if fmt == "megatron":
            reshard(HF / name, out, to="megatron", tp=2, pp=1)
        else:
            convert(HF / name, out, fmt=fmt)
        outs.append(_sums(out))
    assert outs[0] == outs[1] and outs[0]
    if fmt == "safetensors":
        from safetensors.torch import load_file

        r = SafetensorsReader(HF / name)
        got = {k: v for f in sorted((tmp_path / "512").rglob("*.safetensors")) for k, v in load_file(f).items()}
        assert r.coded
        for n in r.coded:
            assert torch.equal(_bits(got[n].reshape(-1)), _bits(r.fragment(n, "weight", 0))), n


@pytest.mark.parametrize("name", ["fp8_qwen2", "mxfp4_gpt_oss"])
@pytest.mark.parametrize("files", [None, 3])
def test_kept_dcp_decodes_in_bands_as_whole(tmp_path, monkeypatch, name, files):
    """A kept quantized DCP (``--quantize keep``; one file, or each entry chunked over 3) decodes in
    bands (``DcpReader.banded``; bands of 512 bytes, so several a weight) to its whole decode's bits,
    read through ``execute.bands.window`` as the deep check and ``reshard verify`` read it."""
    from reshard.execute.bands import read_bands, window
    from reshard.formats.dcp.reader import DcpReader

    if files is None:
        convert(HF / name, tmp_path / "dcp", fmt="dcp", quantize="keep")
    else:
        reshard(HF / name, tmp_path / "dcp", to="dcp", files=files, quantize="keep")
    monkeypatch.setenv("RESHARD_BAND_BYTES", "512")
    r = DcpReader.open(tmp_path / "dcp" / name)
    r.check()
    assert r.coded
    wholes = {n: r.fragment(n, "weight", 0) for n in r.coded}
    if name.startswith("fp8"):  # a 2-D FP8 weight's bands read only their rows of its chunks: nothing rebuilt whole
        monkeypatch.setattr(r.ck, "full", lambda key: pytest.fail(f"{key} read whole"))
    for n in r.coded:
        whole = wholes[n]
        banded = r.banded(n, "weight", 0)
        assert banded is not None and banded.numel == whole.numel()
        got = torch.cat([window(banded, at, min(700, banded.numel - at)) for at in range(0, banded.numel, 700)])
        assert torch.equal(_bits(got), _bits(whole)), n
        assert read_bands(r.banded(n, "weight", 0)) == whole.numel()
    assert r.banded(next(iter(r.coded)), "exp_avg", 0) is None  # a state not decoded
    assert not r._coded_held  # every held payload dropped after its last row


@pytest.mark.parametrize("name", ["fp8_qwen2", "mxfp4_gpt_oss"])
def test_verify_reads_a_quantized_source_in_bands(tmp_path, monkeypatch, name):
    """``reshard verify SRC`` on a quantized folder and on its kept DCP reads each quantized weight in
    bands (``Reader.banded``), never decoding one whole (``fragment``)."""
    from reshard.formats.dcp.reader import DcpReader
    from reshard.jobs.source_check import check_source

    reshard(HF / name, tmp_path / "dcp", to="dcp", files=2, quantize="keep")

    def whole(self, n, state, rank):
        if n in self.coded and state == "weight":
            raise AssertionError(f"{n} decoded whole")
        return real[type(self)](self, n, state, rank)

    real = {SafetensorsReader: SafetensorsReader.fragment, DcpReader: DcpReader.fragment}
    monkeypatch.setattr(SafetensorsReader, "fragment", whole)
    monkeypatch.setattr(DcpReader, "fragment", whole)
    for src in (HF / name, tmp_path / "dcp" / name):
        checked = check_source(src)
        assert checked.shards > 0 and checked.params > 0
