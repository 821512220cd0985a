"""What the live scripts ask each vLLM worker (``collective_rpc``; imported by every vLLM process)."""

from __future__ import annotations


def engine_stats(worker) -> dict:
    """The "reshard" worker engine's counters (rank, bytes received in the last update, ...)."""
    return dict(worker.weight_transfer_engine.stats)


def pid(worker) -> int:
    import os

    return os.getpid()
