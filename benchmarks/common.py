"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable


def tree_rss(p: object) -> tuple[int, list]:
    """The summed RSS of psutil process ``p`` and its descendants now, and those processes (ones
    that exit while read count nothing)."""
    import psutil

    try:
        procs = [p, *p.children(recursive=True)]  # type: ignore[attr-defined]
    except psutil.NoSuchProcess:
        return 0, []
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total, procs


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


def spawn_ranks(worker: Callable[[int, str], None], world: int, timeout: float, name: str) -> dict | str:
    """Run ``worker(rank, workdir)`` in ``world`` spawned processes (a gloo job); rank 0 writes
    its results to ``workdir/result.json``. Returns them, or a line saying the workers failed
    (a worker still alive at ``timeout`` seconds is killed)."""
    import json
    import multiprocessing
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as workdir:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, workdir), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        path = Path(workdir) / "result.json"
        if not path.exists():
            return f"{name}: workers failed (exit codes {[p.exitcode for p in procs]})"
        return json.loads(path.read_text())
