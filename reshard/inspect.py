"""See a layout and a plan: ``reshard inspect`` and ``reshard plan SOURCE --tp T``.

``reshard inspect TARGET [--param NAME] [--element-size N] [--composed] [--json] [--png FILE]``

TARGET is a map document (JSON: one map, or ``{"version": 1, "params": {name: map}}``), a
DeepSpeed checkpoint folder (a tag folder, or its parent with ``latest``), or a universal
checkpoint folder (a tag folder holding ``zero/<param>/fp32.pt``, or its parent with
``latest_universal``; each parameter is F itself on one rank). One row per parameter:

* ``F`` and ``valid`` -- ``logical_shape`` and ``valid_shape`` (``=F`` when equal);
* ``pieces/rank`` -- pieces of the *canonical* map on each rank (empty pieces do not count);
* ``replicated`` -- the fraction of F's elements held by more than one rank;
* ``scales`` -- the distinct piece scales;
* ``bytes/rank`` -- shard elements times the element size (``--element-size``, default 4: fp32).

Per-rank lists are written compactly over the ranks named in the header: ``2×4`` is 2 on each of
4 consecutive ranks. Totals per rank follow. For a DeepSpeed checkpoint the rows are the TP maps
(over TP ranks), followed by the ZeRO split: how many elements of each TP shard each DP rank's
flat optimizer partition holds. ``--composed`` shows instead the TP map composed with the ZeRO
split, over global ranks ``dp_rank * TP + tp_rank`` (DeepSpeed's order).

``--png FILE`` draws one parameter (``--param``, default the first) with :func:`reshard.viz.draw_map`.

``reshard plan SOURCE --tp T [--dp D] [--vocab-divisible-by N] [--json] [--png FILE]``

SOURCE is a map document or a DeepSpeed checkpoint folder. Each parameter's layout is recognised
from its geometry alone (``layout_of``) and rebuilt at TP=T (``Layout.build``); the move from the
source maps to those target maps is planned without moving data. Supported layout families:

* ``replicated`` -- every rank holds all of F; scale 1 stays 1, a scale of ``1/tp`` (a bias
  pre-divided by the TP size) becomes ``1/T``; other scales are refused;
* ``split`` -- contiguous blocks along one dim in rank order, possibly uneven; at TP=T the dim is
  cut into near-even sizes (equal when T divides it, else the first ranks take one more);
* ``sub-params`` -- several sub-parameters concatenated along one dim (fused q/k/v, gate/up),
  each split over the ranks; at TP=T each keeps its size and is cut near-evenly;
* ``split+replicated`` -- segments along one dim, each split or held by every rank (GPT-BigCode
  multi-query attention: query rows split, key/value rows on every rank); split segments are cut
  near-evenly at TP=T, replicated segments stay on every rank;
* ``padded-vocab`` -- a split of F whose rows past ``valid_shape`` are padding; F keeps its rows
  when T divides them, else it is re-padded to a multiple of ``N * T`` rows with ``N`` from
  ``--vocab-divisible-by`` (required then: the padding rule cannot be read back from the rows);
* ``shared-qk`` -- Yuan's shared-QK value / o_proj heads (with odd heads per rank, neighbouring
  ranks share a head); the number of heads is recognised and kept.

Anything else (ZeRO flat ranges, CodeGen's permuted blocks, maps with mixed scales, a 1-rank
source, whose family its geometry cannot tell) is refused with a :class:`reshard.PlanError` naming
the parameter. When T equals the source TP every map is kept as it is. With ``--dp D`` (default:
the source's DP size) the target TP maps are replicated over D data-parallel replicas, global rank
``dp_rank * T + tp_rank``; a DeepSpeed source's TP maps are likewise replicated over its own DP
ranks. Only model weights are planned; ZeRO optimizer partitions are not.

JSON (``--json``; keys are stable, ranks are decimal strings as in map documents):

``inspect``::

    {"version": 1, "target": PATH, "kind": "maps" | "deepspeed" | "universal",
     "view": "maps" | "tp" | "composed" | "universal",
     "topology": {"tp": int, "dp": int, "zero_stage": int} (DeepSpeed only, else {}),
     "element_size": int, "ranks": [int, ...],
     "params": [{"name", "logical_shape", "valid_shape", "elements", "valid_elements",
                 "pieces_per_rank": {rank: int}, "bytes_per_rank": {rank: int},
                 "replicated_elements": int, "replicated_fraction": float,
                 "scales": [float, ...], "rule": str | null,
                 "zero_fragments": {tp_rank: {dp_rank: elements}} (DeepSpeed only)}, ...],
     "totals": {"params", "elements", "valid_elements", "replicated_elements",
                "replicated_fraction", "pieces_per_rank", "bytes_per_rank"},
     "zero": {"stage": int, "dp": int, "elements": {tp_rank: {dp_rank: elements}}} (DeepSpeed only)}

``plan SOURCE --tp T``::

    {"version": 1, "source": {"path", "kind", "tp", "dp"}, "target": {"tp", "dp"},
     "element_size": int, "params": int, "segments": int, "local_bytes": int, "remote_bytes": int,
     "sent": {rank: bytes}, "received": {rank: bytes},
     "busiest_link": {"src": int, "dst": int, "bytes": int} | null,
     "bytes_matrix": {"source_ranks": [int], "target_ranks": [int], "bytes": [[int]]},
     "layouts": {name: {"family": str, "text": str}}}

``plan SRC.json TGT.json --json`` keeps printing the plan document itself (``ModelPlan.to_dict``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointError, MapError, MapFormatError, PlanError, ReshardError
from .ir.canonical import canonicalize
from .ir.geometry import view_boxes
from .ir.param_map import ParamMap, map_from_dict, maps_from_document
from .ir.piece import Piece, View, prod, row_major_strides
from .ir.shard import Shard

JSON_VERSION = 1

# -- what a path holds ------------------------------------------------------------------------------


@dataclass
class Source:
    """The maps a TARGET/SOURCE path describes, with what is known of its topology."""

    path: str
    kind: str  # "maps" | "deepspeed" | "universal"
    maps: dict[str, ParamMap]
    label: str  # human description of the topology
    tp: int | None = None
    dp: int = 1
    zero_stage: int | None = None
    rules: dict[str, str] = field(default_factory=dict)
    checkpoint: object | None = None  # the DeepSpeedCheckpoint, for the ZeRO split

    @property
    def names(self) -> list[str]:
        return list(self.maps)


def open_source(path: str | Path) -> Source:
    """Read a map document, a DeepSpeed checkpoint folder or a universal checkpoint folder."""
    p = Path(path)
    if p.is_file():
        return _open_maps(p)
    if not p.is_dir():
        raise ReshardError(f"{p}: no such file or folder")
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
    from .formats.safe_load import load
    from .layouts import replicated

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


def _open_deepspeed(path: Path) -> Source:
    from .formats.deepspeed import DeepSpeedCheckpoint

    ck = DeepSpeedCheckpoint.open(path)
    maps, rules = {}, {}
    for name in ck.names:
        low = ck.tp_map(name)
        _checked(low.map, f"{ck.tag_dir}: parameter {name!r}")
        maps[name] = canonicalize(low.map)
        rules[name] = low.rule
    label = f"DeepSpeed TP={ck.tp} DP={ck.dp}{f' PP={ck.pp}' if ck.pp > 1 else ''} ZeRO-{ck.zero_stage}"
    return Source(str(path), "deepspeed", maps, label, ck.tp, ck.dp, ck.zero_stage, rules, ck)


def _checked(m: ParamMap, where: str) -> None:
    try:
        m.check()
    except ReshardError as e:
        raise type(e)(f"{where}: {e}") from None


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
    import difflib

    near = difflib.get_close_matches(param, src.names, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ReshardError(f"{src.path}: no parameter {param!r}{hint}")


# -- the ZeRO split of a DeepSpeed checkpoint -----------------------------------------------------------


def zero_fragments(src: Source, name: str) -> dict[int, dict[int, int]]:
    """``{tp_rank: {dp_rank: elements}}`` of ``name``'s TP shards in the DP ranks' flat partitions."""
    ck = src.checkpoint
    out: dict[int, dict[int, int]] = {}
    for t in range(src.tp or 0):
        entry = ck.zero_map(name, t)
        out[t] = {} if entry is None else {d: s.numel for d, s in entry[1].shards.items()}
    return out


def composed_map(src: Source, name: str) -> ParamMap:
    """``name``'s TP map composed with its ZeRO split, over global ranks ``dp * TP + tp``."""
    from .layouts import compose
    from .topology import Topology

    ck = src.checkpoint
    topo = Topology(1, src.dp, src.tp)
    m = src.maps[name]
    inner = {}
    for t in m.ranks:
        entry = ck.zero_map(name, t)
        if entry is None:
            inner[t] = ParamMap(m.shard(t).shape, {})
        else:
            inner[t] = entry[1].with_ranks({d: topo.rank(0, d, t) for d in entry[1].ranks})
    try:
        return compose(m, inner)
    except ReshardError as e:
        raise type(e)(f"{src.path}: parameter {name!r}: composing the TP map with the ZeRO split: {e}") from None


