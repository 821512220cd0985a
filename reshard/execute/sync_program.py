"""One rank's share of a weight sync, compiled once: every copy, cast and message of every push,
with its staging place fixed (:class:`reshard.execute.sync.WeightSync` runs it every step).

Why a module of its own: the program is a pure function of the rank's per-rank plans, the
rounds, the wire dtype and the dtypes its source shards had at the first push (no torch.distributed),
so it can be compiled and run without processes (:func:`run_loopback`: every rank's program in one
process, a message being a copy from the sender's buffer into the receiver's; the tests check
layouts against it, ``benchmarks/bench_sync.py --gpu`` times the GPU side of a push with it).

What travels. Every message carries the *wire dtype* (the engine's, e.g. bf16): the sender
casts while it packs, so the wire carries the target's bytes, not the source's. A part is
``F[src] * factor`` computed in the source dtype, then cast: exactly ``(F * target scale)`` cast to
the wire dtype, the content the target map defines (docs/spec.md §6, rule 6; the scaled product
is formed in a scratch buffer of the source dtype, never in a temporary). So the receiver only
copies, and a part contiguous in the target tensor is received straight into it. A part is sent
straight from the source shard only when nothing changes on the way (same dtype, factor 1,
contiguous). Message boundaries come from :func:`reshard.execute.schedule.messages` with every
part unscaled at the receiver, so both ends cut alike from their own plans.

Targets are engine tensors: a parameter's target shard is a contiguous run at ``offset`` of its
engine tensor (:class:`reshard.layouts.inference.Placed`), so each destination view is shifted by
that offset when the program is compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from ..ir.apply import view_of
from ..ir.piece import View, prod, row_major_strides
from ..plan.values import TransferPlan
from .bands import Banded
from .lazy import LazyShards, lazy_copy
from .schedule import Link, Message, Part, messages, schedule, schedule_links

__all__ = ["Loopback", "Param", "Program", "RoundProgram", "compile_program", "run_loopback", "simulate"]

_ALIGN = 16  # staging slices start aligned for any element size


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter as this rank sees it: its per-rank plan; where its target shard lies on this
    rank (engine tensor ``into``, element ``offset``; ``None`` when it receives none); the dtype of
    its source shard here (``None`` when it holds none)."""

    name: str
    plan: TransferPlan
    into: str | None
    offset: int
    src_dtype: torch.dtype | None
    lazy: bool = False  # its source shard is read a band at a time when packed (execute.lazy): never sent as it is


@dataclass(frozen=True, slots=True)
class Copy:
    """``dst[dst_view] = cast(src[src_view] * factor)``. ``dst``/``src``: ``("t", engine tensor)``,
    ``("s", param index)`` or ``("w", byte offset in staging)``; ``scratch`` is where a scaled
    block is formed first (elements of the source dtype), or ``None``."""

    dst: tuple[str, object]
    dst_view: View
    src: tuple[str, object]
    src_view: View
    shape: tuple[int, ...]
    factor: float = 1.0
    scratch: int | None = None
    src_dtype: torch.dtype | None = None


@dataclass(frozen=True, slots=True)
class Op:
    """One send or receive: ``nbytes`` at ``where`` (``("t", tensor, byte offset)`` into an engine
    tensor, ``("s", param, byte offset)`` from a source shard, ``("w", byte offset)`` in staging);
    ``copies`` run before a send (packing) or after a receive (unpacking)."""

    peer: int
    nbytes: int
    where: tuple
    copies: tuple[Copy, ...] = ()


@dataclass(slots=True)
class RoundProgram:
    recvs: list[Op] = field(default_factory=list)
    sends: list[Op] = field(default_factory=list)  # sends from a source first, then packed ones


@dataclass(slots=True)
class Program:
    """Everything one rank does in a push. ``staging_bytes``: the largest round's staging (wire
    bytes) plus the scratch for scaled blocks, which starts at ``scratch_at``."""

    rounds: list[RoundProgram]
    local: list[Copy]
    zero: list[tuple[str, View, tuple[int, ...]]]
    staging_bytes: int
    scratch_at: int
    sent_bytes: int = 0
    received_bytes: int = 0
    local_bytes: int = 0
    packed_bytes: int = 0
    unpacked_bytes: int = 0


def _shift(v: View, by: int) -> View:
    return View.trusted(v.offset + by, v.strides)


def _needs_copy(p: Param, part: Part, wire: torch.dtype) -> bool:
    return p.lazy or p.src_dtype != wire or part.factor != 1.0


