"""Distributed executor: run a transfer plan inside a live ``torch.distributed`` job.

Every rank holds its source shards and computes the same plan locally (plans are
deterministic). :func:`transfer` moves exactly the bytes the plan marks remote, and copies
local segments in place; nothing else crosses the wire.

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

   a. ``all_gather`` of ``[problems, fingerprint, n_params]`` per rank. ``problems`` is 1 when
      the rank's own shards disagree with the plan (a missing or unexpected shard, a shape the
      plan does not give, a tensor on the wrong device, an unknown parameter name);
      ``fingerprint`` is a 63-bit digest of the plan and of the options that shape the
      exchange (``max_inflight_bytes``, ``scale_power``). Differing fingerprints raise
      :class:`reshard.PlanError` on every rank.
   b. ``all_gather`` of one dtype code per parameter (parameters in sorted name order; ``-1``
      where the rank holds no source shard). Receive-only ranks learn each parameter's dtype
      here; holders that disagree, or a scaled segment of an integer dtype, are an error.
   c. Only when something is wrong: ``all_gather_object`` of every rank's problem lines, so that
      every rank raises the same :class:`reshard.ShardError` naming each offending rank and
      parameter. No rank sends data before every rank has passed the check, so a bad shard on
      one rank can never leave the others waiting in a receive.

2. **Schedule** (:func:`reshard.schedule.schedule`: identical on every rank, no
   communication). The remote segments, in sorted parameter-name order, go into rounds; with
   ``max_inflight_bytes`` they are split at element boundaries so that in every round each
   rank sends plus receives at most that many bytes.

3. **Rounds.** In each round, each ordered pair of ranks with traffic exchanges exactly one
   message: a contiguous ``uint8`` buffer holding that round's segment parts for the pair,
   ordered by element size (largest first, so every part is aligned for its dtype without
   padding), then by schedule order. Each part is the source elements in the segment's
   row-major order, unscaled; the receiver applies ``factor ** scale_power`` while unpacking.
   Operations go through ``batch_isend_irecv``, receives first, peers in rank order. On NCCL
   (CUDA tensors) a rank's receives and sends of the round form one batch: NCCL runs batches
   in order on one stream, so a send held back in a second batch could wait forever behind a
   receive whose sender is doing the same. On CPU (gloo, where every operation runs on its
   own) the receives are posted first and each send is posted as soon as it is packed, so the
   wire is busy while later messages are packed. Local segments are copied while the first
   round is in flight; each staged receive is unpacked as soon as it lands. A message that is a
   single contiguous part is sent from (or, unscaled, received into) the shard itself, with no
   staging copy, and sends that carry the same parts (one block to every replica of a target
   shard) are packed once; the bytes on the wire are the same.

Staging: one allocation per round, cut into the round's messages at 16-byte boundaries (the
alignment never travels), at most ``max_inflight_bytes`` per round when that is given, and kept
between calls by a :class:`Workspace`. Large host buffers (staging and target shards) are asked
for transparent huge pages before first touch (``reshard.memory.empty``), which cuts the cost of
first-touch page faults about threefold where a call gets fresh memory.

The target shards are allocated on the transfer device with the agreed dtype; target padding
(``plan.unfilled``) is zero. Results are bit-exact: every copy, local or staged, is
:func:`reshard.ir.apply.strided_copy`, the operation the in-memory executor uses.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .errors import PlanError, ShardError
from .ir.apply import flatten, strided_copy, view_of
from .ir.piece import View, prod, row_major_strides
from .memory import empty
from .plan import ModelPlan, TransferPlan
from .schedule import Item, Round, schedule

__all__ = ["Workspace", "transfer"]

# Every dtype torch knows, in a fixed order: a dtype travels as its index here. Same torch
# version on every rank is assumed (the fingerprint does not cover it).
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_SINGLE = "<param>"  # key of a lone TransferPlan's parameter


# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    plan: TransferPlan
    dtype: torch.dtype
    esize: int


def _label(name: str) -> str:
    return "the parameter" if name == _SINGLE else f"parameter {name!r}"


def _as_named(plan, local_shards) -> tuple[list[tuple[str, TransferPlan]], object, bool]:
    """(sorted (name, plan) pairs, local shards by name, whether a lone TransferPlan was given).
    Local shards that are not a mapping are returned as they are, for the check to report."""
    if isinstance(plan, TransferPlan):
        return [(_SINGLE, plan)], ({} if local_shards is None else {_SINGLE: local_shards}), True
    if not isinstance(plan, ModelPlan):
        raise PlanError(f"transfer needs a TransferPlan or a ModelPlan, got {type(plan).__name__}")
    if local_shards is None or isinstance(local_shards, Mapping):
        local_shards = {k: v for k, v in (local_shards or {}).items() if v is not None}
    return sorted(plan.params.items()), local_shards, False


def _transfer_device(group, device) -> torch.device:
    """Not inferred from the shards: a rank holding none must pick the same kind of device."""
    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_problems(named, local, me: int, device: torch.device) -> list[str]:
    """What is wrong with this rank's own shards (empty when they match the plan)."""
    if not isinstance(local, Mapping):
        return [f"rank {me} passed local_shards as a {type(local).__name__}; for a ModelPlan it maps "
                f"parameter names to tensors"]
    out = []
    known = {n for n, _ in named}
    extra = sorted((k for k in local if k not in known), key=repr)
    if extra:
        out.append(f"rank {me} passed shards for parameters the plan does not have: {extra[:5]}")
    for name, p in named:
        want = p.source_shards.get(me)
        t = local.get(name)
        if t is None:
            if want is not None:
                out.append(f"{_label(name)}: rank {me} passed no source shard; the plan expects shape {list(want)}")
            continue
        if not isinstance(t, torch.Tensor):
            out.append(f"{_label(name)}: rank {me} passed a {type(t).__name__}, not a tensor")
        elif want is None:
            out.append(f"{_label(name)}: rank {me} passed a source shard {list(t.shape)}, "
                       f"but the plan gives rank {me} none")
        elif tuple(t.shape) != tuple(want):
            out.append(f"{_label(name)}: rank {me} source shard has shape {list(t.shape)}, "
                       f"the plan expects {list(want)}")
        elif t.device != device:
            out.append(f"{_label(name)}: rank {me} source shard is on {t.device}, the transfer runs on {device}")
    return out


