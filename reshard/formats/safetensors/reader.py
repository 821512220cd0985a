"""A Hugging Face ``save_pretrained`` folder (``model.safetensors``, or shards listed by
``model.safetensors.index.json``), or any safetensors file, as the engine reads it: each tensor is a
parameter's ``weight``, F whole on one rank, mapped from its file.

Headers are checked before anything is read: every entry's dtype is known, its byte range has
exactly its shape's size and lies inside the file's data, no two ranges overlap, and the index
names only files inside the folder that hold the tensors it says. safetensors carries no
checksum, so the bytes themselves cannot be verified.

A quantized folder (``config.json``'s ``quantization_config``: FP8 block scales, MXFP4) is read as
the parameters it encodes (``quantized.py``): each payload under its HF parameter name, with the
weight's shape, float32, decoded a band of block rows at a time as the engine fills from it
(``banded``; ``fragment`` decodes one whole, for what reads it whole); its scales are consumed,
not listed. What cannot be decoded exactly is refused (``QuantizedError``).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import threading
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, QuantizedError
from ...execute.bands import Banded
from ...execute.memory import release
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import replicated
from ..contract import ExpertLayer, Held, Reader, Stored
from ..fused_experts import fused_expert_layers
from ..hf_order import hf_model_keys
from .io import DTYPES
from .quantized import Codec, Coded, open_codec, release_decoded

__all__ = ["INDEX", "SafetensorsReader", "is_safetensors"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the header's dtypes: the plain ones, and the FP8 payloads and E8M0 scales a codec decodes (quantized.py)
NAMES = {v: k for k, v in DTYPES.items()} | {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                                             "F8_E8M0": torch.float8_e8m0fnu}
MAX_HEADER = 100 << 20  # safetensors' own limit


def is_safetensors(p: Path) -> bool:
    return p.is_file() and p.suffix == ".safetensors" or p.is_dir() and ((p / INDEX).is_file() or (p / SINGLE).is_file())


@dataclass(frozen=True, slots=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file


def read_header(path: Path) -> tuple[dict[str, _Entry], dict[str, str]]:
    """The tensors of one safetensors file (checked against the file's size) and its metadata."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: {size} bytes: too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: header of {n} bytes does not fit the file's {size}: truncated or "
                                      "not a safetensors file")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base, spans, out = 8 + n, [], {}
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict) or not isinstance(e.get("shape"), list) or not isinstance(e.get("data_offsets"), list):
            raise CheckpointError(f"{where}: malformed header entry {e!r:.200}")
        dtype = NAMES.get(e.get("dtype"))
        if dtype is None:
            kind = e.get("dtype")
            if isinstance(kind, str) and kind.startswith(("F8", "F6", "F4", "E8")):  # FP6/FP4 payloads
                raise QuantizedError(f"{where}: dtype {kind!r}: a quantized payload reshard does not decode")
            raise CheckpointError(f"{where}: dtype {kind!r} is not one reshard reads ({sorted(NAMES)})")
        shape = e["shape"]
        lo_hi = e["data_offsets"]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape + lo_hi) or len(lo_hi) != 2:
            raise CheckpointError(f"{where}: shape {shape} / data_offsets {lo_hi} are not non-negative integers")
        lo, hi = lo_hi
        if hi - lo != prod(tuple(shape)) * dtype.itemsize or base + hi > size:
            raise CheckpointError(f"{where}: bytes [{lo}, {hi}) do not hold a {dtype} {shape} tensor inside the "
                                  f"file's {size - base} data bytes: truncated or corrupt")
        spans.append((lo, hi, name))
        out[name] = _Entry(path, dtype, tuple(shape), base + lo)
    spans.sort()
    for (_, a_hi, a), (b_lo, _, b) in zip(spans, spans[1:]):
        if b_lo < a_hi:
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap in the file")
    # as the safetensors library's own validation: the entries tile the data bytes exactly, from the first to
    # the last (bytes no entry names are a tensor whose entry was lost, or another file's)
    at = 0
    for lo, hi, name in spans:
        if lo != at:
            raise CheckpointError(f"{path}: data bytes [{at}, {lo}) before tensor {name!r} belong to no header entry: "
                                  "a header entry is missing or the file is corrupt")
        at = hi
    if base + at != size:
        raise CheckpointError(f"{path}: data bytes [{at}, {size - base}) belong to no header entry: a header entry is "
                              "missing, or the file has bytes appended")
    return dict(sorted(out.items(), key=lambda kv: kv[1].start)), meta if isinstance(meta, dict) else {}


