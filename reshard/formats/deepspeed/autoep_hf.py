"""A source in DeepSpeed AutoEP's names (a DeepSpeed AutoEP checkpoint, its universal checkpoint,
anything converted from them) seen in the Hugging Face names of the model a ``config.json`` says:
what an HF model folder is written from (``hf.writer.HfWriter``), so that ``from_pretrained`` loads
it. The inverse of ``autoep_view``, read from the same mapping document ``autoep.json`` (the preset
of the config's ``model_type``, its ``fused`` layout: transformers 5's in-memory names, which
``from_pretrained`` loads as they are): each ``split`` entry's parts joined again along its dim
(``experts.w1`` and ``experts.w3`` into ``gate_up_proj``: a map over one rank label per part and
source label, each piece moved to its part's run), every other entry renamed, AutoEP's router alias
left out (held weights the target writes as its router). The source itself is not changed."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.apply import rebuild
from ...ir.geometry import piece_blocks
from ...ir.param_map import ParamMap
from ...ir.piece import Piece, View, row_major_strides
from ...ir.shard import Shard
from ..contract import Held, Reader, ReaderView
from .autoep_view import AUTOEP_DOC

__all__ = ["AutoEPHfView", "autoep_hf_view"]


@dataclass(frozen=True, slots=True)
class _Join:
    """A view tensor: the source tensors ``parts`` (one whole, or several joined along ``dim``)."""

    parts: tuple[str, ...]
    dim: int = 0


def _template(t: str) -> re.Pattern[str]:
    """An entry's AutoEP name (``{module}.experts.w1``) as a pattern finding its module."""
    return re.compile(re.escape(t).replace(re.escape("{module}"), "(?P<module>.+)"))


def _preset_of(doc: dict, model_type: str | None) -> dict | None:
    return next((p for p in doc["presets"] if model_type in p["model_types"]), None)


def _fused(preset: dict) -> dict:
    return next(s for s in preset["sources"] if s["layout"] == "fused")


def _autoep_names(entry: dict) -> list[str]:
    return entry["autoep"] if isinstance(entry["autoep"], list) else [entry["autoep"]]


def _modules(doc: dict, names: Sequence[str]) -> tuple[list[str], str | None]:
    """The AutoEP MoE modules ``names`` hold (the module of every name one of the document's expert
    entries gives), in the names' order, and an expert name showing it."""
    pats = [_template(n) for p in doc["presets"] for e in _fused(p)["params"] if e.get("experts")
            for n in _autoep_names(e)]
    found: dict[str, None] = {}
    shown = None
    for n in names:
        for pat in pats:
            m = pat.fullmatch(n)
            if m is not None:
                found[m["module"]] = None
                shown = shown or n
                break
    return list(found), shown


# a deepspeed.pipe PipelineModule names its layers by index ("1.mlp"): a model of the user's own, not
# a transformers class, so its weights have no transformers names (docs/deepspeed-checkpoints.md §11.4)
PIPELINE_NAMES = ("; a pipeline (deepspeed.pipe) module names its layers by their index in the PipelineModule, "
                  "so its weights have no transformers names: convert it to safetensors, universal or DCP, which "
                  "keep its own names")


