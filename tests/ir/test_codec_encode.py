"""``reshard.ir.codec.fp8_block_encode`` against transformers' own ``Fp8Quantize``, bit for bit, on
block-multiple shapes (both scale formats, bf16/fp32/fp16 inputs, expert-style leading dims, all-zero
blocks, any run length); partial last blocks as the decoder reads them (zero-padded, quantized,
cropped); ``decode(encode(x))`` within E4M3's rounding of ``x``; a NaN/inf block refused by index."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import QuantizedError
from reshard.ir import codec
from reshard.ir.codec import fp8_block_decode, fp8_block_encode, scale_grid

transformers = pytest.importorskip("transformers")
from transformers import FineGrainedFP8Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Quantize  # noqa: E402

FORMATS = {"float32": "float", "ue8m0": "ue8m0"}  # ours -> FineGrainedFP8Config's scale_fmt


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _transformers(x: torch.Tensor, block: tuple[int, int], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    config = FineGrainedFP8Config(weight_block_size=block, scale_fmt=FORMATS[fmt])
    out = Fp8Quantize(SimpleNamespace(quantization_config=config)).convert({"m.weight": x})
    return out["m.weight"], out["m.weight_scale_inv"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("shape", "block"), [((256, 384), (128, 128)), ((64, 96), (16, 32)), ((3, 32, 64), (32, 32)),
                                             ((8, 8), (8, 8))])
@pytest.mark.parametrize("run", [1, 1 << 20])  # elements per run: one block row at a time, or all
def test_equals_transformers_fp8_quantize(fmt: str, dtype: torch.dtype, shape: tuple[int, ...],
                                          block: tuple[int, int], run: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_RUN", run)
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 0.1).to(dtype)
    x[..., :block[0], :block[1]] = 0  # an all-zero block: scale 1, payload 0
    x.view(-1)[-1] = 1e4  # a large value: its block's amax
    want_q, want_s = _transformers(x, block, fmt)
    assert want_q.dtype == torch.float8_e4m3fn  # transformers quantized it (a block-multiple shape)
    q, s = fp8_block_encode(x, block, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == codec.SCALE_FORMATS[fmt]
    assert tuple(s.shape) == scale_grid(tuple(shape), block) == tuple(want_s.shape)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))


def _padded_reference(x: torch.Tensor, block: tuple[int, int], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The convention for a partial last block: zero-pad to whole blocks, quantize (transformers'
    quantizer, which takes whole blocks only), crop the payload."""
    rows, cols = x.shape
    pr, pc = -(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]
    padded = torch.nn.functional.pad(x.float(), (0, pc - cols, 0, pr - rows)).to(x.dtype)
    q, s = _transformers(padded, block, fmt)
    return q[:rows, :cols], s


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shape", [(576, 256), (130, 200), (3, 5), (129, 128), (128, 257)])
def test_partial_blocks_are_zero_padded_then_cropped(fmt: str, shape: tuple[int, int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_RUN", 3 * 128 * 128)  # runs that end inside the grid, not on its last row
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 0.02).to(torch.bfloat16)
    want_q, want_s = _padded_reference(x, (128, 128), fmt)
    q, s = fp8_block_encode(x, (128, 128), fmt)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))


def _within_rounding(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> None:
    """``decode(encode(x))`` is ``x`` to E4M3's precision: relative 2**-4 for a normal value,
    2**-10 of the block's scale below (E4M3's subnormal step is 2**-9), a little slack for the two
    float32 products."""
    back = fp8_block_decode(q, s, block)
    rows, cols = torch.meshgrid(torch.arange(x.shape[-2]), torch.arange(x.shape[-1]), indexing="ij")
    inv = codec.e8m0(s) if s.dtype == torch.float8_e8m0fnu else s
    bound = x.float().abs() * 2.0 ** -4 + inv[rows // block[0], cols // block[1]] * 2.0 ** -10
    assert bool(((back - x.float()).abs() <= bound * 1.0001).all())


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), bm=st.integers(1, 16), bn=st.integers(1, 16),
       magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]), fmt=st.sampled_from(sorted(FORMATS)),
       seed=st.integers(0, 2**16))
def test_any_shape_and_block(rows: int, cols: int, bm: int, bn: int, magnitude: float, fmt: str, seed: int) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, s = fp8_block_encode(x, (bm, bn), fmt)
    want_q, want_s = _padded_reference(x, (bm, bn), fmt)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))
    _within_rounding(x, q, s, (bm, bn))
    if fmt == "float32":  # each block's amax lands on E4M3's largest value (448), a zero block's scale is 1
        blocks = torch.nn.functional.pad(q.float(), (0, -cols % bn, 0, -rows % bm)).reshape(-1, bm, s.shape[1], bn)
        top = blocks.abs().amax(dim=(1, 3))
        assert bool(((top == 448) | (top == 0) & (s == 1)).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_value_refused_naming_its_block(bad: float) -> None:
    x = torch.zeros(2, 40, 70)
    x[1, 37, 65] = bad
    with pytest.raises(QuantizedError, match=r"block \[1, 2, 2\] holds a NaN or infinite value"):
        fp8_block_encode(x, (16, 32))


def test_tiny_block_float32_refused_ue8m0_held() -> None:
    """448 / amax overflows float32 for amax below ~1.3e-36 (transformers would write a zero scale and
    NaN payload there): refused for float32 scales; UE8M0 clamps it to 2**-126 and holds it."""
    x = torch.zeros(4, 4)
    x[0, 0] = 1e-38
    with pytest.raises(QuantizedError, match=r"block \[0, 0\]'s largest magnitude is below"):
        fp8_block_encode(x, (4, 4))
    q, s = fp8_block_encode(x, (4, 4), "ue8m0")
    assert float(codec.e8m0(s)) == 2.0 ** -126 and torch.equal(fp8_block_decode(q, s, (4, 4))[0, 1:], torch.zeros(3))


def test_leading_dims_encode_each_matrix() -> None:
    """Experts-style ``[E, rows, cols]`` with partial blocks: each matrix encoded on its own."""
    x = torch.randn(3, 37, 50, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    q, s = fp8_block_encode(x, (16, 32), "ue8m0")
    for i in range(3):
        qi, si = fp8_block_encode(x[i], (16, 32), "ue8m0")
        assert torch.equal(_bits(q[i]), _bits(qi)) and torch.equal(_bits(s[i]), _bits(si))
