"""Open whatever a user points ``reshard inspect`` or ``reshard plan`` at: a map document (JSON),
a DeepSpeed checkpoint folder, or a universal checkpoint folder, as a :class:`Inspected` -- its
maps by parameter name and what is known of its topology.

* A map document holds one map, or ``{"version": 1, "params": {name: map}}``.
* A DeepSpeed checkpoint is a tag folder, or its parent with ``latest``; its maps are the TP maps
  (the ZeRO split is reached through :meth:`Inspected.zero_fragments` / :meth:`Inspected.composed_map`).
* A universal checkpoint is a tag folder holding ``zero/<param>/fp32.pt``, or its parent with
  ``latest_universal``; each parameter is F itself on one rank.
* A PyTorch DCP folder (``.metadata``) lists every tensor entry (weights and optimizer states) by
  its DCP key; each map has one piece per chunk on the storage rank that wrote it (``formats.dcp``).
* A parameter stored as FP8 block scales (``Reader.stored``) is followed by its scale tensor, whose
  map is the payload's coarsened by the block (``ir.blocks.coarsen``, docs/spec.md §7.5), here
  and at a planned TP (:func:`hf_plan_targets`). In a DCP that keeps them as stored (``--quantize
  keep``) the payload and scale entries are each shown with their own chunks, the scales paired with
  their payload (:attr:`Inspected.scales`: ``inspect --png`` draws them beside it).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MapFormatError, ReshardError, in_context
from ..formats.contract import STATES, Reader
from ..formats.dcp.checkpoint import DcpCheckpoint
from ..formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from ..formats.deepspeed.reader import DeepSpeedNative
from ..formats.registry import open_reader
from ..ir.blocks import coarsen
from ..ir.canonical import canonicalize
from ..ir.codec import SCALE_FORMATS
from ..ir.param_map import ParamMap, map_from_dict, maps_from_document
from ..layouts import replicated

__all__ = ["Inspected", "hf_plan_targets", "open_source", "select"]


@dataclass
class Inspected:
    """The maps a TARGET/SOURCE path describes, with what is known of its topology."""

    path: str
    kind: str  # "maps" | "deepspeed" | "universal" | "dcp"
    maps: dict[str, ParamMap]
    description: str  # the topology, in words
    tp: int | None = None
    dp: int = 1
    zero_stage: int | None = None
    families: dict[str, str] = field(default_factory=dict)  # lowering family per parameter (DeepSpeed)
    checkpoint: DeepSpeedCheckpoint | None = None  # for the ZeRO split
    scales: dict[str, tuple[str, tuple[int, int]]] = field(default_factory=dict)  # scale tensor: payload, block
    unit: str = "rank"  # what the maps' keys name (Reader.labels): a saving rank, or a rank label
    world: int | None = None  # how many processes saved it, where known (Reader.world)
    dtypes: dict[str, str] = field(default_factory=dict)  # each shown map's dtype as stored ("bfloat16")
    sizes: dict[str, int] = field(default_factory=dict)  # each shown map's element size as stored, bytes
    held: dict[str, tuple[str, ...]] = field(default_factory=dict)  # every state the source holds: its dtypes
    savers: dict[str, dict[int, int]] = field(default_factory=dict)  # per shown map: its rank labels' storage ranks
    shown: str | None = None  # the state whose map the table shows, where the source has states
    state_dtypes: dict[str, dict[str, torch.dtype]] = field(default_factory=dict)  # per parameter: each state's

    def show_state(self, state: str) -> None:
        """Figures of ``state`` rather than each parameter's first (DeepSpeed's composed view: the
        ZeRO split holds the optimizer's fp32 state, not the module weights)."""
        for name, dtypes in self.state_dtypes.items():
            if name in self.maps and state in dtypes:
                self.dtypes[name], self.sizes[name] = _dtype_name(dtypes[state]), dtypes[state].itemsize
        self.shown = state

    @property
    def names(self) -> list[str]:
        return list(self.maps)

    def zero_fragments(self, name: str) -> dict[int, dict[int, int]]:
        """``{tp_rank: {dp_rank: elements}}`` of ``name``'s TP shards in the DP ranks' flat
        partitions (a DeepSpeed checkpoint)."""
        ck = self._deepspeed()
        out: dict[int, dict[int, int]] = {}
        for t in range(ck.tp):
            entry = ck.zero_map(name, t)
            out[t] = {} if entry is None else {d: s.numel for d, s in entry[1].shards.items()}
        return out

    def composed_map(self, name: str) -> ParamMap:
        """``name``'s TP map composed with its ZeRO split, over global ranks ``dp * TP + tp``."""
        return self._deepspeed().composite_map(name, self.maps[name])

    def _deepspeed(self) -> DeepSpeedCheckpoint:
        if self.checkpoint is None:
            raise ReshardError(f"{self.path}: not a DeepSpeed checkpoint, so it has no ZeRO split")
        return self.checkpoint


