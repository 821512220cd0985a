"""Planning at scale: a 1T-parameter-shaped MoE, measured whole.

The model: 128 layers of attention (fused qkv, o), two norms, a router and 64 experts of three
matrices (hidden 8192, expert width 4864), an embedding on the first pipeline stage and the final
norm and head on the last (vocabulary 163840): 1.02T parameters in 25,219 tensors. Every
parameter's map is its TP split inside its pipeline stage composed with the ZeRO-1 flat partition
of its TP shard over the stage's DP group, on global ranks (``reshard.Topology``); the maps are
built by ``ZeroComposer.group``, which composes each geometry once (``compose`` per parameter
gives the same maps; the previous benchmark built them that way at ~26 s per 16 layers).

1. The whole model, TP8 x PP8 x DP16 -> TP4 x PP16 x DP32: building every map of both sides and
   ``plan_model`` over all 128 layers, in one timing (goal < 10 s), and the plan's JSON size
   (goal < 50 MB).
2. One rank of a live move at 4,096 ranks, TP8 x PP8 x DP64 -> TP4 x PP16 x DP64:
   ``plan_for_rank`` for a sample of ranks, the slowest and the largest tracemalloc peak
   (goal < 1 s and < 100 MB); the maps are built first, as in 1."""

from __future__ import annotations

import json
import math
import random
import time
import tracemalloc

from benchmarks.common import row
from reshard import ModelPlan, ParamMap, plan_model
from reshard.layouts import even_sizes, replicated, split, zero12_group_layout
from reshard.layouts.compose import ZeroComposer
from reshard.layouts.topology import Topology
from reshard.plan.planner import plan_for_rank

HIDDEN, INTER, EXPERTS, LAYERS, VOCAB = 8192, 4864, 64, 128, 163840

Param = tuple[str, tuple[int, ...], int | None]  # (name, shape, TP split dim or None: replicated)


def _layer_params(i: int) -> list[Param]:
    p = f"layers.{i}."
    out = [(p + "attn.qkv", (3 * HIDDEN, HIDDEN), 0), (p + "attn.o", (HIDDEN, HIDDEN), 1),
           (p + "norm1", (HIDDEN,), None), (p + "norm2", (HIDDEN,), None), (p + "router", (EXPERTS, HIDDEN), None)]
    for e in range(EXPERTS):
        out += [(p + f"experts.{e}.w1", (INTER, HIDDEN), 0), (p + f"experts.{e}.w3", (INTER, HIDDEN), 0),
                (p + f"experts.{e}.w2", (HIDDEN, INTER), 1)]
    return out


def _stage_params(topo: Topology, layers: int, stage: int) -> list[Param]:
    per_stage = layers // topo.pp
    out = [q for i in range(stage * per_stage, (stage + 1) * per_stage) for q in _layer_params(i)]
    if stage == 0:
        out.insert(0, ("embed", (VOCAB, HIDDEN), 0))
    if stage == topo.pp - 1:
        out += [("norm", (HIDDEN,), None), ("head", (VOCAB, HIDDEN), 0)]
    return out


def build(topo: Topology, layers: int = LAYERS) -> dict[str, ParamMap]:
    """Maps of every parameter under ``topo`` with ZeRO-1 over DP. TP maps are built once per
    (shape, split, stage) and each TP rank's flat group once per list of shard shapes; the
    composites come from one :class:`ZeroComposer`."""
    composer, tp_maps, flat_groups = ZeroComposer(), {}, {}
    maps = {}
    for stage in range(topo.pp):
        params = _stage_params(topo, layers, stage)
        ranks = tuple(topo.rank(stage, 0, t) for t in range(topo.tp))
        outer = []
        for _, shape, dim in params:
            m = tp_maps.get((shape, dim, ranks))
            if m is None:
                m = tp_maps[(shape, dim, ranks)] = (replicated(shape, ranks) if dim is None else
                                                    split(shape, dim, even_sizes(shape[dim], topo.tp), ranks=ranks))
            outer.append(m)
        groups = {}
        for r in ranks:
            shapes = tuple(m.shard(r).shape for m in outer)
            g = flat_groups.get(shapes)
            if g is None:
                g = flat_groups[shapes] = zero12_group_layout(shapes, topo.dp)
            groups[r] = g
        dp_ranks = {r: [topo.rank(stage, d, t) for d in range(topo.dp)] for t, r in enumerate(ranks)}
        maps.update(zip((name for name, _, _ in params), composer.group(outer, groups, dp_ranks)))
    return maps


