"""HF-style safetensors weights written from any source: every parameter whole, by name, in files
of at most ``max_file_bytes`` (``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json``), each tensor streamed from the source fragments.

The weights are the most precise ones the source holds: a DeepSpeed checkpoint's fp32 masters
(a module weight outside the optimizer cast to fp32 beside them), a DCP or safetensors source's
weights in their stored dtype; ``dtype`` casts them all. ``with_optimizer`` adds the Adam moments
in the universal layout (``zero/<name>/{exp_avg,exp_avg_sq,step}.pt``).

``quantize`` (``"fp8"``, ``"fp8-ue8m0"``) writes each weight transformers' FP8 quantizer converts
(an ``nn.Linear``'s, not the output head's: the model built from ``config.json`` on the meta device;
without one, a 2-D ``X.weight`` that is not an embedding, a norm, a router or a head) as an
E4M3 payload with ``X.weight_scale_inv`` right after it, per ``block``: transformers' ``Fp8Quantize``
of the values the weight would otherwise be written as (``dtype``), bit for bit
(``ir.codec.fp8_block_encode``), one run of block rows at a time. A weight the source already
stores in that encoding (same block, same scale format: ``Reader.stored``) is copied as stored,
payload and scales byte for byte, never decoded and re-encoded.

``quantize="keep"`` writes every weight the source stores quantized as it stores it, whatever its
encoding (FP8 of any block and scale format; MXFP4's ``X_blocks`` / ``X_scales``), payload and
scales byte for byte, and every other tensor as it is; nothing is encoded or decoded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...errors import QuantizedError, ReshardError, in_context
from ...ir.codec import SCALE_FORMATS, fp8_block_encode, scale_grid
from ...ir.piece import is_int, prod
from ...layouts import replicated
from ..contract import BEST, Buffer, Reader, Slot, Stored, Writer
from ..table import noun_of
from .io import DTYPES, SafetensorsFile, plan_files
from .reader import INDEX

__all__ = ["QUANTIZE", "SafetensorsWriter", "fp8_block", "quantizable"]

QUANTIZE = {"fp8": "float32", "fp8-ue8m0": "ue8m0"}  # --quantize: the scale format it writes
KEEP = "keep"  # --quantize keep: the source's quantized weights as it stores them, nothing encoded
DEFAULT_BLOCK = (128, 128)
HEADS = ("lm_head", "output", "embed_out")  # output heads (a model's last module), as transformers skips them
RUN = 1 << 22  # elements of a weight read and encoded at a time (whole block rows)


def quantizable(name: str, shape: tuple[int, ...], model: tuple[set[str], set[str]] | None = None) -> bool:
    """Whether ``--quantize`` writes weight ``name`` as FP8: a 2-D ``X.weight`` that transformers' FP8
    quantizer converts -- where ``model`` (:func:`fp8_linears`: its linears' weights, all its
    parameters) knows the name, one of its linears; else by name: not an embedding, a norm, an MoE
    router (``router``, ``gate``) or an output head (a checkpoint's per-expert weights, which
    transformers fuses on load, are chosen so)."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    key = name.removeprefix("module.")
    if model is not None and key in model[1]:
        return key in model[0]
    module = name[:-len(".weight")]
    last = module.rsplit(".", 1)[-1]
    return last not in HEADS and last != "gate" and not any(w in module for w in ("embed", "norm", "router"))