def _fingerprint(named, max_inflight_bytes, scale_power) -> int:
    """63-bit digest of the plans and of the options every rank must share."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((max_inflight_bytes, scale_power)).encode())
    seen: dict[int, bytes] = {}
    for name, p in named:
        d = seen.get(id(p))
        if d is None:  # layers often share one plan object; digest it once
            body = (p.logical_shape, sorted(p.source_shards.items()), sorted(p.target_shards.items()),
                    p.segments, p.unfilled)
            d = seen[id(p)] = hashlib.blake2b(repr(body).encode(), digest_size=16).digest()
        h.update(name.encode() + b"\0" + d)
    return int.from_bytes(h.digest(), "little") >> 1


# -- the collective check -----------------------------------------------------------------------


def _gather(t: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return out


def _check(named, local, me: int, world: int, group, device, max_inflight_bytes, scale_power) -> list[_Param]:
    """Run the check of the wire protocol (step 1); every rank returns the same parameters or
    raises the same error."""
    mine = _local_problems(named, local, me, device)
    flagged = _agree_on_plan(named, bool(mine), world, group, device, max_inflight_bytes, scale_power)
    _check_plan_ranks(named, world)  # plans agree now, so every rank raises alike
    held = local if isinstance(local, Mapping) else {}
    codes_local = [(_DTYPE_CODE[held[n].dtype] if isinstance(held.get(n), torch.Tensor) else -1)
                   for n, _ in named]
    codes = [c.tolist() for c in _gather(torch.tensor(codes_local, dtype=torch.int64, device=device),
                                         group, world)] if named else [[] for _ in range(world)]
    problems: list[str] = []
    if flagged:  # only now, and on every rank alike, is the cost of pickling messages paid
        lines: list[object] = [None] * world
        dist.all_gather_object(lines, mine, group=group)
        problems = [line for rank_lines in lines for line in (rank_lines or [])]
    params = []
    for k, (name, p) in enumerate(named):
        prm = _agreed_param(name, p, {r: codes[r][k] for r in p.source_shards}, scale_power, problems)
        if prm is not None:
            params.append(prm)
    if problems:
        raise ShardError("transfer: shards disagree with the plan:\n  " + "\n  ".join(problems))
    return params


def _agree_on_plan(named, flagged: bool, world: int, group, device, max_inflight_bytes, scale_power) -> bool:
    """Step 1a: gather (problem flag, fingerprint, parameter count); raise :class:`PlanError` on
    every rank if the plans differ. Returns whether any rank flagged a problem."""
    fp = _fingerprint(named, max_inflight_bytes, scale_power)
    head = torch.tensor([int(flagged), fp, len(named)], dtype=torch.int64, device=device)
    heads = [h.tolist() for h in _gather(head, group, world)]
    odd = [r for r, h in enumerate(heads) if h[1:] != heads[0][1:]]
    if odd:
        raise PlanError(f"transfer: ranks disagree on the plan or its options (max_inflight_bytes, scale_power): "
                        f"ranks {odd} differ from rank 0")
    return any(h[0] for h in heads)


def _agreed_param(name: str, p: TransferPlan, codes: Mapping[int, int], scale_power: int,
                  problems: list[str]) -> _Param | None:
    """The parameter with the dtype its holders agree on; appends to ``problems`` otherwise."""
    by_dtype: dict[int, list[int]] = defaultdict(list)
    for r in sorted(codes):
        if codes[r] >= 0:
            by_dtype[codes[r]].append(r)
    if len(by_dtype) > 1:
        parts = "; ".join(f"rank(s) {rs} hold {_DTYPES[c]}" for c, rs in sorted(by_dtype.items(), key=lambda x: x[1]))
        problems.append(f"{_label(name)}: source shards disagree on dtype: {parts}")
        return None
    if not by_dtype:
        return None  # every holder has reported a problem of its own
    dtype = _DTYPES[next(iter(by_dtype))]
    if not (dtype.is_floating_point or dtype.is_complex) and any(s.factor ** scale_power != 1.0 for s in p.segments):
        problems.append(f"{_label(name)}: the plan scales some blocks, which integer dtype {dtype} cannot hold")
    return _Param(name, p, dtype, torch.empty((), dtype=dtype).element_size())


def _check_plan_ranks(named, world: int) -> None:
    for name, p in named:
        bad = sorted(r for r in set(p.source_shards) | set(p.target_shards) if not 0 <= r < world)
        if bad:
            raise PlanError(f"transfer: {_label(name)} names plan ranks {bad}, outside the group of {world}")


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


def _direct(items: list[Item], flat: torch.Tensor, side: str) -> torch.Tensor | None:
    """The shard's own storage for a message that is one contiguous part, else ``None``."""
    if len(items) != 1:
        return None
    boxes = items[0].views(getattr(items[0].seg, side))
    if len(boxes) != 1:
        return None
    view = view_of(flat, *boxes[0])
    return view.reshape(-1).view(torch.uint8) if view.is_contiguous() else None


