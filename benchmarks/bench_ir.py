"""IR core benchmarks: ``check()`` over a 70B-shaped model vs DeepSpeed's element-wise
``validate_coverage``; ``rebuild``/``extract`` throughput vs a plain copy of the same bytes."""

from __future__ import annotations

import torch

from benchmarks.common import best_of, row
from benchmarks.models import llama_maps
from reshard.ir.check import check


def bench_check() -> list[str]:
    maps = llama_maps(8)
    numel = sum(m.numel for m in maps.values())
    ours = best_of(lambda: [check(m) for m in maps.values()], repeat=3)
    out = [row(f"check(): Llama-70B TP=8, {len(maps)} params, {numel / 1e9:.1f}G elements", ours)]
    try:
        from deepspeed.checkpoint.affine import contiguous_split_map
    except ImportError:
        return out + ["  (deepspeed not installed: peer skipped)"]
    ds = contiguous_split_map((1024, 1024), [128] * 8, 1)
    peer_small = best_of(ds.validate_coverage, repeat=1)
    rate = 1024 * 1024 / peer_small
    peer_model = numel / rate
    out.append(row("  DeepSpeed validate_coverage, 1024x1024 TP=8", peer_small,
                   note=f"({rate / 1e6:.2f} M elements/s)"))
    out.append(row("  check() whole model vs DeepSpeed extrapolated per element", ours, peer_model,
                   note=f"(peer ~{peer_model / 3600:.1f} h)"))
    return out


def _maps_for_apply():
    from reshard.layouts import split, sub_params

    return {
        "column split 4096x4096 TP=8": split((4096, 4096), 1, [512] * 8),
        "fused qkv rows 6144x4096 TP=8": sub_params((6144, 4096), [4096, 1024, 1024], [[512] * 8, [128] * 8, [128] * 8]),
    }


def bench_rebuild_extract() -> list[str]:
    out = []
    default = torch.get_num_threads()
    for threads in sorted({default, 1}, reverse=True):
        torch.set_num_threads(threads)
        out.append(f"  (torch intra-op threads: {threads})")
        out += _rebuild_extract_rows()
    torch.set_num_threads(default)
    return out


def _rebuild_extract_rows() -> list[str]:
    out = []
    for name, m in _maps_for_apply().items():
        full = torch.randn(m.logical_shape)
        shards = {r: m.extract(full, r) for r in m.ranks}
        # the baseline allocates its output too, as rebuild and extract must
        copy = best_of(lambda: torch.empty_like(full).copy_(full))
        t_rebuild = best_of(lambda: m.rebuild(shards, verify=False))
        t_extract = best_of(lambda: [m.extract(full, r) for r in m.ranks])
        mib = full.numel() * full.element_size() / 2**20
        out.append(row(f"rebuild: {name} ({mib:.0f} MiB)", t_rebuild,
                       note=f"throughput vs plain copy {copy / t_rebuild:.2f} (goal >= 0.7)"))
        out.append(row(f"extract all ranks: {name}", t_extract,
                       note=f"throughput vs plain copy {copy / t_extract:.2f} (goal >= 0.7)"))
    return out


def main() -> list[str]:
    return bench_check() + bench_rebuild_extract()


if __name__ == "__main__":
    print("\n".join(main()))
