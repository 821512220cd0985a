"""What ``reshard inspect`` and ``reshard plan`` show: figures of maps and plans, as text tables
and as JSON documents (their keys are specified in docs/spec.md §10), and the plan's picture.
Presentation only: the figures come from the IR, the planner and the sources.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..ir.canonical import canonicalize
from ..ir.param_map import ParamMap
from ..ir.piece import prod
from ..plan.retarget import TopologyPlan
from ..plan.values import ModelPlan
from .inspected import Inspected
from .viz import draw_plan, human_bytes, ranks_label

JSON_VERSION = 1


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


def by_storage_rank(s: Summary, savers: Mapping[int, int]) -> Summary:
    """``s`` with its rank labels' figures summed on the storage rank that wrote each (``savers``)."""
    pieces: dict[int, int] = defaultdict(int)
    elements: dict[int, int] = defaultdict(int)
    for label, n in s.pieces.items():
        pieces[savers[label]] += n
    for label, n in s.elements_per_rank.items():
        elements[savers[label]] += n
    return Summary(s.name, s.logical_shape, s.valid_shape, dict(pieces), dict(elements), s.replicated_elements,
                   s.scales)


def regrouped(src: Inspected, summaries: list[Summary], ranks: list[int]) -> tuple[list[Summary], list[int]]:
    """Where every shown map's rank labels have storage ranks (Megatron torch_dist chunks), the
    figures per storage rank over the saving world; else as they are."""
    if not summaries or src.unit != "rank label" or any(s.name not in src.savers for s in summaries):
        return summaries, ranks
    out = [by_storage_rank(s, src.savers[s.name]) for s in summaries]
    src.unit = "storage rank"
    return out, sorted({r for s in out for r in s.pieces} | set(range(src.world or 0)))


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


ASSUMED = 4  # bytes per element where the source records no dtype (a map document): fp32


def element_sizes(src: Inspected, summaries: list[Summary], override: int | None) -> dict[str, int]:
    """Bytes per element of each shown map: ``--element-size`` where given, else as stored."""
    return {s.name: override if override is not None else src.sizes.get(s.name, ASSUMED) for s in summaries}


def format_inspect(src: Inspected, view: str, summaries: list[Summary], ranks: list[int], element_size: int | None,
                   zero: dict[str, dict[int, dict[int, int]]] | None) -> list[str]:
    sizes = element_sizes(src, summaries, element_size)
    unit = src.unit
    lines = [f"{src.path}: {src.description}" + _view_text(src, view)]
    lines.append(_units_line(src, ranks))
    lines.append(_sizes_line(src, summaries, sizes, element_size))
    if src.held:
        lines.append(_held_line(src))
    if src.scales:
        lines.append(scales_line(src))
    lines.append(f"lists per {unit} are in {unit} order, a×n = a on each of n {unit}s")
    lines.append("")
    rows = [["parameter", "F", "valid", f"pieces/{unit}", "replicated", "scales", f"bytes/{unit}"]]
    for s in summaries:
        rows.append([s.name, _shape(s.logical_shape),
                     "=F" if s.valid_shape == s.logical_shape else _shape(s.valid_shape),
                     compact([s.pieces.get(r, 0) for r in ranks]), percent(s.replicated_fraction),
                     _scales(s.scales), compact([s.elements_per_rank.get(r, 0) * sizes[s.name] for r in ranks])])
    lines += _table(rows, set())
    tot = _totals(summaries, ranks, sizes)
    lines.append("")
    lines.append(f"totals: {tot['params']} parameter(s), {tot['elements']} elements of F "
                 f"({tot['valid_elements']} valid), {percent(tot['replicated_fraction'])} replicated")
    rank_rows = [[unit, "pieces", "bytes", ""]]
    for r in ranks:
        b = tot["bytes_per_rank"][r]
        rank_rows.append([str(r), str(tot["pieces_per_rank"][r]), str(b), f"({human_bytes(b)})"])
    lines += ["  " + x for x in _table(rank_rows, {0, 1, 2})]
    if zero is not None:
        lines += _zero_lines(src, zero)
        lines += _expert_lines(src)
    return lines


def scales_line(src: Inspected) -> str:
    """The block scales beside their payloads: derived maps (a folder's), or entries of their own (a DCP
    that keeps them as stored, each with its own chunks)."""
    how = ("entries of their own, each map its own chunks" if src.kind == "dcp"
           else "each map the payload's coarsened by its block")
    return f"block scales: {len(src.scales)} tensors, each listed after its payload ({how})"


def _units_line(src: Inspected, ranks: list[int]) -> str:
    """What the columns are over: saving ranks, or (where the maps' keys name shards, not
    processes) rank labels, beside the world that saved the checkpoint."""
    world = f"; saved by {src.world} rank(s)" if src.world is not None else ""
    if src.unit == "rank":
        return f"ranks {ranks_label(ranks)}{world}"
    if src.unit == "storage rank" and src.savers:  # the reader named each label's writer (Reader.saver)
        return (f"storage ranks {ranks_label(ranks)} (the rank that wrote each shard's file: each parameter's shards "
                f"summed on it){world}")
    if src.unit == "storage rank":
        return f"storage ranks {ranks_label(ranks)} (the R of __R_N.distcp){world}"
    return f"{src.unit}s {ranks_label(ranks)} (each names one shard as it lies in the files, not a process){world}"