def _nbytes(items: list[Item], params: list[_Param]) -> int:
    return sum(it.numel * params[it.param].esize for it in items)


_ALIGN = 16  # staging slices start aligned for any element size (complex128 is the widest)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Workspace:
    """Staging memory kept between :func:`transfer` calls, one buffer per device, grown to the
    largest round seen. Fresh host memory costs a page fault per page on first touch, which on a
    CPU-bound job can cost as much as the copy itself; pass one ``Workspace`` to repeated calls
    (optimizer states, many checkpoints) to pay it once. ``release()`` frees the memory."""

    def __init__(self) -> None:
        self._bufs: dict[torch.device, torch.Tensor] = {}

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < nbytes:
            self._bufs.pop(device, None)  # drop the old buffer before the new one: lower peak
            buf = self._bufs[device] = empty(nbytes, torch.uint8, device)
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())

    def release(self) -> None:
        self._bufs.clear()


class _Arena:
    """One allocation per round, cut into the round's staging buffers."""

    def __init__(self, sizes: list[int], device: torch.device, workspace: Workspace) -> None:
        self.buf = workspace.get(sum(_aligned(n) for n in sizes), device)
        self.at = 0

    def take(self, n: int) -> torch.Tensor:
        out = self.buf[self.at:self.at + n]
        self.at += _aligned(n)
        return out


def _staged(buf: torch.Tensor, items: list[Item], params: list[_Param], side: str):
    """(item, flat staging slice in the item's dtype, box shape, row-major view into the slice,
    view on ``side`` of the segment) for each box of the message, in wire order."""
    at = 0
    for it in items:
        esize, dtype = params[it.param].esize, params[it.param].dtype
        for shape, v in it.views(getattr(it.seg, side)):
            nb = prod(shape) * esize
            yield it, buf[at:at + nb].view(dtype), shape, View(0, row_major_strides(shape)), v
            at += nb