def open_source(path: str | Path) -> Inspected:
    """Read a map document, or any checkpoint reshard reads (``registry.open_reader``)."""
    p = Path(path)
    if p.is_file() and p.suffix != ".safetensors":
        return _open_maps(p)
    if not p.exists():
        raise ReshardError(f"{p}: no such file or folder")
    reader = open_reader(p)
    own, dcp = reader.native("deepspeed"), reader.native("dcp")
    if isinstance(own, DeepSpeedNative):
        return _stored(_open_deepspeed(own.ck, p, reader.names), reader)
    if isinstance(dcp, DcpCheckpoint):
        ck = dcp
        scales = _dcp_scales(reader, ck)
        after = {payload: scale for scale, (payload, _) in scales.items()}
        maps = {}
        for key in ck.tensors:  # each scale entry right after its payload's
            if key not in scales:
                maps[key] = ck.param_map(key)
                if key in after:
                    maps[after[key]] = ck.param_map(after[key])
        src = _stored(Inspected(str(p), "dcp", maps, reader.description, scales=scales), reader)
        for key, e in ck.tensors.items():  # each entry is shown, optimizer states too: its own dtype
            src.dtypes[key], src.sizes[key] = _dtype_name(e.dtype), e.dtype.itemsize
        return src
    maps, scales = {}, {}
    for n in reader.names:
        maps[n] = reader.map(n, reader.states(n)[0])
        stored = reader.stored(n)
        if stored is not None and stored.kind == "fp8":  # the payload's scales beside it, their map derived from its map
            scale = (n[:-len(".weight")] if n.endswith(".weight") else n) + ".weight_scale_inv"
            maps[scale], scales[scale] = coarsen(maps[n], stored.block), (n, stored.block)
    kind = "universal" if reader.format == "universal" else "maps"
    return _stored(Inspected(str(p), kind, maps, reader.description, scales=scales), reader)


def _dcp_scales(reader: Reader, ck: DcpCheckpoint) -> dict[str, tuple[str, tuple[int, int]]]:
    """A DCP holding quantized weights as stored (``--quantize keep``): each scale entry (FP8's
    ``weight_scale_inv``, MXFP4's ``_scales``) by its key, with its payload entry's key and the block;
    each is an entry of its own, its map its own chunks."""
    out = {}
    for n in reader.names:
        stored = reader.stored(n)
        if stored is None:
            continue
        payload, scale = ck.param_key(n + stored.payload_suffix), ck.param_key(n + stored.scales_suffix)
        if payload in ck.tensors and scale in ck.tensors:
            out[scale] = (payload, stored.block)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stored(src: Inspected, reader: Reader) -> Inspected:
    """``src`` with what ``reader`` says of what is stored: its maps' keys and saving world, the
    dtype of each shown map (a parameter's first state, as its map is shown), every state's dtypes."""
    src.unit, src.world = reader.labels(), reader.world()
    held: dict[str, set[str]] = {}
    for n in reader.names:
        states = reader.states(n)
        src.state_dtypes[n] = {state: reader.dtype(n, state) for state in states}
        for state in states:
            held.setdefault(state, set()).add(_dtype_name(src.state_dtypes[n][state]))
        if states and src.shown is None and src.kind != "dcp":
            src.shown = states[0]
        if n in src.maps and states and src.unit != "rank":
            savers = {r: reader.saver(n, states[0], r) for r in src.maps[n].ranks}
            if all(s is not None for s in savers.values()):
                src.savers[n] = {r: s for r, s in savers.items() if s is not None}
        if n in src.maps and states:
            stored = reader.stored(n)
            # an FP8 payload is stored one byte an element (its weight state is the decoded value)
            dtype = stored.payload_dtype if stored is not None and stored.kind == "fp8" else reader.dtype(n, states[0])
            src.dtypes[n], src.sizes[n] = _dtype_name(dtype), dtype.itemsize
            if stored is not None and stored.kind != "fp8":  # packed below a byte an element: counted as decoded
                src.dtypes[n] += f" as decoded from {stored.kind}"
    for scale, (payload, _) in src.scales.items():  # block scales: float32, or E8M0 in a byte
        stored = reader.stored(payload)
        if stored is not None:
            src.dtypes[scale], src.sizes[scale] = stored.scale_fmt, SCALE_FORMATS[stored.scale_fmt].itemsize
    src.held = {s: tuple(sorted(held[s])) for s in STATES if s in held}
    return src


