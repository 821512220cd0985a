"""``make bench``: every benchmark, ours and the peer's in the same run, with ratios."""

from __future__ import annotations

import warnings

from benchmarks import (
    bench_convert,
    bench_dcp,
    bench_derive,
    bench_dist,
    bench_dsv3_memory,
    bench_fp8_export,
    bench_ir,
    bench_megatron,
    bench_moe,
    bench_offline,
    bench_planner,
    bench_quantize,
    bench_sync,
    bench_zero3,
)
from benchmarks.common import machine


def main() -> None:
    warnings.filterwarnings("ignore")
    print(f"machine: {machine()}")
    for mod in (bench_ir, bench_derive, bench_planner, bench_moe, bench_dist, bench_sync, bench_convert, bench_offline,
                bench_zero3, bench_dcp, bench_megatron, bench_quantize, bench_fp8_export, bench_dsv3_memory):
        print(f"\n== {mod.__name__} ==")
        for line in mod.main():
            print(line, flush=True)


if __name__ == "__main__":
    main()
