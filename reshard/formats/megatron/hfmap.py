"""Hugging Face names for Megatron keys, from an **architecture mapping document** (data:
``llama.json`` beside this module, or any dict of the same form), consumed by one generic function.

Each document entry maps one Megatron key to HF names: its stacked axes become ``{layer}``
(``{expert}``) in the names, a ``split`` cuts one layer's tensor along ``dim`` into ``groups``
repeats of ``sizes`` rows with part ``i`` of every group going to ``hf[i]`` (Megatron's grouped
``[q_g k_g v_g]`` rows, SwiGLU's ``[gate; up]`` halves), ``vocab`` keeps only the ``vocab_size``
rows of a padded vocabulary (the map's valid region) and ``when`` names a condition on the model
(``qkv_bias``, ``swiglu``, ``untied``, ``experts``, ``qk_layernorm``; with multi-latent attention
``mla``, ``q_lora``, ``no_q_lora``: ``deepseek_v3.json``, the default document then). Each HF name is then a list of *blocks*: a box
of the key's stacked F and where it lands in the HF tensor.

:func:`restrict` turns a key's map into an HF name's map: each shard's elements inside the
name's blocks form contiguous runs of that shard, and every run becomes a shard of its own (a new
rank label, remembered as ``(old label, lo, hi)``), so a fragment is ``shard[lo:hi]``, a view
(the q rows of one query group of one TP chunk, say). Readers use it on the source's maps, the
Megatron writer on its target's; no code is written per name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, MapError, ReshardError
from ...ir.geometry import box_intersect, piece_blocks
from ...ir.param_map import ParamMap
from ...ir.piece import Piece, View, row_major_strides
from ...layouts import compose, flat_ranges
from ...layouts._core import finish
from .model import Arch

__all__ = ["HUB_EXPERTS", "LLAMA", "Block", "HfParam", "hf_params", "hub_document", "load_document", "restrict",
           "unplaced"]

LLAMA = Path(__file__).with_name("llama.json")
DEEPSEEK_V3 = Path(__file__).with_name("deepseek_v3.json")  # multi-latent attention
# the same models with each expert's tensors apart, as transformers' save_pretrained and the Hub write them
HUB_EXPERTS = Path(__file__).with_name("llama_hub_experts.json")
DEEPSEEK_V3_HUB_EXPERTS = Path(__file__).with_name("deepseek_v3_hub_experts.json")


@dataclass(frozen=True, slots=True)
class Block:
    """The box ``[start, start + size)`` of a key's F (``fixed`` leading axes of extent 1) lands
    at ``hf_start`` of the HF tensor, the remaining axes one for one."""

    start: tuple[int, ...]
    size: tuple[int, ...]
    hf_start: tuple[int, ...]
    fixed: int

    @property
    def box(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((a, 1, n) for a, n in zip(self.start, self.size))


@dataclass(frozen=True, slots=True)
class HfParam:
    """One HF tensor: the key it is cut from, its shape (padding included), its valid shape and
    its blocks."""

    name: str
    key: str
    shape: tuple[int, ...]
    valid: tuple[int, ...]
    blocks: tuple[Block, ...]


@cache
def _document(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{path}: unreadable architecture mapping document ({e})") from None
    return _extended(doc, Path(path).parent)


def _extended(doc: dict, folder: Path) -> dict:
    """A document that ``extends`` another (a file beside it): the base's entries, those of each
    Megatron key the document enters replaced, in place, by its own entries for that key."""
    base_name = doc.get("extends")
    if base_name is None:
        return doc
    base = _document(str(folder / base_name))
    own = doc.get("params", [])
    keys = {e["megatron"] for e in own}
    params: list = []
    for e in base.get("params", []):
        if e["megatron"] not in keys:
            params.append(e)
        elif not any(x["megatron"] == e["megatron"] for x in params):
            params += [x for x in own if x["megatron"] == e["megatron"]]
    params += [x for x in own if not any(y is x for y in params)]
    return {**base, **{k: v for k, v in doc.items() if k != "extends"}, "params": params}


def load_document(doc: str | Path | Mapping | None = None, arch: Arch | None = None) -> dict:
    """The mapping document: the built-in one (DeepSeek-V3's for multi-latent attention, else
    Llama's), a path, or a dict."""
    if doc is None:
        return _document(str(DEEPSEEK_V3 if arch is not None and arch.mla else LLAMA))
    if isinstance(doc, Mapping):  # its "extends" names a document beside llama.json
        return _extended(dict(doc), LLAMA.parent)
    return _document(str(doc))


def hub_document(arch: Arch) -> Path:
    """The document naming each expert's tensors apart (save_pretrained's and the Hub's layout)
    for ``arch``'s built-in document."""
    return DEEPSEEK_V3_HUB_EXPERTS if arch.mla is not None else HUB_EXPERTS


def _sizes(arch: Arch) -> dict[str, int]:
    return {"hidden": arch.hidden, "heads": arch.heads, "groups": arch.groups, "per_group": arch.per_group,
            "head_dim": arch.head_dim, "q_group_rows": arch.per_group * arch.head_dim, "ffn": arch.ffn,
            "moe_ffn": arch.moe_ffn, "experts": arch.experts, "shared_ffn": arch.shared_ffn}


def _holds(arch: Arch, cond: str | list | None, layer: int | None = None) -> bool:
    """Whether condition ``cond`` holds of ``arch`` (of global ``layer`` for ``dense`` / ``moe``:
    a model with dense and MoE layers mixed)."""
    if isinstance(cond, list):
        return all(_holds(arch, c, layer) for c in cond)
    if isinstance(cond, str) and cond.startswith("!"):
        return not _holds(arch, cond[1:], layer)
    moe = arch.is_moe(layer) if layer is not None else bool(arch.experts)
    conds = {"qkv_bias": arch.qkv_bias, "swiglu": arch.swiglu, "untied": not arch.tied, "tied": arch.tied,
             "experts": bool(arch.experts), "dense": not moe, "moe": moe, "qk_layernorm": arch.qk_norm,
             "shared_experts": bool(arch.shared_ffn), "shared_expert_gate": arch.shared_gate,
             "expert_bias": arch.expert_bias, "mixed_layers": arch.moe_layers is not None and not all(arch.moe_layers),
             # the HF model with experts is a Mixtral (no QK layer norms, no shared expert; hfconfig)
             "mixtral": bool(arch.experts) and not arch.qk_norm and not arch.shared_ffn,
             "mla": arch.mla is not None, "q_lora": bool(arch.mla and arch.mla.q_lora),
             "no_q_lora": bool(arch.mla and not arch.mla.q_lora), None: True}
    if cond not in conds:
        raise ReshardError(f"architecture mapping: unknown condition {cond!r} (one of {sorted(c for c in conds if c)})")
    return conds[cond]


def _size(value: Any, sizes: dict[str, int], what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value in sizes:
        return sizes[value]
    raise ReshardError(f"architecture mapping: {what} {value!r} is neither an integer nor one of {sorted(sizes)}")


def _doc_key(spec: Any) -> str:
    """The document's name of a key: a per-layer key (``decoder.layers.<i>.…``, mixed layers) is
    entered once, as the stacked key's name."""
    if spec.layer is None:
        return spec.key
    return spec.key.replace(f"decoder.layers.{spec.layer}.", "decoder.layers.", 1)


def _axes(spec: Any) -> list[str]:
    """The names of a key's stacked axes (the leading axes of its F)."""
    return (["layer"] if spec.layered and spec.layer is None else []) + (["expert"] if spec.expert else [])


def hf_params(arch: Arch, doc: str | Path | Mapping | None = None) -> list[HfParam]:
    """Every HF tensor of ``arch`` under the mapping ``doc``, in HF model order (the entries' order,
    each layer's entries together). A key no entry maps is refused, naming it: nothing is dropped."""
    doc = load_document(doc, arch)
    sizes = _sizes(arch)
    by_doc: dict[str, list] = {}
    for s in arch.keys():
        by_doc.setdefault(_doc_key(s), []).append(s)
    mapped: set[str] = set()
    per_index: dict[tuple[int, ...], list[HfParam]] = {}
    head: list[HfParam] = []
    tail: list[HfParam] = []
    seen_layer = False
    for e in doc.get("params", []):
        specs = by_doc.get(e["megatron"], [])
        if not specs and _holds(arch, e.get("when")):
            raise ReshardError(f"architecture mapping: {e['megatron']!r} is not a key of this model")
        for spec in specs:
            if not _holds(arch, e.get("when"), spec.layer):
                continue
            mapped.add(spec.key)
            axes = _axes(spec)
            fixed = [a for a in e.get("index", axes) if a in axes]
            if fixed != axes[:len(fixed)]:
                raise ReshardError(f"architecture mapping: {e['megatron']!r} index {e.get('index')} is not a leading "
                                   f"part of its stacked axes {axes}")
            for index in _indices(arch, fixed):
                fmt = dict(zip(fixed, index))
                if spec.layer is not None:
                    fmt["layer"] = spec.layer
                got = _entry(spec, arch.full_shape(spec), e, index, fmt, sizes, arch.vocab)
                if "layer" in fmt:
                    rest = index[1:] if spec.layer is None else index  # the layer, then the expert
                    per_index.setdefault((fmt["layer"], *rest), []).extend(got)
                    seen_layer = True
                else:
                    (tail if seen_layer else head).extend(got)
    placeless = {k for k, _ in unplaced(arch, doc)}
    unmapped = [s.key for s in arch.keys() if s.key not in mapped and s.key not in placeless]
    if unmapped:
        raise ReshardError(f"architecture mapping: no entry for Megatron key {unmapped[0]!r} (of {len(unmapped)}): "
                           f"{doc.get('name', 'this document')} has no Hugging Face name for it")
    out = head + [p for ix in sorted(per_index) for p in per_index[ix]] + tail
    seen: set[str] = set()
    for p in out:
        if p.name in seen:
            raise ReshardError(f"architecture mapping: Hugging Face name {p.name!r} comes from two entries")
        seen.add(p.name)
    return out


def unplaced(arch: Arch, doc: str | Path | Mapping | None = None) -> list[tuple[str, str]]:
    """The keys of ``arch`` the document says the HF model has no place for (its ``unplaced``
    entries: a key ``prefix`` and ``why``, e.g. multi-token prediction layers), each with its reason:
    no HF name is made for them, and a reader lists them as weights the target cannot hold (refused
    unless ``--drop`` names them), so they are never lost silently."""
    doc = load_document(doc, arch)
    out = []
    for s in arch.keys():
        hit = next((e for e in doc.get("unplaced", []) if s.key.startswith(e["prefix"])), None)
        if hit is not None:
            out.append((s.key, str(hit["why"])))
    return out


def _indices(arch: Arch, fixed: list[str]) -> list[tuple[int, ...]]:
    """Every index of the ``fixed`` axes (``layer``, ``expert``)."""
    out: list[tuple[int, ...]] = [()]
    for a in fixed:
        n = arch.layers if a == "layer" else arch.experts
        out = [(*ix, i) for ix in out for i in range(n)]
    return out


def _entry(spec: Any, full: tuple[int, ...], e: Mapping, index: tuple[int, ...], fmt: dict, sizes: dict,
           vocab: int) -> list[HfParam]:
    fixed = len(index)
    rest = full[fixed:]
    names = e["hf"] if isinstance(e["hf"], list) else [e["hf"]]
    names = [n.format(**{"layer": None, "expert": None, **fmt}) for n in names]
    valid_rows = vocab if e.get("vocab") else None
    split = e.get("split")
    if split is None:
        start = tuple(index) + (0,) * len(rest)
        valid = (valid_rows, *rest[1:]) if valid_rows is not None else rest
        return [HfParam(names[0], spec.key, rest, valid, (Block(start, (1,) * fixed + rest, (0,) * len(rest), fixed),))]
    dim = int(split["dim"])
    groups = _size(split["groups"], sizes, "split groups")
    parts = [_size(s, sizes, "split size") for s in split["sizes"]]
    if len(parts) != len(names) or groups * sum(parts) != rest[dim]:
        raise ReshardError(f"architecture mapping: {spec.key!r} splits dim {dim} ({rest[dim]}) into {groups} x "
                           f"{parts} for {len(names)} names")
    out = []
    for i, (name, n) in enumerate(zip(names, parts)):
        shape = rest[:dim] + (groups * n,) + rest[dim + 1:]
        blocks = []
        for g in range(groups):
            start = [*index] + [0] * len(rest)
            start[fixed + dim] = g * sum(parts) + sum(parts[:i])
            size = [1] * fixed + list(rest)
            size[fixed + dim] = n
            hf_start = [0] * len(rest)
            hf_start[dim] = g * n
            blocks.append(Block(tuple(start), tuple(size), tuple(hf_start), fixed))
        out.append(HfParam(name, spec.key, shape, shape, tuple(blocks)))
    return out


# -- restriction ---------------------------------------------------------------------------------


def _runs(m: ParamMap, rank: int, blocks: tuple[Block, ...], where: str) -> list[tuple[int, int]]:
    """The contiguous runs ``[lo, hi)`` of rank ``rank``'s shard whose elements lie in ``blocks``."""
    spans = []
    for p in m.shard(rank).pieces:
        for b in piece_blocks(p, m.logical_shape):
            for blk in blocks:
                z = box_intersect(b.box, blk.box)
                if z is None:
                    continue
                sub = b.sub(z)
                n = 1
                hi = sub.base + 1
                for (_, _, count), st in zip(z, sub.strides):
                    n *= count
                    hi += (count - 1) * st
                spans.append((sub.base, hi, n))
    spans.sort()
    runs: list[list[int]] = []
    for lo, hi, n in spans:
        if runs and lo <= runs[-1][1]:
            if lo < runs[-1][1]:
                raise MapError(f"{where}: rank {rank}'s elements overlap")
            runs[-1][1], runs[-1][2] = hi, runs[-1][2] + n
        else:
            runs.append([lo, hi, n])
    for lo, hi, n in runs:
        if hi - lo != n:
            raise MapError(f"{where}: the elements of rank {rank}'s shard in this name are not one contiguous run "
                           f"([{lo}, {hi}) holds {n})")
    return [(lo, hi) for lo, hi, _ in runs]


def restrict(m: ParamMap, param: HfParam) -> tuple[ParamMap, dict[int, tuple[int, int, int]]]:
    """``m`` (a map of ``param.key``'s F) seen as HF tensor ``param``: its map over new rank
    labels, and each label's ``(label of m, lo, hi)``: the run of that shard it is."""
    where = f"{param.key} -> {param.name}"
    inner, origin = {}, {}
    for r in m.ranks:
        shard = m.shard(r)
        ranges = {}
        for lo, hi in _runs(m, r, param.blocks, where):
            label = len(origin)
            origin[label] = (r, lo, hi)
            ranges[label] = (hi - lo, [(lo, 0, hi - lo)])
        inner[r] = flat_ranges(shard.shape, ranges) if ranges else ParamMap(shard.shape, {})
    try:
        c = compose(m, inner)
    except ReshardError as e:
        raise CheckpointError(f"{where}: {e}") from None
    hf_strides = row_major_strides(param.shape)
    shards = {}
    for label, (_, lo, hi) in origin.items():
        pieces = []
        for p in c.shard(label).pieces:
            for b in piece_blocks(p, m.logical_shape):
                for blk in param.blocks:
                    z = box_intersect(b.box, blk.box)
                    if z is None:
                        continue
                    sub = b.sub(z)
                    k = blk.fixed
                    coords = [h + (ax[0] - s) for h, ax, s in zip(blk.hf_start, z[k:], blk.start[k:])]
                    pieces.append(Piece(tuple(ax[2] for ax in z[k:]),
                                        View(sum(c_ * s for c_, s in zip(coords, hf_strides)),
                                             tuple(ax[1] * s for ax, s in zip(z[k:], hf_strides))),
                                        View(sub.base, sub.strides[k:]), p.locations, p.scale))
        shards[label] = ((hi - lo,), pieces)
    return finish(param.shape, shards, param.valid), origin