def _sizes_line(src: Inspected, summaries: list[Summary], sizes: dict[str, int], override: int | None) -> str:
    """The element size(s) the byte columns use: given, as stored (per dtype), or assumed."""
    if override is not None:
        return f"element size {_bytes(override)} (--element-size)"
    by: dict[tuple[int, str], int] = defaultdict(int)
    for s in summaries:
        by[(sizes[s.name], src.dtypes.get(s.name, "assumed float32: no dtype recorded"))] += 1
    if len(by) == 1:
        ((size, dtype),) = by
        return f"element size {_bytes(size)} ({dtype})"
    return "element sizes " + ", ".join(f"{_bytes(size)} ({dtype}: {n} parameter(s))"
                                        for (size, dtype), n in sorted(by.items(), key=lambda kv: (-kv[0][0], kv[0][1])))


def _bytes(n: int) -> str:
    return f"{n} byte" + ("" if n == 1 else "s")


_STATE_WORDS = {"weight": "weight", "fp32": "fp32 masters", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _held_line(src: Inspected) -> str:
    """Every state the source holds with its dtype(s); the optimizer's said to be absent where it is."""
    held = ", ".join(f"{_STATE_WORDS.get(s, s)} {'/'.join(d)}" for s, d in src.held.items())
    if not set(src.held) - {"weight"}:
        held += "; no optimizer state"
    shown = "" if src.shown is None else f" (the table shows {_STATE_WORDS.get(src.shown, src.shown)})"
    return f"stored: {held}{shown}"


def _view_text(src: Inspected, view: str) -> str:
    if view == "tp":
        return f"; TP maps over TP ranks 0-{src.tp - 1}"
    if view == "composed":
        return f"; TP maps composed with the ZeRO split, global rank = dp_rank * {src.tp} + tp_rank"
    if view == "storage":
        return "; one piece per chunk, on the storage rank that wrote it (__R_N.distcp)"
    return ""


def _zero_lines(src: Inspected, zero: dict[str, dict[int, dict[int, int]]]) -> list[str]:
    per = _zero_totals(zero)
    if src.dp == 1:
        head = f"ZeRO-{src.zero_stage} over DP=1: each TP shard's optimizer state is on its one rank (no split)"
    elif src.zero_stage == 3:
        head = (f"ZeRO-3 over DP={src.dp}: each TP shard is padded to a multiple of {src.dp} elements and "
                "split evenly over its DP ranks")
    else:
        head = (f"ZeRO-{src.zero_stage} over DP={src.dp}: each TP shard is flattened with its group and cut into "
                f"{src.dp} equal flat partitions (a parameter may straddle them)")
    which = "all parameters" if src.checkpoint is None or src.checkpoint.experts is None else \
        "all parameters but the AutoEP experts (below)"
    out = ["", head, f"  elements of the TP shards per DP rank, {which}:"]
    for t, by_dp in sorted(per.items()):
        out.append(f"    tp {t}: " + ", ".join(f"dp {d} {n}" for d, n in sorted(by_dp.items())))
    if src.dp > 1:
        out.append("  (--composed shows the composed maps over global ranks)")
    return out


def _expert_lines(src: Inspected) -> list[str]:
    """An AutoEP checkpoint's expert groups: EP, EDP, the DP ranks of each EDP group and the
    expert elements each DP rank's partition holds."""
    ck = src.checkpoint
    ax = None if ck is None else ck.experts
    if ax is None:
        return []
    from ..formats.deepspeed.experts import edp_elements

    which = f"d // {ax.edp}, use_data_before_expert_parallelism" if ax.data_before_expert else f"d % {ax.ep}"
    # folded (AutoEP x AutoTP): the EP groups span the TP lanes, so the ranks are global ranks dp * TP + tp
    rank, r = ("global rank", "rank") if ax.folded else ("DP rank", "dp")
    if ax.folded:
        which = f"g % {ax.ep}, folded over TP={ax.tp}: g = dp * {ax.tp} + tp"
    groups = "; ".join(f"EP {e}: {r} {', '.join(str(d) for d in ax.members(e))}" for e in range(ax.ep))
    of = f"{rank} {'g' if ax.folded else 'd'}"
    if ax.pp > 1:  # each stage its own experts over its own EP groups: holder stage * EP + e, global ranks
        rank, r, of = "global rank", "rank", "DP rank d in its stage"
        which += f"; global rank g = d * {ax.pp} + stage"
        groups = "; ".join(f"stage {h // ax.ep} EP {h % ax.ep}: {r} {', '.join(str(g) for g in ax.holder_ranks(h))}"
                           for h in range(ax.pp * ax.ep))
    per = edp_elements(ck)
    return ["", f"AutoEP experts: {len(ax.params)} fused parameter(s) over EP={ax.ep} (in the TP view their maps' ranks "
                f"are EP ranks); their optimizer group is cut over each EP rank's expert-data-parallel group, EDP={ax.edp} "
                f"(EP rank of {of}: {which})",
            f"  EDP groups: {groups}",
            f"  expert elements per {rank}: " + ", ".join(f"{r} {d} {n}" for d, n in sorted(per.items()))]


def _zero_totals(zero: dict[str, dict[int, dict[int, int]]]) -> dict[int, dict[int, int]]:
    per: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for frags in zero.values():
        for t, by_dp in frags.items():
            per[t]
            for d, n in by_dp.items():
                per[t][d] += n
    return {t: dict(v) for t, v in per.items()}


def _totals(summaries: list[Summary], ranks: list[int], sizes: dict[str, int]) -> dict:
    elements = sum(s.elements for s in summaries)
    repl = sum(s.replicated_elements for s in summaries)
    return {
        "params": len(summaries),
        "elements": elements,
        "valid_elements": sum(s.valid_elements for s in summaries),
        "replicated_elements": repl,
        "replicated_fraction": repl / elements if elements else 0.0,
        "pieces_per_rank": {r: sum(s.pieces.get(r, 0) for s in summaries) for r in ranks},
        "bytes_per_rank": {r: sum(s.elements_per_rank.get(r, 0) * sizes[s.name] for s in summaries) for r in ranks},
    }


def _keyed(d: Mapping[int, object]) -> dict[str, object]:
    return {str(k): v for k, v in sorted(d.items())}


def inspect_document(src: Inspected, view: str, summaries: list[Summary], ranks: list[int], element_size: int | None,
                     zero: dict[str, dict[int, dict[int, int]]] | None) -> dict:
    """The ``--json`` document of ``inspect`` (keys in docs/spec.md §10)."""
    sizes = element_sizes(src, summaries, element_size)
    params = []
    for s in summaries:
        entry = {
            "name": s.name,
            "logical_shape": list(s.logical_shape),
            "valid_shape": list(s.valid_shape),
            "elements": s.elements,
            "valid_elements": s.valid_elements,
            "pieces_per_rank": _keyed(s.pieces),
            "bytes_per_rank": _keyed({r: n * sizes[s.name] for r, n in s.elements_per_rank.items()}),
            "element_size": sizes[s.name],
            "dtype": src.dtypes.get(s.name) if element_size is None else None,
            "replicated_elements": s.replicated_elements,
            "replicated_fraction": s.replicated_fraction,
            "scales": list(s.scales),
            "family": src.families.get(s.name),
        }
        if zero is not None:
            entry["zero_fragments"] = {str(t): _keyed(v) for t, v in sorted(zero[s.name].items())}
        params.append(entry)
    tot = _totals(summaries, ranks, sizes)
    tot["pieces_per_rank"] = _keyed(tot["pieces_per_rank"])
    tot["bytes_per_rank"] = _keyed(tot["bytes_per_rank"])
    doc = {
        "version": JSON_VERSION,
        "target": src.path,
        "kind": src.kind,
        "view": view,
        "topology": {"tp": src.tp, "dp": src.dp, "zero_stage": src.zero_stage} if src.kind == "deepspeed" else {},
        "element_size": sizes[summaries[0].name] if len(set(sizes.values())) == 1 else None,
        "ranks": ranks,
        "unit": src.unit,
        "world": src.world,
        "states": {s: list(d) for s, d in src.held.items()},
        "params": params,
        "totals": tot,
    }
    if zero is not None:
        doc["zero"] = {"stage": src.zero_stage, "dp": src.dp,
                       "elements": {str(t): _keyed(v) for t, v in sorted(_zero_totals(zero).items())}}
    return doc


def stats_lines(mp: ModelPlan, element_size: int) -> list[str]:
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


def plan_document(src: Inspected, tplan: TopologyPlan, element_size: int) -> dict:
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
        "target": {"tp": tplan.tp, "dp": tplan.dp},
        "element_size": element_size,
        "params": len(tplan.plan.params),
        "segments": st.segments,
        "local_bytes": st.local_bytes,
        "remote_bytes": st.remote_bytes,
        "sent": _keyed(st.sent),
        "received": _keyed(st.received),
        "busiest_link": busiest,
        "bytes_matrix": {"source_ranks": sr, "target_ranks": dr, "bytes": mat},
        "families": {n: {"family": fam.name, "text": fam.text} for n, fam in tplan.families.items()},
    }


def write_plan_png(mp: ModelPlan, source_maps: Mapping[str, ParamMap], target_maps: Mapping[str, ParamMap], path: str,
                   element_size: int, title: str) -> None:
    sr, dr, mat = bytes_matrix(mp, source_maps, target_maps, element_size)
    st = mp.stats(element_size=element_size)
    sub = (f"{len(mp.params)} parameter(s), {st.segments} segments; local {human_bytes(st.local_bytes)}, "
           f"remote {human_bytes(st.remote_bytes)} (element size {element_size})")
    draw_plan(mat, sr, dr, path, title=title, subtitle=sub)


def bytes_matrix(mp: ModelPlan, source_maps: Mapping[str, ParamMap], target_maps: Mapping[str, ParamMap],
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
