"""The decoders of ``reshard.ir.codec`` against transformers' own dequantizing ops, bit for bit,
over every E8M0 exponent, every nibble, every target dtype; a partial last block as DeepSeek's
reference formula (per element, ``q[i, j] * s[i // bm, j // bn]``)."""

from __future__ import annotations

import pytest
import torch

from reshard.ir import codec
from reshard.ir.codec import fp8_block_decode, mxfp4_decode, mxfp4_shape, scale_grid

transformers = pytest.importorskip("transformers")
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_equals_convert_moe_packed_tensors_over_every_exponent(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 85, 2, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble, low and high
    scales = torch.arange(255, dtype=torch.uint8).repeat(2)[:3 * 85 * 2].reshape(3, 85, 2)  # 0 .. 254: all finite
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = mxfp4_decode(blocks, scales)
    assert got.dtype == torch.float32 and tuple(got.shape) == mxfp4_shape(tuple(blocks.shape)) == (3, 64, 85)
    assert torch.equal(_bits(got.to(dtype)), _bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", ["float32", "bfloat16", "uint8", "e8m0"])
def test_fp8_equals_transformers_fp8_dequantize(dtype: torch.dtype, scale: str) -> None:
    g = torch.Generator().manual_seed(1)
    payload = (torch.randn(2, 64, 96, generator=g) * 300).to(torch.float8_e4m3fn)  # experts-style leading dim
    grid = scale_grid(tuple(payload.shape), (16, 32))
    assert grid == (2, 4, 3)
    if scale in ("uint8", "e8m0"):
        s = torch.randint(90, 160, grid, generator=g, dtype=torch.uint8)
        s = s.view(torch.float8_e8m0fnu) if scale == "e8m0" else s
    else:
        s = (torch.rand(grid, generator=g) * 1e-2 + 1e-8).to(getattr(torch, scale))
    want = Fp8Dequantize(None)._dequantize_one(payload, s, output_dtype=dtype)
    got = fp8_block_decode(payload, s, (16, 32))
    assert got.dtype == torch.float32 and torch.equal(_bits(got.to(dtype)), _bits(want))


@pytest.mark.parametrize("run", [1, 300, 1 << 22])  # elements widened at a time: one block row, a few, all
@pytest.mark.parametrize("shape", [(130, 200), (1, 1), (129, 128), (128, 257), (0, 5)])
def test_fp8_partial_blocks_per_element(shape: tuple[int, int], run: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_RUN", run)
    g = torch.Generator().manual_seed(2)
    payload = (torch.randn(shape, generator=g) * 100).to(torch.float8_e5m2)
    grid = scale_grid(shape, (128, 128))
    s = torch.rand(grid, generator=g) + 0.5
    s = s[:, :, None].expand(*grid, 2)[..., 0]  # a non-contiguous scale tensor reads the same
    rows, cols = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    want = payload.to(torch.float32) * s[rows // 128, cols // 128]
    assert torch.equal(_bits(fp8_block_decode(payload, s, (128, 128))), _bits(want))
