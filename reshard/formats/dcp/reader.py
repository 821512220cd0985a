"""A PyTorch DCP checkpoint as the engine reads it: each tensor entry's chunks are its map over
the storage ranks that wrote them (``formats.dcp.checkpoint``), each rank's shard its chunk, as
mapped. ``model.<fqn>`` is a parameter's ``weight``, ``optim.state.<fqn>.<s>`` its state ``s``
(Adam's ``exp_avg``, ``exp_avg_sq``, ``step``, or any other the optimizer keeps); every tensor
entry is also readable by its own key as the state ``raw``, which a DCP target laid out again
uses to keep every entry exactly (``formats.dcp.writer``).

Quantized weights (``--quantize keep``'s DCP target, or any DCP whose model entries hold an FP8
payload): the non-tensor entry ``quantization_config`` says how, as a Hugging Face folder's
``config.json`` does, and the payload and scale entries are paired and checked by the same codec
(``formats.safetensors.quantized``): each is one parameter on rank 0, decoded a band of block rows at a
time as the engine (and ``reshard verify``) reads it (:meth:`DcpReader.banded`; :meth:`DcpReader.fragment`
decodes one whole, for what needs a tensor), its encoding beside it (:meth:`DcpReader.stored`). Without
the entry a quantized payload is refused, never read as a weight."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import cached_property, partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ...errors import CheckpointError
from ...execute.bands import Banded
from ...execute.memory import release
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import replicated
from ...storage import verified
from ...storage.staging import MANIFEST
from ..contract import MOMENTS, ExpertLayer, Held, Reader, Stored
from ..fused_experts import fused_expert_layers
from ..hf.trainer_files import trainer_held
from ..safetensors.quantized import Codec, Coded, open_codec, release_decoded
from .checkpoint import DcpCheckpoint

__all__ = ["ENTRY_ORDER", "QUANTIZATION_CONFIG", "RAW", "DcpReader"]

RAW = "raw"  # a tensor entry by its own key
# the manifest's word that reshard wrote the entries in the model's order, as dcp.save does (before it
# reshard wrote them sorted by key, which is no model's order)
ENTRY_ORDER = "model"
QUANTIZATION_CONFIG = "quantization_config"  # the entry (or dcp.save's flattened entries) saying how weights are quantized


class DcpReader(Reader):
    format = "dcp"

    def __init__(self, ck: DcpCheckpoint, given: Path | None = None, optim: DcpCheckpoint | None = None) -> None:
        self.ck = ck
        self.optim = optim or ck  # where the optimizer's entries are (Accelerate keeps them in a folder of their own)
        self.tag = ck.path.name
        self.sources = (ck.path,) if given is None or Path(given) == ck.path else (Path(given), ck.path)
        if optim is not None:
            self.sources += (optim.path,)
        ranks = {c.rank for e in ck.tensors.values() for c in e.chunks}
        self.description = f"PyTorch DCP checkpoint, {len(ranks)} storage ranks"
        self.topology: dict[str, int] = {}
        self.names = ck.params
        self.codec, self.quantization = self._codec()
        self.coded: dict[str, Coded] = {}  # quantized parameters by name
        if self.codec is not None:
            by_payload, consumed = self.codec.coded, self.codec.consumed()
            self.coded = {c.name: c for c in by_payload.values()}
            self.names = [by_payload[n].name if n in by_payload else n for n in self.names
                          if n in by_payload or n not in consumed]
            self.description += f", {self.codec.description}"
        self._decoded: tuple[str, torch.Tensor] | None = None  # the last parameter decoded: one at a time
        # the payload and scales of the parameters being decoded in bands (a payload in several chunks is
        # rebuilt once, not once a band); at most two parameters, each dropped after its last row
        self._coded_held: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def _codec(self) -> tuple[Codec | None, Any]:
        """The codec of the quantized model entries (``None``: none); refuses, as the HF reader does, a
        quantized payload or scale-named entry without a ``quantization_config`` entry, and what the
        codec cannot decode."""
        key = "quantization_config"
        q = self._quantization_config()
        where = self.ck.path / ".metadata"
        entries = {n: SimpleNamespace(dtype=e.dtype, shape=tuple(e.shape), file=where)
                   for n in self.ck.params for e in (self.ck.entry(self.ck.param_key(n)),)}
        return open_codec({key: q} if q is not None else None, entries, where), q

    def _quantization_config(self) -> Any:
        """The ``quantization_config`` entry: one object, or a dict ``dcp.save`` flattened into an
        entry per leaf (``quantization_config.<key>``, its path in the planner data)."""
        ck = self.ck
        if QUANTIZATION_CONFIG in ck.objects:
            return ck.object(QUANTIZATION_CONFIG)
        leaves = [k for k in ck.objects if k.startswith(QUANTIZATION_CONFIG + ".")]
        if not leaves:
            return None
        out: dict[str, Any] = {}
        for k in leaves:
            path = ck.planner_data.get(k) or tuple(k.split("."))
            at = out
            for part in path[1:-1]:
                at = at.setdefault(str(part), {})
            at[str(path[-1])] = ck.object(k)
        return out
    @classmethod
    def open(cls, path: str | Path) -> DcpReader:
        return cls(DcpCheckpoint.open(path), Path(path))

    @cached_property
    def _states(self) -> dict[str, tuple[str, ...]]:
        """Each parameter's states, in the checkpoint's key order after ``weight``."""
        params = set(self.names)
        out: dict[str, list[str]] = {n: ["weight"] for n in self.names}
        prefix = f"{self.optim.optim}state."
        for key in self.optim.tensors:
            if not key.startswith(prefix):
                continue
            fqn, _, state = key[len(prefix):].rpartition(".")
            if fqn in params:
                out[fqn].append(state)
        return {n: tuple(s) for n, s in out.items()}

    def _where(self, name: str, state: str) -> tuple[DcpCheckpoint, str]:
        """(checkpoint, key) of one state's entry."""
        if state == RAW:
            return self.ck, name
        if state == "weight":
            return self.ck, self.ck.param_key(name)
        key = f"{self.optim.optim}state.{name}.{state}"
        if key not in self.optim.tensors:
            raise CheckpointError(f"{self.optim.path}: no tensor {key!r} in the DCP metadata")
        return self.optim, key

    def check(self) -> None:
        if not self.names:
            raise CheckpointError(f"{self.ck.path}: holds no model entries, only {sorted(self.ck.tensors)[:2]}...: an "
                                  "optimizer's folder? Point at the checkpoint folder (Accelerate: the one holding "
                                  "pytorch_model_fsdp_0/ and optimizer_0/)")
        for ck in {id(self.ck): self.ck, id(self.optim): self.optim}.values():
            for key in ck.tensors:  # every entry's chunks tile its tensor
                ck.param_map(key)
            ck.check_records()  # and each record holds what the metadata says
        if self.codec is not None:  # every scale finite and positive
            self.codec.check(self._tensor, lambda n: self.ck.path / ".metadata")
        _ = self._manifest  # readable where it is there (it tells the entries' order)

    def unlowered(self) -> list[Held]:
        """Entries beside the model's parameters and their Adam states: tensors outside the model
        and the optimizer (weights), other optimizer states, and non-tensor entries but the
        parameter groups and steps (a run's state); Trainer's files beside an Accelerate checkpoint."""
        names, out = set(self.names), []
        for ck in {id(self.ck): self.ck, id(self.optim): self.optim}.values():
            where, prefix = str(ck.path / ".metadata"), f"{ck.optim}state."
            lowered = {ck.param_key(n) for n in names} if ck is self.ck else set()
            if ck is self.ck and self.codec is not None:  # payloads and scales, decoded to their parameters
                lowered |= {ck.param_key(n) for n in self.codec.consumed()}
            for key in ck.tensors:
                if key in lowered:
                    continue
                if key.startswith(prefix):
                    fqn, _, state = key[len(prefix):].rpartition(".")
                    if fqn in names and state in (*MOMENTS, "step"):
                        continue
                    why = f"optimizer state {state!r}, which reshard does not carry" if fqn in names else \
                        "optimizer state of no model parameter"
                    out.append(Held(key, where, "state", why))
                else:
                    out.append(Held(key, where, "weights", "a tensor entry outside the model's and the optimizer's"))
            for key in ck.objects:
                if ck is self.ck and self.codec is not None and key.split(".")[0] == QUANTIZATION_CONFIG:
                    continue  # what the quantized entries are decoded by
                if key.startswith(f"{ck.optim}param_groups.") or (key.startswith(prefix) and key.endswith(".step")):
                    continue
                out.append(Held(key, where, "state", "a non-tensor entry"))
        for src in dict.fromkeys(self.sources):
            out += trainer_held(Path(src))
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        c = self.coded.get(name)
        return c.shape if c is not None else tuple(self.ck.entry(self.ck.param_key(name)).shape)

    def states(self, name: str) -> tuple[str, ...]:
        return self._states.get(name, ()) + ((RAW,) if name in self.ck.tensors else ())

    def dtype(self, name: str, state: str) -> torch.dtype:
        if state == "weight" and name in self.coded:
            return torch.float32
        ck, key = self._where(name, state)
        return ck.entry(key).dtype

    def map(self, name: str, state: str) -> ParamMap:
        c = self.coded.get(name) if state == "weight" else None
        if c is not None:  # decoded on rank 0 (as a safetensors folder's)
            return replicated(c.shape, 1)
        ck, key = self._where(name, state)
        return ck.param_map(key)

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        c = self.coded.get(name) if state == "weight" else None
        if c is not None and self.codec is not None:
            with self._lock:
                last = self._decoded
            if last is not None and last[0] == name:  # another segment of the parameter the engine is filling
                return last[1]
            t = self.codec.decode(c, self._tensor).reshape(-1)
            for n in (c.payload, c.scales):
                self.ck.release(self.ck.param_key(n))
            with self._lock:
                self._decoded = (name, t)
            return t
        ck, key = self._where(name, state)
        return ck.shard(key, rank).reshape(-1)

    def banded(self, name: str, state: str, rank: int) -> Banded | None:
        """A quantized parameter decoded a band of block rows at a time (``fragment``'s values)."""
        c = self.coded.get(name) if state == "weight" else None
        if c is None or self.codec is None:
            return None
        row, rows, align = self.codec.rows_of(c)
        return Banded(prod(c.shape), torch.float32, row, partial(self._decode_rows, c, rows), align=align)

    def check_fragment(self, name: str, state: str, rank: int) -> None:
        """A quantized parameter's scales checked again (read now, as its bands will be)."""
        c = self.coded.get(name) if state == "weight" else None
        if c is not None and self.codec is not None:
            self.codec.check_scales(c, self._tensor, lambda n: self.ck.path / ".metadata")
            self.ck.release(self.ck.param_key(c.scales))

    def _decode_rows(self, c: Coded, rows: int, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0..r1`` of ``c`` decoded; the payload pages they read dropped (read once), and after the
        last row its entries' pages and what was held for it."""
        t = self._fp8_slab(c, rows, r0, r1)
        if t is not None:
            return t
        t = self.codec.decode(c, partial(self._held, c), (r0, r1))  # type: ignore[union-attr]
        raw = self._held(c, c.payload).reshape(-1)
        release_decoded(c, raw, rows, r0, r1)  # a no-op on a rebuilt copy
        if r1 == rows:
            with self._lock:
                self._coded_held.pop(c.name, None)
            for n in (c.payload, c.scales):
                self.ck.release(self.ck.param_key(n))
        return t

    def _fp8_slab(self, c: Coded, rows: int, r0: int, r1: int) -> torch.Tensor | None:
        """Rows ``r0..r1`` of a 2-D FP8 weight decoded from only the whole block rows they fall in, read from
        its payload's and scales' chunks where they split dim 0 (``DcpCheckpoint.rows``: nothing rebuilt
        whole); ``None`` where they do not."""
        if c.kind != "fp8" or len(c.shape) != 2 or self.codec is None:
            return None
        bm = c.block[0]
        a0, b0 = r0 // bm * bm, min(rows, -(-r1 // bm) * bm)
        pkey, skey = self.ck.param_key(c.payload), self.ck.param_key(c.scales)
        q = self.ck.rows(pkey, a0, b0)
        s = self.ck.rows(skey, a0 // bm, -(-b0 // bm)) if q is not None else None
        if q is None or s is None:
            return None
        t = self.codec.decode(c, {c.payload: q, c.scales: s}.__getitem__, (r0 - a0, r1 - a0))
        release(q)  # read once: its mapped pages dropped (a no-op where the rows crossed chunks: a copy)
        if r1 == rows:
            for key in (pkey, skey):
                self.ck.release(key)
        return t

    def _held(self, c: Coded, name: str) -> torch.Tensor:
        """Entry ``name`` (``c``'s payload or scales) whole, kept while ``c`` is decoded in bands."""
        with self._lock:
            held = self._coded_held.get(c.name)
            if held is None:
                held = self._coded_held[c.name] = {}
                while len(self._coded_held) > 2:
                    self._coded_held.popitem(last=False)
            t = held.get(name)
        if t is None:
            t = self._tensor(name)
            with self._lock:
                held[name] = t
        return t

    def _tensor(self, name: str) -> torch.Tensor:
        """Model entry ``name`` whole, as stored."""
        return self.ck.full(self.ck.param_key(name))

    def stored(self, name: str) -> Stored | None:
        """A quantized parameter's payload and scales as the entries hold them."""
        c = self.coded.get(name)
        if c is None:
            return None
        payload, scales = partial(self._tensor, c.payload), partial(self._tensor, c.scales)
        q = self.quantization
        if c.kind == "mxfp4":
            return Stored(torch.uint8, c.block, "ue8m0", payload, scales, kind="mxfp4",
                          payload_suffix=c.payload[len(name):], scales_suffix=c.scales[len(name):],
                          quantization_config=q)
        sdtype = self.ck.entry(self.ck.param_key(c.scales)).dtype
        fmt = "float32" if sdtype == torch.float32 else "ue8m0" if sdtype in (torch.uint8, torch.float8_e8m0fnu) else None
        if fmt is None:
            return None
        return Stored(self.ck.entry(self.ck.param_key(c.payload)).dtype, c.block, fmt, payload, scales,
                      scales_suffix=c.scales[len(name):], quantization_config=q)

    def tp_index(self, name: str, state: str, rank: int) -> None:
        return None

    def step(self, name: str) -> Any:
        ck = self.optim
        key = ck.state_key(name, "step")
        if key is None:
            return None
        if key not in ck.tensors:
            return ck.object(key)
        full = ck.full(key)
        verified.ensure(full, f"{key}")  # read outside the engine's fills: its record is checked now
        return full.clone()

    def extras(self, name: str) -> dict[str, Any]:
        return {}

    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        """Each MoE block whose experts the model holds fused (an FSDP2 job of a transformers 5 MoE
        model saves ``<module>.experts.gate_up_proj`` ``[E, ...]``): ``fused_experts``."""
        return fused_expert_layers(self.names, self.shape, str(self.sources[-1]))

    def model_order(self) -> list[str] | None:
        """The entries' order, which ``dcp.save`` of ``get_state_dict`` takes from the model, and so
        does reshard's DCP writer where its manifest says ``entry_order``; ``None`` for a DCP that
        reshard wrote without it (an earlier reshard sorted the entries by key; a source that does
        not tell its model's order, such as a safetensors folder without config.json, keeps its own)."""
        manifest = self._manifest
        if manifest is None or manifest.get("entry_order") == ENTRY_ORDER:
            return list(self.names)
        return None

    def frozen(self) -> tuple[str, ...]:
        """The frozen parameters reshard's manifest names (``frozen``: written from a source that told
        them); a DCP's own files cannot tell a weight no optimizer state follows from a buffer."""
        names = (self._manifest or {}).get("frozen") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CheckpointError(f"{self.ck.path / MANIFEST}: 'frozen' is not a list of parameter names")
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise CheckpointError(f"{self.ck.path / MANIFEST}: names {unknown[0]!r} frozen, which the checkpoint does "
                                  "not hold")
        held = set(names)
        return tuple(n for n in self.names if n in held)

    @cached_property
    def _manifest(self) -> dict[str, Any] | None:
        """reshard's manifest beside the entries (``None``: a DCP reshard did not write). One that is
        there but unreadable is refused: what it says (the entries' order) changes the output."""
        f = self.ck.path / MANIFEST
        if not f.is_file():
            return None
        try:
            manifest = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable manifest ({str(e)[:80]}); a damaged reshard output?") from None
        if not isinstance(manifest, dict):
            raise CheckpointError(f"{f}: not a reshard manifest (a JSON {type(manifest).__name__}, not an object)")
        return manifest

    def labels(self) -> str:
        return "storage rank"  # a chunk lies on the rank that wrote its __R_N.distcp (docs/spec.md §7, DCP)

    def native(self, fmt: str) -> DcpCheckpoint | None:
        """The DCP checkpoint itself (its entries, objects and chunks)."""
        return self.ck if fmt == "dcp" else None