def hf_plan_targets(src: Inspected, tp: int) -> dict[str, tuple[ParamMap, str]] | None:
    """A Hugging Face folder's parameters at TP=``tp`` as transformers' own TP plan for its
    architecture places them (``formats.hf.tp_plan``), with the style naming each layout; None for
    any other source (its layouts are recognised from its TP maps)."""
    folder = Path(src.path)
    if src.kind != "maps" or not folder.is_dir() or not (folder / "config.json").is_file() \
            or any(len(m.ranks) != 1 for m in src.maps.values()):
        return None
    from ..formats.hf.tp_plan import tp_plan

    shapes = {n: tuple(m.logical_shape) for n, m in src.maps.items() if n not in src.scales}
    plan = tp_plan(folder, shapes)
    maps = plan.maps(shapes, tp)
    out = {n: (maps[n], f"transformers' TP plan: {plan.params[n].style or 'no rule, whole'}") for n in shapes}
    for scale, (payload, block) in src.scales.items():  # coarsened from the payload's target, not by name
        out[scale] = (coarsen(maps[payload], block), f"block scales: the payload's map coarsened by {block[0]}x{block[1]}")
    return out


def _open_maps(p: Path) -> Inspected:
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{p}: cannot read a JSON map document ({e})") from None
    many = isinstance(doc, dict) and "params" in doc
    try:
        maps = maps_from_document(doc) if many else {p.stem: map_from_dict(doc)}
    except MapFormatError as e:
        raise MapFormatError(e.path, f"{e.reason} (in {p})") from None
    for name, m in maps.items():  # the JSON path of a bad field, as in the file
        _checked(m, f"{p}: parameter {name!r}", f"params.{name}" if many else "")
    return Inspected(str(p), "maps", {n: canonicalize(m) for n, m in maps.items()}, "map document")


def _open_deepspeed(ck: DeepSpeedCheckpoint, path: Path, names: list[str] | None = None) -> Inspected:
    maps, families = {}, {}
    frozen = ck.frozen.shapes
    for name in names or ck.names:
        if name in frozen:  # a frozen parameter: whole at TP 1, no optimizer state (no ZeRO split)
            maps[name] = canonicalize(replicated(frozen[name], 1))
            families[name] = "frozen (module weight only)"
            continue
        low = ck.tp_map(name)
        _checked(low.map, f"{ck.tag_dir}: parameter {name!r}")
        maps[name] = canonicalize(low.map)
        families[name] = low.family
    description = f"DeepSpeed TP={ck.tp} DP={ck.dp}{f' PP={ck.pp}' if ck.pp > 1 else ''} ZeRO-{ck.zero_stage}"
    return Inspected(str(path), "deepspeed", maps, description, ck.tp, ck.dp, ck.zero_stage, families, ck)


def _checked(m: ParamMap, where: str, path: str = "") -> None:
    try:
        m.check(path)
    except ReshardError as e:
        raise in_context(e, where) from None


def select(src: Inspected, param: str | None) -> list[str]:
    """The parameter names to show: all, or the one ``param`` names: exactly, else as the only name
    ending in ``.param``, else as the only name containing it."""
    if param is None:
        return src.names
    if param in src.maps:
        return [param]
    suffix = [n for n in src.names if n.endswith("." + param)]
    if len(suffix) == 1:
        return suffix
    hits = [n for n in src.names if param in n]
    if len(hits) == 1:
        return hits
    if hits:
        more = f" and {len(hits) - 5} more" if len(hits) > 5 else ""
        raise ReshardError(f"--param {param!r} matches {len(hits)} parameters: {', '.join(hits[:5])}{more}")
    near = difflib.get_close_matches(param, src.names, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ReshardError(f"{src.path}: no parameter {param!r}{hint}")
