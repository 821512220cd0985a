"""A DeepSpeed AutoEP source (or its universal checkpoint) seen in Hugging Face names: what a
target that maps HF names (Megatron's, ``llama.json``) is planned and filled from. The way back of
``autoep_view``, read from the same mapping document ``autoep.json``, its ``fused`` source layout
(transformers' in-memory names): each AutoEP module's router ``router.gate.weight`` is the HF
router again, ``experts.w1`` (gate) and ``experts.w3`` (up) are joined along the document's
``split`` dim into ``gate_up_proj`` (a map over one rank label per part and source label, each
piece moved into its part's rows), ``experts.w2`` is ``down_proj``. AutoEP's alias of the router
(``gate.gate.weight``, the same parameter saved under a second name) is checked equal to the
router and written once, as the router. The source itself is not changed."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.geometry import piece_blocks
from ...ir.param_map import ParamMap
from ...ir.piece import Piece, View, row_major_strides
from ...ir.shard import Shard
from ..contract import Held, Reader
from ..hf_order import hf_model_order
from .autoep_view import AUTOEP_DOC

__all__ = ["HfNamesView", "hf_names_view"]


def _template(pattern: str) -> str:
    """A preset's module path (``model.layers.{layer}.mlp``) as a regular expression."""
    return re.escape(pattern).replace(re.escape("{layer}"), r"(?P<layer>\d+)")


def _fused(preset: dict) -> dict:
    for spec in preset["sources"]:
        if spec["layout"] == "fused":
            return spec
    raise ReshardError(f"{AUTOEP_DOC}: preset {preset['name']}: no 'fused' source layout to name its experts by")


def _found(doc: dict, names: Sequence[str]) -> tuple[dict, list[str]] | None:
    """The preset whose AutoEP modules the source holds, and those modules in order; ``None`` where
    the source holds none (its names are already a model's own)."""
    have = set(names)
    for preset in doc["presets"]:
        module = re.compile(_template(preset["module"]))
        order = [n.replace("{module}", "") for n in preset["order"]]  # ".experts.w1", ...
        found: dict[str, None] = {}
        for n in names:
            for suffix in order:
                if n.endswith(suffix) and module.fullmatch(n[:-len(suffix)]):
                    found[n[:-len(suffix)]] = None
        if found:
            for m in found:
                lacking = [m + s for s in order if m + s not in have]
                if lacking:
                    raise CheckpointError(f"{lacking[0]}: missing beside {m}'s other AutoEP experts ({AUTOEP_DOC.name}, "
                                          f"preset {preset['name']})")
            return preset, list(found)
    return None