def _pack(buf: torch.Tensor, items: list[Item], params: list[_Param], flats: Mapping[int, torch.Tensor]
          ) -> None:
    for it, part, shape, packed, v in _staged(buf, items, params, "src"):
        strided_copy(part, packed, flats[it.param], v, shape)


def _unpack(buf: torch.Tensor, items: list[Item], params: list[_Param], outs: Mapping[int, torch.Tensor],
            scale_power: int) -> None:
    for it, part, shape, packed, v in _staged(buf, items, params, "dst"):
        strided_copy(outs[it.param], v, part, packed, shape, it.seg.factor ** scale_power)


def _targets(params: list[_Param], me: int, device) -> dict[int, torch.Tensor]:
    """Flat target shards of this rank; padding zeroed, the rest left for the segments."""
    outs = {}
    for k, prm in enumerate(params):
        shape = prm.plan.target_shards.get(me)
        if shape is None:
            continue
        numel = prod(shape)
        written = sum(s.numel for s in prm.plan.segments if s.dst_rank == me)
        pads = [u for u in prm.plan.unfilled if u.dst_rank == me]
        if written + sum(prod(u.shape) for u in pads) == numel:
            flat = empty(numel, prm.dtype, device)
            for u in pads:
                view_of(flat, u.shape, u.dst).zero_()
        else:  # the plan does not write every element (a non-tiling map): zero the rest too
            flat = torch.zeros(numel, dtype=prm.dtype, device=device)
        outs[k] = flat
    return outs


def _copy_local(params: list[_Param], me: int, flats, outs, scale_power: int, stats: _Stats) -> None:
    for k, prm in enumerate(params):
        for s in prm.plan.segments:
            if s.src_rank == me and s.dst_rank == me:
                strided_copy(outs[k], s.dst, flats[k], s.src, s.shape, s.factor ** scale_power)
                stats.local_bytes += s.numel * prm.esize


@dataclass(slots=True)
class _Message:
    peer: int
    items: list[Item]
    buf: torch.Tensor | None  # the shard's own storage when no staging is needed
    nbytes: int


def _messages(rnd: Round, params, me: int, flats, outs, scale_power: int) -> tuple[list[_Message], list[_Message]]:
    """This rank's receives and sends in the round, peers in rank order."""
    recvs, sends = [], []
    for (src, dst), items in rnd.items():
        if dst == me:
            unscaled = all(it.seg.factor ** scale_power == 1.0 for it in items)
            direct = _direct(items, outs[items[0].param], "dst") if unscaled else None
            recvs.append(_Message(src, items, direct, _nbytes(items, params)))
        elif src == me:
            sends.append(_Message(dst, items, _direct(items, flats[items[0].param], "src"), _nbytes(items, params)))
    return sorted(recvs, key=lambda m: m.peer), sorted(sends, key=lambda m: m.peer)


def _content(items: list[Item]) -> tuple:
    """What a send carries: messages with equal keys hold the same bytes."""
    return tuple((it.param, it.seg.shape, it.seg.src, it.lo, it.hi) for it in items)


def _run_round(rnd: Round, params, me: int, peer_of, group, device, flats, outs, scale_power: int,
               stats: _Stats, workspace: Workspace, before_wait) -> None:
    recvs, sends = _messages(rnd, params, me, flats, outs, scale_power)
    staged = [m.nbytes for m in recvs if m.buf is None]
    staged += {_content(m.items): m.nbytes for m in sends if m.buf is None}.values()
    arena = _Arena(staged, device, workspace)
    stats.peak_staged_bytes = max(stats.peak_staged_bytes, sum(staged))
    ops, inbox = [], []
    for m in recvs:
        if m.buf is None:
            m.buf = arena.take(m.nbytes)
            inbox.append((len(ops), m))
        ops.append(dist.P2POp(dist.irecv, m.buf, peer_of(m.peer), group))
        stats.received_bytes += m.nbytes
        stats.messages_received += 1
    # CPU backends (gloo) run every operation on its own, so each send is posted as soon as it is
    # packed and the wire starts before the last message is packed. Coalescing backends (NCCL)
    # need a rank's receives and sends in one batch: split batches can deadlock on the stream.
    pipelined = device.type == "cpu"
    works = dist.batch_isend_irecv(ops) if pipelined and ops else []
    posted = len(ops)
    packed: dict[tuple, torch.Tensor] = {}  # replicas of one target often get the same bytes
    for m in sends:
        if m.buf is None:
            key = _content(m.items)
            m.buf = packed.get(key)
            if m.buf is None:
                m.buf = packed[key] = arena.take(m.nbytes)
                _pack(m.buf, m.items, params, flats)
                stats.packed_bytes += m.nbytes
        ops.append(dist.P2POp(dist.isend, m.buf, peer_of(m.peer), group))
        if pipelined:
            works += dist.batch_isend_irecv(ops[-1:])
            posted += 1
        stats.sent_bytes += m.nbytes
        stats.messages_sent += 1
    if posted < len(ops):
        works += dist.batch_isend_irecv(ops[posted:])
    before_wait()
    _finish(works, len(ops), inbox, params, outs, scale_power)


