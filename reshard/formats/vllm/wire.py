"""What the "reshard" weight-transfer backend's two sides say to each other, and the per-link
programs both sides cut from one plan. No vLLM import: the trainer side and the tests use it as is.

Ranks of the transfer group (:class:`reshard.execute.group.TransferGroup`): trainer ranks
``0..T-1``, then the engine's workers, worker ``w`` (vLLM's world rank) at ``T + w``.

Init, over the group (rank 0 is trainer rank 0):

1. rank 0 broadcasts the **setup**: every source parameter's full (HF) shape, its source map over
   the trainer ranks, the wire dtype;
2. each worker loads a marker per element (``layouts.learned.markers``) with vLLM's own loader and
   sends rank 0 what landed in each of its engine tensors (:func:`encode_tensors`);
3. rank 0 learns every parameter's placement (``layouts.learned.learn_placed``) and broadcasts the
   **targets** (or one error line, which every rank raises);

   (before 2, every rank reports in one reduction whether it lacks cached maps, ``cache.py``;
   when no worker does, each sends its cached maps instead of markers (:func:`encode_cached_reply`),
   and rank 0 checks they agree and broadcasts them as the targets)
4. every rank plans its own part (``plan_for_rank``) and cuts it into one message per link
   (:func:`link_program`): the same segments in the same order at both ends, so a link's message
   is the concatenation of its segments' elements, cast to the wire dtype, and nothing else.

Each update: every link's one message, then one ``MAX`` reduction of failures over the group.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...errors import MapError, PlanError
from ...execute.lazy import LazyShards, lazy_copy
from ...ir.apply import flatten, view_of
from ...ir.param_map import ParamMap
from ...ir.piece import View
from ...layouts.inference import Placed
from ...plan.values import ModelPlan, Segment

__all__ = ["Link", "Setup", "decode_cached_reply", "decode_marker_reply", "encode_cached_reply", "decode_targets", "decode_tensors", "encode_marker_reply",
           "encode_targets", "encode_tensors",
           "link_program", "pack", "unpack", "wire_dtype"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def wire_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise PlanError(f"reshard weight transfer: wire dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class Setup:
    """Rank 0's first message: full shapes and source maps by parameter name, the wire dtype."""

    shapes: dict[str, tuple[int, ...]]
    sources: dict[str, ParamMap]
    dtype: str

    def encode(self) -> bytes:
        return json.dumps({"shapes": {n: list(s) for n, s in self.shapes.items()},
                           "sources": {n: m.to_dict() for n, m in self.sources.items()},
                           "dtype": self.dtype}).encode()

    @staticmethod
    def decode(data: bytes) -> Setup:
        d = json.loads(data)
        return Setup({n: tuple(s) for n, s in d["shapes"].items()},
                     {n: ParamMap.from_dict(m, f"sources.{n}") for n, m in d["sources"].items()}, d["dtype"])


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Float32 tensors by name: a JSON header (names and shapes), then their bytes in order."""
    header = json.dumps({n: list(t.shape) for n, t in tensors.items()}).encode()
    body = b"".join(t.detach().to(torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for t in tensors.values())
    return len(header).to_bytes(8, "little") + header + body


def decode_tensors(data: bytes) -> dict[str, torch.Tensor]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    flat = torch.frombuffer(bytearray(data[8 + n:]), dtype=torch.float32) if len(data) > 8 + n else torch.empty(0)
    out, at = {}, 0
    for name, shape in header.items():
        k = 1
        for s in shape:
            k *= s
        out[name] = flat[at:at + k].reshape(shape)
        at += k
    if at != flat.numel():
        raise MapError(f"a marker message of {flat.numel()} elements; its header names {at}")
    return out


def encode_marker_reply(tensors: Mapping[str, torch.Tensor] | None, error: str | None = None) -> bytes:
    """A worker's reply to the setup: its marker state, or why its loader failed (so rank 0 need
    not wait out the timeout)."""
    return b"E" + (error or "").encode() if tensors is None else b"T" + encode_tensors(tensors)


def decode_marker_reply(data: bytes, worker: int) -> dict[str, torch.Tensor]:
    if data[:1] == b"E":
        raise MapError(f"vLLM worker {worker} could not load the markers: {data[1:].decode(errors='replace')}")
    return decode_tensors(data[1:])


def encode_cached_reply(maps: Mapping[str, Placed]) -> bytes:
    """A worker's reply to the setup when every worker holds cached maps (``cache.py``): the maps
    of every parameter on workers ``0..W-1``."""
    return b"C" + encode_targets(maps)


def decode_cached_reply(data: bytes, worker: int) -> dict[str, Placed]:
    if data[:1] != b"C":
        raise MapError(f"vLLM worker {worker} sent its marker state where every worker had agreed to send cached maps")
    return decode_targets(data[1:])


def encode_targets(targets: Mapping[str, Placed] | None, error: str | None = None) -> bytes:
    if error is not None:
        return json.dumps({"error": error}).encode()
    if targets is None:
        raise PlanError("encode_targets: neither targets nor an error")
    return json.dumps({n: {"map": p.map.to_dict(), "into": p.into,
                           "shapes": {str(r): list(s) for r, s in p.shapes.items()},
                           "offsets": {str(r): o for r, o in p.offsets.items()}}
                       for n, p in targets.items()}).encode()


def decode_targets(data: bytes) -> dict[str, Placed]:
    """Rank 0's targets; an error it broadcast instead is raised here, on every rank."""
    d = json.loads(data)
    if "error" in d and isinstance(d["error"], str):
        raise MapError(f"reshard weight transfer: learning the engine's maps failed on trainer rank 0: {d['error']}")
    return {n: Placed(ParamMap.from_dict(p["map"], f"targets.{n}"), p["into"],
                      {int(r): tuple(s) for r, s in p["shapes"].items()},
                      {int(r): int(o) for r, o in p["offsets"].items()})
            for n, p in d.items()}