class HfNamesView(Reader):
    """``inner`` (in DeepSpeed AutoEP's names) in Hugging Face names (module doc)."""

    def __init__(self, inner: Reader, preset: dict, modules: Sequence[str]) -> None:
        self.inner = inner
        self.format, self.tag, self.sources = inner.format, inner.tag, inner.sources
        self.description, self.topology = inner.description, inner.topology
        self.preset: str = preset["name"]
        where = str(inner.sources[-1])
        spec = _fused(preset)
        held = set(inner.names)
        self._parts: dict[str, tuple[tuple[str, ...], int]] = {}  # HF name -> (AutoEP names joined, dim)
        self.renamed: dict[str, str] = {}  # AutoEP name -> its HF name
        self._aliases: dict[str, str] = {}  # AutoEP's alias -> the router it is
        self._told: dict[str, str] = {}  # the same, where the source holds it beside its parameters (tied)
        for module in modules:
            if re.fullmatch(spec["source"], module) is None:  # AutoEP replaces the block in place
                raise ReshardError(f"{where}: {module}: DeepSpeed AutoEP's {self.preset} preset places its experts "
                                   f"outside the model's own MoE module ({AUTOEP_DOC.name}): no HF name to give back")
            for entry in spec["params"]:
                hf = entry["hf"].replace("{source}", module)
                names = [n.replace("{module}", module) for n in
                         (entry["autoep"] if isinstance(entry["autoep"], list) else [entry["autoep"]])]
                missing = [n for n in names if n not in held]
                if missing:
                    raise CheckpointError(f"{where}: holds no {missing[0]!r}, which DeepSpeed AutoEP's {self.preset} "
                                          f"preset makes of {hf} ({AUTOEP_DOC.name})")
                dim = int(entry["split"]["dim"]) if "split" in entry else 0
                if "split" in entry and len(names) != int(entry["split"]["parts"]):
                    raise ReshardError(f"{AUTOEP_DOC}: preset {self.preset}: {entry['hf']} cuts into "
                                       f"{entry['split']['parts']} parts, named {len(names)}")
                self._parts[hf] = (tuple(names), dim)
                self.renamed.update((n, hf) for n in names)
                if "alias" in entry:
                    alias = entry["alias"].replace("{module}", module)
                    if alias in held:  # a DeepSpeed checkpoint: a module entry of its own (checked equal)
                        self._aliases[alias] = names[0]
                    elif inner.tied().get(alias) == names[0]:  # a universal one: held beside, checked by it
                        self._told[alias] = names[0]
        self.names: list[str] = []
        for n in inner.names:
            if n in self._aliases:
                continue
            hf = self.renamed.get(n, n)
            if hf not in self._parts:
                self._parts[hf] = ((n,), 0)
            if hf not in self.names:
                self.names.append(hf)
        clash = [n for n in inner.names if n not in self.renamed and n in self.renamed.values()]
        if clash:
            raise CheckpointError(f"{where}: holds {clash[0]!r} beside the AutoEP tensors it is made of")
        self._check_parts(where)
        aliases = {**self._aliases, **self._told}
        self.how = (f"the source read in Hugging Face names (DeepSpeed AutoEP's {self.preset} preset, "
                    f"{AUTOEP_DOC.name}, its fused layout): each router.gate.weight renamed gate.weight, experts.w1 "
                    "(gate) and experts.w3 (up) joined into experts.gate_up_proj, experts.w2 renamed "
                    "experts.down_proj" + (f"; AutoEP's alias of each router ({len(aliases)}: {next(iter(aliases))}, "
                                           "...) equal to it, written once as the router" if aliases else ""))
        self._maps: dict[tuple[str, str], tuple[ParamMap, dict[int, tuple[int, int]]]] = {}

    def _check_parts(self, where: str) -> None:
        """The parts of a join alike (states, dtypes) and of one shape but along the join dim."""
        for hf, (parts, dim) in self._parts.items():
            first = parts[0]
            a = self.inner.shape(first)
            for n in parts[1:]:
                b = self.inner.shape(n)
                if len(a) != len(b) or dim >= len(a) or any(x != y for i, (x, y) in enumerate(zip(a, b)) if i != dim) \
                        or self.inner.states(n) != self.inner.states(first) \
                        or any(self.inner.dtype(n, s) != self.inner.dtype(first, s) for s in self.inner.states(n)):
                    raise CheckpointError(f"{where}: {n}: not alike {first} (shape but along dim {dim}, states, dtype), "
                                          f"which {hf} joins with it")

    # -- the contract ------------------------------------------------------------------------------
    def _part(self, name: str) -> tuple[tuple[str, ...], int]:
        try:
            return self._parts[name]
        except KeyError:
            raise CheckpointError(f"{self.inner.sources[-1]}: no parameter {name!r}") from None

    def _whole(self, name: str) -> str | None:
        parts, _ = self._part(name)
        return parts[0] if len(parts) == 1 else None

    def shape(self, name: str) -> tuple[int, ...]:
        parts, dim = self._part(name)
        one = list(self.inner.shape(parts[0]))
        one[dim] = sum(self.inner.shape(n)[dim] for n in parts)
        return tuple(one)

    def states(self, name: str) -> tuple[str, ...]:
        return self.inner.states(self._part(name)[0][0])

    def dtype(self, name: str, state: str) -> torch.dtype:
        return self.inner.dtype(self._part(name)[0][0], state)

    def _joined(self, name: str, state: str) -> tuple[ParamMap, dict[int, tuple[int, int]]]:
        got = self._maps.get((name, state))
        if got is None:
            parts, dim = self._part(name)
            maps = [self.inner.map(n, state) for n in parts]
            padded = [n for n, m in zip(parts, maps) if m.is_padded]
            if padded:
                raise CheckpointError(f"{self.inner.sources[-1]}: {padded[0]} ({state}) is padded; {name} is joined "
                                      "from unpadded tensors only")
            got = self._maps[(name, state)] = _joined(maps, dim, self.shape(name))
        return got

    def map(self, name: str, state: str) -> ParamMap:
        whole = self._whole(name)
        return self.inner.map(whole, state) if whole is not None else self._joined(name, state)[0]

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        whole = self._whole(name)
        if whole is not None:
            return self.inner.fragment(whole, state, rank)
        i, r = self._joined(name, state)[1][rank]
        return self.inner.fragment(self._part(name)[0][i], state, r)

    def tp_index(self, name: str, state: str, rank: int) -> int | None:
        whole = self._whole(name)
        if whole is not None:
            return self.inner.tp_index(whole, state, rank)
        i, r = self._joined(name, state)[1][rank]
        return self.inner.tp_index(self._part(name)[0][i], state, r)

    def saver(self, name: str, state: str, rank: int) -> int | None:
        whole = self._whole(name)
        return self.inner.saver(whole, state, rank) if whole is not None else None

    def step(self, name: str) -> Any:
        return self.inner.step(self._part(name)[0][0])

    def extras(self, name: str) -> dict[str, Any]:
        whole = self._whole(name)
        return self.inner.extras(whole) if whole is not None else {}

    def param_groups(self) -> list[dict[str, Any]]:
        out = []
        for g in self.inner.param_groups():
            params = list(dict.fromkeys(self.renamed.get(n, n) for n in g.get("params", []) if n not in self._aliases))
            out.append({**g, "params": params})
        return out

    def model_order(self) -> list[str] | None:
        """The HF model's order where the source records its config (AutoEP's own order is the
        replaced model's, not the HF one); ``None`` otherwise."""
        cfg = self.inner.hf_config()
        order = hf_model_order(cfg) if cfg is not None else None
        if order is None:
            return None
        out = [n for n in order if n in self._parts]
        return out if len(out) == len(self.names) else None

    def tied(self) -> dict[str, str]:
        gone = {**self._aliases, **self._told}
        return {a: self.renamed.get(w, w) for a, w in self.inner.tied().items() if a not in gone}

    def hf_config(self) -> dict[str, Any] | None:
        return self.inner.hf_config()

    def grad_clip(self) -> float | None:
        return self.inner.grad_clip()

    def check(self) -> None:
        """The source's checks, and each AutoEP alias equal to its router, bit for bit (a router
        [experts, hidden] is small): written once, it must be the one tensor it names."""
        self.inner.check()
        self.check_aliases()

    def check_aliases(self) -> None:
        """Each AutoEP alias the source holds as a module entry equal to its router, bit for bit."""
        for alias, router in self._aliases.items():
            for state in self.inner.states(alias):
                if state not in self.inner.states(router):
                    continue
                a, b = self.inner.map(alias, state), self.inner.map(router, state)
                if a != b or any(not torch.equal(self.inner.fragment(alias, state, r).view(torch.uint8),
                                                 self.inner.fragment(router, state, r).view(torch.uint8))
                                 for r in a.ranks):
                    raise CheckpointError(f"{self.inner.sources[-1]}: {alias} ({state}) differs from {router}, which "
                                          "DeepSpeed AutoEP saves it as an alias of; refused rather than one dropped")

    def unlowered(self) -> list[Held]:
        """The source's, but AutoEP's router aliases a universal checkpoint holds beside its
        parameters (the router's values, which its reader checks): written once, as the router."""
        return [h for h in self.inner.unlowered() if h.key not in self._told]

    def labels(self) -> str:
        return self.inner.labels()

    def world(self) -> int | None:
        return self.inner.world()

    def native(self, fmt: str) -> object | None:
        return None  # no target copies the source's own files under these names