def whole(src: Topology, tgt: Topology, layers: int = LAYERS) -> tuple[dict[str, float], dict, dict, ModelPlan]:
    """Build both sides' maps and plan the model in one timing; each part's wall time, and the
    total's CPU time (the box may be shared)."""
    cpu, t0 = time.process_time(), time.perf_counter()
    source = build(src, layers)
    t1 = time.perf_counter()
    target = build(tgt, layers)
    t2 = time.perf_counter()
    mp = plan_model(source, target, check=False)
    t3 = time.perf_counter()
    parts = {"build source maps": t1 - t0, "build target maps": t2 - t1, "plan_model": t3 - t2,
             "total, one timing": t3 - t0, "cpu": time.process_time() - cpu}
    return parts, source, target, mp


def per_rank(source: dict, target: dict, ranks: list[int]) -> tuple[float, int, int, int]:
    """Slowest ``plan_for_rank`` over ``ranks`` (seconds), that rank, the largest tracemalloc
    peak (bytes, from a second run under tracemalloc) and the most segments one rank has."""
    worst, worst_rank, peak, segments = 0.0, ranks[0], 0, 0
    for r in ranks:
        t = time.perf_counter()
        mp = plan_for_rank(source, target, r, check=False)
        took = time.perf_counter() - t
        if took > worst:
            worst, worst_rank = took, r
        segments = max(segments, sum(len(p.segments) for p in mp.params.values()))
        del mp
        tracemalloc.start()
        plan_for_rank(source, target, r, check=False)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return worst, worst_rank, peak, segments


def _name(src: Topology, tgt: Topology) -> str:
    def one(t: Topology) -> str:
        return f"TP{t.tp}xPP{t.pp}xDP{t.dp}"

    return f"{one(src)} ZeRO-1 -> {one(tgt)}"


def main(layers: int = LAYERS, sample: int = 24) -> list[str]:
    src, tgt = Topology(pp=8, dp=16, tp=8), Topology(pp=16, dp=32, tp=4)
    parts, source, target, mp = whole(src, tgt, layers)
    size = len(json.dumps(mp.to_dict(), separators=(",", ":")))
    st = mp.stats(element_size=2)
    elements = sum(math.prod(m.logical_shape) for m in source.values())
    out = [f"MoE {layers} layers, {EXPERTS} experts: {elements / 1e12:.2f}T parameters in {len(source):,} tensors, "
           f"{_name(src, tgt)}: {len(set(map(id, source.values()))):,} + {len(set(map(id, target.values()))):,} "
           f"distinct maps, {len(set(map(id, mp.params.values()))):,} distinct plans"]
    for what in ("build source maps", "build target maps", "plan_model"):
        out.append(row(f"  {what}", parts[what]))
    out.append(row("  total: every map built, the whole model planned", parts["total, one timing"],
                   note=f"(one timing, not extrapolated; {parts['cpu']:.2f} s of CPU; goal < 10 s)"))
    out.append(row("  serialized plan size", size / 1e6, unit="MB",
                   note=f"(goal < 50 MB; {st.segments:,} segments, {st.remote_bytes / 2**40:.2f} TiB remote in bf16)"))
    del source, target, mp

    big_src, big_tgt = Topology(pp=8, dp=64, tp=8), Topology(pp=16, dp=64, tp=4)
    cpu, t = time.process_time(), time.perf_counter()
    source, target = build(big_src, layers), build(big_tgt, layers)
    built, cpu = time.perf_counter() - t, time.process_time() - cpu
    world = big_src.world_size
    ranks = sorted({0, 1, world // 2, world - 1, *random.Random(0).sample(range(world), sample)})
    worst, who, peak, segs = per_rank(source, target, ranks)
    out += [
        f"4,096 ranks, {_name(big_src, big_tgt)}: one rank's share of a live move",
        row("  every map of both sides built (the rank's input)", built, note=f"({cpu:.2f} s of CPU)"),
        row(f"  plan_for_rank, slowest of {len(ranks)} ranks (rank {who})", worst, note="(goal < 1 s)"),
        row("  plan_for_rank, largest tracemalloc peak", peak / 1e6, unit="MB",
            note=f"(goal < 100 MB; at most {segs} segments for one rank)"),
    ]
    return out


if __name__ == "__main__":
    print("\n".join(main()))
