"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    """Best wall time of ``repeat`` runs (seconds): the least noisy estimate on a shared box."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def machine() -> str:
    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")


def row(name: str, ours: float, peer: float | None = None, unit: str = "s", note: str = "") -> str:
    if peer is None:
        return f"{name:<58} {ours:>10.4f} {unit} {note}"
    return f"{name:<58} {ours:>10.4f} {unit}  peer {peer:>10.4f} {unit}  ratio {peer / ours:>8.1f}x {note}"
