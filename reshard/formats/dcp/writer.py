"""A PyTorch DCP checkpoint written from any source, which ``dcp.load`` reads at any world size
into ``get_state_dict(model, optim)``: ``model.<name>`` (fp32), ``optim.state.<name>.{exp_avg,
exp_avg_sq,step}`` and ``optim.param_groups.<i>.<key>``.

* ``files=None``: one chunk per tensor, parameters gathered into files of about
  ``max_file_bytes`` (``__i_0.distcp``), the parameter groups in a file of their own.
* ``files=N``: laid out for N loading ranks: file ``__r_0.distcp`` holds rank ``r``'s dim-0
  chunk of every tensor, as ``fully_shard`` splits (:func:`fsdp_chunks`), so an N-way FSDP job
  reads every byte once. From a DCP source every entry is kept by its own key (the objects go
  with rank 0's file); from any other, the keys above.

* ``quantize="keep"``: each weight the source stores quantized (``Reader.stored``: FP8 block
  scales, MXFP4) is two entries of its own, its payload and its scales as stored, byte for byte
  (``model.X.weight`` E4M3 and ``model.X.weight_scale_inv``; ``model.X_blocks`` and
  ``model.X_scales``), each laid out as any tensor (``--files N``: dim-0 chunks, so MXFP4 experts
  split over the loading ranks), and the source's ``quantization_config`` a non-tensor entry of
  that name, which the DCP reader decodes them by (``formats.dcp.reader``). Never decoded.

Every chunk is streamed from the source fragments through the engine's plan; ``.metadata`` is
written last, by one process, from every file's records (:meth:`DcpWriter.finish`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...errors import ReshardError
from ...ir.piece import prod
from ...layouts import replicated
from ...layouts._core import box_piece
from ...layouts._core import finish as finish_map
from ..contract import BEST, MOMENTS, Buffer, Held, Reader, Slot, Stored, Writer
from ..safetensors.io import plan_files
from .checkpoint import DcpCheckpoint
from .reader import ENTRY_ORDER, QUANTIZATION_CONFIG, RAW
from .records import DcpFile, Record, TensorSpec, metadata_bytes

__all__ = ["DcpWriter", "fsdp_chunks", "fsdp_map", "renamer"]


def fsdp_chunks(shape: tuple[int, ...], n: int) -> list[tuple[int, int]]:
    """``(start, rows)`` of dim 0 on each of ``n`` ranks, as ``fully_shard`` splits (``torch.chunk``:
    ceil-sized chunks, the last ones shorter or empty); a 0-d tensor lives on rank 0."""
    if not shape:
        return [(0, 1)] + [(0, 0)] * (n - 1)
    step = -(-shape[0] // n)
    return [(min(r * step, shape[0]), max(0, min(shape[0], (r + 1) * step) - r * step)) for r in range(n)]


def target_chunks(shape: tuple[int, ...], n: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``{rank: (offsets, sizes)}`` of the chunks a tensor is stored in for ``n`` loading ranks;
    a tensor without elements is one empty chunk on rank 0 (as ``dcp.save`` stores it)."""
    if not shape or not prod(shape):
        return {0: ((0,) * len(shape), shape)}
    return {r: ((start,) + (0,) * (len(shape) - 1), (rows, *shape[1:]))
            for r, (start, rows) in enumerate(fsdp_chunks(shape, n)) if rows}


def fsdp_map(shape: tuple[int, ...], n: int):
    """The map of a tensor laid out for ``n`` FSDP ranks (:func:`target_chunks`)."""
    shards = {}
    for r, (offsets, sizes) in target_chunks(shape, n).items():
        pieces = [box_piece(shape, offsets, sizes, sizes, (0,) * len(shape), (r,))] if prod(sizes) else []
        shards[r] = (sizes, pieces)
    return finish_map(shape, shards)


def renamer(rules: Sequence[str]) -> Callable[[str], str]:
    """``FROM=TO`` regex substitutions (``--rename``), applied in order."""
    compiled = []
    for rule in rules:
        src, sep, dst = rule.partition("=")
        if not sep or not src:
            raise ReshardError(f"--rename takes FROM=TO (a regex and its replacement), got {rule!r}")
        try:
            compiled.append((re.compile(src), dst))
        except re.error as e:
            raise ReshardError(f"--rename {rule!r}: bad regex ({e})") from None

    def rename(name: str) -> str:
        for pattern, dst in compiled:
            name = pattern.sub(dst, name)
        return name

    return rename


def _as_step(step: Any) -> torch.Tensor:
    """Adam's step as ``torch.optim`` keeps it (a float32 scalar tensor)."""
    value = step.item() if isinstance(step, torch.Tensor) else step
    return torch.tensor(float(value), dtype=torch.float32)


