"""Planning at scale: a 1T-parameter-shaped MoE, TP8 x PP8 x DP16 with ZeRO-1 -> TP4 x PP16 x DP32.

Every parameter's map is the composition of its TP split (inside its pipeline stage) with the
ZeRO-1 flat partition of its TP shard over the stage's DP group (``reshard.layouts.compose``),
on global ranks from ``reshard.topology.Topology``. Maps are built with the builders, then
``plan_model`` plans every parameter; we report planning time and serialized plan size."""

from __future__ import annotations

import json
import time

from benchmarks.common import best_of, row
from reshard import model_plan_to_dict, plan_model
from reshard.layouts import compose, even_sizes, replicated, split, zero12_group
from reshard.topology import Topology

HIDDEN, INTER, EXPERTS, LAYERS = 8192, 4864, 64, 128


def _layer_params(i: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, TP split dim or None for replicated)."""
    p = f"layers.{i}."
    out = [(p + "attn.qkv", (3 * HIDDEN, HIDDEN), 0), (p + "attn.o", (HIDDEN, HIDDEN), 1),
           (p + "norm1", (HIDDEN,), None), (p + "norm2", (HIDDEN,), None), (p + "router", (EXPERTS, HIDDEN), None)]
    for e in range(EXPERTS):
        out += [(p + f"experts.{e}.w1", (INTER, HIDDEN), 0), (p + f"experts.{e}.w3", (INTER, HIDDEN), 0),
                (p + f"experts.{e}.w2", (HIDDEN, INTER), 1)]
    return out


def build(topo: Topology, layers: int) -> dict:
    """Maps of every parameter under ``topo`` with ZeRO-1 over DP."""
    per_stage = layers // topo.pp
    maps = {}
    for stage in range(topo.pp):
        params = [q for i in range(stage * per_stage, (stage + 1) * per_stage) for q in _layer_params(i)]
        for t in range(topo.tp):
            ranks = [topo.rank(stage, 0, k) for k in range(topo.tp)]
            tp_maps = [split(s, d, even_sizes(s[d], topo.tp), ranks=ranks) if d is not None
                       else replicated(s, ranks) for _, s, d in params]
            shapes = [m.shard(ranks[t]).shape for m in tp_maps]
            dp_ranks = [topo.rank(stage, d, t) for d in range(topo.dp)]
            zero = zero12_group(shapes, topo.dp, ranks=dp_ranks, shard="fragment")
            for (name, _, _), tm, zm in zip(params, tp_maps, zero):
                maps.setdefault(name, (tm, {}))[1][ranks[t]] = zm
    return {name: compose(tm, inner) for name, (tm, inner) in maps.items()}


def main(layers: int = 16) -> list[str]:
    t0 = time.perf_counter()
    src = build(Topology(pp=8, dp=16, tp=8), layers)
    tgt = build(Topology(pp=16, dp=32, tp=4), layers)
    built = time.perf_counter() - t0
    took = best_of(lambda: plan_model(src, tgt, check=False), repeat=3)
    mp = plan_model(src, tgt, check=False)
    size = len(json.dumps(model_plan_to_dict(mp), separators=(",", ":")))
    scale = LAYERS / layers
    st = mp.stats(element_size=2)
    return [
        f"MoE {layers} of {LAYERS} layers, {EXPERTS} experts, {len(src)} params: built maps in {built:.1f} s",
        row("  plan_model TP8xPP8xDP16 ZeRO-1 -> TP4xPP16xDP32", took,
            note=f"(x{scale:.0f} for the full model: ~{took * scale:.1f} s; goal < 10 s)"),
        row("  serialized plan size", size / 2**20, unit="MiB",
            note=f"(~{size * scale / 2**20:.0f} MiB full; goal < 50 MB; {st.segments} segments)"),
    ]


if __name__ == "__main__":
    print("\n".join(main()))