def _joined(maps: Sequence[ParamMap], dim: int, whole: tuple[int, ...]) -> tuple[ParamMap, dict[int, tuple[int, int]]]:
    """The join of ``maps`` along ``dim`` into a tensor of shape ``whole``: part ``i``'s label
    ``r`` is a new label, each of its pieces moved to part ``i``'s run of ``dim``; and each new
    label's ``(i, r)``. A shard keeps its own elements in its own order."""
    strides = row_major_strides(whole)
    label = {(i, r): k for k, (i, r) in enumerate((i, r) for i, m in enumerate(maps) for r in m.ranks)}
    shards, at = {}, 0
    for i, m in enumerate(maps):
        for r in m.ranks:
            s = m.shard(r)
            pieces = []
            for p in s.pieces:
                where = frozenset(label[(i, x)] for x in p.locations)
                for b in piece_blocks(p, m.logical_shape):
                    counts = tuple(n for _, _, n in b.box)
                    offset = sum((s0 + (at if k == dim else 0)) * st for k, ((s0, _, _), st) in enumerate(zip(b.box, strides)))
                    pieces.append(Piece(counts, View(offset, tuple(t * st for (_, t, _), st in zip(b.box, strides))),
                                        View(b.base, b.strides), where, p.scale))
            shards[label[(i, r)]] = Shard(s.shape, tuple(pieces))
        at += m.logical_shape[dim]
    return ParamMap(whole, shards), {k: ir for ir, k in label.items()}


def hf_names_view(reader: Reader) -> Reader:
    """``reader`` in Hugging Face names: :class:`HfNamesView` where it holds DeepSpeed AutoEP's
    modules (``autoep.json``), else itself."""
    doc = json.loads(AUTOEP_DOC.read_text())
    found = _found(doc, reader.names)
    if found is None:
        return reader
    view = HfNamesView(reader, *found)
    view.check_aliases()  # the source itself was checked when opened
    return view