def fp8_linears(config: dict[str, Any] | None, names: list[str]) -> tuple[set[str], set[str]] | None:
    """The weights transformers' FP8 quantizer converts in the model ``config`` describes -- each
    ``nn.Linear``'s (``replace_with_fp8_linear``), less ``get_keys_to_not_convert``'s (the output
    head, tied weights, the last module) -- and all the model's parameters, the model built on the
    meta device (no weights, no remote code). ``None`` where transformers cannot build it or none of
    its linears is named as in the checkpoint."""
    if not config or not config.get("model_type"):
        return None
    try:
        import transformers
        from transformers.quantizers.base import get_keys_to_not_convert
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:
        return None
    try:
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
        arch = (config.get("architectures") or [None])[0]
        with torch.device("meta"):
            model = getattr(transformers, arch)(cfg) if arch else transformers.AutoModelForCausalLM.from_config(cfg)
        skip = get_keys_to_not_convert(model)
        out = {f"{n}.weight" for n, m in model.named_modules()
               if type(m) is torch.nn.Linear and should_convert_module(n, skip)}
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    except Exception:  # noqa: BLE001 -- an architecture transformers cannot build: chosen by name
        return None
    return (out, params) if out & {n.removeprefix("module.") for n in names} else None


def fp8_block(reader: Reader, block: Any) -> tuple[int, int]:
    """``--block``: two positive ints; by default an FP8 source's own block, else 128 x 128."""
    if block is None:
        return next((s.block for s in map(reader.stored, reader.names) if s is not None and s.kind == "fp8"),
                    DEFAULT_BLOCK)
    if not (isinstance(block, (tuple, list)) and len(block) == 2 and all(is_int(b) and b > 0 for b in block)):
        raise ReshardError(f"--block {block!r}: the scale block is two positive integers, rows x columns (128x128)")
    return int(block[0]), int(block[1])


