"""Distributed executor: run a transfer plan inside a live ``torch.distributed`` job.

Every rank holds its source shards and computes the same plan locally (plans are
deterministic), or only its own part of it (``plan_for_rank``: what it sends and receives, so
that no rank of a large job plans the whole world). :func:`transfer` moves exactly the bytes
the plan marks remote, and copies local segments in place; nothing else crosses the wire.

Rank convention
---------------
Plan ranks are ranks *of the group*: with ``group=None`` they are global ranks of the default
group; with a group, plan rank ``p`` is the process whose ``dist.get_rank(group) == p`` (its
global rank is ``dist.get_global_rank(group, p)``). Every rank of the group must call
:func:`transfer` with the same plan and options, including ranks that hold neither a source nor
a target shard (they take part in the check below and then return at once).

Wire protocol
-------------
1. **Check** (collective over the group, small ``int64`` tensors on the transfer device):

   a. ``all_gather`` of ``[problems, fingerprint, n_params, dtype]`` per rank. ``problems`` is 1
      when the rank's own shards (or ``out`` tensors) disagree with the plan (a missing or
      unexpected shard, a shape the plan does not give, a tensor on the wrong device, an
      unknown parameter name); ``fingerprint`` is a 63-bit digest of the plan and of the
      options that shape the exchange (``max_inflight_bytes``, ``scale_power``); ``dtype`` is
      the code of the one dtype of every tensor the rank holds (-1: none, -2: several).
      Differing fingerprints raise :class:`reshard.PlanError` on every rank.
   b. Unless no rank has a problem and every rank holds one and the same dtype (then every
      parameter has it): ``all_gather`` of one dtype code per parameter (sorted name order;
      the source shard's, else the ``out`` tensor's, else ``-1``). Receive-only ranks learn
      each parameter's dtype here; tensors that disagree, or a scaled segment of an integer
      dtype, are an error.
   c. Only when something is wrong: ``all_gather_object`` of every rank's problem lines, so that
      every rank raises the same :class:`reshard.ShardError` naming each offending rank and
      parameter. No rank sends data before every rank has passed the check, so a bad shard on
      one rank can never leave the others waiting in a receive.

   With per-rank plans (``ModelPlan.ranks`` set) no rank holds the whole plan to fingerprint, so
   each link is checked by its two ends (:func:`reshard.execute.live_check.check_per_rank`): an
   ``all_to_all`` of one digest per peer and direction (and each rank's number of peers), an
   ``all_reduce`` of problem flags, then an ``all_to_all`` of the dtype of every parameter on
   each link. Rounds are then cut link by link (:func:`reshard.execute.schedule.schedule_links`): a
   link's budget per round is ``max_inflight_bytes`` over the larger of its ends' peer counts.

2. **Schedule** (:mod:`reshard.execute.schedule`: identical on every rank, no communication). The
   remote segments, in sorted parameter-name order, go into rounds; with ``max_inflight_bytes``
   they are split at element boundaries so that in every round each rank sends plus receives
   at most that many bytes. Each pair's share of a round is cut into messages
   (:func:`reshard.execute.schedule.messages`): a run of at least ``MIN_DIRECT_BYTES`` contiguous in
   both shards travels alone, sent from the source shard and received into the target shard;
   a box that large contiguous on one side only travels alone, staged on the other side; the
   rest forms one packed ``uint8`` message, its parts ordered by element size (largest first,
   so every part is aligned without padding), then by schedule order. A part is the source
   elements in row-major order, unscaled; the receiver applies ``factor ** scale_power`` while
   unpacking (a scaled part is never received into the target). Rounds and messages are
   cached by fingerprint and dtypes, so repeated calls skip this step.

3. **Rounds.** Both ends post a pair's messages in the same order (one tag: gloo and NCCL
   match them first in, first out). On CPU (gloo, where every operation runs on its own) the
   receives are posted first, then the sends straight from source shards, then each packed
   send as soon as it is packed, each straight to the process group. On NCCL (CUDA tensors) a
   rank's receives and sends of the round form one ``batch_isend_irecv``: NCCL runs batches in
   order on one stream, so a send held back in a second batch could wait forever behind a
   receive whose sender is doing the same. Local segments are copied while the first round is
   in flight; each staged receive is unpacked as soon as it lands; sends that carry the same
   parts (one block to every replica of a target shard) are packed once.

Staging: one allocation per round, cut into the round's staged messages at 16-byte boundaries
(the alignment never travels), at most ``max_inflight_bytes`` per round when that is given, and
kept between calls by a :class:`Workspace`. Large host buffers (staging and target shards) are
asked for transparent huge pages before first touch (``reshard.execute.memory.empty``).

The target shards are the caller's ``out`` tensors, or allocated on the transfer device with
the agreed dtype; target padding (``plan.unfilled``) is zero. Results are bit-exact: every
copy, local or staged, is :func:`reshard.ir.apply.strided_copy`, the operation the in-memory
executor uses, and a message received into a target carries exactly the bytes the copy would
write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..ir.apply import flatten, strided_copy, view_of
from ..ir.piece import View, prod, row_major_strides
from ..plan.values import ModelPlan, TransferPlan
from .live_check import SINGLE, Param, check, check_per_rank
from .memory import Arena, Workspace, empty
from .schedule import Link, Message, Part, messages, schedule, schedule_links

__all__ = ["Workspace", "transfer"]

def _as_named(plan, local_shards, out) -> tuple[list[tuple[str, TransferPlan]], object, object, bool]:
    """(sorted (name, plan) pairs, local shards by name, ``out`` tensors by name, whether a lone
    TransferPlan was given). Arguments that are not mappings are returned as they are, for the
    check to report."""
    if isinstance(plan, TransferPlan):
        return [(SINGLE, plan)], *({} if t is None else {SINGLE: t} for t in (local_shards, out)), True
    if not isinstance(plan, ModelPlan):
        raise PlanError(f"transfer needs a TransferPlan or a ModelPlan, got {type(plan).__name__}")

    def by_name(arg):
        if arg is None or isinstance(arg, Mapping):
            return {k: v for k, v in (arg or {}).items() if v is not None}
        return arg

    return sorted(plan.params.items()), by_name(local_shards), by_name(out), False


def _transfer_device(group, device) -> torch.device:
    """Not inferred from the shards: a rank holding none must pick the same kind of device."""
    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- execution ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Stats:  # field names are the keys of transfer's ``stats``
    sent_bytes: int = 0
    received_bytes: int = 0
    local_bytes: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    peak_staged_bytes: int = 0
    packed_bytes: int = 0
    unpacked_bytes: int = 0


def _bytes(flat: torch.Tensor, part: Part, side: str) -> torch.Tensor:
    """The bytes of a part contiguous on ``side`` (``"src"`` or ``"dst"``) of its flat shard."""
    return flat.narrow(0, getattr(part, side).offset, prod(part.shape)).view(torch.uint8)


def _packed(buf: torch.Tensor, msg: Message, params: list[Param]):
    """(part, row-major view of it in the staged message, the part's slice of ``buf`` in its dtype),
    in wire order."""
    at = 0
    for part in msg.parts:
        prm = params[part.param]
        nb = prod(part.shape) * prm.esize
        yield part, View.trusted(0, row_major_strides(part.shape)), buf[at:at + nb].view(prm.dtype)
        at += nb


def _pack(buf: torch.Tensor, msg: Message, params: list[Param], flats: Mapping[int, torch.Tensor]) -> None:
    for part, packed, into in _packed(buf, msg, params):
        strided_copy(into, packed, flats[part.param], part.src, part.shape)


def _unpack(buf: torch.Tensor, msg: Message, params: list[Param], outs: Mapping[int, torch.Tensor],
            scale_power: int) -> None:
    for part, packed, frm in _packed(buf, msg, params):
        strided_copy(outs[part.param], part.dst, frm, packed, part.shape, part.factor ** scale_power)


def _targets(params: list[Param], me: int, device, given: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Flat target shards of this rank (the caller's ``out`` tensors where given); padding zeroed,
    the rest left for the segments."""
    outs = {}
    for k, prm in enumerate(params):
        shape = prm.plan.target_shards.get(me)
        if shape is None:
            continue
        numel = prod(shape)
        written = sum(s.numel for s in prm.plan.segments if s.dst_rank == me)
        pads = [u for u in prm.plan.unfilled if u.dst_rank == me]
        tiled = written + sum(prod(u.shape) for u in pads) == numel
        flat = given[prm.name].reshape(-1) if prm.name in given else None  # contiguous: a view
        if flat is None:
            flat = empty(numel, prm.dtype, device) if tiled else torch.zeros(numel, dtype=prm.dtype, device=device)
        elif not tiled:  # the plan does not write every element (a non-tiling map): zero the rest
            flat.zero_()
        for u in pads:
            view_of(flat, u.shape, u.dst).zero_()
        outs[k] = flat
    return outs


def _copy_local(params: list[Param], me: int, flats, outs, scale_power: int, stats: _Stats) -> None:
    for k, prm in enumerate(params):
        for s in prm.plan.segments:
            if s.src_rank == me and s.dst_rank == me:
                strided_copy(outs[k], s.dst, flats[k], s.src, s.shape, s.factor ** scale_power)
                stats.local_bytes += s.numel * prm.esize


def _content(msg: Message) -> tuple:
    """What a packed send carries: messages with equal keys hold the same bytes."""
    return tuple((p.param, p.shape, p.src) for p in msg.parts)


_ROUNDS: dict[tuple, list[list[tuple[Link, list[Message]]]]] = {}  # recent calls' rounds, oldest first
_ROUNDS_KEPT = 4


def _wire_rounds(params: list[Param], limit: int | None, scale_power: int, fp: int,
                 budgets: dict[Link, int] | None = None) -> list[list[tuple[Link, list[Message]]]]:
    """Each round's links and their messages, in link order. A pure function of the plans, the
    options (both in the fingerprint), the dtypes and (per-rank plans) the links' budgets, so
    repeated calls (every optimizer state, every step) reuse it instead of cutting thousands of
    segments again."""
    key = (fp, tuple(p.dtype for p in params), None if budgets is None else tuple(sorted(budgets.items())))
    rounds = _ROUNDS.pop(key, None)
    if rounds is None:
        esizes = [p.esize for p in params]
        pairs = [(p.plan, p.esize) for p in params]
        cut = schedule(pairs, limit) if budgets is None else schedule_links(pairs, budgets)
        rounds = [sorted(messages(rnd, esizes, scale_power).items()) for rnd in cut]
    _ROUNDS[key] = rounds
    while len(_ROUNDS) > _ROUNDS_KEPT:  # oldest out; tolerant of another thread doing the same
        _ROUNDS.pop(next(iter(_ROUNDS), None), None)
    return rounds


class _Wire:
    """Posts a round's operations. CPU backends (gloo) run every operation on its own: each is
    posted straight to the process group as soon as its buffer is ready (the wire is busy while
    later messages are packed; no per-operation wrappers). Coalescing backends (NCCL) need a
    rank's receives and sends in one batch: split batches can deadlock on the stream."""

    def __init__(self, group, peer_of, device: torch.device) -> None:
        self.group, self.peer_of, self.batched = group, peer_of, device.type != "cpu"
        self.pg = group if group is not None else dist.group.WORLD
        self.ops: list = []
        self.works: list = []
        self.posted = 0

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self._post(dist.irecv, buf, peer)

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._post(dist.isend, buf, peer)

    def _post(self, op, buf: torch.Tensor, peer: int) -> None:
        self.posted += 1
        if self.batched:
            self.ops.append(dist.P2POp(op, buf, self.peer_of(peer), self.group))
        elif op is dist.isend:
            self.works.append(self.pg.send([buf], peer, 0))
        else:
            self.works.append(self.pg.recv([buf], peer, 0))

    def flush(self) -> list:
        if self.ops:
            self.works += dist.batch_isend_irecv(self.ops)
            self.ops = []
        return self.works


def _run_round(links: list[tuple[Link, list[Message]]], params, me: int, peer_of, group, device, flats, outs,
               scale_power: int, stats: _Stats, workspace: Workspace, before_wait) -> None:
    recvs = [(src, m) for (src, dst), ms in links if dst == me for m in ms]
    # sends from the source shard first (nothing to wait for), then those that need packing
    sends = sorted(((dst, m) for (src, dst), ms in links if src == me for m in ms), key=lambda x: not x[1].from_source)
    to_pack = {_content(m): m.nbytes for _, m in sends if not m.from_source}  # replicas: packed once
    staged = [m.nbytes for _, m in recvs if not m.into_target] + list(to_pack.values())
    arena = Arena(staged, device, workspace)
    stats.peak_staged_bytes = max(stats.peak_staged_bytes, sum(staged))
    wire, inbox = _Wire(group, peer_of, device), []
    for peer, m in recvs:
        if m.into_target:
            buf = _bytes(outs[m.parts[0].param], m.parts[0], "dst")
        else:
            buf = arena.take(m.nbytes)
            inbox.append((wire.posted, m, buf))
        wire.recv(buf, peer)
        stats.received_bytes += m.nbytes
        stats.messages_received += 1
    packed: dict[tuple, torch.Tensor] = {}
    for peer, m in sends:
        if m.from_source:
            buf = _bytes(flats[m.parts[0].param], m.parts[0], "src")
        else:
            key = _content(m)
            buf = packed.get(key)
            if buf is None:
                buf = packed[key] = arena.take(m.nbytes)
                _pack(buf, m, params, flats)
                stats.packed_bytes += m.nbytes
        wire.send(buf, peer)
        stats.sent_bytes += m.nbytes
        stats.messages_sent += 1
    works = wire.flush()
    before_wait()
    _finish(works, wire.posted, inbox, params, outs, scale_power, stats)


def _finish(works, n_ops: int, inbox, params, outs, scale_power: int, stats: _Stats) -> None:
    """Wait for the round; unpack each staged receive as soon as it lands."""
    if len(works) == n_ops:  # one request per operation
        for i, m, buf in inbox:
            works[i].wait()
            _unpack(buf, m, params, outs, scale_power)
            stats.unpacked_bytes += m.nbytes
        done = {i for i, _, _ in inbox}
        for i, w in enumerate(works):
            if i not in done:  # gloo: a second wait on a finished receive waits for another message
                w.wait()
        return
    for w in works:  # coalesced (NCCL): one request for the whole batch
        w.wait()
    for _, m, buf in inbox:
        _unpack(buf, m, params, outs, scale_power)
        stats.unpacked_bytes += m.nbytes


# -- public -------------------------------------------------------------------------------------


def transfer(
    plan: TransferPlan | ModelPlan,
    local_shards,
    group=None,
    *,
    max_inflight_bytes: int | None = None,
    scale_power: int = 1,
    device: torch.device | str | None = None,
    workspace: Workspace | None = None,
    out=None,
    stats: dict | None = None,
):
    """Run ``plan`` across the ranks of ``group`` (see the module docstring for the protocol).

    ``plan`` is a :class:`TransferPlan` or a :class:`ModelPlan`, the same on every rank, or on
    each rank ``plan_for_rank(..., rank)`` of its own rank (checked link by link). For a ``TransferPlan``,
    ``local_shards`` is this rank's source shard (``None`` where it holds none) and the result
    is this rank's target shard (``None`` where it holds none). For a ``ModelPlan`` both are
    dicts by parameter name; the result holds exactly the parameters this rank is a target of,
    and every parameter moves in the same rounds.

    ``max_inflight_bytes`` bounds the bytes each rank sends plus receives per round (its staging
    memory); ``scale_power`` is as in ``ParamMap.extract`` (1 for parameters, -1 and -2 for
    Adam's moments). ``device`` is where target shards live and the transfer runs (default: the
    current CUDA device under NCCL, else CPU); source shards must be there already.
    ``workspace`` (a :class:`Workspace`) keeps staging memory between calls. ``out`` gives target
    shards to write into instead of allocating them (a tensor for a ``TransferPlan``, a dict by
    name, possibly partial, for a ``ModelPlan``): contiguous, of the plan's shape, on ``device``,
    of the source's dtype; they are returned, filled, padding zeroed. When ``stats`` is a dict it
    is filled with this rank's ``sent_bytes``, ``received_bytes``, ``local_bytes``,
    ``messages_sent``, ``messages_received``, ``rounds``, ``peak_staged_bytes``,
    ``packed_bytes`` (bytes copied into staging to be sent) and ``unpacked_bytes`` (bytes copied
    out of staging into target shards).

    Raises :class:`reshard.ShardError` on every rank when any rank's shards or ``out`` tensors
    disagree with the plan (shape, presence, dtype, device, not a dict for a ``ModelPlan``), and
    :class:`reshard.PlanError` on every rank when ranks hold different plans or options, when the
    plan names ranks outside the group, or when ``max_inflight_bytes`` cannot hold one element;
    all before any data moves. A ``plan`` of the wrong type, or a call from a process outside
    ``group``, raises :class:`reshard.PlanError` on that process alone.
    """
    named, local, given, single = _as_named(plan, local_shards, out)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    if me < 0:
        raise PlanError("transfer: this process is not a member of the group")
    dev = _transfer_device(group, device)
    per_rank = None if single else plan.ranks
    if per_rank is None:
        params, fp = check(named, local, given, me, world, group, dev, max_inflight_bytes, scale_power)
        budgets = None
    else:
        params, fp, budgets = check_per_rank(named, local, given, me, world, group, dev, max_inflight_bytes,
                                             scale_power, per_rank)
    # plans and options agree by now, so a bad max_inflight_bytes raises alike on every rank
    rounds = _wire_rounds(params, max_inflight_bytes, scale_power, fp, budgets)
    flats = {k: flatten(local[prm.name]) for k, prm in enumerate(params) if prm.name in local}
    outs = _targets(params, me, dev, given)
    peer_of = (lambda p: p) if group is None else (lambda p: dist.get_global_rank(group, p))
    st = _Stats()
    copy_local = lambda: _copy_local(params, me, flats, outs, scale_power, st)  # overlapped with round 0
    # Without a caller's workspace, rounds still share one staging buffer within the call.
    ws = workspace if workspace is not None else Workspace()
    for i, links in enumerate(rounds):
        _run_round(links, params, me, peer_of, group, dev, flats, outs, scale_power, st, ws,
                   copy_local if i == 0 else lambda: None)
    if not rounds:
        copy_local()
    if stats is not None:
        stats.update(asdict(st), rounds=len(rounds))
    result = {prm.name: given.get(prm.name) if prm.name in given else outs[k].view(prm.plan.target_shards[me])
              for k, prm in enumerate(params) if k in outs}
    if single:
        return result.get(SINGLE)
    return result