class AutoEPHfView(ReaderView):
    """``inner`` (in AutoEP's names) in the HF names of ``config``'s model (module doc)."""

    def __init__(self, inner: Reader, config: dict[str, Any], preset: dict, modules: Sequence[str]) -> None:
        super().__init__(inner)
        where = str(inner.sources[-1])
        self.preset: str = preset["name"]
        spec = _fused(preset)
        held = set(inner.names)
        made: dict[str, tuple[str, _Join]] = {}  # first source name -> (view name, what it is)
        taken: set[str] = set()
        self._aliases: dict[str, str] = {}  # AutoEP's router alias -> the view name written for it
        self._routers: dict[str, str] = {}  # AutoEP's router alias -> the router's source name
        for module in modules:
            if re.fullmatch(spec["source"], module) is None:
                raise ReshardError(f"{where}: {module}: an AutoEP MoE module that DeepSpeed's {self.preset} preset "
                                   f"does not place in Hugging Face names ({AUTOEP_DOC.name}: "
                                   f"{spec['source']!r})" + (PIPELINE_NAMES if module.split(".")[0].isdigit() else ""))
            for entry in spec["params"]:
                hf = entry["hf"].replace("{source}", module)
                names = [n.replace("{module}", module) for n in _autoep_names(entry)]
                missing = [n for n in names if n not in held]
                if missing and (entry.get("experts") or "alias" in entry or len(missing) < len(names)):
                    raise CheckpointError(f"{where}: the source holds no {missing[0]!r}, which DeepSpeed AutoEP's "
                                          f"{self.preset} preset places as {hf} ({AUTOEP_DOC.name})")
                if missing:
                    continue
                dim = int(entry["split"]["dim"]) if "split" in entry else 0
                made[names[0]] = (hf, _Join(tuple(names), dim))
                taken.update(names)
                alias = entry.get("alias", "").replace("{module}", module)
                if alias:
                    self._aliases[alias] = hf
                    self._routers[alias] = names[0]
                    taken.add(alias)
            stray = [n for n in inner.names if n.startswith(module + ".") and n not in taken]
            if stray:
                raise ReshardError(f"{where}: {stray[0]}: a tensor of the AutoEP MoE module {module} that DeepSpeed "
                                   f"AutoEP's {self.preset} preset does not name in Hugging Face names "
                                   f"({AUTOEP_DOC.name})")
        self._joins: dict[str, _Join] = {}
        self.names: list[str] = []
        for n in inner.names:
            if n in made:
                v, join = made[n]
                self._joins[v] = join
                self.names.append(v)
            elif n not in taken:
                self._joins[n] = _Join((n,))
                self.names.append(n)
        self._check(where)
        self._maps: dict[tuple[str, str], tuple[ParamMap, dict[int, tuple[int, int]]]] = {}
        self.how = (f"DeepSpeed AutoEP's names read in Hugging Face names ({self.preset} preset, {AUTOEP_DOC.name}): "
                    "each router.gate.weight the MoE block's gate.weight, experts.w1 (gate) and experts.w3 (up) "
                    "joined into experts.gate_up_proj, experts.w2 experts.down_proj"
                    + ("; AutoEP's router alias (gate.gate.weight) written once, as the router" if self._aliases else ""))

    def _check(self, where: str) -> None:
        for v, join in self._joins.items():
            first = join.parts[0]
            for n in join.parts[1:]:
                a, b = self.inner.shape(first), self.inner.shape(n)
                if len(a) != len(b) or any(x != y for i, (x, y) in enumerate(zip(a, b)) if i != join.dim) \
                        or self.inner.states(n) != self.inner.states(first) \
                        or any(self.inner.dtype(n, s) != self.inner.dtype(first, s) for s in self.inner.states(n)):
                    raise CheckpointError(f"{where}: {n}: not alike {first} (shape but along dim {join.dim}, states, "
                                          f"dtypes), which {v} joins it with")

    # -- the contract ------------------------------------------------------------------------------
    def _join(self, name: str) -> _Join:
        try:
            return self._joins[name]
        except KeyError:
            raise CheckpointError(f"{self.inner.sources[-1]}: no parameter {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        join = self._join(name)
        shapes = [self.inner.shape(n) for n in join.parts]
        if len(shapes) == 1:
            return shapes[0]
        return tuple(sum(s[join.dim] for s in shapes) if i == join.dim else n for i, n in enumerate(shapes[0]))

    def _whole(self, name: str) -> str | None:
        join = self._join(name)
        return join.parts[0] if len(join.parts) == 1 else None

    def states(self, name: str) -> tuple[str, ...]:
        return self.inner.states(self._join(name).parts[0])

    def dtype(self, name: str, state: str) -> torch.dtype:
        return self.inner.dtype(self._join(name).parts[0], state)

    def _made(self, name: str, state: str) -> tuple[ParamMap, dict[int, tuple[int, int]]]:
        got = self._maps.get((name, state))
        if got is None:
            join = self._join(name)
            maps = [self.inner.map(n, state) for n in join.parts]
            padded = [n for n, m in zip(join.parts, maps) if m.is_padded]
            if padded:
                raise CheckpointError(f"{self.inner.sources[-1]}: {padded[0]} ({state}) is padded; {name} is joined "
                                      "from unpadded tensors only")
            got = _joined(maps, join.dim, self.shape(name))
            self._maps[(name, state)] = got
        return got

    def map(self, name: str, state: str) -> ParamMap:
        whole = self._whole(name)
        return self.inner.map(whole, state) if whole is not None else self._made(name, state)[0]

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        whole = self._whole(name)
        if whole is not None:
            return self.inner.fragment(whole, state, rank)
        part, r = self._made(name, state)[1][rank]
        return self.inner.fragment(self._join(name).parts[part], state, r)

    def tp_index(self, name: str, state: str, rank: int) -> int | None:
        whole = self._whole(name)
        if whole is not None:
            return self.inner.tp_index(whole, state, rank)
        part, r = self._made(name, state)[1][rank]
        return self.inner.tp_index(self._join(name).parts[part], state, r)

    def step(self, name: str) -> Any:
        return self.inner.step(self._join(name).parts[0])

    def extras(self, name: str) -> dict[str, Any]:
        whole = self._whole(name)
        return self.inner.extras(whole) if whole is not None else {}

    def saver(self, name: str, state: str, rank: int) -> int | None:
        whole = self._whole(name)
        return self.inner.saver(whole, state, rank) if whole is not None else None

    def param_groups(self) -> list[dict[str, Any]]:
        rename = {j.parts[0]: v for v, j in self._joins.items()}
        return [{**g, "params": [rename[n] for n in g.get("params", []) if n in rename]}
                for g in self.inner.param_groups()]

    def model_order(self) -> list[str] | None:
        order = self.inner.model_order()
        if order is None:
            return None
        rename = {j.parts[0]: v for v, j in self._joins.items()}
        return [rename[n] for n in order if n in rename]

    def tied(self) -> dict[str, str]:
        return {a: t for a, t in self.inner.tied().items() if a not in self._aliases}

    def aliases(self) -> dict[str, str]:
        """AutoEP's router aliases left out, each with the HF name written for it."""
        return dict(self._aliases)

    def check_aliases(self) -> None:
        """Each AutoEP alias the source holds as a module entry equal to its router, bit for bit:
        written once, as the router, only where it is the router's value."""
        for alias, router in self._routers.items():
            if alias not in self.inner.names:
                continue  # a universal checkpoint holds it beside (tied), checked by its reader
            for state in self.inner.states(alias):
                if state not in self.inner.states(router):
                    continue
                # whole tensors: a router replicated over TP ranks has more holders than its alias
                a, b = (rebuild(m, {r: self.inner.fragment(n, state, r) for r in m.ranks})
                        for n, m in ((n, self.inner.map(n, state)) for n in (alias, router)))
                if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.view(torch.uint8),
                                                                                b.view(torch.uint8)):
                    raise CheckpointError(f"{self.inner.sources[-1]}: {alias} ({state}) differs from {router}, which "
                                          "DeepSpeed AutoEP saves it as an alias of; refused rather than one dropped")

    def unlowered(self) -> list[Held]:
        where = str(self.inner.sources[-1])
        seen = {h.key for h in self.inner.unlowered()}
        alias = [Held(a, where, "weights", f"DeepSpeed AutoEP's router alias, its router's value (written as {hf})")
                 for a, hf in self._aliases.items() if a in self.inner.names and a not in seen]
        return [*self.inner.unlowered(), *alias]