@dataclass(frozen=True, slots=True)
class Link:
    """One peer's message: its segments in order (``(parameter, segment)``) and its element count."""

    peer: int
    segments: tuple[tuple[str, Segment], ...]
    numel: int


def link_program(plan: ModelPlan, me: int) -> tuple[dict[int, Link], dict[int, Link]]:
    """``(sends, receives)`` of rank ``me`` by peer, from its part of the plan: each link's segments
    sorted by (parameter, source view, target view), an order both ends compute alike."""
    out: tuple[dict[int, list], dict[int, list]] = ({}, {})
    for name in sorted(plan.params):
        for s in plan.params[name].segments:
            if s.is_local:
                raise PlanError(f"{name!r}: a segment from rank {s.src_rank} to itself; trainer and engine ranks "
                                "must differ")
            if s.src_rank == me:
                out[0].setdefault(s.dst_rank, []).append((name, s))
            elif s.dst_rank == me:
                out[1].setdefault(s.src_rank, []).append((name, s))

    def key(item: tuple[str, Segment]):
        n, s = item
        return (n, s.src.offset, s.src.strides, s.dst.offset, s.dst.strides, s.shape)

    return tuple({peer: Link(peer, tuple(sorted(segs, key=key)), sum(s.numel for _, s in segs))
                  for peer, segs in sorted(side.items())} for side in out)  # type: ignore[return-value]


def pack(link: Link, shards: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``link``'s message from this rank's source shards into flat ``out`` (the wire dtype); a lazy
    checkpoint source (``execute.lazy``) read a band at a time, one parameter open at once."""
    at = 0
    lazy = shards if isinstance(shards, LazyShards) else None
    for name, s in link.segments:
        n = s.numel
        if lazy is not None:
            lazy_copy(out, View(at, _row_major(s.shape)), lazy.open(name), s.src, s.shape)
        else:
            view_of(out, s.shape, View(at, _row_major(s.shape))).copy_(view_of(flatten(shards[name]), s.shape, s.src))
        at += n
    if lazy is not None:
        lazy.close()
    return out


def unpack(link: Link, msg: torch.Tensor, targets: Mapping[str, Placed], staging: Mapping[str, torch.Tensor],
           me: int) -> None:
    """``link``'s received message into this rank's staging engine tensors (flat, by engine name)."""
    at = 0
    for name, s in link.segments:
        t = targets[name]
        dst = View(s.dst.offset + t.offsets[me], s.dst.strides)
        view_of(staging[t.into], s.shape, dst).copy_(view_of(msg, s.shape, View(at, _row_major(s.shape))))
        at += s.numel


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))
