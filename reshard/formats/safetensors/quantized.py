"""A quantized Hugging Face folder's tensors as the parameters they encode (docs/hf-checkpoints.md,
docs/spec.md §"Quantized sources").

``config.json``'s ``quantization_config`` says how the folder is quantized; :func:`open_codec`
pairs every payload with its scales, checks their shapes and dtypes against the config, and
refuses (``QuantizedError``, naming the tensor) what it cannot decode exactly:

* ``"quant_method": "fp8"`` with ``weight_block_size`` ``[bm, bn]``: an FP8 ``X.weight``
  (the ``fmt`` the config names, E4M3 by default) and its ``X.weight_scale_inv``
  ``[..., ceil(rows/bm), ceil(cols/bn)]`` (float, or E8M0) decode to parameter ``X.weight``;
* ``"quant_method": "mxfp4"``: ``X_blocks`` uint8 ``[E, out, G, 16]`` and ``X_scales`` uint8
  ``[E, out, G]`` decode to parameter ``X`` ``[E, 32 G, out]`` (gpt-oss's experts as
  ``GptOssForCausalLM`` holds them);
* anything else quantized (another ``quant_method``, FP8 without block scales, a payload dtype or
  a scale-named tensor no rule consumes) is refused.

The scales' values are checked (finite, positive; E8M0 not its NaN byte) by :meth:`Codec.check`,
before any output exists. The engine decodes a parameter a band of block rows at a time as it fills
from it (:meth:`Codec.decode` with ``rows``; docs/spec.md §1 "band").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import torch

from ...errors import QuantizedError
from ...execute.memory import release
from ...ir.codec import E8M0_NAN, MXFP4_BYTES, fp8_block_decode, mxfp4_decode, mxfp4_shape, scale_grid

__all__ = ["FP8_DTYPES", "QUANTIZED_DTYPES", "SCALE_SUFFIXES", "Codec", "Coded", "open_codec", "release_decoded"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)
E8M0_SCALES = (torch.uint8, torch.float8_e8m0fnu)
# names of the second tensor of a quantized weight (its scales) or of a packed payload, in the formats the
# quantizers transformers ships write (FP8 block scales, MXFP4, bitsandbytes, GPTQ/AWQ)
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "activation_scale")
PACKED_SUFFIXES = ("_blocks", "_scales", "qweight", "qzeros", "scales", "absmax", "quant_map",
                   "quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")


@dataclass(frozen=True, slots=True)
class Coded:
    """Parameter ``name`` as the folder holds it: ``payload`` and ``scales`` (tensor names)."""

    name: str
    kind: str  # "fp8" | "mxfp4"
    payload: str
    scales: str
    shape: tuple[int, ...]  # the decoded weight's
    block: tuple[int, int]  # FP8's (rows, cols) per scale; MXFP4's (1, 32)


@dataclass(frozen=True, slots=True)
class Codec:
    """A folder's quantized parameters (by payload name) and the words reports use for them."""

    coded: dict[str, Coded]  # payload tensor name -> what it decodes to
    description: str

    def consumed(self) -> set[str]:
        return {n for c in self.coded.values() for n in (c.payload, c.scales)}

    def check(self, tensor: Callable[[str], torch.Tensor], where: Callable[[str], Path]) -> None:
        """Every scale a finite positive number (E8M0: not its NaN byte), naming the first block that is not."""
        for c in self.coded.values():
            self.check_scales(c, tensor, where)

    @staticmethod
    def check_scales(c: Coded, tensor: Callable[[str], torch.Tensor], where: Callable[[str], Path]) -> None:
        """:meth:`check` for one parameter ``c`` (what a lazy source asks again before each read of it)."""
        s = tensor(c.scales)
        if s.dtype in E8M0_SCALES:
            bad = s.view(torch.uint8) == E8M0_NAN
        else:
            bad = ~(torch.isfinite(s) & (s > 0))
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            value = "NaN (E8M0 byte 255)" if s.dtype in E8M0_SCALES else repr(float(s[at]))
            raise QuantizedError(f"{where(c.scales)}: tensor {c.scales!r}: the scale of block {list(at)} of "
                                 f"{c.payload!r} is {value}; a scale must be a finite positive number")

    def decode(self, c: Coded, tensor: Callable[[str], torch.Tensor], rows: tuple[int, int] | None = None
               ) -> torch.Tensor:
        """Parameter ``c`` decoded: float32, its shape; or, with ``rows`` ``(r0, r1)``, only those rows
        of it as :meth:`rows_of` counts them, flat (the same values)."""
        if c.kind == "fp8":
            return fp8_block_decode(tensor(c.payload), tensor(c.scales), c.block, rows)
        return mxfp4_decode(tensor(c.payload), tensor(c.scales), rows)

    @staticmethod
    def rows_of(c: Coded) -> tuple[int, int, int]:
        """How the decoded parameter splits into rows (its last dim): ``(row, rows, align)``, the
        elements of a row, how many rows, and the rows of one block (a stripe starts at a multiple)."""
        row = c.shape[-1]
        return row, prod(c.shape) // max(1, row), c.block[0] if c.kind == "fp8" else c.block[1]


