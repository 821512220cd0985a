"""Quantized weights decoded to their values (docs/spec.md §"Quantized sources"): pure tensor math,
no I/O. Each decoder returns the float32 products; a target of another dtype casts them once, as
transformers' dequantizing load computes in float32 and then casts to the model's dtype.

* **FP8 block scales** (DeepSeek-V3/R1, Qwen3-FP8, transformers' ``FineGrainedFP8Config``): a
  payload ``q`` ``[..., rows, cols]`` (E4M3 or E5M2) and one scale per ``bm x bn`` block,
  ``s`` ``[..., ceil(rows/bm), ceil(cols/bn)]``; ``w[i, j] = float32(q[i, j]) * s[i // bm, j // bn]``,
  the products DeepSeek's reference forms (pad to whole blocks, multiply, crop). Scales are float32
  (any float dtype, converted exactly) or E8M0 (``float8_e8m0fnu``, or its byte in ``uint8``:
  ``2 ** (byte - 127)``).
* **MXFP4** (gpt-oss): ``blocks`` uint8 ``[E, out, G, 16]`` (32 E2M1 values per block, the low
  nibble first) and ``scales`` uint8 ``[E, out, G]`` (E8M0 exponents, bias 127):
  ``w = ldexp(E2M1[nibble], scale - 127)``, laid out ``[E, in = 32 G, out]`` as the HF model holds
  its experts -- transformers' ``convert_moe_packed_tensors`` step for step.

And one encoder, the inverse direction of the first: :func:`fp8_block_encode`, transformers'
``Fp8Quantize`` expression for expression (so bit for bit), with a partial last block defined as the
decoder defines it: padded with zeros to a whole block, quantized, cropped.
"""

from __future__ import annotations

from math import prod

import torch

from ..errors import QuantizedError

__all__ = ["E2M1", "FP8_MAX", "MXFP4_BYTES", "MXFP4_VALUES_PER_BYTE", "SCALE_FORMATS", "e8m0", "fp8_block_decode",
           "fp8_block_encode", "mxfp4_decode", "mxfp4_shape", "scale_grid"]