def _finish(works, n_ops: int, inbox, params, outs, scale_power: int) -> None:
    """Wait for the round; unpack each staged receive as soon as it lands."""
    if len(works) == n_ops:  # one request per operation
        for i, m in inbox:
            works[i].wait()
            _unpack(m.buf, m.items, params, outs, scale_power)
        done = {i for i, _ in inbox}
        for i, w in enumerate(works):
            if i not in done:  # gloo: a second wait on a finished receive waits for another message
                w.wait()
        return
    for w in works:  # coalesced (NCCL): one request for the whole batch
        w.wait()
    for _, m in inbox:
        _unpack(m.buf, m.items, params, outs, scale_power)


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
    stats: dict | None = None,
):
    """Run ``plan`` across the ranks of ``group`` (see the module docstring for the protocol).

    ``plan`` is a :class:`TransferPlan` or a :class:`ModelPlan`. For a ``TransferPlan``,
    ``local_shards`` is this rank's source shard (``None`` where it holds none) and the result
    is this rank's target shard (``None`` where it holds none). For a ``ModelPlan`` both are
    dicts by parameter name; the result holds exactly the parameters this rank is a target of,
    and every parameter moves in the same rounds (one message per peer per round).

    ``max_inflight_bytes`` bounds the bytes each rank sends plus receives per round (its staging
    memory); ``scale_power`` is as in ``ParamMap.extract`` (1 for parameters, -1 and -2 for
    Adam's moments). ``device`` is where target shards live and the transfer runs (default: the
    current CUDA device under NCCL, else CPU); source shards must be there already.
    ``workspace`` (a :class:`Workspace`) keeps staging memory between calls. When
    ``stats`` is a dict it is filled with this rank's ``sent_bytes``, ``received_bytes``,
    ``local_bytes``, ``messages_sent``, ``messages_received``, ``rounds``,
    ``peak_staged_bytes`` and ``packed_bytes`` (bytes copied into staging to be sent).

    Raises :class:`reshard.ShardError` on every rank when any rank's shards disagree with the
    plan (shape, presence, dtype, ``local_shards`` not a dict for a ``ModelPlan``), and
    :class:`reshard.PlanError` on every rank when ranks hold different plans or options, when the
    plan names ranks outside the group, or when ``max_inflight_bytes`` cannot hold one element;
    all before any data moves. A ``plan`` of the wrong type, or a call from a process outside
    ``group``, raises :class:`reshard.PlanError` on that process alone.
    """
    named, local, single = _as_named(plan, local_shards)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    if me < 0:
        raise PlanError("transfer: this process is not a member of the group")
    dev = _transfer_device(group, device)
    params = _check(named, local, me, world, group, dev, max_inflight_bytes, scale_power)
    # plans and options agree by now, so a bad max_inflight_bytes raises alike on every rank
    rounds = schedule([(prm.plan, prm.esize) for prm in params], max_inflight_bytes)
    flats = {k: flatten(local[prm.name]) for k, prm in enumerate(params) if prm.name in local}
    outs = _targets(params, me, dev)
    peer_of = (lambda p: p) if group is None else (lambda p: dist.get_global_rank(group, p))
    st = _Stats()
    copy_local = lambda: _copy_local(params, me, flats, outs, scale_power, st)  # overlapped with round 0
    # Without a caller's workspace, rounds still share one staging buffer within the call.
    ws = workspace if workspace is not None else Workspace()
    for i, rnd in enumerate(rounds):
        _run_round(rnd, params, me, peer_of, group, dev, flats, outs, scale_power, st, ws,
                   copy_local if i == 0 else lambda: None)
    if not rounds:
        copy_local()
    if stats is not None:
        stats.update(asdict(st), rounds=len(rounds))
    result = {params[k].name: t.view(params[k].plan.target_shards[me]) for k, t in outs.items()}
    if single:
        return result.get(_SINGLE)
    return result
