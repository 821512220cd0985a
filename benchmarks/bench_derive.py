"""``derive`` on large parameters (goal: 8192x8192 at TP=8 under 2 s), and the builders for a
whole 70B-shaped model."""

from __future__ import annotations

from benchmarks.common import best_of, row
from reshard.derive import derive


def main() -> list[str]:
    out = []
    for n in (4096, 8192):
        for name, dim in (("column split", 1), ("row split", 0)):
            t = best_of(lambda: derive(lambda f, r: f.chunk(8, dim=dim)[r], (n, n), 8), repeat=2)
            out.append(row(f"derive: {n}x{n} {name}, TP=8", t, note="(goal < 2 s at 8192)"))
    from benchmarks.models import llama_maps

    t = best_of(lambda: llama_maps(8), repeat=3)
    out.append(row("builders: every map of a Llama-70B-shaped model, TP=8", t))
    return out


if __name__ == "__main__":
    print("\n".join(main()))