def open_codec(config: dict[str, Any] | None, entries: dict[str, Any], config_path: Path) -> Codec | None:
    """The folder's codec (``None``: nothing in it is quantized); refuses what reshard cannot decode."""
    q = (config or {}).get("quantization_config")
    if q is None:
        _refuse_unconsumed(entries, set(), "no quantization_config in config.json says how to decode it")
        return None
    method = q.get("quant_method", "?") if isinstance(q, dict) else q
    where = f"{config_path}: quantization_config"
    if method == "fp8":
        codec = _fp8(q, entries, where)
    elif method == "mxfp4":
        codec = _mxfp4(entries)
    else:
        raise QuantizedError(f"{where}.quant_method = {method!r}: a quantized checkpoint reshard does not decode "
                             "(it decodes 'fp8' block scales and 'mxfp4')")
    if not codec.coded:
        raise QuantizedError(f"{where}.quant_method = {method!r}, but no tensor in the folder is a payload of it: "
                             "the config and the weights disagree")
    _refuse_unconsumed(entries, codec.consumed(), f"quantization_config.quant_method = {method!r} does not name it")
    return codec


def _refuse_unconsumed(entries: dict[str, Any], consumed: set[str], why: str) -> None:
    left = {n: e for n, e in entries.items() if n not in consumed}
    for name, e in left.items():  # a payload's dtype first: it names what the folder is
        if e.dtype in QUANTIZED_DTYPES:
            raise QuantizedError(f"{e.file}: tensor {name!r}: dtype {_dtype_name(e.dtype)!r}: a quantized payload "
                                 f"or scale, and {why}; refused rather than copied as a weight")
    for name, e in left.items():
        if e.dtype in (torch.uint8, torch.int8, torch.int32) and name.endswith(PACKED_SUFFIXES) \
                or name.endswith(SCALE_SUFFIXES):
            raise QuantizedError(f"{e.file}: tensor {name!r} ({e.dtype}) is part of a quantized weight (a packed "
                                 f"payload or its scales), and {why}; refused rather than copied as a weight")


