"""``derive`` on large parameters against one pass over F, and the builders for a whole
70B-shaped model.

Goal (issue #15): ``derive`` of 8192x8192 at TP=8 within 10x of running the partition function
itself once on F. That floor is ``[fn(F, r) for r in range(8)]`` on a float32 F, in two forms:

- *views*: ``chunk`` returns views, so this reads no element of F and costs microseconds;
- *one pass*: each shard materialised (``fn(F, r).clone()``, so a row split's contiguous views are
  copied too): F read once and every shard written once. The goal is measured against this one.

``derive`` runs on ``chunk`` ("views") and on a function that clones each shard ("copies": the
floor is then exactly that function's own run), each as users call it (its check on random data of
its default ``dtype``, float64: twice the bytes per element of the floor's F) and with
``dtype=torch.float32`` (F's own dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.common import best_of, row
from reshard.layouts.derive import derive

TP = 8
Split = Callable[[torch.Tensor, int], torch.Tensor]


def _split(dim: int, copy: bool) -> Split:
    if copy:
        return lambda f, r: f.chunk(TP, dim=dim)[r].clone()
    return lambda f, r: f.chunk(TP, dim=dim)[r]


def _floors(fn: Split, full: torch.Tensor) -> tuple[float, float]:
    """(views, one pass): the partition function over every rank, as it is and materialised."""
    views = best_of(lambda: [fn(full, r) for r in range(TP)], repeat=3)
    one_pass = best_of(lambda: [fn(full, r).clone() for r in range(TP)], repeat=3)
    return views, one_pass


def main() -> list[str]:
    out = []
    for n in (4096, 8192):
        full = torch.empty(n, n, dtype=torch.float32).uniform_(-1.0, 1.0)
        for name, dim in (("column split", 1), ("row split", 0)):
            views, one_pass = _floors(_split(dim, False), full)
            for copy, dtype in ((False, torch.float64), (False, torch.float32), (True, torch.float64),
                                (True, torch.float32)):
                what = ("copies" if copy else "views") + (", float32" if dtype == torch.float32 else "")
                t = best_of(lambda: derive(_split(dim, copy), (n, n), TP, dtype=dtype), repeat=2)
                out.append(row(f"derive: {n}x{n} {name}, TP=8, {what}", t,
                               note=f"{t / one_pass:5.1f}x one pass (goal <= 10x at 8192)"))
            out += [
                row("  floor, one pass: fn(F, r).clone(), all r, F float32", one_pass),
                row("  floor, views: fn(F, r), all r, F float32 (reads nothing)", views),
            ]
        del full
    from benchmarks.models import llama_maps

    t = best_of(lambda: llama_maps(8), repeat=3)
    out.append(row("builders: every map of a Llama-70B-shaped model, TP=8", t))
    return out


if __name__ == "__main__":
    print("\n".join(main()))