def _joined(maps: Sequence[ParamMap], dim: int, shape: tuple[int, ...]) -> tuple[ParamMap, dict[int, tuple[int, int]]]:
    """``maps`` (alike but along ``dim``) joined along ``dim`` into ``shape``: part ``i``'s label ``r``
    a new label whose shard is the same, each of its pieces cut into blocks moved to part ``i``'s
    run of ``dim``; and each new label's ``(i, r)``."""
    strides = row_major_strides(shape)
    label = {(i, r): k for k, (i, r) in enumerate((i, r) for i, m in enumerate(maps) for r in m.ranks)}
    shards = {}
    start = 0
    for i, m in enumerate(maps):
        for r in m.ranks:
            s = m.shard(r)
            pieces = []
            for p in s.pieces:
                where = frozenset(label[(i, x)] for x in p.locations)
                for b in piece_blocks(p, m.logical_shape):
                    box = tuple((a + start, t, n) if d == dim else (a, t, n) for d, (a, t, n) in enumerate(b.box))
                    pieces.append(Piece(tuple(n for _, _, n in box),
                                        View(sum(a * st for (a, _, _), st in zip(box, strides)),
                                             tuple(t * st for (_, t, _), st in zip(box, strides))),
                                        View(b.base, b.strides), where, p.scale))
            shards[label[(i, r)]] = Shard(s.shape, tuple(pieces))
        start += m.logical_shape[dim]
    return ParamMap(shape, shards), {k: ir for ir, k in label.items()}


def autoep_hf_view(reader: Reader, config: dict[str, Any]) -> Reader:
    """``reader`` as an HF model folder of ``config``'s model is written from: itself where it holds
    no AutoEP expert names, else :class:`AutoEPHfView` (refused, naming the model type, where
    ``autoep.json`` has no preset for it)."""
    doc = json.loads(AUTOEP_DOC.read_text())
    modules, shown = _modules(doc, reader.names)
    if not modules:
        return reader
    kind = config.get("model_type")
    preset = _preset_of(doc, kind)
    if preset is None:
        raise ReshardError(f"{reader.sources[-1]}: {shown}: DeepSpeed AutoEP's names, which a Hugging Face "
                           f"model_type {kind!r} folder cannot hold; {AUTOEP_DOC.name} names them in HF for "
                           f"{', '.join(t for p in doc['presets'] for t in p['model_types'])}")
    view = AutoEPHfView(reader, config, preset, modules)
    view.check_aliases()  # the source itself was checked when opened
    return view