def _fp8(q: dict[str, Any], entries: dict[str, Any], where: str) -> Codec:
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise QuantizedError(f"{where}.weight_block_size = {block!r}: reshard decodes FP8 with block scales "
                             "([rows, cols] of positive integers), not per-tensor or per-channel scales")
    fmt = q.get("fmt", "e4m3")
    dtype = FP8_DTYPES.get(fmt)
    if dtype is None:
        raise QuantizedError(f"{where}.fmt = {fmt!r}: not an FP8 format reshard decodes ({sorted(FP8_DTYPES)})")
    for key, ok in (("activation_scheme", ("dynamic", None)), ("expert_dtype", ("fp8", None))):
        if q.get(key) not in ok:
            raise QuantizedError(f"{where}.{key} = {q.get(key)!r}: reshard decodes only {ok[0]!r}")
    bm, bn = block
    coded = {}
    for name, e in entries.items():
        if e.dtype not in QUANTIZED_DTYPES or e.dtype == torch.float8_e8m0fnu and name.endswith("_scale_inv"):
            continue
        if e.dtype != dtype:
            raise QuantizedError(f"{e.file}: tensor {name!r}: dtype {_dtype_name(e.dtype)!r}, but the config's "
                                 f"quantization_config.fmt is {fmt!r} ({_dtype_name(dtype)})")
        if len(e.shape) < 2:
            raise QuantizedError(f"{e.file}: tensor {name!r}: an FP8 payload of shape {list(e.shape)}; block "
                                 "scales need at least two dims")
        scale = name[:-len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"
        s = entries.get(scale)
        if s is None:
            raise QuantizedError(f"{e.file}: tensor {name!r} is an FP8 payload without its scales {scale!r}")
        want = scale_grid(e.shape, (bm, bn))
        if s.shape != want:
            raise QuantizedError(f"{s.file}: tensor {scale!r}: shape {list(s.shape)}, but {name!r} "
                                 f"{list(e.shape)} in {bm} x {bn} blocks has {list(want)}")
        if s.dtype not in FLOAT_SCALES + E8M0_SCALES:
            raise QuantizedError(f"{s.file}: tensor {scale!r}: dtype {s.dtype} is not a scale's (float or E8M0)")
        coded[name] = Coded(name, "fp8", name, scale, e.shape, (bm, bn))
    kind = "/".join(sorted({_dtype_name(entries[c.scales].dtype) for c in coded.values()}))
    return Codec(coded, f"FP8 {fmt} {bm}x{bn} block scales ({kind}) decoded ({len(coded)} tensors)")


def _mxfp4(entries: dict[str, Any]) -> Codec:
    coded = {}
    for name, e in entries.items():
        if not name.endswith("_blocks"):
            continue
        param, scale = name[:-len("_blocks")], name[:-len("_blocks")] + "_scales"
        s = entries.get(scale)
        if s is None:
            raise QuantizedError(f"{e.file}: tensor {name!r} is an MXFP4 payload without its scales {scale!r}")
        for n, x in ((name, e), (scale, s)):
            if x.dtype != torch.uint8:
                raise QuantizedError(f"{x.file}: tensor {n!r}: dtype {_dtype_name(x.dtype)!r}, but MXFP4 "
                                     "blocks and scales are uint8")
        if len(e.shape) != 4 or e.shape[-1] != MXFP4_BYTES:
            raise QuantizedError(f"{e.file}: tensor {name!r}: shape {list(e.shape)} is not MXFP4 blocks "
                                 f"[experts, out, in/32, {MXFP4_BYTES}]")
        if s.shape != e.shape[:-1]:
            raise QuantizedError(f"{s.file}: tensor {scale!r}: shape {list(s.shape)}, but {name!r} "
                                 f"{list(e.shape)} has {list(e.shape[:-1])} blocks of 32 values")
        if param in entries:
            raise QuantizedError(f"{entries[param].file}: tensor {param!r} is also the weight MXFP4 {name!r} "
                                 "decodes to: two values for one parameter")
        coded[name] = Coded(param, "mxfp4", name, scale, mxfp4_shape(e.shape), (1, 2 * MXFP4_BYTES))
    for name, e in entries.items():  # scales no payload consumed
        if name.endswith("_scales") and name[:-len("_scales")] + "_blocks" not in entries:
            raise QuantizedError(f"{e.file}: tensor {name!r}: MXFP4 scales without their blocks "
                                 f"{name[:-len('_scales')] + '_blocks'!r}")
    return Codec(coded, f"MXFP4 (E2M1, E8M0 scales per 32) decoded ({len(coded)} tensors)")


def _dtype_name(dtype: torch.dtype) -> str:
    from .io import DTYPES

    return {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
            **DTYPES}.get(dtype, str(dtype))


def release_decoded(c: Coded, raw: torch.Tensor, rows: int, r0: int, r1: int) -> None:
    """Drop the pages of ``c``'s flat payload ``raw`` that rows ``r0..r1`` (of ``rows``) were decoded
    from: each is read once, in bands. FP8 is row-major (the rows are one run); an MXFP4 expert's
    blocks go once its last row is decoded."""
    if c.kind == "fp8":
        release(raw.narrow(0, r0 * c.shape[-1], (r1 - r0) * c.shape[-1]))
        return
    per, size = rows // c.shape[0], raw.numel() // c.shape[0]
    for x in range(r0 // per, r1 // per):
        release(raw.narrow(0, x * size, size))