# -- per-parameter figures ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """The figures ``inspect`` prints for one parameter's map."""

    name: str
    logical_shape: tuple[int, ...]
    valid_shape: tuple[int, ...]
    pieces: dict[int, int]
    elements_per_rank: dict[int, int]
    replicated_elements: int
    scales: tuple[float, ...]

    @property
    def elements(self) -> int:
        return prod(self.logical_shape)

    @property
    def valid_elements(self) -> int:
        return prod(self.valid_shape)

    @property
    def replicated_fraction(self) -> float:
        return self.replicated_elements / self.elements if self.elements else 0.0


def summarize(name: str, m: ParamMap) -> Summary:
    """Figures of a valid map. Replicated elements are counted without a grid: by homogeneity
    every element held by the rank set L lies in exactly ``|L|`` pieces naming L, so the pieces
    naming L cover ``|L|`` times as many elements as L holds."""
    c = canonicalize(m)
    by_locs: dict[frozenset[int], int] = defaultdict(int)
    for _, _, p in c.pieces():
        by_locs[p.locations] += p.numel
    replicated = sum(n // len(locs) for locs, n in by_locs.items() if len(locs) > 1)
    scales = tuple(sorted({p.scale for _, _, p in c.pieces() if not p.is_empty}))
    return Summary(name, c.logical_shape, c.valid_shape,
                   {r: sum(1 for p in s.pieces if not p.is_empty) for r, s in c.shards.items()},
                   {r: s.numel for r, s in c.shards.items()}, replicated, scales)


# -- text formatting ------------------------------------------------------------------------------------


def compact(values: Sequence[int]) -> str:
    """``[2, 2, 2, 3]`` -> ``2×3 3``: runs of equal values as ``value×count``."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{values[i]}×{j - i}" if j - i > 1 else f"{values[i]}")
        i = j
    return " ".join(out)


def percent(x: float) -> str:
    if x == 0:
        return "0%"
    if x == 1:
        return "100%"
    return f"{100 * x:.1f}%"


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(n) for n in s) + "]"


def _scales(scales: tuple[float, ...]) -> str:
    return ",".join(f"{s:g}" for s in scales) or "-"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def format_inspect(src: Source, view: str, summaries: list[Summary], ranks: list[int], element_size: int,
                   zero: dict[str, dict[int, dict[int, int]]] | None) -> list[str]:
    from .viz import human_bytes, ranks_label

    lines = [f"{src.path}: {src.label}" + _view_text(src, view)]
    lines.append(f"ranks {ranks_label(ranks)}; element size {element_size} bytes; "
                 "per-rank lists are in rank order, a×n = a on each of n ranks")
    lines.append("")
    rows = [["parameter", "F", "valid", "pieces/rank", "replicated", "scales", "bytes/rank"]]
    for s in summaries:
        rows.append([s.name, _shape(s.logical_shape),
                     "=F" if s.valid_shape == s.logical_shape else _shape(s.valid_shape),
                     compact([s.pieces.get(r, 0) for r in ranks]), percent(s.replicated_fraction),
                     _scales(s.scales), compact([s.elements_per_rank.get(r, 0) * element_size for r in ranks])])
    lines += _table(rows, set())
    tot = _totals(summaries, ranks, element_size)
    lines.append("")
    lines.append(f"totals: {tot['params']} parameter(s), {tot['elements']} elements of F "
                 f"({tot['valid_elements']} valid), {percent(tot['replicated_fraction'])} replicated")
    rank_rows = [["rank", "pieces", "bytes", ""]]
    for r in ranks:
        b = tot["bytes_per_rank"][r]
        rank_rows.append([str(r), str(tot["pieces_per_rank"][r]), str(b), f"({human_bytes(b)})"])
    lines += ["  " + x for x in _table(rank_rows, {0, 1, 2})]
    if zero is not None:
        lines += _zero_lines(src, zero)
    return lines


def _view_text(src: Source, view: str) -> str:
    if view == "tp":
        return f"; TP maps over TP ranks 0-{src.tp - 1}"
    if view == "composed":
        return f"; TP maps composed with the ZeRO split, global rank = dp_rank * {src.tp} + tp_rank"
    return ""


def _zero_lines(src: Source, zero: dict[str, dict[int, dict[int, int]]]) -> list[str]:
    per = _zero_totals(zero)
    if src.dp == 1:
        head = f"ZeRO-{src.zero_stage} over DP=1: each TP shard's optimizer state is on its one rank (no split)"
    elif src.zero_stage == 3:
        head = (f"ZeRO-3 over DP={src.dp}: each TP shard is padded to a multiple of {src.dp} elements and "
                "split evenly over its DP ranks")
    else:
        head = (f"ZeRO-{src.zero_stage} over DP={src.dp}: each TP shard is flattened with its group and cut into "
                f"{src.dp} equal flat partitions (a parameter may straddle them)")
    out = ["", head, "  elements of the TP shards per DP rank, all parameters:"]
    for t, by_dp in sorted(per.items()):
        out.append(f"    tp {t}: " + ", ".join(f"dp {d} {n}" for d, n in sorted(by_dp.items())))
    if src.dp > 1:
        out.append("  (--composed shows the composed maps over global ranks)")
    return out


def _zero_totals(zero: dict[str, dict[int, dict[int, int]]]) -> dict[int, dict[int, int]]:
    per: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for frags in zero.values():
        for t, by_dp in frags.items():
            per[t]
            for d, n in by_dp.items():
                per[t][d] += n
    return {t: dict(v) for t, v in per.items()}


def _totals(summaries: list[Summary], ranks: list[int], element_size: int) -> dict:
    elements = sum(s.elements for s in summaries)
    repl = sum(s.replicated_elements for s in summaries)
    return {
        "params": len(summaries),
        "elements": elements,
        "valid_elements": sum(s.valid_elements for s in summaries),
        "replicated_elements": repl,
        "replicated_fraction": repl / elements if elements else 0.0,
        "pieces_per_rank": {r: sum(s.pieces.get(r, 0) for s in summaries) for r in ranks},
        "bytes_per_rank": {r: sum(s.elements_per_rank.get(r, 0) for s in summaries) * element_size for r in ranks},
    }


def _keyed(d: Mapping[int, object]) -> dict[str, object]:
    return {str(k): v for k, v in sorted(d.items())}


def inspect_document(src: Source, view: str, summaries: list[Summary], ranks: list[int], element_size: int,
                     zero: dict[str, dict[int, dict[int, int]]] | None) -> dict:
    """The ``--json`` document of ``inspect`` (keys in the module docstring)."""
    params = []
    for s in summaries:
        entry = {
            "name": s.name,
            "logical_shape": list(s.logical_shape),
            "valid_shape": list(s.valid_shape),
            "elements": s.elements,
            "valid_elements": s.valid_elements,
            "pieces_per_rank": _keyed(s.pieces),
            "bytes_per_rank": _keyed({r: n * element_size for r, n in s.elements_per_rank.items()}),
            "replicated_elements": s.replicated_elements,
            "replicated_fraction": s.replicated_fraction,
            "scales": list(s.scales),
            "rule": src.rules.get(s.name),
        }
        if zero is not None:
            entry["zero_fragments"] = {str(t): _keyed(v) for t, v in sorted(zero[s.name].items())}
        params.append(entry)
    tot = _totals(summaries, ranks, element_size)
    tot["pieces_per_rank"] = _keyed(tot["pieces_per_rank"])
    tot["bytes_per_rank"] = _keyed(tot["bytes_per_rank"])
    doc = {
        "version": JSON_VERSION,
        "target": src.path,
        "kind": src.kind,
        "view": view,
        "topology": {"tp": src.tp, "dp": src.dp, "zero_stage": src.zero_stage} if src.kind == "deepspeed" else {},
        "element_size": element_size,
        "ranks": ranks,
        "params": params,
        "totals": tot,
    }
    if zero is not None:
        doc["zero"] = {"stage": src.zero_stage, "dp": src.dp,
                       "elements": {str(t): _keyed(v) for t, v in sorted(_zero_totals(zero).items())}}
    return doc


# -- the inspect command --------------------------------------------------------------------------------


def _all_ranks(src: Source, view: str) -> range:
    """Every rank of the topology, holding some of the shown parameters or not."""
    if view == "tp":
        return range(src.tp)
    if view == "composed":
        return range(src.tp * src.dp)
    return range(0)


def run_inspect(args) -> int:
    """``reshard inspect`` (see the module docstring)."""
    if args.element_size < 1:
        raise ReshardError(f"--element-size must be a positive number of bytes, got {args.element_size}")
    if args.png:
        from .viz import require_matplotlib

        require_matplotlib()
    src = open_source(args.target)
    names = select(src, args.param)
    view = {"maps": "maps", "universal": "universal", "deepspeed": "tp"}[src.kind]
    if args.composed:
        if src.kind != "deepspeed":
            raise ReshardError("--composed needs a DeepSpeed checkpoint (it composes the TP maps with the ZeRO split)")
        view = "composed"
    maps = {n: composed_map(src, n) if view == "composed" else src.maps[n] for n in names}
    summaries = [summarize(n, m) for n, m in maps.items()]
    ranks = sorted({r for m in maps.values() for r in m.ranks} | set(_all_ranks(src, view)))
    zero = {n: zero_fragments(src, n) for n in names} if src.kind == "deepspeed" else None
    if args.json:
        json.dump(inspect_document(src, view, summaries, ranks, args.element_size, zero), sys.stdout)
        print()
    else:
        print("\n".join(format_inspect(src, view, summaries, ranks, args.element_size, zero)))
    if args.png:
        from .viz import draw_map

        name = names[0]
        label = src.label + {"tp": " · TP map", "composed": " · TP∘ZeRO composed"}.get(view, "")
        names_ = None
        if view == "composed":
            names_ = {g: f"rank {g} (dp {g // src.tp}, tp {g % src.tp})" for g in range(src.tp * src.dp)}
        draw_map(maps[name], args.png, name=name, topology=label, rank_names=names_)
        if not args.json:
            print(f"wrote {args.png} ({name})")
    return 0


# -- layout families at another TP degree ---------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A recognised layout family: ``build(T)`` is the same family at TP degree ``T``."""

    family: str
    text: str
    build: Callable[[int], ParamMap]


def _target_scale(scale: float, tp: int, target: int) -> float:
    if scale == 1.0:
        return 1.0
    if abs(scale * tp - 1.0) < 1e-12:
        return 1.0 / target
    raise PlanError(f"pieces scaled by {scale:g} on {tp} ranks: only 1 and 1/TP (a pre-divided bias) "
                    "have a known meaning at another TP degree")


def _same(a: ParamMap, b: ParamMap) -> bool:
    return canonicalize(a) == canonicalize(b)


def _as_replicated(m: ParamMap, n: int, vocab_divisible_by: int | None) -> Layout | None:
    from .layouts import replicated

    scales = {p.scale for _, _, p in m.pieces() if not p.is_empty}
    if len(scales) != 1:
        return None
    scale = scales.pop()
    ref = replicated(m.logical_shape, n, scale=scale)
    if not _same(ParamMap(ref.logical_shape, ref.shards, m.valid_shape), m):
        return None

    def build(t: int) -> ParamMap:
        out = replicated(m.logical_shape, t, scale=_target_scale(scale, n, t))
        return ParamMap(out.logical_shape, out.shards, m.valid_shape)

    text = "replicated" if scale == 1.0 else f"replicated, pre-divided by TP (scale {scale:g})"
    return Layout("replicated", text, build)


def _slab_blocks(m: ParamMap, d: int) -> dict[int, list[tuple[int, int]]] | None:
    """Each rank's pieces as ``(start, length)`` blocks along dim ``d`` (in shard order), when
    every piece is one box spanning all of every other dim."""
    shape = m.logical_shape
    out: dict[int, list[tuple[int, int]]] = {}
    for r, s in m.shards.items():
        out[r] = []
        for p in sorted((p for p in s.pieces if not p.is_empty), key=lambda p: p.dest.offset):
            boxes = view_boxes(p.source, p.shape, shape)
            if len(boxes) != 1:
                return None
            box = boxes[0]
            if any(box[k] != (0, 1, shape[k]) for k in range(len(shape)) if k != d):
                return None
            start, step, count = box[d]
            if step != 1 and count != 1:
                return None
            out[r].append((start, count))
    return out


@dataclass(frozen=True)
class _Segment:
    start: int
    size: int
    widths: tuple[int, ...] | None  # per rank for a split segment; None: held by every rank


def _segments(blocks: dict[int, list[tuple[int, int]]], n: int, length: int) -> list[_Segment] | None:
    """Cut dim ``d`` into segments, each split over the ranks in rank order or held by all."""
    cuts = sorted({0, length} | {x for bl in blocks.values() for a, k in bl if k for x in (a, a + k)})
    segs: list[list] = []  # [start, size, widths dict | None, last rank]
    everyone = frozenset(range(n))
    for a, b in zip(cuts, cuts[1:]):
        holders = frozenset(r for r, bl in blocks.items() if any(s <= a and b <= s + k for s, k in bl))
        if holders == everyone and n > 1:
            if segs and segs[-1][2] is None:
                segs[-1][1] += b - a
            else:
                segs.append([a, b - a, None, None])
        elif len(holders) == 1:
            (r,) = holders
            last = segs[-1] if segs else None
            if last is not None and last[2] is not None and r >= last[3]:
                last[1] += b - a
                last[2][r] = last[2].get(r, 0) + b - a
                last[3] = r
            else:
                segs.append([a, b - a, {r: b - a}, r])
        else:
            return None  # partial replication or a hole
    return [_Segment(a, k, None if w is None else tuple(w.get(r, 0) for r in range(n))) for a, k, w, _ in segs]


def _segments_map(shape: tuple[int, ...], d: int, segs: Sequence[_Segment], n: int, scale: float = 1.0,
                  valid: tuple[int, ...] | None = None) -> ParamMap:
    """The map whose rank ``r`` holds, concatenated along dim ``d`` in segment order, its part of
    every split segment and all of every replicated segment."""
    fs = row_major_strides(shape)
    everyone = frozenset(range(n))
    shards = {}
    for r in range(n):
        parts, cursor = [], 0
        for seg in segs:
            if seg.widths is None:
                start, length, locs = seg.start, seg.size, everyone
            else:
                start, length, locs = seg.start + sum(seg.widths[:r]), seg.widths[r], frozenset({r})
            parts.append((start, length, locs, cursor))
            cursor += length
        sshape = shape[:d] + (cursor,) + shape[d + 1 :]
        ss = row_major_strides(sshape)
        pieces = tuple(Piece(shape[:d] + (length,) + shape[d + 1 :], View(start * fs[d], fs), View(at * ss[d], ss),
                             locs, scale) for start, length, locs, at in parts if length)
        shards[r] = Shard(sshape, pieces)
    return canonicalize(ParamMap(shape, shards, valid))


def _segments_text(segs: Sequence[_Segment], d: int) -> tuple[str, str]:
    split = [s for s in segs if s.widths is not None]
    if len(split) == len(segs) == 1:
        return "split", f"split dim {d}"
    if len(split) == len(segs):
        return "sub-params", f"sub-params {[s.size for s in segs]} dim {d}"
    parts = " + ".join(f"{'split' if s.widths is not None else 'replicated'} {s.size}" for s in segs)
    return "split+replicated", f"segments dim {d}: {parts}"


def _as_segments(m: ParamMap, n: int, vocab_divisible_by: int | None, *, proper: bool = False) -> Layout | None:
    """Segments along one dim. With ``proper``, every split segment must be split over at least two
    ranks (a "split" held by one rank is also how shared-QK's own heads look, so shared-QK is tried
    between the proper and the general pass)."""
    from .layouts import near_even_sizes

    scales = {p.scale for _, _, p in m.pieces() if not p.is_empty}
    if len(scales) != 1:
        return None
    scale = scales.pop()
    shape = m.logical_shape
    for d in range(len(shape)):
        blocks = _slab_blocks(m, d)
        segs = None if blocks is None else _segments(blocks, n, shape[d])
        if not segs or proper and any(s.widths is not None and sum(map(bool, s.widths)) < 2 for s in segs):
            continue
        ref = _segments_map(shape, d, segs, n, scale, m.valid_shape)
        if not _same(ref, m):
            continue
        family, text = _segments_text(segs, d)
        if m.is_padded:
            return _padded(m, d, family, scale, vocab_divisible_by)

        def build(t: int, segs=segs, d=d) -> ParamMap:
            new = [_Segment(s.start, s.size, None if s.widths is None else tuple(near_even_sizes(s.size, t)))
                   for s in segs]
            return _segments_map(shape, d, new, t, _target_scale(scale, n, t))

        return Layout(family, text, build)
    return None


def _padded(m: ParamMap, d: int, family: str, scale: float,
            divisible_by: int | None) -> Layout:
    from .layouts import padded_vocab_rows

    shape, valid = m.logical_shape, m.valid_shape
    if family != "split" or scale != 1.0 or any(v != s for k, (v, s) in enumerate(zip(valid, shape)) if k != d):
        raise PlanError(f"F {_shape(shape)} is padded (valid {_shape(valid)}) but is not a split of the padded "
                        f"dim ({family} dim {d}): only padded vocabularies are supported")
    rows = shape[d]

    def build(t: int) -> ParamMap:
        if divisible_by is not None:
            new_rows = padded_vocab_rows(valid[d], t, divisible_by=divisible_by)
        elif rows % t == 0:
            new_rows = rows
        else:
            raise PlanError(f"padded vocabulary of {rows} rows ({valid[d]} valid) does not split evenly over "
                            f"TP={t}; pass --vocab-divisible-by N to re-pad it to a multiple of N*{t} rows")
        logical = shape[:d] + (new_rows,) + shape[d + 1 :]
        return _segments_map(logical, d, [_Segment(0, new_rows, (new_rows // t,) * t)], t, 1.0, valid)

    how = f"re-padded with --vocab-divisible-by {divisible_by}" if divisible_by else "rows kept"
    return Layout("padded-vocab", f"padded vocabulary split dim {d} ({rows} rows, {valid[d]} valid; {how})", build)


def _divisors(k: int) -> list[int]:
    small = [i for i in range(1, int(k**0.5) + 1) if k % i == 0]
    return sorted(set(small) | {k // i for i in small})


def _as_shared_qk(m: ParamMap, n: int, vocab_divisible_by: int | None) -> Layout | None:
    from .layouts import shared_qk_o_proj, shared_qk_value

    if n < 2 or m.is_padded or any(p.scale != 1.0 for _, _, p in m.pieces()):
        return None
    found = []
    for d, builder in ((0, shared_qk_value), (1, shared_qk_o_proj)):
        if len(m.logical_shape) <= d:
            continue
        for h in _divisors(m.logical_shape[d]):
            if h % 2 or h % n or n > h // 2:
                continue
            if _same(builder(m.logical_shape, n, num_heads=h), m):
                found.append((d, h, builder))
    if not found:
        return None
    if len(found) > 1:
        raise PlanError(f"ambiguous shared-QK layout: {len(found)} head counts fit "
                        f"({', '.join(f'{h} heads on dim {d}' for d, h, _ in found)})")
    d, h, builder = found[0]

    def build(t: int) -> ParamMap:
        try:
            return builder(m.logical_shape, t, num_heads=h)
        except MapError as e:
            raise PlanError(f"shared-QK with {h} heads has no layout at TP={t}: {e}") from None

    return Layout("shared-qk", f"shared-QK {h} heads on dim {d}", build)


def _as_proper_segments(m: ParamMap, n: int, vocab_divisible_by: int | None) -> Layout | None:
    return _as_segments(m, n, vocab_divisible_by, proper=True)


# Tried in order; the first that rebuilds the map exactly wins. Shared-QK with an even number of
# heads per rank *is* a two-sub-parameter split, and is planned as one.
FAMILIES = (_as_replicated, _as_proper_segments, _as_shared_qk, _as_segments)


def layout_of(m: ParamMap, *, vocab_divisible_by: int | None = None) -> Layout:
    """Recognise the family of a TP map (ranks ``0..n-1``) from its geometry: each family's
    builder must rebuild exactly this map. Raises :class:`PlanError` when none does."""
    n = len(m.ranks)
    if tuple(m.ranks) != tuple(range(n)):
        raise PlanError(f"expected a TP map over ranks 0..{n - 1}, got ranks {list(m.ranks)}")
    if n == 1:
        raise PlanError("a map on one rank does not say how F splits over more (split, replicated or fused); "
                        "give a target map document instead (reshard plan SRC.json TGT.json)")
    c = canonicalize(m)
    for finder in FAMILIES:
        lay = finder(c, n, vocab_divisible_by)
        if lay is not None:
            return lay
    raise PlanError("layout not recognised (supported at another TP degree: replicated, split, sub-params, "
                    "split+replicated segments, padded vocabulary, shared-QK; see reshard.inspect)")


# -- planning to a topology -----------------------------------------------------------------------------


@dataclass
class TopologyPlan:
    plan: object  # ModelPlan
    source_maps: dict[str, ParamMap]
    target_maps: dict[str, ParamMap]
    layouts: dict[str, Layout]
    source_tp: int
    source_dp: int


def _over_dp(m: ParamMap, tp: int, dp: int) -> ParamMap:
    if dp == 1:
        return m
    from .layouts import replicate_over
    from .topology import Topology

    topo = Topology(1, dp, tp)
    return replicate_over(m, {t: topo.dp_group(t) for t in m.ranks})


def plan_topology(src: Source, tp: int, dp: int | None = None, *, vocab_divisible_by: int | None = None,
                  ranks_per_node: int | None = None, allow_inexact_scale: bool = False) -> TopologyPlan:
    """Target maps for TP=``tp`` x DP=``dp`` from ``src``'s TP layouts, and the plan to them."""
    from .planner import DefaultCost, plan_model

    for what, v in (("--tp", tp), ("--dp", dp), ("--vocab-divisible-by", vocab_divisible_by)):
        if v is not None and v < 1:
            raise ReshardError(f"{what} must be a positive integer, got {v}")
    if src.kind == "universal":
        raise PlanError(f"{src.path}: a universal checkpoint holds F on one rank, which does not say how "
                        "parameters split over TP ranks; plan from the DeepSpeed checkpoint or a map document")
    src_dp = src.dp if src.kind == "deepspeed" else 1
    dp = src_dp if dp is None else dp
    layouts: dict[str, Layout] = {}
    sources: dict[str, ParamMap] = {}
    targets: dict[str, ParamMap] = {}
    cache: dict[ParamMap, tuple[ParamMap, ParamMap, Layout]] = {}
    for name, m in src.maps.items():
        if m not in cache:
            n = len(m.ranks)
            try:
                lay = (Layout("same", f"kept as is (TP={n})", lambda t, m=m: m) if n == tp
                       else layout_of(m, vocab_divisible_by=vocab_divisible_by))
                target = lay.build(tp)
            except ReshardError as e:
                raise PlanError(f"{src.path}: parameter {name!r} (F {_shape(m.logical_shape)}): {e}") from None
            cache[m] = (_over_dp(m, n, src_dp), _over_dp(target, tp, dp), lay)
        sources[name], targets[name], layouts[name] = cache[m]
    mp = plan_model(sources, targets, cost=DefaultCost(ranks_per_node), allow_inexact_scale=allow_inexact_scale)
    source_tp = src.tp if src.tp is not None else max(len(m.ranks) for m in src.maps.values())
    return TopologyPlan(mp, sources, targets, layouts, source_tp, src_dp)


def bytes_matrix(mp, source_maps: Mapping[str, ParamMap], target_maps: Mapping[str, ParamMap],
                 element_size: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Bytes each source rank sends each target rank (local copies on the diagonal included)."""
    src_ranks = sorted({r for m in source_maps.values() for r in m.ranks})
    dst_ranks = sorted({r for m in target_maps.values() for r in m.ranks})
    si = {r: i for i, r in enumerate(src_ranks)}
    di = {r: j for j, r in enumerate(dst_ranks)}
    out = [[0] * len(dst_ranks) for _ in src_ranks]
    for p in mp.params.values():
        for s in p.segments:
            out[si[s.src_rank]][di[s.dst_rank]] += s.numel * element_size
    return src_ranks, dst_ranks, out


def stats_lines(mp, element_size: int) -> list[str]:
    """The figures ``reshard plan`` prints (the same lines for both of its forms)."""
    st = mp.stats(element_size=element_size)
    lines = [f"{len(mp.params)} parameter(s), {st.segments} segments",
             f"bytes local {st.local_bytes}, remote {st.remote_bytes} (element size {element_size})"]
    for r in sorted(set(st.sent) | set(st.received)):
        lines.append(f"  rank {r}: sends {st.sent.get(r, 0)}, receives {st.received.get(r, 0)}")
    if st.busiest_link:
        (a, b), n = st.busiest_link
        lines.append(f"busiest link: {a} -> {b}, {n} bytes")
    return lines


def plan_document(src: Source, tplan: TopologyPlan, tp: int, dp: int, element_size: int) -> dict:
    """The ``--json`` document of ``plan SOURCE --tp T`` (keys in the module docstring)."""
    st = tplan.plan.stats(element_size=element_size)
    sr, dr, mat = bytes_matrix(tplan.plan, tplan.source_maps, tplan.target_maps, element_size)
    busiest = None
    if st.busiest_link:
        (a, b), n = st.busiest_link
        busiest = {"src": a, "dst": b, "bytes": n}
    return {
        "version": JSON_VERSION,
        "source": {"path": src.path, "kind": src.kind, "tp": tplan.source_tp, "dp": tplan.source_dp},
        "target": {"tp": tp, "dp": dp},
        "element_size": element_size,
        "params": len(tplan.plan.params),
        "segments": st.segments,
        "local_bytes": st.local_bytes,
        "remote_bytes": st.remote_bytes,
        "sent": _keyed(st.sent),
        "received": _keyed(st.received),
        "busiest_link": busiest,
        "bytes_matrix": {"source_ranks": sr, "target_ranks": dr, "bytes": mat},
        "layouts": {n: {"family": lay.family, "text": lay.text} for n, lay in tplan.layouts.items()},
    }


def write_plan_png(mp, source_maps, target_maps, path: str, element_size: int, title: str) -> None:
    from .viz import draw_plan, human_bytes

    sr, dr, mat = bytes_matrix(mp, source_maps, target_maps, element_size)
    st = mp.stats(element_size=element_size)
    sub = (f"{len(mp.params)} parameter(s), {st.segments} segments; local {human_bytes(st.local_bytes)}, "
           f"remote {human_bytes(st.remote_bytes)} (element size {element_size})")
    draw_plan(mat, sr, dr, path, title=title, subtitle=sub)


def run_plan_topology(args) -> int:
    """``reshard plan SOURCE --tp T [--dp D]`` (see the module docstring)."""
    if args.target is not None:
        raise ReshardError("give either a TARGET map document or --tp/--dp, not both")
    if args.tp is None:
        raise ReshardError("give a TARGET map document, or the target topology with --tp T [--dp D]")
    if args.png:
        from .viz import require_matplotlib

        require_matplotlib()
    src = open_source(args.source)
    tplan = plan_topology(src, args.tp, args.dp, vocab_divisible_by=args.vocab_divisible_by,
                          ranks_per_node=args.ranks_per_node, allow_inexact_scale=args.allow_inexact_scale)
    dp = args.dp if args.dp is not None else tplan.source_dp
    if args.json:
        json.dump(plan_document(src, tplan, args.tp, dp, args.element_size), sys.stdout)
        print()
    else:
        print(f"source: {src.path} ({src.label})")
        print(f"target: TP={args.tp} DP={dp}" + (f" (rank = dp_rank * {args.tp} + tp_rank)" if dp > 1 else ""))
        counts = Counter(lay.text for lay in tplan.layouts.values())
        print("layouts: " + "; ".join(f"{v}× {k}" for k, v in counts.most_common()))
        print("\n".join(stats_lines(tplan.plan, args.element_size)))
    if args.png:
        title = f"plan: {Path(src.path).name} (TP={tplan.source_tp} DP={tplan.source_dp}) → TP={args.tp} DP={dp}"
        write_plan_png(tplan.plan, tplan.source_maps, tplan.target_maps, args.png, args.element_size, title)
        if not args.json:
            print(f"wrote {args.png}")
    return 0