def _send(m: Message, peer: int, params: Sequence[Param], wire: torch.dtype, esize: int, at: int,
          scratch: list[int]) -> tuple[Op, int]:
    """The op of one send; packed messages take ``m.nbytes`` of staging at ``at``."""
    part = m.parts[0]
    if m.from_source and not _needs_copy(params[part.param], part, wire):
        return Op(peer, m.nbytes, ("s", part.param, part.src.offset * esize)), at
    copies, cursor = [], at
    for q in m.parts:
        p = params[q.param]
        sc = None
        if q.factor != 1.0:
            sc = 0
            scratch[0] = max(scratch[0], prod(q.shape) * torch.empty((), dtype=p.src_dtype).element_size())
        copies.append(Copy(("w", cursor), View.trusted(0, row_major_strides(q.shape)), ("s", q.param), q.src,
                           q.shape, q.factor, sc, p.src_dtype))
        cursor += prod(q.shape) * esize
    return Op(peer, m.nbytes, ("w", at), tuple(copies)), at + _aligned(m.nbytes)


def _recv(m: Message, peer: int, params: Sequence[Param], esize: int, at: int) -> tuple[Op, int]:
    part = m.parts[0]
    p = params[part.param]
    if m.into_target:
        return Op(peer, m.nbytes, ("t", p.into, (part.dst.offset + p.offset) * esize)), at
    copies, cursor = [], at
    for q in m.parts:
        pq = params[q.param]
        copies.append(Copy(("t", pq.into), _shift(q.dst, pq.offset), ("w", cursor),
                           View.trusted(0, row_major_strides(q.shape)), q.shape))
        cursor += prod(q.shape) * esize
    return Op(peer, m.nbytes, ("w", at), tuple(copies)), at + _aligned(m.nbytes)


def _content(m: Message) -> tuple:
    """What a packed send carries (scaled by the sender): equal keys, equal bytes."""
    return tuple((q.param, q.shape, q.src, q.factor) for q in m.parts)


def peers_of(plans: Sequence[TransferPlan], me: int) -> set[int]:
    """The ranks ``me`` sends to or receives from."""
    out = set()
    for p in plans:
        for s in p.segments:
            if not s.is_local:
                out.add(s.dst_rank if s.src_rank == me else s.src_rank)
    return out


def rounds_for(plans: Sequence[TransferPlan], me: int, esize: int, limit: int | None,
               degree: Callable[[int], int]) -> tuple[list, list[Link]]:
    """Rank ``me``'s rounds over its per-rank ``plans`` (one round without ``limit``), and the
    links whose budget cannot hold one element. ``degree(q)`` is rank ``q``'s number of peers: a
    link's budget per round is ``limit`` over the larger of its two ends' (so no rank moves more
    than ``limit`` bytes in a round), and both ends compute it alike."""
    pairs = [(p, esize) for p in plans]
    if limit is None:
        return schedule(pairs, None), []
    mine = len(peers_of(plans, me))
    budgets = {}
    for p in plans:
        for s in p.segments:
            if not s.is_local:
                peer = s.dst_rank if s.src_rank == me else s.src_rank
                budgets[(s.src_rank, s.dst_rank)] = limit // max(mine, degree(peer), 1)
    small = sorted(link for link, b in budgets.items() if b < esize)
    return ([] if small else schedule_links(pairs, budgets)), small


def _sources_first(sends: list[Op]) -> list[Op]:
    """Each link's leading sends straight from a source shard (nothing to pack, nothing to wait
    for) are posted before any packing starts; a link's own order, which its receiver matches
    message by message, is kept."""
    links: dict[int, list[Op]] = {}
    for op in sends:
        links.setdefault(op.peer, []).append(op)
    first, rest = [], []
    for ops in links.values():
        k = next((i for i, op in enumerate(ops) if op.where[0] != "s"), len(ops))
        first += ops[:k]
        rest += ops[k:]
    return first + rest


def compile_program(params: Sequence[Param], rounds: Sequence[Mapping[Link, list]], me: int, wire: torch.dtype
                    ) -> Program:
    """The program of rank ``me`` for ``params`` (indexed as the rounds' items are) and ``rounds``
    (:func:`reshard.execute.schedule.schedule_links` or ``schedule`` over this rank's plans, with
    the wire element size for every parameter)."""
    esize = torch.empty((), dtype=wire).element_size()
    esizes = [esize] * len(params)
    scratch = [0]
    prog = Program([], [], [], 0, 0)
    peak = 0
    for rnd in rounds:
        rp, at, packed = RoundProgram(), 0, {}
        for (src, dst), msgs in sorted(messages(dict(rnd), esizes, 0).items()):
            for m in msgs:
                if dst == me:
                    op, at = _recv(m, src, params, esize, at)
                    rp.recvs.append(op)
                    prog.received_bytes += m.nbytes
                    prog.unpacked_bytes += m.nbytes if op.copies else 0
                elif src == me:
                    key = _content(m)
                    if key in packed:  # the same bytes to another replica: packed once
                        op = replace(packed[key], peer=dst, copies=())
                    else:
                        op, at = _send(m, dst, params, wire, esize, at, scratch)
                        if op.copies:
                            packed[key] = op
                            prog.packed_bytes += m.nbytes
                    rp.sends.append(op)
                    prog.sent_bytes += m.nbytes
        rp.sends = _sources_first(rp.sends)
        peak = max(peak, at)
        prog.rounds.append(rp)
    for k, p in enumerate(params):
        for s in p.plan.segments:
            if s.src_rank == s.dst_rank == me:
                if s.factor != 1.0:
                    scratch[0] = max(scratch[0], s.numel * torch.empty((), dtype=p.src_dtype).element_size())
                prog.local.append(Copy(("t", p.into), _shift(s.dst, p.offset), ("s", k), s.src, s.shape, s.factor,
                                       0 if s.factor != 1.0 else None, p.src_dtype))
                prog.local_bytes += s.numel * esize
        for u in p.plan.unfilled:
            if u.dst_rank == me:
                prog.zero.append((p.into, _shift(u.dst, p.offset), u.shape))
    prog.scratch_at = _aligned(peak)
    prog.staging_bytes = prog.scratch_at + _aligned(scratch[0])
    return prog


