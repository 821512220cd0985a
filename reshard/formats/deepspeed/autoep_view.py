"""A source whose MoE experts are in Hugging Face names (``Reader.expert_layers`` without a
DeepSpeed record: an HF folder, DCP, a Megatron checkpoint read in HF names), seen as DeepSpeed
AutoEP's model holds it: what an AutoEP target (``expert_target.autoep_fresh_target``) is planned
and filled from (``Writer.view``). The names come from the mapping document ``autoep.json``
(DeepSpeed's AutoEP presets): the router renamed and aliased; fused experts (transformers'
in-memory layout) a gate/up tensor cut into ``w1`` and ``w3`` (a map of part of it over the same
rank labels, each fragment that part's elements of the source's), the other renamed; experts
apart (the Hub's layout) each of ``w1``/``w2``/``w3`` the stack of one tensor per expert (a map
over one label per expert and source label). The source itself is not changed."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.geometry import Box, box_intersect, piece_blocks
from ...ir.param_map import ParamMap
from ...ir.piece import Piece, View, prod, row_major_strides
from ...ir.shard import Shard
from ..contract import ExpertLayer, Held, Reader, ReaderView
from ..hf_order import hf_model_order
from .templates import ADAMW

__all__ = ["AUTOEP_DOC", "AutoEPView", "autoep_view"]

AUTOEP_DOC = Path(__file__).with_name("autoep.json")
_HYPER = ("lr", "betas", "eps", "weight_decay")  # what an AutoEP group takes of the source's groups


@dataclass(frozen=True, slots=True)
class _Part:
    """A view parameter: source tensor ``sources[0]`` whole, or the box ``region`` of it, or (several
    ``sources``, one per expert) their stack in expert order."""

    sources: tuple[str, ...]
    region: Box | None = None


def _preset(doc: dict, reader: Reader, layers: Sequence[ExpertLayer], where: str) -> dict:
    """The document's preset for the source: by its ``config.json``'s model_type where it has one,
    else the first one with a source layout every layer's module matches."""
    presets = doc["presets"]
    kind = (reader.hf_config() or {}).get("model_type")
    if kind is not None:
        for p in presets:
            if kind in p["model_types"]:
                return p
        raise ReshardError(f"{where}: model_type {kind!r}: DeepSpeed AutoEP is written for "
                           f"{', '.join(t for p in presets for t in p['model_types'])} ({AUTOEP_DOC.name}, DeepSpeed "
                           "0.19.8's AutoEP presets)")
    for p in presets:  # the first whose entries name every tensor of every MoE module
        if all(_layout(p, lay) is not None and _places_all(_layout(p, lay), lay, reader.names) for lay in layers):
            return p
    lay = layers[0]
    raise ReshardError(f"{where}: {lay.module_path}: expert tensors {list(lay.params)} match no DeepSpeed AutoEP preset "
                       f"({AUTOEP_DOC.name})")


def _places_all(found: tuple[dict, str] | None, lay: ExpertLayer, names: Sequence[str]) -> bool:
    """Whether a layout's entries name every source tensor under ``lay``'s module (each expert's
    as the entry's ``{expert}`` name)."""
    if found is None:
        return False
    named = {e["hf"].replace("{source}", lay.module_path) for e in found[0]["params"]}
    apart = re.compile(re.escape(lay.module_path) + r"\.experts\.\d+\.")
    held = {apart.sub(f"{lay.module_path}.experts.{{expert}}.", n, count=1) for n in names
            if n.startswith(lay.module_path + ".")}
    return held <= named


def _layout(preset: dict, lay: ExpertLayer) -> tuple[dict, str] | None:
    """The preset's source layout holding ``lay`` (fused or apart, its module path matched) and the
    AutoEP module path it takes; ``None`` where there is none."""
    for spec in preset["sources"]:
        m = re.fullmatch(spec["source"], lay.module_path)
        if m is not None and (spec["layout"] == "apart") == lay.apart:
            return spec, preset["module"].format(**m.groupdict())
    return None


