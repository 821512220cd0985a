"""A plan: the data the planner produces and executors run (docs/spec.md §6).

Plain values only: the planner (``reshard.plan.planner``) decides them, executors
(``reshard.execute.local``, ``reshard.execute.live``, the offline writer) run them, ``reshard.plan.serial``
stores them as JSON. None of those is imported here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..ir.piece import View, prod


@dataclass(frozen=True, slots=True)
class Segment:
    """One strided copy: ``target[dst_rank][dst] = source[src_rank][src] * factor ** scale_power``
    (views into the flattened shards)."""

    src_rank: int
    src: View
    dst_rank: int
    dst: View
    shape: tuple[int, ...]
    factor: float = 1.0

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True, slots=True)
class Unfilled:
    """A target region no source can fill: target-side padding, zero-filled by executors."""

    dst_rank: int
    dst: View
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """How to produce every target shard of one parameter from the source shards."""

    logical_shape: tuple[int, ...]
    source_shards: Mapping[int, tuple[int, ...]]
    target_shards: Mapping[int, tuple[int, ...]]
    segments: tuple[Segment, ...]
    unfilled: tuple[Unfilled, ...] = ()

    def stats(self, element_size: int = 1) -> PlanStats:
        return PlanStats.of([self], element_size)


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Bytes moved, per rank and in total, and the number of segments."""

    segments: int
    local_bytes: int
    remote_bytes: int
    sent: Mapping[int, int]
    received: Mapping[int, int]
    links: Mapping[tuple[int, int], int]

    @staticmethod
    def of(plans: Sequence[TransferPlan], element_size: int = 1) -> PlanStats:
        sent: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        links: dict[tuple[int, int], int] = defaultdict(int)
        local = remote = count = 0
        for p in plans:
            count += len(p.segments)
            for s in p.segments:
                b = s.numel * element_size
                if s.is_local:
                    local += b
                else:
                    remote += b
                    sent[s.src_rank] += b
                    received[s.dst_rank] += b
                    links[(s.src_rank, s.dst_rank)] += b
        return PlanStats(count, local, remote, dict(sent), dict(received), dict(links))

    @property
    def busiest_link(self) -> tuple[tuple[int, int], int] | None:
        return max(self.links.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]), default=None)

    def send_balance(self) -> float:
        """max / mean of bytes sent over the ranks that send (1.0 is perfect)."""
        if not self.sent:
            return 1.0
        vals = list(self.sent.values())
        return max(vals) / (sum(vals) / len(vals))


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """Plans for every parameter of a model, by name. ``ranks``: the ranks it was made for
    (``plan_for_rank``: only what they send or receive), ``None`` for the whole world."""

    params: Mapping[str, TransferPlan]
    ranks: frozenset[int] | None = None

    def stats(self, element_size: int | Mapping[str, int] = 1) -> PlanStats:
        if isinstance(element_size, int):
            return PlanStats.of(list(self.params.values()), element_size)
        parts = [PlanStats.of([p], element_size[n]) for n, p in self.params.items()]
        return _sum_stats(parts)


def _sum_stats(parts: Sequence[PlanStats]) -> PlanStats:
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    links: dict[tuple[int, int], int] = defaultdict(int)
    for s in parts:
        for k, v in s.sent.items():
            sent[k] += v
        for k, v in s.received.items():
            received[k] += v
        for k2, v in s.links.items():
            links[k2] += v
    return PlanStats(sum(s.segments for s in parts), sum(s.local_bytes for s in parts),
                     sum(s.remote_bytes for s in parts), dict(sent), dict(received), dict(links))