# the sixteen E2M1 values by nibble (OCP MX spec; transformers' FP4_VALUES)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BYTES = 16  # bytes of one MXFP4 block: 32 values
MXFP4_VALUES_PER_BYTE = 2
E8M0_NAN = 255  # the one E8M0 byte that is not a power of two
_RUN = 1 << 20  # elements of FP8 payload widened at a time
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: a block's largest magnitude maps to it
# weight_scale_inv's storage: float32 (DeepSeek-V3) or a power of two in one byte (UE8M0, DeepSeek-V4)
SCALE_FORMATS = {"float32": torch.float32, "ue8m0": torch.float8_e8m0fnu}


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a payload of ``shape`` in ``block``-sized blocks (the last
    block of each of the two trailing dims may be partial)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def e8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as float32: ``2 ** (byte - 127)``, from ``float8_e8m0fnu`` or its bytes."""
    if scales.dtype == torch.uint8:
        return (scales.to(torch.float32) - 127.0).exp2()
    return scales.to(torch.float32)


def fp8_block_decode(payload: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                     rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``payload`` (``[..., rows, cols]``, FP8) times its per-block ``scales`` (``scale_grid``'s
    shape), in float32, shaped as ``payload``. Each element is multiplied by its block's scale (the
    products of DeepSeek's pad-multiply-crop and of transformers' block reshape, bit for bit), a
    run of whole block rows at a time: memory is the output and one run.

    ``rows`` ``(r0, r1)``: only those rows of the payload seen as ``[prod(lead) * rows, cols]``,
    flat (``(r1 - r0) * cols`` elements): each element's product is the same as in the whole
    decode (a band of a weight, docs/spec.md §1: memory follows the rows, not the weight)."""
    *lead, n_rows, cols = payload.shape
    bm, bn = block
    s = e8m0(scales) if scales.dtype in (torch.uint8, torch.float8_e8m0fnu) else scales.to(torch.float32)
    n = prod(lead)
    q, s = payload.reshape(n, n_rows, cols), s.reshape(n, -(-n_rows // bm), -(-cols // bn))
    if rows is None:
        out = torch.empty(q.shape, dtype=torch.float32)
        for i in range(n):
            _decode_rows(q[i], s[i], 0, n_rows, block, out[i])
        return out.reshape(payload.shape)
    r0, r1 = rows
    out = torch.empty((r1 - r0, cols), dtype=torch.float32)
    for i in range(r0 // max(1, n_rows), -(-r1 // max(1, n_rows))):  # each leading index the rows reach
        a, b = max(r0, i * n_rows) - i * n_rows, min(r1, (i + 1) * n_rows) - i * n_rows
        a0, b0 = a // bm * bm, min(n_rows, -(-b // bm) * bm)  # whole blocks: decoded as in the whole weight
        if (a0, b0) == (a, b):
            _decode_rows(q[i], s[i], a, b, block, out[i * n_rows + a - r0:i * n_rows + b - r0])
        else:
            part = torch.empty((b0 - a0, cols), dtype=torch.float32)
            _decode_rows(q[i], s[i], a0, b0, block, part)
            out[i * n_rows + a - r0:i * n_rows + b - r0] = part[a - a0:b - a0]
    return out.reshape(-1)


def _decode_rows(q: torch.Tensor, s: torch.Tensor, lo: int, hi: int, block: tuple[int, int], out: torch.Tensor) -> None:
    """Rows ``lo..hi`` of one payload ``q`` ``[rows, cols]`` (``lo`` a multiple of the block's rows,
    ``hi`` one too or the last row) decoded into ``out`` ``[hi - lo, cols]``, a run of whole
    block rows (about ``_RUN`` elements) at a time."""
    rows, cols = q.shape
    bm, bn = block
    k = -(-cols // bn)
    step = max(1, _RUN // max(1, bm * cols)) * bm  # rows per run: whole blocks, about _RUN elements
    for r0 in range(lo, hi, step):
        r1 = min(hi, r0 + step)
        nb = -(-(r1 - r0) // bm)
        scale = s[r0 // bm:r0 // bm + nb].reshape(nb, 1, k, 1)
        dst = out[r0 - lo:r1 - lo]
        if (r1 - r0) % bm or cols % bn:  # a partial last block: pad, multiply, crop
            padded = torch.nn.functional.pad(q[r0:r1].to(torch.float32), (0, k * bn - cols, 0, nb * bm - r1 + r0))
            dst[:] = (padded.reshape(nb, bm, k, bn) * scale).reshape(nb * bm, k * bn)[:r1 - r0, :cols]
        else:
            torch.mul(q[r0:r1].to(torch.float32).reshape(nb, bm, k, bn), scale, out=dst.view(nb, bm, k, bn))


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The decoded weight's shape: ``[E, in, out]`` of ``blocks`` ``[E, out, G, 16]``."""
    e, out, g, b = blocks_shape
    return (e, g * b * MXFP4_VALUES_PER_BYTE, out)


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``blocks`` ``[E, out, G, 16]`` and ``scales`` ``[E, out, G]`` as float32 ``[E, in, out]``,
    one expert at a time: memory is the output and one expert's values.

    ``rows`` ``(r0, r1)``: only those rows of the result seen as ``[E * in, out]``, flat: each value
    the same as in the whole decode (each is one table value times a power of two), the blocks of
    the 32-row groups they fall in decoded, the rest cropped."""
    e, n_out, g, b = blocks.shape
    per = b * MXFP4_VALUES_PER_BYTE  # input rows of one block
    # a byte's two values (low nibble first) in one lookup: the same values as nibble by nibble, faster
    pairs = torch.tensor([[E2M1[v & 0x0F], E2M1[v >> 4]] for v in range(256)], dtype=torch.float32)
    n_in = g * per
    r0, r1 = rows if rows is not None else (0, e * n_in)
    out = torch.empty(r1 - r0, n_out, dtype=torch.float32)
    for x in range(r0 // n_in, -(-r1 // n_in)):
        a, b_ = max(r0, x * n_in) - x * n_in, min(r1, (x + 1) * n_in) - x * n_in
        g0, g1 = a // per, -(-b_ // per)
        index = blocks[x, :, g0:g1].reshape(-1).to(torch.int)
        values = pairs.index_select(0, index).reshape(n_out * (g1 - g0), per)
        torch.ldexp(values, (scales[x, :, g0:g1].to(torch.int32) - 127).reshape(n_out * (g1 - g0), 1), out=values)
        out[x * n_in + a - r0:x * n_in + b_ - r0] = values.reshape(n_out, (g1 - g0) * per).T[a - g0 * per:b_ - g0 * per]
    return out.reshape(e, n_in, n_out) if rows is None else out.reshape(-1)


def fp8_block_encode(tensor: torch.Tensor, block: tuple[int, int], scale_fmt: str = "float32", *,
                     row_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` (``[..., rows, cols]``, any float dtype) as an E4M3 payload of its shape and its
    ``weight_scale_inv`` (``scale_grid``'s shape; float32, or ``float8_e8m0fnu`` for ``"ue8m0"``):
    transformers' ``Fp8Quantize`` per block -- ``inv = 1 / (448 / amax)`` (1 for an all-zero block;
    UE8M0 rounds it up to a power of two first), ``q = e4m3(clamp(x * (1 / inv)))`` -- computed by
    the same torch expressions, a run of whole block rows at a time (memory: the outputs and one
    run). A partial last block is padded with zeros, quantized and cropped (its amax is its own
    elements'), as :func:`fp8_block_decode` reads it. Refuses (``QuantizedError``) a block holding a
    NaN or infinite value, and, for float32 scales, one too small to scale (448 / amax overflows),
    naming its index (its block row counted from ``row_block``: where ``tensor`` is a run of a larger one)."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {sorted(SCALE_FORMATS)}, got {scale_fmt!r}")
    *lead, rows, cols = tensor.shape
    bm, bn = block
    n, k = prod(lead), -(-cols // bn)
    x = tensor.reshape(n, rows, cols)
    payload = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((n, -(-rows // bm), k), dtype=SCALE_FORMATS[scale_fmt])
    step = max(1, _RUN // max(1, bm * cols)) * bm  # rows per run: whole blocks, about _RUN elements
    for i in range(n):
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            nb = -(-(r1 - r0) // bm)
            run = x[i, r0:r1].to(torch.float32)
            if (r1 - r0) % bm or cols % bn:  # a partial last block: zeros change no amax
                run = torch.nn.functional.pad(run, (0, k * bn - cols, 0, nb * bm - r1 + r0))
            q, inv = _encode_blocks(run.reshape(nb, bm, k, bn), scale_fmt, ([i] if lead else [], row_block + r0 // bm))
            payload[i, r0:r1] = q.reshape(nb * bm, k * bn)[:r1 - r0, :cols]
            scales[i, r0 // bm:r0 // bm + nb] = inv
    return payload.reshape(tensor.shape), scales.reshape(scale_grid(tuple(tensor.shape), block))


def _encode_blocks(blocks: torch.Tensor, scale_fmt: str, at: tuple[list[int], int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``Fp8Quantize._quantize_one`` on float32 ``[nb, bm, k, bn]`` blocks, its expressions in its
    order (a reciprocal and a product each round: the same ops give the same bits)."""
    max_abs = blocks.abs().amax(dim=(-3, -1))
    if not bool(torch.isfinite(max_abs).all()):
        raise QuantizedError(f"block {_first(~torch.isfinite(max_abs), at)} holds a NaN or infinite value, "
                             "which FP8 cannot hold")
    safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_MAX / safe_max_abs
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))  # an all-zero block: scale 1
    inv_scales = (1.0 / scales).to(torch.float32)
    if scale_fmt == "ue8m0":  # the power of two at or above, stored; the forward scale its exact reciprocal
        inv_scales = torch.pow(2.0, torch.ceil(torch.log2(inv_scales.clamp(min=torch.finfo(torch.float32).tiny))))
        inv_scales = inv_scales.to(torch.float8_e8m0fnu)
        scales = 1.0 / inv_scales.to(torch.float32)
    elif not bool((inv_scales > 0).all()):
        raise QuantizedError(f"block {_first(inv_scales <= 0, at)}'s largest magnitude is below what a float32 "
                             "scale can reach (448 / amax overflows); quantize with ue8m0 scales")
    scaled = blocks * scales.unsqueeze(-1).unsqueeze(-3)
    return torch.clamp(scaled, min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn), inv_scales


def _first(bad: torch.Tensor, at: tuple[list[int], int]) -> list[int]:
    """The scale-grid index ``[.., row, col]`` of the first ``bad`` block of a run at ``at``
    (its leading index, its first block row)."""
    r, c = (int(v) for v in bad.nonzero()[0])
    return [*at[0], at[1] + r, c]