def _restricted(m: ParamMap, region: Box) -> tuple[ParamMap, dict[int, list[tuple[tuple[int, ...], tuple[int, ...], int]]]]:
    """``m`` seen as the box ``region`` of its F: a map over the same rank labels whose shards hold
    the region's elements only, and per label the source shard's blocks they are read from
    (``(shape, strides, base)``, in the new shard's order)."""
    shape = tuple(n for _, _, n in region)
    strides = row_major_strides(shape)
    shards, reads = {}, {}
    for rank, shard in m.shards.items():
        pieces, blocks, cursor = [], [], 0
        for p in shard.pieces:
            for b in piece_blocks(p, m.logical_shape):
                z = box_intersect(b.box, region)
                if z is None:
                    continue
                sub = b.sub(z)
                counts = tuple(n for _, _, n in z)
                src = View(sum((s - r0) * st for (s, _, _), (r0, _, _), st in zip(z, region, strides)),
                           tuple(t * st for (_, t, _), st in zip(z, strides)))
                pieces.append(Piece(counts, src, View(cursor, row_major_strides(counts)), p.locations, p.scale))
                blocks.append((counts, sub.strides, sub.base))
                cursor += prod(counts)
        if pieces:
            shards[rank], reads[rank] = Shard((cursor,), tuple(pieces)), blocks
    return ParamMap(shape, shards), reads