class SafetensorsWriter(Writer):
    format = "safetensors"
    latest = None
    keeps_replicas = False

    def __init__(self, reader: Reader, *, max_file_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
                 with_optimizer: bool = False, names: dict[str, str] | None = None, index: bool = True,
                 quantize: str | None = None, block: tuple[int, int] | None = None,
                 config: dict[str, Any] | None = None, fp32: Callable[[str], bool] | None = None) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise ReshardError(f"--dtype {dtype} is not a safetensors dtype")
        if quantize is not None and quantize not in (*QUANTIZE, KEEP):
            raise ReshardError(f"--quantize {quantize!r}: reshard writes {' or '.join(QUANTIZE)}, or {KEEP} "
                               "(the source's own encoding)")
        if block is not None and quantize in (None, KEEP):
            raise ReshardError("--block goes with --quantize fp8 or fp8-ue8m0 (the block of the scales it writes; "
                               "--quantize keep keeps the source's)")
        self.keep = quantize == KEEP
        self.reader, self.tag = reader, reader.tag
        masters = any("fp32" in reader.states(n) for n in reader.names)
        # each parameter's name in the files (``names``: a subset of the source's, renamed)
        self.names = {n: n for n in reader.names} if names is None else dict(names)
        self.source = {out: n for n, out in self.names.items()}
        self.scale_fmt = QUANTIZE.get(quantize) if quantize is not None else None
        self.block = fp8_block(reader, block) if self.scale_fmt is not None else None
        # the model's own linears where transformers can build it (``config``, else the source's)
        self.linears = fp8_linears(config or reader.hf_config(), list(self.names.values())) \
            if self.scale_fmt else None
        self.specs = []  # every tensor of the files: (name, shape, dtype), a payload's scales right after it
        self.params = []  # the parameters among them, with the dtype their values are read in
        self.encoded: dict[str, tuple[str, torch.dtype, Stored | None]] = {}  # payload -> scales, values' dtype, copy
        for n in self.names:
            have = reader.states(n)
            state = next((s for s in BEST if s in have), None)
            if state is None:
                raise ReshardError(f"{reader.sources[-1]}: parameter {n!r} has no weights to write")
            own = torch.float32 if masters else reader.dtype(n, state)
            out, shape = self.names[n], reader.shape(n)
            # what the model computes in float32 (``fp32``: transformers' _keep_in_fp32_modules) is never narrowed
            want = own if own == torch.float32 and dtype not in (None, own) and fp32 is not None and fp32(out) \
                else dtype or own
            self.params.append((out, shape, want))
            copy = self._as_stored(n)
            if self.keep and copy is not None:  # payload and scales by the source's names for them
                payload, raw, raw_scales = out + copy.payload_suffix, copy.payload(), copy.scales()
                self.source[payload] = n
                self.encoded[payload] = (out + copy.scales_suffix, want, copy)
                self.specs += [(payload, tuple(raw.shape), raw.dtype),
                               (out + copy.scales_suffix, tuple(raw_scales.shape), raw_scales.dtype)]
                continue
            if self.scale_fmt is None or not (copy is not None or quantizable(out, shape, self.linears)):
                self.specs.append((out, shape, want))
                continue
            scales = out[:-len(".weight")] + ".weight_scale_inv" if out.endswith(".weight") else out + "_scale_inv"
            self.encoded[out] = (scales, want, copy)
            sdtype = copy.scales().dtype if copy is not None else SCALE_FORMATS[self.scale_fmt]
            self.specs += [(out, shape, torch.float8_e4m3fn), (scales, scale_grid(shape, self.block), sdtype)]
        self.groups = _keep_pairs(plan_files(self.specs, max_file_bytes), set(self.encoded))
        self.index = index or len(self.groups) > 1  # save_pretrained writes one only for shards
        self.fnames = ["model.safetensors"] if len(self.groups) == 1 else [
            f"model-{i + 1:05d}-of-{len(self.groups):05d}.safetensors" for i in range(len(self.groups))]
        self._maps = {out: replicated(shape, 1) for out, shape, _ in self.params}
        self.moments = None
        if with_optimizer and not any(m in reader.states(n) for n in reader.names for m in ("exp_avg", "exp_avg_sq")):
            raise ReshardError(f"{reader.sources[-1]}: --with-optimizer, but {noun_of(reader)} holds no "
                               "optimizer state (no Adam moments) to write")
        if with_optimizer:
            from ..universal.writer import UniversalWriter

            self.moments = UniversalWriter(reader, moments_only=True)
        self._buffers = {b.key: b for b in self._declare()}

    def _declare(self) -> list[Buffer]:
        """Each tensor of the files read from the source, whole (a payload's values before they are
        encoded; not one copied as stored, nor a scales tensor), then the moments' files."""
        out = []
        for fname, group in zip(self.fnames, self.groups):
            for name, shape, dtype in group:
                if name in self.encoded:
                    _, dtype, copy = self.encoded[name]
                    if copy is not None:
                        continue
                elif name not in self.names.values():
                    continue  # a payload's scales
                out.append(Buffer(f"{fname}:{name}", dtype, prod(shape),
                                  (Slot(0, self.source[name], BEST, self._maps[name], 0),)))
        return out + (self.moments.buffers() if self.moments is not None else [])

    def buffers(self) -> list[Buffer]:
        return list(self._buffers.values())

    def copied(self) -> list[str]:
        return [self.source[o] for o, (_, _, c) in self.encoded.items() if c is not None]

    def kept_config(self) -> dict[str, Any] | None:
        """``--quantize keep``: the source's ``quantization_config`` its kept weights are read back by."""
        return next((c.quantization_config for _, _, c in self.encoded.values()
                     if c is not None and c.quantization_config is not None), None)

    def meta(self) -> dict[str, Any]:
        return {"target": "safetensors weights"}

    def notes(self) -> list[str]:
        return [self.quantized_note()] if self.encoded else []

    def quantized_note(self) -> str:
        copied = sum(1 for _, _, c in self.encoded.values() if c is not None)
        if self.keep:
            kinds = sorted({"MXFP4" if c.kind == "mxfp4" else f"FP8 {c.block[0]}x{c.block[1]} {c.scale_fmt}"
                            for _, _, c in self.encoded.values() if c is not None})
            return (f"{copied} weights kept quantized as the source stores them ({', '.join(kinds)}; payload and "
                    f"scales byte for byte, never decoded); {len(self.params) - copied} tensors as they are")
        block = self.block or DEFAULT_BLOCK
        return (f"{len(self.encoded)} weights FP8 E4M3 with {self.scale_fmt} scales per {block[0]}x{block[1]} block"
                + (f" ({copied} copied as the source stores them)" if copied else "")
                + f"; {len(self.params) - len(self.encoded)} tensors as they are")

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        jobs = [(_size(g), partial(self._file, engine, staging, f, g)) for f, g in zip(self.fnames, self.groups)]
        if self.index:
            jobs.append((1, partial(self._index, staging)))
        if self.moments is not None:
            jobs += self.moments.jobs(engine, staging)
        return jobs

    def _as_stored(self, name: str) -> Stored | None:
        """The source's own encoding of ``name`` where it is the one asked for (copied as stored)."""
        if self.keep:
            return self.reader.stored(name)
        s = self.reader.stored(name) if self.scale_fmt is not None else None
        if s is None or s.kind != "fp8" or s.payload_dtype != torch.float8_e4m3fn or s.block != self.block or s.scale_fmt != self.scale_fmt:
            return None
        return s

    def _file(self, engine: Any, staging: Any, fname: str, group: list) -> None:
        scales: dict[str, torch.Tensor] = {}  # a payload's scales, written right after it
        with staging.open(fname) as out:
            w = SafetensorsFile(out, group)
            for name, shape, dtype in group:
                if name in scales:
                    w.write(name, scales.pop(name))
                elif name in self.encoded:
                    scales[self.encoded[name][0]] = self._payload(engine, w, fname, name, shape)
                else:
                    w.write_fill(name, shape, dtype, engine.fill(self._buffers[f"{fname}:{name}"]))
            w.close()

    def _payload(self, engine: Any, w: SafetensorsFile, fname: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Write ``name``'s FP8 payload: the source's as stored, or its values encoded a run of block
        rows at a time; returns its scales (small: one per block)."""
        from ...execute.memory import release

        _, dtype, copy = self.encoded[name]
        if copy is not None:
            payload = copy.payload()
            w.write(name, payload)
            release(payload)
            return copy.scales()
        block, fmt = self.block or DEFAULT_BLOCK, self.scale_fmt or "float32"  # both set wherever encoded is
        rows, cols = shape
        bm = block[0]
        step = max(1, RUN // max(1, bm * cols)) * bm
        fill = engine.fill(self._buffers[f"{fname}:{name}"])
        scales = torch.empty(scale_grid(shape, block), dtype=SCALE_FORMATS[fmt])
        values = torch.empty(min(rows, step) * cols, dtype=dtype)

        def runs() -> Any:
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                run = values[:(r1 - r0) * cols]
                fill(run, r0 * cols)
                try:
                    q, s = fp8_block_encode(run.view(r1 - r0, cols), block, fmt, row_block=r0 // bm)
                except QuantizedError as e:
                    raise in_context(e, f"{self.reader.sources[-1]}: parameter {self.source[name]!r}") from None
                scales[r0 // bm:r0 // bm + s.shape[0]] = s
                yield q

        w.write_runs(name, shape, torch.float8_e4m3fn, runs())
        return scales

    def _index(self, staging: Any) -> None:
        weight_map = {name: f for f, g in zip(self.fnames, self.groups) for name, _, _ in g}
        doc = {"metadata": {"total_size": _size(self.specs)}, "weight_map": weight_map}
        with staging.open(INDEX) as out:
            out.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())


def _size(specs: list) -> int:
    return sum(prod(s) * d.itemsize for _, s, d in specs)


def _keep_pairs(groups: list[list], payloads: set[str]) -> list[list]:
    """Files with each payload's scales in the payload's file (``plan_files`` may cut between them)."""
    out: list[list] = []
    for g in groups:
        if out and out[-1] and out[-1][-1][0] in payloads:
            out[-1].append(g[0])
            g = g[1:]
        if g:
            out.append(g)
    return out