# a buffer older checkpoints keep beside the weights, which transformers recomputes and never loads
RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class SafetensorsReader(Reader):
    format = "safetensors"

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        self.folder = p if p.is_dir() else p.parent
        self.tag = self.folder.name if p.is_dir() else p.stem
        self.sources = (p,)
        self.entries: dict[str, _Entry] = {}
        for f in self._files(p):
            tensors, _ = read_header(f)
            for name, e in tensors.items():
                if name in self.entries:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {self.entries[name].file.name}")
                self.entries[name] = e
        if not self.entries:
            raise CheckpointError(f"{p}: holds no tensors")
        # a quantized folder's payloads are not its weights: decoded (or refused), never copied as they are
        self.codec: Codec | None = open_codec(self.config, self.entries, self.folder / "config.json")
        by_payload = self.codec.coded if self.codec is not None else {}
        consumed = self.codec.consumed() if self.codec is not None else set()
        self.coded: dict[str, Coded] = {c.name: c for c in by_payload.values()}  # by parameter name
        self.names = [by_payload[n].name if n in by_payload else n for n in self.entries
                      if (n in by_payload or n not in consumed) and not RECOMPUTED.search(n)]
        self.description = f"safetensors weights ({len(self.names)} tensors)" \
            + (f", {self.codec.description}" if self.codec else "")
        self.topology: dict[str, int] = {}
        self._maps: dict[str, ParamMap] = {}
        self._mapped: dict[Path, mmap.mmap] = {}
        self._decoded: tuple[str, torch.Tensor] | None = None  # the last parameter decoded: one at a time
        self._lock = threading.Lock()

    def _files(self, p: Path) -> list[Path]:
        if p.is_file():
            return [p]
        index = p / INDEX
        if not index.is_file():
            if not (p / SINGLE).is_file():
                raise CheckpointError(f"{p}: no {SINGLE} and no {INDEX}: not a Hugging Face safetensors folder")
            return [p / SINGLE]
        try:
            doc = json.loads(index.read_text())
            weight_map = doc["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("'weight_map' is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        files = []
        for name, rel in weight_map.items():
            if not isinstance(rel, str) or "/" in rel or "\\" in rel or rel in ("", ".", ".."):
                raise CheckpointError(f"{index}: weight_map[{name!r}] = {rel!r} is not a file in the folder")
            if rel not in files:
                files.append(rel)
        missing = [rel for rel in files if not (p / rel).is_file()]
        if missing:
            raise CheckpointError(f"{p / missing[0]}: file is missing ({INDEX} lists it)")
        self._index = {n: p / rel for n, rel in weight_map.items()}
        return [p / rel for rel in files]

    def unlowered(self) -> list[Held]:
        """Older checkpoints' rotary ``inv_freq`` buffers (no parameter: transformers recomputes
        them), and safetensors files in the folder that the index does not list (or beside the
        single ``model.safetensors``): tensors, never read silently past."""
        out = [Held(n, str(e.file), "state", "a rotary embedding's inv_freq: a buffer transformers recomputes "
                    "(from_pretrained does not load it)") for n, e in self.entries.items() if RECOMPUTED.search(n)]
        if not self.sources[0].is_dir():
            return out
        read = {e.file.name for e in self.entries.values()}
        return out + [Held(f.name, str(f), "weights", "a safetensors file the folder's index does not list")
                      for f in sorted(self.folder.glob("*.safetensors")) if f.name not in read]

    def check(self) -> None:
        if self.codec is not None:
            self.codec.check(self._tensor, lambda n: self.entries[n].file)
            for c in self.codec.coded.values():
                release(self._raw(c.scales))
        index = getattr(self, "_index", None)
        if index is None:
            return
        for name, f in index.items():
            e = self.entries.get(name)
            if e is None or e.file != f:
                raise CheckpointError(f"{self.folder / INDEX}: says {name!r} is in {f.name}, "
                                      f"{'which does not hold it' if e is None else 'but ' + e.file.name + ' does'}")
        extra = [n for n in self.entries if n not in index]
        if extra:
            raise CheckpointError(f"{self.entries[extra[0]].file}: holds {extra[0]!r}, which {INDEX} does not list")

    def shape(self, name: str) -> tuple[int, ...]:
        c = self.coded.get(name)
        return c.shape if c is not None else self.entries[name].shape

    def states(self, name: str) -> tuple[str, ...]:
        return ("weight",)

    def dtype(self, name: str, state: str) -> torch.dtype:
        return torch.float32 if name in self.coded else self.entries[name].dtype

    def map(self, name: str, state: str) -> ParamMap:
        m = self._maps.get(name)
        if m is None:
            m = self._maps[name] = replicated(self.shape(name), 1)
        return m

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        c = self.coded.get(name)
        if c is None:
            return self._raw(name)
        with self._lock:
            last = self._decoded
        if last is not None and last[0] == name:  # another segment of the parameter the engine is filling
            return last[1]
        t = self.codec.decode(c, self._tensor).reshape(-1)  # type: ignore[union-attr]
        for n in (c.payload, c.scales):  # read once: drop their pages (the engine releases only what it reads)
            release(self._raw(n))
        with self._lock:
            self._decoded = (name, t)
        return t

    def banded(self, name: str, state: str, rank: int) -> Banded | None:
        """A quantized parameter decoded a band of block rows at a time (``fragment``'s values)."""
        c = self.coded.get(name)
        if c is None:
            return None
        row, rows, align = self.codec.rows_of(c)  # type: ignore[union-attr]
        return Banded(prod(c.shape), torch.float32, row, partial(self._decode_rows, c, rows), align=align)

    def check_fragment(self, name: str, state: str, rank: int) -> None:
        """A quantized parameter's scales checked again (read now, as its bands will be)."""
        c = self.coded.get(name)
        if c is not None:
            self.codec.check_scales(c, self._tensor, lambda n: self.entries[n].file)  # type: ignore[union-attr]
            release(self._raw(c.scales))

    def _decode_rows(self, c: Coded, rows: int, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0..r1`` of ``c`` decoded; the payload's pages it read are dropped (read once), and
        the scales' after the last row."""
        t = self.codec.decode(c, self._tensor, (r0, r1))  # type: ignore[union-attr]
        raw = self._raw(c.payload)
        release_decoded(c, raw, rows, r0, r1)
        if r1 == rows:
            release(self._raw(c.scales))
        return t

    def stored(self, name: str) -> Stored | None:
        """A quantized parameter's payload and scales as the files hold them: FP8 (float32 or E8M0
        scales), MXFP4 (``X_blocks``, ``X_scales``)."""
        c = self.coded.get(name)
        if c is None:
            return None
        q = (self.config or {}).get("quantization_config")
        if c.kind == "mxfp4":
            return Stored(torch.uint8, c.block, "ue8m0", partial(self._tensor, c.payload), partial(self._tensor, c.scales),
                          kind="mxfp4", payload_suffix=c.payload[len(name):], scales_suffix=c.scales[len(name):],
                          quantization_config=q)
        sdtype = self.entries[c.scales].dtype
        fmt = "float32" if sdtype == torch.float32 else "ue8m0" if sdtype in (torch.uint8, torch.float8_e8m0fnu) else None
        if fmt is None:
            return None
        return Stored(self.entries[c.payload].dtype, c.block, fmt, partial(self._tensor, c.payload),
                      partial(self._tensor, c.scales), scales_suffix=c.scales[len(name):], quantization_config=q)

    def _tensor(self, name: str) -> torch.Tensor:
        return self._raw(name).view(self.entries[name].shape)

    def _raw(self, name: str) -> torch.Tensor:
        """Tensor ``name`` of the files, as stored (flat)."""
        e = self.entries[name]
        n = prod(e.shape)
        if not n:
            return torch.empty(0, dtype=e.dtype)
        return torch.frombuffer(self._map(e.file), dtype=e.dtype, count=n, offset=e.start)

    def _map(self, f: Path) -> mmap.mmap:
        m = self._mapped.get(f)
        if m is None:
            with open(f, "rb") as fh:  # a private mapping: nothing can write back to the file
                m = self._mapped[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        return m

    def tp_index(self, name: str, state: str, rank: int) -> None:
        return None

    def step(self, name: str) -> Any:
        return None

    def extras(self, name: str) -> dict[str, Any]:
        return {}

    def param_groups(self) -> list[dict[str, Any]]:
        return []

    def model_order(self) -> list[str] | None:
        """The model's parameter order (what a DeepSpeed target flattens in), which safetensors
        headers do not keep: from ``config.json``'s architecture, built by transformers on the meta
        device (no weights, no remote code); ``None`` when neither can tell."""
        if self.config is None:
            return None
        try:
            import transformers
        except ImportError:
            return None
        try:
            config = transformers.AutoConfig.from_pretrained(self.folder, local_files_only=True)
            arch = (config.architectures or [None])[0]
            cls = getattr(transformers, arch) if arch else transformers.AutoModelForCausalLM
            with torch.device("meta"):
                model = cls(config) if arch else cls.from_config(config)
        except Exception:  # noqa: BLE001 -- an architecture transformers cannot build: order unknown
            return None
        names, held = [n for n, _ in model.named_parameters()], set(self.names)
        return [n for n in names if n in held] + [n for n in self.names if n not in set(names)]

    def buffers(self) -> tuple[str, ...]:
        """The folder's tensors that the model its ``config.json`` describes holds as persistent
        buffers (``hf_order.HfKeys.buffers``: DeepSeek-V3's router ``e_score_correction_bias``),
        in the folder's order; none without a config transformers can build."""
        keys = hf_model_keys(self.config)
        held = set(keys.buffers) if keys is not None else set()
        return tuple(n for n in self.names if n in held)

    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        """Each MoE block whose experts the folder holds fused (``<module>.experts.gate_up_proj``
        ``[E, ...]``, transformers 5's in-memory layout): ``fused_experts``. A folder in the Hub's
        per-expert layout (``experts.<e>.w1.weight``) holds none."""
        return fused_expert_layers(self.names, self.shape, str(self.sources[-1]))

    def tied(self) -> dict[str, str]:
        """Tied aliases ``save_pretrained`` left out (``tie_word_embeddings``): ``{alias: weight}``."""
        cfg = self.config or {}
        if cfg.get("tie_word_embeddings") and "lm_head.weight" not in self.entries \
                and "model.embed_tokens.weight" in self.entries:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def hf_config(self) -> dict[str, Any] | None:
        return self.config

    @cached_property
    def config(self) -> dict[str, Any] | None:
        """The folder's ``config.json``, where there is one."""
        f = self.folder / "config.json"
        try:
            if not f.is_file():
                if f.exists() or f.is_symlink():  # a folder, a device, a broken link: never "no config"
                    raise CheckpointError(f"{f}: not a regular file")
                if (self.folder / "generation_config.json").is_file():  # a model folder that lost its config
                    raise CheckpointError(f"{f}: missing, though the folder holds generation_config.json, which "
                                          "save_pretrained writes only beside it: the model's config (its parameter "
                                          "order, tied embeddings, quantization) is lost; restore config.json")
                return None
            return json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{f}: unreadable ({e})") from None