class AutoEPView(ReaderView):
    """``inner`` in DeepSpeed AutoEP's names (module doc); ``ep``: the target's EP degree (its
    expert optimizer group is named by it)."""

    def __init__(self, inner: Reader, layers: Sequence[ExpertLayer], ep: int, doc: dict | None = None) -> None:
        super().__init__(inner)
        self.ep = ep
        where = str(inner.sources[-1])
        doc = doc if doc is not None else json.loads(AUTOEP_DOC.read_text())
        preset = _preset(doc, inner, layers, where)
        self.preset: str = preset["name"]
        held = set(inner.names)
        parts: dict[str, list[tuple[str, _Part]]] = {}  # source name -> its view names ([]: in a stack)
        self._aliases: dict[str, str] = {}
        self._layers: list[ExpertLayer] = []
        self._memory: dict[str, list[str]] = {}  # the names transformers builds the model with -> the view's
        # module buffers (DeepSeek-V3's router.e_score_correction_bias): no parameter, no optimizer state;
        # each placed in the model's order before the name the document says (buffer -> that name)
        self._before: dict[str, str] = {}
        num_attr = preset.get("num_experts")
        cfg = inner.hf_config() or {}
        for lay in layers:
            found = _layout(preset, lay)
            if found is None:
                raise ReshardError(f"{where}: {lay.module_path}: an MoE module DeepSpeed AutoEP's {self.preset} preset "
                                   f"does not place ({AUTOEP_DOC.name}: its modules match "
                                   f"{[s['source'] for s in preset['sources']]})")
            spec, module = found
            if num_attr in cfg and int(cfg[num_attr]) != lay.num_experts:
                raise CheckpointError(f"{where}: {lay.module_path}: {lay.num_experts} experts in its tensors, "
                                      f"config.json's {num_attr} = {cfg[num_attr]}")
            expert_names: list[str] = []
            placed = set()
            for entry in spec["params"]:
                hf = entry["hf"].replace("{source}", lay.module_path)
                names = [n.replace("{module}", module) for n in
                         (entry["autoep"] if isinstance(entry["autoep"], list) else [entry["autoep"]])]
                placed.add(hf)
                if "{expert}" in hf:
                    stack = tuple(hf.replace("{expert}", str(e)) for e in range(lay.num_experts))
                    missing = [n for n in stack if n not in held]
                    if missing:
                        raise CheckpointError(f"{where}: the source holds no {missing[0]!r}, which DeepSpeed AutoEP's "
                                              f"{self.preset} preset stacks into {names[0]} ({AUTOEP_DOC.name})")
                    parts[stack[0]] = [(names[0], _Part(stack))]
                    parts.update((n, []) for n in stack[1:])
                elif hf not in held:
                    if entry.get("experts") or "alias" in entry:
                        raise CheckpointError(f"{where}: {lay.module_path}: the source holds no {hf!r}, which DeepSpeed "
                                              f"AutoEP's {self.preset} preset places ({AUTOEP_DOC.name})")
                    continue
                else:
                    parts[hf] = self._split(hf, names, entry.get("split"), where)
                if "buffer" in entry:
                    self._before[names[0]] = entry["buffer"]["before"].replace("{module}", module)
                if "alias" in entry:
                    self._aliases[entry["alias"].replace("{module}", module)] = names[0]
                if "alias" in entry and "buffer" not in entry:  # the router's weight (a buffer: not in memory)
                    self._memory[preset["memory"]["router"].replace("{module}", module)] = names
                if entry.get("experts"):
                    expert_names += names
            unplaced = [n for n in lay.params if n not in placed]
            if unplaced:
                raise ReshardError(f"{where}: {unplaced[0]}: an expert tensor of {lay.module_path} that DeepSpeed "
                                   f"AutoEP's {self.preset} preset does not place ({AUTOEP_DOC.name})")
            order = [n.replace("{module}", module) for n in preset["order"]]
            if sorted(order) != sorted(expert_names):
                raise ReshardError(f"{AUTOEP_DOC}: preset {self.preset}: 'order' {order} is not its experts "
                                   f"{expert_names}")
            self._memory.update((n.replace("{module}", module), order) for n in preset["memory"]["experts"])
            self._layers.append(ExpertLayer(lay.layer, module, lay.num_experts, tuple(order), _record(lay, module, order)))
        self._parts: dict[str, _Part] = {}
        self.names: list[str] = []
        for n in inner.names:
            for v, part in parts.get(n, [(n, _Part((n,)))]):
                self._parts[v] = part
                self.names.append(v)
        self.renamed = {n: [v for v, _ in vs] for n, vs in parts.items()}  # source tensor -> its view names
        cut = any(p.region is not None for p in self._parts.values())
        stacked = any(len(p.sources) > 1 for p in self._parts.values())
        self.how = "; ".join(["each router renamed <module>.router.gate.weight and aliased as <module>.gate.gate.weight",
                              *(["each fused gate_up_proj cut into experts.w1 (gate) and experts.w3 (up), down_proj "
                                 "renamed experts.w2"] if cut else []),
                              *(["each expert's tensors, held apart, stacked into experts.w1, w2 and w3 in expert "
                                 "order"] if stacked else [])])
        self._check_parts(where)
        # a buffer of the source that the preset does not write as one would become a trained parameter
        loose = [v for n in inner.buffers() if n in held for v in self.renamed.get(n, [n]) if v not in self._before]
        if loose:
            raise ReshardError(f"{where}: {loose[0]}: a module buffer of the source, which DeepSpeed AutoEP's "
                               f"{self.preset} preset ({AUTOEP_DOC.name}) does not write as a buffer (buffer_names): "
                               "it would be written as a trained parameter")
        layer_of = [re.match(preset["layer"], n) for n in self.names]
        # "first_moe_layer": the model layer of the first MoE block (DeepSeek-V3's first_k_dense_replace)
        moe = [re.match(preset["layer"], lay.module_path + ".") for lay in layers]
        first = min((int(m["layer"]) for m in moe if m), default=0)
        self._config = {**{k: first if v == "first_moe_layer" else v for k, v in preset["config"].items()},
                        "num_hidden_layers": 1 + max(int(m["layer"]) for m in layer_of if m),
                        num_attr: self._layers[0].num_experts, "tie_word_embeddings": "lm_head.weight" not in held}
        self._maps: dict[tuple[str, str], tuple[ParamMap, dict]] = {}

    def _split(self, hf: str, names: list[str], split: dict | None, where: str) -> list[tuple[str, _Part]]:
        if split is None:
            return [(names[0], _Part((hf,)))]
        shape = self.inner.shape(hf)
        dim, k = int(split["dim"]), int(split["parts"])
        if len(names) != k or dim >= len(shape) or shape[dim] % k:
            raise CheckpointError(f"{where}: {hf}: shape {list(shape)} does not cut into {k} equal parts along dim "
                                  f"{dim} ({', '.join(names)})")
        step = shape[dim] // k
        return [(v, _Part((hf,), tuple((i * step, 1, step) if a == dim else (0, 1, n) for a, n in enumerate(shape))))
                for i, v in enumerate(names)]

    def _check_parts(self, where: str) -> None:
        """A stack's tensors alike (shape, states, dtypes); AutoEP's grouped experts: ``w1``/``w3``
        ``[E, ffn, hidden]``, ``w2`` ``[E, hidden, ffn]``."""
        for v, part in self._parts.items():
            first = part.sources[0]
            for n in part.sources[1:]:
                if self.inner.shape(n) != self.inner.shape(first) or self.inner.states(n) != self.inner.states(first) \
                        or any(self.inner.dtype(n, s) != self.inner.dtype(first, s) for s in self.inner.states(n)):
                    raise CheckpointError(f"{where}: {n}: not alike {first} (shape, states, dtype), which {v} stacks "
                                          "with it")
        for lay in self._layers:
            w1, w2, w3 = (self.shape(n) for n in lay.params)
            if not (len(w1) == len(w2) == 3 and w1 == w3 and w2 == (w1[0], w1[2], w1[1])):
                raise CheckpointError(f"{where}: {lay.module_path}: expert tensors {dict(zip(lay.params, (w1, w2, w3)))} "
                                      "are not AutoEP's grouped experts (w1, w3 [E, ffn, hidden], w2 [E, hidden, ffn])")

    # -- the contract ------------------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        part = self._part(name)
        if part.region is not None:
            return tuple(n for _, _, n in part.region)
        one = self.inner.shape(part.sources[0])
        return one if len(part.sources) == 1 else (len(part.sources), *one)

    def _part(self, name: str) -> _Part:
        try:
            return self._parts[name]
        except KeyError:
            raise CheckpointError(f"{self.inner.sources[-1]}: no parameter {name!r}") from None

    def _whole(self, name: str) -> str | None:
        """The source tensor ``name`` is, where it is one whole."""
        part = self._part(name)
        return part.sources[0] if part.region is None and len(part.sources) == 1 else None

    def states(self, name: str) -> tuple[str, ...]:
        return self.inner.states(self._part(name).sources[0])

    def dtype(self, name: str, state: str) -> torch.dtype:
        return self.inner.dtype(self._part(name).sources[0], state)

    def _made(self, name: str, state: str) -> tuple[ParamMap, dict]:
        """The map of a cut or a stack, and per rank label what its fragment is read from."""
        got = self._maps.get((name, state))
        if got is None:
            part = self._part(name)
            maps = [self.inner.map(n, state) for n in part.sources]
            padded = [n for n, m in zip(part.sources, maps) if m.is_padded]
            if padded:
                raise CheckpointError(f"{self.inner.sources[-1]}: {padded[0]} ({state}) is padded; DeepSpeed AutoEP's "
                                      f"{name} is made from unpadded tensors only")
            got = _restricted(maps[0], part.region) if part.region is not None else _stacked(maps)
            self._maps[(name, state)] = got
        return got

    def map(self, name: str, state: str) -> ParamMap:
        whole = self._whole(name)
        return self.inner.map(whole, state) if whole is not None else self._made(name, state)[0]

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        part, whole = self._part(name), self._whole(name)
        if whole is not None:
            return self.inner.fragment(whole, state, rank)
        how = self._made(name, state)[1][rank]
        if part.region is None:  # a stack: label rank is expert e's label r
            e, r = how
            return self.inner.fragment(part.sources[e], state, r)
        flat = self.inner.fragment(part.sources[0], state, rank).reshape(-1)
        return torch.cat([flat.as_strided(shape, strides, flat.storage_offset() + base).reshape(-1)
                          for shape, strides, base in how])

    def tp_index(self, name: str, state: str, rank: int) -> int | None:
        part = self._part(name)
        if part.region is None and len(part.sources) > 1:
            e, r = self._made(name, state)[1][rank]
            return self.inner.tp_index(part.sources[e], state, r)
        return self.inner.tp_index(part.sources[0], state, rank)

    def step(self, name: str) -> Any:
        return self.inner.step(self._part(name).sources[0])

    def extras(self, name: str) -> dict[str, Any]:
        whole = self._whole(name)
        return self.inner.extras(whole) if whole is not None else {}

    def saver(self, name: str, state: str, rank: int) -> int | None:
        whole = self._whole(name)
        return self.inner.saver(whole, state, rank) if whole is not None else None

    def param_groups(self) -> list[dict[str, Any]]:
        """DeepSpeed AutoEP's two groups: the dense parameters (``dense-params``) and the experts
        (``moe``, named by the EP group), each a fresh AdamW's with the learning rate, betas, eps
        and weight decay of the source group that holds most of them, where the source has groups
        (torch's implementation flags are the resuming job's, not the source's)."""
        experts = {n for lay in self._layers for n in lay.params}
        dense = [n for n in self.names if n not in experts and n not in self._before]
        moe = [n for n in self.names if n in experts]
        src = self.inner.param_groups()

        def hyper(names: list[str]) -> dict[str, Any]:
            held = {s for n in names for s in self._part(n).sources}
            best = max(src, key=lambda g: len(held & set(g.get("params", []))), default={})
            got = {k: best.get(k, v) if k in _HYPER else v for k, v in ADAMW.items()}
            return {**got, "betas": tuple(got["betas"])}

        return [{"name": "dense-params", **hyper(dense), "params": dense},
                {"name": f"ep_size_{self.ep}", "moe": True, **hyper(moe), "params": moe}]

    def model_order(self) -> list[str] | None:
        """The AutoEP model's order (DeepSpeed's flat groups follow it): the HF model's, built by
        transformers on the meta device from the source's ``config.json``, or where it has none from
        the preset's architecture at the source's layer and expert counts (the order does not depend
        on the widths); each MoE block's router in its place and its experts, in AutoEP's order,
        where the model first reaches one of them. ``None`` (refused by the writer) where the model
        cannot be built or holds a source tensor nowhere: a source's own order need not be the model's
        (a DCP that an earlier reshard wrote lists its entries sorted by key)."""
        order = hf_model_order(self.inner.hf_config() or self._config)
        if order is None:
            return None
        out: dict[str, None] = {}
        for n in order:
            names = self._memory.get(n) or self.renamed.get(n) or [n]
            out.update((v, None) for v in names if v in self._parts)
        got = [n for n in out if n not in self._before]
        for b, before in self._before.items():  # transformers' named_parameters() holds no buffer
            if before in got:
                got.insert(got.index(before), b)
        return got if len(set(got)) == len(got) == len(self.names) else None

    def tied(self) -> dict[str, str]:
        return {**self.inner.tied(), **self._aliases}

    def buffers(self) -> tuple[str, ...]:
        """The module buffers the document's ``buffer`` entries name (DeepSeek-V3's router
        ``e_score_correction_bias``), in the view's order."""
        return tuple(n for n in self.names if n in self._before)

    def expert_layers(self) -> tuple[ExpertLayer, ...]:
        return tuple(self._layers)

    def unlowered(self) -> list[Held]:
        return self.inner.unlowered()


