"""Planner benchmarks: a Llama-70B-shaped model TP=8 -> TP=4, reshard vs DeepSpeed 0.19.8's
``plan_transfer`` over the same maps in the same run."""

from __future__ import annotations

import json
import time

from benchmarks.common import best_of, row
from benchmarks.models import llama_maps
from reshard.planner import Planner, plan_model


def bench_llama70b() -> list[str]:
    src, tgt = llama_maps(8), llama_maps(4)
    ours = best_of(lambda: plan_model(src, tgt), repeat=3)

    def uncached():  # no geometry sharing between identical layers: every parameter planned afresh
        for name in src:
            Planner().plan(src[name], tgt[name])

    cold = best_of(uncached, repeat=1)
    mp = plan_model(src, tgt)
    st = mp.stats(element_size=2)
    out = [
        row("plan_model: Llama-70B TP=8 -> TP=4 (identical geometry shared)", ours,
            note=f"({st.segments} segments, {st.remote_bytes / 2**30:.1f} GiB remote in bf16; goal < 0.15 s)"),
        row("  same, every parameter planned afresh", cold),
    ]
    try:
        from deepspeed.checkpoint.affine import ParamAffineMap
        from deepspeed.checkpoint.affine_transfer import plan_transfer
    except ImportError:
        return out + ["  (deepspeed not installed: peer skipped)"]
    ds_src = {n: ParamAffineMap.from_dict(json.loads(json.dumps(m.to_dict()))) for n, m in src.items()}
    ds_tgt = {n: ParamAffineMap.from_dict(json.loads(json.dumps(m.to_dict()))) for n, m in tgt.items()}
    t = time.perf_counter()
    ds_segments = sum(len(plan_transfer(ds_tgt[n], ds_src[n]).segments) for n in src)
    peer = time.perf_counter() - t
    out.append(row("  DeepSpeed plan_transfer, same maps", ours, peer, note=f"({ds_segments} segments; goal >= 10x)"))
    out.append(row("  DeepSpeed vs reshard planning every parameter afresh", cold, peer))
    return out


def main() -> list[str]:
    return bench_llama70b()


if __name__ == "__main__":
    print("\n".join(main()))