# -- running a program ------------------------------------------------------------------------------


@dataclass(slots=True)
class Bound:
    """A program's tensors for one push: flat source shards by parameter index, flat engine tensors
    by name (the wire dtype), the staging bytes."""

    sources: Mapping[int, torch.Tensor]
    targets: Mapping[str, torch.Tensor]
    staging: torch.Tensor | None
    scratch_at: int = 0
    lazy: Mapping[int, Callable[[], Banded]] | None = None  # sources read a band at a time (Param.lazy)

    def flat(self, ref: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
        kind, key = ref
        if kind == "t":
            return self.targets[key]
        if kind == "s":
            return self.sources[key]
        return self.staging[key:].view(dtype)  # type: ignore[index]

    def buffer(self, op: Op) -> torch.Tensor:
        kind = op.where[0]
        if kind == "w":
            return self.staging.narrow(0, op.where[1], op.nbytes)  # type: ignore[union-attr]
        flat = self.targets[op.where[1]] if kind == "t" else self.sources[op.where[1]]
        return flat.view(torch.uint8).narrow(0, op.where[2], op.nbytes)


def run_copy(c: Copy, b: Bound, wire: torch.dtype) -> None:
    if b.lazy is not None and c.src[0] == "s" and c.src[1] in b.lazy:
        _lazy_run(c, b, wire)
        return
    dst = b.flat(c.dst, wire)
    src = b.flat(c.src, wire if c.src[0] == "w" else None)
    block = view_of(src, c.shape, c.src_view)
    if c.scratch is not None:  # scale in the source dtype, exactly as the in-memory executor does
        tmp = b.staging[b.scratch_at:b.scratch_at + prod(c.shape) * block.element_size()].view(block.dtype)  # type: ignore[index]
        tmp = tmp.view(c.shape)
        inv = round(1.0 / c.factor)
        if inv != 0 and 1.0 / inv == c.factor:
            torch.div(block, inv, out=tmp)
        else:
            torch.mul(block, c.factor, out=tmp)
        block = tmp
    view_of(dst, c.shape, c.dst_view).copy_(block)


def _lazy_run(c: Copy, b: Bound, wire: torch.dtype) -> None:
    """:func:`run_copy` from a source read a band at a time: each part reads at most a band, scaled
    (by the same operation, element for element) before it is cast into place."""
    fn = None
    if c.factor != 1.0:
        inv = round(1.0 / c.factor)
        fn = (lambda x: torch.div(x, inv)) if inv != 0 and 1.0 / inv == c.factor else (lambda x: torch.mul(x, c.factor))
    lazy_copy(b.flat(c.dst, wire), c.dst_view, b.lazy[c.src[1]](), c.src_view, c.shape, fn)  # type: ignore[index]


def post_round(rp: RoundProgram, b: Bound, wire: torch.dtype, recv: Callable, send: Callable) -> list[tuple[int, Op]]:
    """Post a round's receives, then its sends (packing each just before it is posted); return the
    staged receives (their index among the posted operations) to unpack once they land."""
    inbox = []
    for i, op in enumerate(rp.recvs):
        recv(b.buffer(op), op.peer)
        if op.copies:
            inbox.append((i, op))
    for op in rp.sends:
        for c in op.copies:
            run_copy(c, b, wire)
        send(b.buffer(op), op.peer)
    return inbox


def run_loopback(programs: Mapping[int, Program], bound: Mapping[int, Bound], wire: torch.dtype) -> None:
    """Every rank's program in this process: each message is a copy from the sender's buffer into
    the receiver's, link by link in posting order (what a FIFO wire delivers)."""
    for r, prog in programs.items():
        for dst, view, shape in prog.zero:
            view_of(bound[r].targets[dst], shape, view).zero_()
        for c in prog.local:
            run_copy(c, bound[r], wire)
    n_rounds = max((len(p.rounds) for p in programs.values()), default=0)
    for i in range(n_rounds):
        posted_recv: dict[Link, list[torch.Tensor]] = {}
        posted_send: dict[Link, list[torch.Tensor]] = {}
        inboxes = {}
        for r, prog in programs.items():
            if i >= len(prog.rounds):
                continue

            def recv(buf, peer, r=r):
                posted_recv.setdefault((peer, r), []).append(buf)

            def send(buf, peer, r=r):
                posted_send.setdefault((r, peer), []).append(buf)

            inboxes[r] = post_round(prog.rounds[i], bound[r], wire, recv, send)
        for link, bufs in posted_send.items():
            for out, buf in zip(posted_recv.get(link, []), bufs, strict=True):
                out.copy_(buf)
        for r, inbox in inboxes.items():
            for _, op in inbox:
                for c in op.copies:
                    run_copy(c, bound[r], wire)


class Loopback:
    """A whole push of a job, every rank in this process (:func:`run_loopback`): each rank plans
    its own share (``plan_for_rank``), cuts its rounds and compiles its program exactly as
    ``WeightSync`` does, from ``source_maps`` and ``targets`` (name -> ``Placed``, plan ranks), and
    each :meth:`run` fills ``into[rank]`` (engine tensors by name) from ``sources[rank]`` (shards
    by name). ``programs`` hold each rank's byte counts; staging is allocated once, here."""

    def __init__(self, source_maps: Mapping, targets: Mapping, wire: torch.dtype,
                 sources: Mapping[int, Mapping[str, torch.Tensor]], into: Mapping[int, Mapping[str, torch.Tensor]],
                 limit: int | None = None) -> None:
        from ..plan.planner import plan_for_rank

        tgt = {n: t.map for n, t in targets.items()}
        esize = torch.empty((), dtype=wire).element_size()
        ranks = sorted({r for m in source_maps.values() for r in m.ranks} | {r for m in tgt.values() for r in m.ranks})
        plans = {r: plan_for_rank(source_maps, tgt, r) for r in ranks}
        names = {r: sorted(plans[r].params) for r in ranks}
        degree = {r: len(peers_of([plans[r].params[n] for n in names[r]], r)) for r in ranks}
        device = next((t.device for d in sources.values() if not isinstance(d, LazyShards) for t in d.values()),
                      torch.device("cpu"))  # a lazy source is read on the CPU, and only when packed
        self.wire, self.programs, self.bound = wire, {}, {}
        self.lazy = [m for m in sources.values() if isinstance(m, LazyShards)]
        for r in ranks:
            rounds, small = rounds_for([plans[r].params[n] for n in names[r]], r, esize, limit, degree.__getitem__)
            if small:
                raise ValueError(f"max_inflight_bytes={limit} cannot hold one element on links {small}")
            mine = sources.get(r, {})
            lazy = isinstance(mine, LazyShards)  # read a band at a time when packed, as WeightSync reads it
            params = [Param(n, plans[r].params[n], targets[n].into if r in targets[n].offsets else None,
                            targets[n].offsets.get(r, 0), _dtype_of(mine, n), lazy and n in mine)
                      for n in names[r]]
            self.programs[r] = prog = compile_program(params, rounds, r, wire)
            staging = torch.empty(prog.staging_bytes, dtype=torch.uint8, device=device)
            index = {n: k for k, n in enumerate(names[r])}
            flat = {n: t.view(-1) for n, t in into.get(r, {}).items()}
            if lazy:
                opens = {index[n]: partial(mine.open, n) for n in names[r] if n in mine}  # type: ignore[attr-defined]
                self.bound[r] = Bound({}, flat, staging, prog.scratch_at, opens)
            else:
                self.bound[r] = Bound({index[n]: t.reshape(-1) for n, t in mine.items()}, flat, staging, prog.scratch_at)

    def run(self) -> None:
        try:
            run_loopback(self.programs, self.bound, self.wire)
        finally:
            for m in self.lazy:  # as WeightSync's push: nothing of a lazy source held after it
                m.close()


def _dtype_of(mine: Mapping, n: str) -> torch.dtype | None:
    if n not in mine:
        return None
    return mine.dtype(n) if isinstance(mine, LazyShards) else mine[n].dtype


def simulate(source_maps: Mapping, targets: Mapping, wire: torch.dtype, sources: Mapping[int, Mapping[str, torch.Tensor]],
             into: Mapping[int, Mapping[str, torch.Tensor]], limit: int | None = None) -> dict[int, Program]:
    """One push of :class:`Loopback`; returns the programs."""
    job = Loopback(source_maps, targets, wire, sources, into, limit)
    job.run()
    return job.programs