def _stacked(maps: Sequence[ParamMap]) -> tuple[ParamMap, dict[int, tuple[int, int]]]:
    """The stack of ``maps`` (one per expert, alike) along a new first dim: expert ``e``'s label
    ``r`` is a new label, each of its pieces moved to slab ``e``; and each new label's ``(e, r)``."""
    one = maps[0].logical_shape
    slab = prod(one)
    label = {(e, r): i for i, (e, r) in enumerate((e, r) for e, m in enumerate(maps) for r in m.ranks)}
    shards = {}
    for (e, r), i in label.items():
        s = maps[e].shard(r)
        shards[i] = Shard(s.shape, tuple(Piece(p.shape, View(p.source.offset + e * slab, p.source.strides), p.dest,
                                               frozenset(label[(e, x)] for x in p.locations), p.scale)
                                         for p in s.pieces))
    return ParamMap((len(maps), *one), shards), {i: er for er, i in label.items()}


def _record(lay: ExpertLayer, module: str, params: list[str]) -> dict[str, Any]:
    """A ``ds_autoep_layers`` entry, in DeepSpeed 0.19.8's key order, whose placement fields the
    target fills at its EP x DP (``placement.AutoEPPlacement.layer``)."""
    return {"moe_layer_id": lay.layer, "module_path": module, "num_experts": lay.num_experts,
            "num_local_experts": None, "ep_size": None, "expert_placement": None,
            "affine_maps": {"version": 1, "params": dict.fromkeys(params)},
            "expert_key_prefix": params[0].rpartition(".")[0], "checkpoint_format": "per_expert_files",
            "checkpoint_format_version": None, "ep_group_name": None, "ep_rank": None,
            "expert_data_parallel_rank": None, "expert_data_parallel_world_size": None, "global_expert_start": None,
            "global_expert_end": None}


def autoep_view(reader: Reader, ep: int) -> Reader:
    """``reader`` as an AutoEP target reads it: itself where its expert layers are DeepSpeed's own
    (a universal checkpoint of an AutoEP job records them in AutoEP's names), else
    :class:`AutoEPView` (layers found in HF names, ``fused_experts``)."""
    layers = reader.expert_layers()
    if not layers or all(lay.record for lay in layers):
        return reader
    return AutoEPView(reader, layers, ep)
