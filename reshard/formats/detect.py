"""Open whatever a user points ``reshard inspect`` or ``reshard plan`` at: a map document (JSON),
a DeepSpeed checkpoint folder, or a universal checkpoint folder, as a :class:`Source` -- its
maps by parameter name and what is known of its topology.

* A map document holds one map, or ``{"version": 1, "params": {name: map}}``.
* A DeepSpeed checkpoint is a tag folder, or its parent with ``latest``; its maps are the TP maps
  (the ZeRO split is reached through :meth:`Source.zero_fragments` / :meth:`Source.composed_map`).
* A universal checkpoint is a tag folder holding ``zero/<param>/fp32.pt``, or its parent with
  ``latest_universal``; each parameter is F itself on one rank.
* A PyTorch DCP folder (``.metadata``) lists every tensor entry (weights and optimizer states) by
  its DCP key; each map has one piece per chunk on the storage rank that wrote it (``formats.dcp``).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, MapFormatError, ReshardError, in_context
from ..ir.canonical import canonicalize
from ..ir.param_map import ParamMap, map_from_dict, maps_from_document
from ..layouts import replicated
from ..storage.safe_load import load
from .dcp.reader import DcpCheckpoint, is_dcp
from .deepspeed.checkpoint import DeepSpeedCheckpoint

__all__ = ["Source", "open_source", "select"]


@dataclass
class Source:
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


def open_source(path: str | Path) -> Source:
    """Read a map document, a DeepSpeed checkpoint folder, a universal checkpoint folder or a DCP
    folder."""
    p = Path(path)
    if p.is_file():
        return _open_maps(p)
    if not p.is_dir():
        raise ReshardError(f"{p}: no such file or folder")
    if is_dcp(p):
        return _open_dcp(p)
    ucp = _universal_dir(p)
    if ucp is not None:
        return _open_universal(p, ucp)
    return _open_deepspeed(p)


def _open_maps(p: Path) -> Source:
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{p}: cannot read a JSON map document ({e})") from None
    try:
        maps = maps_from_document(doc) if isinstance(doc, dict) and "params" in doc else {p.stem: map_from_dict(doc)}
    except MapFormatError as e:
        raise MapFormatError(e.path, f"{e.reason} (in {p})") from None
    for name, m in maps.items():
        _checked(m, f"{p}: parameter {name!r}")
    return Source(str(p), "maps", {n: canonicalize(m) for n, m in maps.items()}, "map document")


def _universal_dir(p: Path) -> Path | None:
    if (p / "zero").is_dir():
        return p
    latest = p / "latest_universal"
    if latest.is_file():
        tag = latest.read_text().strip()
        if tag and "/" not in tag and (p / tag / "zero").is_dir():
            return p / tag
        raise CheckpointError(f"{latest}: names tag {tag!r}, but {p / tag / 'zero'} is missing")
    return None


def _open_universal(path: Path, tag_dir: Path) -> Source:
    maps = {}
    for d in sorted(q for q in (tag_dir / "zero").iterdir() if q.is_dir()):
        f = d / "fp32.pt"
        if not f.is_file():
            continue
        obj = load(f)
        t = obj.get("param") if isinstance(obj, dict) else obj
        if not hasattr(t, "shape"):
            raise CheckpointError(f"{f}: expected a tensor or a dict with 'param', got {type(obj).__name__}")
        maps[d.name] = replicated(tuple(t.shape), 1)
    if not maps:
        raise CheckpointError(f"{tag_dir}: no zero/<param>/fp32.pt files: not a universal checkpoint")
    return Source(str(path), "universal", maps, "universal checkpoint")


def _open_dcp(path: Path) -> Source:
    ck = DcpCheckpoint.open(path)
    maps = {key: ck.param_map(key) for key in ck.tensors}
    ranks = sorted({c.rank for e in ck.tensors.values() for c in e.chunks})
    return Source(str(path), "dcp", maps, f"PyTorch DCP checkpoint, {len(ranks)} storage ranks")


def _open_deepspeed(path: Path) -> Source:
    ck = DeepSpeedCheckpoint.open(path)
    maps, families = {}, {}
    for name in ck.names:
        low = ck.tp_map(name)
        _checked(low.map, f"{ck.tag_dir}: parameter {name!r}")
        maps[name] = canonicalize(low.map)
        families[name] = low.family
    description = f"DeepSpeed TP={ck.tp} DP={ck.dp}{f' PP={ck.pp}' if ck.pp > 1 else ''} ZeRO-{ck.zero_stage}"
    return Source(str(path), "deepspeed", maps, description, ck.tp, ck.dp, ck.zero_stage, families, ck)


def _checked(m: ParamMap, where: str) -> None:
    try:
        m.check()
    except ReshardError as e:
        raise in_context(e, where) from None


def select(src: Source, param: str | None) -> list[str]:
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