def _flat(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """``value``'s leaves under ``prefix``, a dict's keys joined by dots (``dcp.save``'s flattening)."""
    if isinstance(value, dict) and value:
        return [kv for k, v in value.items() for kv in _flat(f"{prefix}.{k}", v)]
    return [(prefix, value)]


def _path_of(key: str) -> tuple:
    """The nested-dict path DCP's planners rebuild a flattened key from."""
    if key.startswith(QUANTIZATION_CONFIG + "."):
        return tuple(key.split("."))
    if key.startswith("model."):
        return ("model", key[len("model."):])
    if key.startswith("optim.state."):
        fqn, _, state = key[len("optim.state."):].rpartition(".")
        return ("optim", "state", fqn, state)
    if key.startswith("optim.param_groups."):
        index, _, name = key[len("optim.param_groups."):].partition(".")
        return ("optim", "param_groups", int(index), name)
    return (key,)


class DcpWriter(Writer):
    format = "dcp"
    latest = None
    keeps_replicas = False

    def __init__(self, reader: Reader, *, files: int | None = None, max_file_bytes: int = 5 * 2**30,
                 rename: Sequence[str] = (), quantize: str | None = None) -> None:
        if files is not None and (isinstance(files, bool) or not isinstance(files, int) or files < 1):
            raise ReshardError(f"--files must be a positive integer, got {files!r}")
        if quantize not in (None, "keep"):
            raise ReshardError(f"--quantize {quantize!r}: a DCP target keeps a quantized source's weights as it stores "
                               "them (--quantize keep); it encodes none (--quantize fp8 goes with hf, safetensors "
                               "and vllm)")
        self.reader, self.files, self.max_file_bytes = reader, files, max_file_bytes
        self.tag = reader.tag
        own = reader.native("dcp")
        self.own = own if isinstance(own, DcpCheckpoint) and files is not None else None
        self.native = self.own is not None  # a DCP source laid out again: every entry as it is
        if self.native and rename:
            raise ReshardError("--rename goes with --format dcp from another format; a DCP checkpoint laid out "
                               "again with --files keeps its keys")
        rename_fn = renamer(rename)
        self.new = {n: rename_fn(n) for n in reader.names}
        # --quantize keep: the parameters moved as stored (payload and scales), from no buffer
        self.kept: dict[str, Stored] = {} if self.native or quantize is None else {
            n: s for n in reader.names if (s := reader.stored(n)) is not None}
        dup = sorted({v for v in self.new.values() if list(self.new.values()).count(v) > 1})
        if dup:
            raise ReshardError(f"--rename maps several parameters to {dup[0]!r}")
        # the model's order where the source tells it: the manifest then says so (entry_order), and a
        # DeepSpeed target written from these files flattens in it; else the source's own, unmarked
        self.ordered = None if self.native else _model_order(reader)
        self.entries = self._entries()
        self.layout = {e.key: target_chunks(e.shape, files) if files is not None else {0: ((0,) * len(e.shape), e.shape)}
                       for e in self.entries}
        self._maps = {e.key: fsdp_map(e.shape, files) if files is not None else replicated(e.shape, 1)
                      for e in self.entries}
        # without --files: each parameter's tensors in one of the files of at most max_file_bytes
        self.groups = [] if files is not None else [
            [n for n, _, _ in g] for g in plan_files([(n, (prod(reader.shape(n)) * 3,), torch.float32)
                                                        for n in reader.names], max_file_bytes)]
        self._buffers = {b.key: b for b in self._declare()}
        self.records: list[Record] = []
        self.specs: dict[str, TensorSpec] = {}
        self.values: list[str] = []
        self._lock = threading.Lock()

    def _entries(self) -> list[_Entry]:
        r = self.reader
        if self.own is not None:
            own = self.own
            return [_Entry(k, k, (RAW,), r.dtype(k, RAW), tuple(own.entry(k).shape)) for k in own.tensors]
        out = []
        for n in self.ordered or r.names:
            have = r.states(n)
            state = next((s for s in BEST if s in have), None)
            if state is None:
                raise ReshardError(f"{r.sources[-1]}: parameter {n!r} has no weights to write")
            kept = self.kept.get(n)
            if kept is not None:  # payload and scales as stored (their shapes: views, nothing read)
                for want, suffix, t in ((PAYLOAD, kept.payload_suffix, kept.payload()),
                                        (SCALES, kept.scales_suffix, kept.scales())):
                    out.append(_Entry(f"model.{self.new[n]}{suffix}", n, (want,), t.dtype, tuple(t.shape)))
            else:
                dtype = r.dtype(n, state)
                out.append(_Entry(f"model.{self.new[n]}", n, BEST, torch.float32 if dtype.is_floating_point else dtype,
                                  r.shape(n)))
            out += [_Entry(f"optim.state.{self.new[n]}.{m}", n, (m,), torch.float32, r.shape(n))
                    for m in MOMENTS if m in have]
        return out

    def _declare(self) -> list[Buffer]:
        """Each file's chunk of each tensor entry: with ``--files``, loading rank r's file holds its
        chunk of every entry; else each file holds its parameters' entries whole."""
        if self.files is not None:
            where = [(r, r, e) for r in range(self.files) for e in self.entries if r in self.layout[e.key]]
        else:
            group = {n: i for i, members in enumerate(self.groups) for n in members}
            where = [(group[e.name], 0, e) for e in self.entries]
            where.sort(key=lambda w: w[0])
        return [Buffer(_buffer_key(i, e.key), e.dtype, prod(self.layout[e.key][r][1]),
                       (Slot(0, e.name, e.want, self._maps[e.key], r),)) for i, r, e in where
                if e.want not in ((PAYLOAD,), (SCALES,))]  # kept quantized tensors: copied, not planned

    def copied(self) -> list[str]:
        """``--quantize keep``: the parameters whose payload and scales are copied as stored; a DCP
        source laid out again keeps its quantized entries as every entry, by their keys."""
        own = self.own
        if own is not None:  # an MXFP4 parameter is no entry of its own: its _blocks and _scales are
            return [n for n in self.reader.names if own.param_key(n) not in own.tensors
                    and self.reader.stored(n) is not None]
        return list(self.kept)

    def buffers(self) -> list[Buffer]:
        return list(self._buffers.values())

    def carries(self, held: Held) -> bool:
        """A DCP source laid out again (``--files``) keeps every entry of its own by its key."""
        own = self.own
        return own is not None and any(k in own.tensors or k in own.objects for k in (held.key, own.param_key(held.key)))

    def meta(self) -> dict[str, Any]:
        # a DCP laid out again keeps its source's entries, in its order: the model's where it was
        ordered = self.ordered is not None or (self.native and self.reader.model_order() is not None)
        # the source's frozen parameters: DCP's files cannot tell a weight no optimizer state follows from a buffer
        frozen = list(self.reader.frozen())
        return {"target": "PyTorch DCP checkpoint", **({"entry_order": ENTRY_ORDER} if ordered else {}),
                **({"files": self.files} if self.files is not None else {}), **({"frozen": frozen} if frozen else {})}

    def notes(self) -> list[str]:
        if not self.kept:
            return []
        return [f"{len(self.kept)} weights kept quantized as the source stores them: payload and scales entries of "
                f"their own, byte for byte (never decoded), and the source's {QUANTIZATION_CONFIG} as an entry"]

    # -- files ---------------------------------------------------------------------------------
    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        if self.files is not None:
            for e in self.entries:
                self.specs[e.key] = TensorSpec(e.dtype, e.shape, tuple(self.layout[e.key].values()))
            sizes = [sum(prod(lay[r][1]) for lay in self.layout.values() if r in lay) for r in range(self.files)]
            return [(sizes[r] + 1, partial(self._rank_file, engine, staging, r)) for r in range(self.files)]
        jobs = [(sum(prod(self.reader.shape(n)) * 3 for n in g), partial(self._whole_file, engine, staging, i, g))
                for i, g in enumerate(self.groups)]
        jobs.append((1, partial(self._values_file, staging, f"__{len(self.groups)}_0.distcp")))
        return jobs

    def _put(self, engine: Any, f: DcpFile, i: int, e: _Entry, rank: int) -> None:
        offsets, sizes = self.layout[e.key][rank]
        if e.want in ((PAYLOAD,), (SCALES,)):  # a kept quantized tensor: its dim-0 chunk, bytes as stored
            kept = self.kept[e.name]
            whole = kept.payload() if e.want == (PAYLOAD,) else kept.scales()
            chunk = whole[offsets[0]:offsets[0] + sizes[0]] if sizes else whole
            f.tensor(e.key, offsets, e.dtype, sizes, chunk.contiguous())
            return
        f.tensor(e.key, offsets, e.dtype, sizes, engine.fill(self._buffers[_buffer_key(i, e.key)]))

    def _quantization_config(self, f: DcpFile) -> None:
        """The source's ``quantization_config`` (what the kept tensors are decoded by), flattened
        as ``dcp.save`` flattens a nested dict: an entry per leaf, ``quantization_config.<key>``."""
        config = next((s.quantization_config for s in self.kept.values() if s.quantization_config is not None), None)
        if config is None:
            return
        for key, value in _flat(QUANTIZATION_CONFIG, config):
            f.value(key, value)
            with self._lock:
                self.values.append(key)

    def _rank_file(self, engine: Any, staging: Any, r: int) -> None:
        """Loading rank ``r``'s chunk of every tensor (and on rank 0 the rest)."""
        rel = f"__{r}_0.distcp"
        with staging.open(rel) as out:
            f = DcpFile(out, rel)
            for e in self.entries:
                if r in self.layout[e.key]:
                    self._put(engine, f, r, e, r)
            if r == 0 and self.own is not None:
                ck = self.own
                for key in ck.objects:
                    f.value(key, ck.object(key))
                with self._lock:
                    self.values.extend(ck.objects)
            elif r == 0:
                for n in self.reader.names:
                    self._step(f, n)
                self._groups(f)
                self._quantization_config(f)
        self._record(f.records)

    def _whole_file(self, engine: Any, staging: Any, i: int, members: list[str]) -> None:
        """Each of ``members``: its weight, moments and step, one chunk each."""
        rel = f"__{i}_0.distcp"
        mine = set(members)
        with staging.open(rel) as out:
            f = DcpFile(out, rel)
            for e in self.entries:
                if e.name not in mine:
                    continue
                self._put(engine, f, i, e, 0)
                with self._lock:
                    self.specs[e.key] = TensorSpec(e.dtype, e.shape, (((0,) * len(e.shape), e.shape),))
                if e is self._last[e.name]:
                    self._step(f, e.name)
        self._record(f.records)

    @property
    def _last(self) -> dict[str, _Entry]:
        return {e.name: e for e in self.entries}

    def _step(self, f: DcpFile, name: str) -> None:
        step = self.reader.step(name)
        if step is not None:
            key = f"optim.state.{self.new[name]}.step"
            f.tensor(key, (), torch.float32, (), _as_step(step))
            with self._lock:
                self.specs[key] = TensorSpec(torch.float32, (), (((), ()),))

    def _groups(self, f: DcpFile) -> None:
        for i, g in enumerate(self.reader.param_groups()):
            for k, v in g.items():
                f.value(f"optim.param_groups.{i}.{k}", [self.new[n] for n in v] if k == "params" else v)
                with self._lock:
                    self.values.append(f"optim.param_groups.{i}.{k}")

    def _values_file(self, staging: Any, rel: str) -> None:
        with staging.open(rel) as out:
            f = DcpFile(out, rel)
            self._groups(f)
            self._quantization_config(f)
        self._record(f.records)

    def _record(self, records: list[Record]) -> None:
        with self._lock:
            self.records.extend(records)

    def finish(self, staging: Any, gather: Callable[[Any], list], rank: int) -> None:
        """``.metadata``, by process 0, from every process's records (the same bytes whatever
        the number of processes)."""
        gathered = gather((self.records, self.specs, self.values))
        if rank != 0:
            return
        records = [r for part in gathered for r in part[0]]
        specs = {k: v for part in gathered for k, v in part[1].items()}
        values = [k for part in gathered for k in part[2]]
        planner = {k: _path_of(k) for k in sorted(list(specs) + values)}
        with staging.open(".metadata") as out:
            out.write(metadata_bytes(self._in_order(specs), sorted(values), records, planner))

    def _in_order(self, specs: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
        """The entries as ``dcp.save`` of ``get_state_dict`` lists them: the weights in the model's
        order, then each parameter's optimizer state in it (a reader of these files takes the model's
        order from it: a DeepSpeed target flattens its ZeRO buffers in that order); the same whichever
        process wrote which."""
        if self.own is not None:  # a DCP source laid out again: its own entries' order
            index = {e.key: i for i, e in enumerate(self.entries)}
            return dict(sorted(specs.items(), key=lambda kv: (kv[0] not in index, index.get(kv[0], 0), kv[0])))
        rank = {e.key: i for i, e in enumerate(e for e in self.entries if e.key.startswith("model."))}
        params = {self.new[n]: i for i, n in enumerate(dict.fromkeys(e.name for e in self.entries))}
        moments = {m: i for i, m in enumerate((*MOMENTS, "step"))}

        def key(k: str) -> tuple:
            if k in rank:
                return (0, rank[k], 0, k)
            fqn, _, state = k.removeprefix("optim.state.").rpartition(".")
            if k.startswith("optim.state.") and fqn in params:
                return (1, params[fqn], moments.get(state, len(moments)), k)
            return (2, 0, 0, k)
        return dict(sorted(specs.items(), key=lambda kv: key(kv[0])))


PAYLOAD, SCALES = "stored payload", "stored scales"  # a kept quantized weight's entries (not states: no buffer)


def _model_order(reader: Reader) -> list[str] | None:
    """The source's parameters in its model's order, where it tells one."""
    order = reader.model_order()
    return order if order is not None and set(order) == set(reader.names) else None


def _buffer_key(i: int, key: str) -> str:
    """Tensor entry ``key``'s chunk in file ``__{i}_0.distcp``."""
    return f"__{i}_0.distcp:{key}"


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor entry of the target: its key, the parameter and states it is made from."""

    key: str
    name: str
    want: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
