"""A plan: the data the planner produces and executors run (docs/spec.md §6), and its JSON form.

Plain values only: the planner (``reshard.plan.planner``) decides them, executors
(``reshard.execute.local``, ``reshard.execute.live``, the engine's fills) run them; ``to_dict`` /
``from_dict`` store them as JSON, as maps do. A single-parameter plan is executable by any tool
with ``torch.as_strided`` alone: offsets and strides are in elements of the flattened shards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MapFormatError
from ..ir.piece import View, prod, scale_problem
from ..ir.serial import json_dict, json_int, json_key, json_list, json_rank, json_shape


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

    def to_dict(self) -> dict[str, Any]:
        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "") -> TransferPlan:
        return plan_from_dict(d, path)


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

    def to_dict(self) -> dict[str, Any]:
        return model_plan_to_dict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ModelPlan:
        return model_plan_from_dict(d)


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


# -- JSON ------------------------------------------------------------------------------------------


def _end(rank: int, v: View) -> list:
    return [rank, v.offset, list(v.strides)]


def plan_to_dict(p: TransferPlan) -> dict[str, Any]:
    segs = []
    for s in p.segments:
        d: dict[str, Any] = {"src": _end(s.src_rank, s.src), "dst": _end(s.dst_rank, s.dst), "shape": list(s.shape)}
        if s.factor != 1.0:
            d["factor"] = s.factor
        segs.append(d)
    return {
        "logical_shape": list(p.logical_shape),
        "source_shards": {str(r): list(s) for r, s in p.source_shards.items()},
        "target_shards": {str(r): list(s) for r, s in p.target_shards.items()},
        "segments": segs,
        "unfilled": [{"dst": _end(u.dst_rank, u.dst), "shape": list(u.shape)} for u in p.unfilled],
    }


def _endpoint(x: Any, path: str, ndim: int) -> tuple[int, View]:
    e = json_list(x, path)
    if len(e) != 3:
        raise MapFormatError(path, f"expected [rank, offset, [strides]], got {len(e)} items")
    rank = json_int(e[0], f"{path}[0]")
    offset = json_int(e[1], f"{path}[1]")
    strides = tuple(json_int(s, f"{path}[2][{i}]") for i, s in enumerate(json_list(e[2], f"{path}[2]")))
    if len(strides) != ndim:
        raise MapFormatError(f"{path}[2]", f"{len(strides)} strides for a {ndim}-d shape")
    return rank, View(offset, strides)


def _shards(x: Any, path: str) -> dict[int, tuple[int, ...]]:
    return {json_rank(k, f"{path}.{k}"): json_shape(v, f"{path}.{k}") for k, v in json_dict(x, path).items()}


def plan_from_dict(d: Any, path: str = "") -> TransferPlan:
    d = json_dict(d, path)
    j = (lambda k: f"{path}.{k}" if path else k)
    logical = json_shape(json_key(d, "logical_shape", path), j("logical_shape"))
    segs = []
    for i, s in enumerate(json_list(json_key(d, "segments", path), j("segments"))):
        sp = f"{j('segments')}.{i}"
        s = json_dict(s, sp)
        shape = json_shape(json_key(s, "shape", sp), f"{sp}.shape")
        sr, sv = _endpoint(json_key(s, "src", sp), f"{sp}.src", len(shape))
        dr, dv = _endpoint(json_key(s, "dst", sp), f"{sp}.dst", len(shape))
        f = s.get("factor", 1.0)
        problem = scale_problem(f)
        if problem:
            raise MapFormatError(f"{sp}.factor", problem)
        segs.append(Segment(sr, sv, dr, dv, shape, float(f)))
    unfilled = []
    for i, u in enumerate(json_list(d.get("unfilled", []), j("unfilled"))):
        up = f"{j('unfilled')}.{i}"
        u = json_dict(u, up)
        shape = json_shape(json_key(u, "shape", up), f"{up}.shape")
        r, v = _endpoint(json_key(u, "dst", up), f"{up}.dst", len(shape))
        unfilled.append(Unfilled(r, v, shape))
    src_sh = _shards(d["source_shards"], j("source_shards")) if "source_shards" in d else _infer(segs, "src")
    dst_sh = _shards(d["target_shards"], j("target_shards")) if "target_shards" in d else _infer(segs, "dst")
    return TransferPlan(logical, src_sh, dst_sh, tuple(segs), tuple(unfilled))


def _infer(segs: list[Segment], side: str) -> dict[int, tuple[int, ...]]:
    """Flat shard sizes from the segments, for plans written by tools that omit them."""
    out: dict[int, int] = {}
    for s in segs:
        rank, v = (s.src_rank, s.src) if side == "src" else (s.dst_rank, s.dst)
        hi = v.offset + sum((n - 1) * st for n, st in zip(s.shape, v.strides)) + 1
        out[rank] = max(out.get(rank, 0), hi)
    return {r: (n,) for r, n in out.items()}


def model_plan_to_dict(mp: ModelPlan) -> dict[str, Any]:
    return {"version": 1, "params": {n: plan_to_dict(p) for n, p in mp.params.items()}}


def model_plan_from_dict(d: Any) -> ModelPlan:
    d = json_dict(d, "")
    v = json_key(d, "version", "")
    if isinstance(v, bool) or v != 1:
        raise MapFormatError("version", f"unknown plan format version {v!r}")
    params = json_dict(json_key(d, "params", ""), "params")
    return ModelPlan({n: plan_from_dict(p, f"params.{n}") for n, p in params.items()})
