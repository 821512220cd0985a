"""Planner benchmarks: a Llama-70B-shaped model TP=8 -> TP=4, reshard vs DeepSpeed 0.19.8's
``plan_transfer`` over the same maps in the same run."""

from __future__ import annotations

import time

from benchmarks.common import best_of, row
from benchmarks.models import llama_maps
from reshard.plan.planner import Planner, plan_model


def bench_llama70b() -> list[str]:
    src, tgt = llama_maps(8), llama_maps(4)
    ours = best_of(lambda: plan_model(src, tgt), repeat=3)

    def uncached():  # no geometry sharing between identical layers: every parameter planned afresh
        for name in src:
            Planner().plan(src[name], tgt[name])

    cold = best_of(uncached, repeat=1)

    def uncached_unchecked():  # the same without re-validating both maps of every parameter
        for name in src:
            Planner(check=False).plan(src[name], tgt[name])

    bare = best_of(uncached_unchecked, repeat=1)
    mp = plan_model(src, tgt)
    st = mp.stats(element_size=2)
    out = [
        row("plan_model: Llama-70B TP=8 -> TP=4 (identical geometry shared)", ours,
            note=f"({st.segments} segments, {st.remote_bytes / 2**30:.1f} GiB remote in bf16; goal < 0.15 s)"),
        row("  same, every parameter planned afresh (check() included)", cold),
        row("  same, every parameter planned afresh, maps already checked", bare),
    ]
    try:
        from deepspeed.checkpoint.affine_transfer import plan_transfer
    except ImportError:
        return out + ["  (deepspeed not installed: peer skipped)"]
    # DeepSpeed's planner takes only pieces with one axis per axis of F, so it is given the same
    # layouts built by its own builders rather than reshard's canonical (merged) maps.
    ds_src, ds_tgt = _ds_llama(8), _ds_llama(4)
    assert set(ds_src) == set(src)
    t = time.perf_counter()
    ds_segments = sum(len(plan_transfer(ds_tgt[n], ds_src[n]).segments) for n in src)
    peer = time.perf_counter() - t
    out.append(row("  DeepSpeed plan_transfer, same maps", ours, peer, note=f"({ds_segments} segments; goal >= 10x)"))
    out.append(row("  DeepSpeed vs reshard planning every parameter afresh", cold, peer))
    out.append(row("  DeepSpeed vs reshard afresh without re-checking maps", bare, peer))
    return out


def _ds_llama(tp: int, layers: int = 80, hidden: int = 8192, kv: int = 1024, inter: int = 28672,
              vocab: int = 128256) -> dict:
    from deepspeed.checkpoint.affine import contiguous_split_map, replicated_map, sub_param_map

    def even(n: int) -> list[int]:
        return [n // tp] * tp

    maps = {"embed.weight": contiguous_split_map((vocab, hidden), even(vocab), 0)}
    for i in range(layers):
        p = f"layers.{i}."
        maps[p + "attn.qkv.weight"] = sub_param_map((hidden + 2 * kv, hidden), [hidden, kv, kv],
                                                    [even(hidden), even(kv), even(kv)], 0)
        maps[p + "attn.o_proj.weight"] = contiguous_split_map((hidden, hidden), even(hidden), 1)
        maps[p + "mlp.gate_up.weight"] = sub_param_map((2 * inter, hidden), [inter, inter], [even(inter)] * 2, 0)
        maps[p + "mlp.down.weight"] = contiguous_split_map((hidden, inter), even(inter), 1)
        maps[p + "input_norm.weight"] = replicated_map((hidden,), tp)
        maps[p + "post_norm.weight"] = replicated_map((hidden,), tp)
    maps["norm.weight"] = replicated_map((hidden,), tp)
    maps["lm_head.weight"] = contiguous_split_map((vocab, hidden), even(vocab), 0)
    return maps


def main() -> list[str]:
    return bench_llama70b()


if __name__ == "__main__":
    print("\n".join(main()))
