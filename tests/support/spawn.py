"""A gloo job of spawned processes for a test module: each rank appends one JSON record per line
to ``workdir/rank<r>.jsonl``; the module's assertions read them back."""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path


def run_ranks(worker: Callable[[int, str], None], world: int, workdir: Path, timeout_s: float, key: str) -> dict:
    """Run ``worker(rank, workdir)`` on ``world`` spawned processes, killing any still alive after
    ``timeout_s`` (only the processes started here). Returns ``{"records": {record[key]: {rank:
    record}}, "hung": [ranks killed], "exitcodes": [...]}``."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, str(workdir)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    records: dict[str, dict[int, dict]] = {}
    for r in range(world):
        path = workdir / f"rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            rec = json.loads(line)
            records.setdefault(rec.pop(key), {})[r] = rec
    return {"records": records, "hung": hung, "exitcodes": [p.exitcode for p in procs]}
