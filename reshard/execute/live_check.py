"""Step 1 of a live transfer (:mod:`reshard.execute.live`): every rank checks its shards and plan, and the
ranks agree that their plans fit together, before any data moves.

Two kinds of plan are checked. A *global* plan (every rank holds the same plan) is compared by
fingerprint (``check``). A *per-rank* plan (``plan_for_rank``: each rank holds only the segments
it sends or receives) cannot be compared whole, so each pair of ranks compares what moves between
them (``check_per_rank``): one digest per link and direction, exchanged with ``all_to_all``, then
the dtype of every parameter on each link. Either way, a problem on one rank becomes the same
:class:`~reshard.PlanError` or :class:`~reshard.ShardError` on every rank.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import PlanError, ShardError
from ..plan.values import Segment, TransferPlan
from .schedule import Link

# Every dtype torch knows, in a fixed order: a dtype travels as its index here. Same torch
# version on every rank is assumed (the fingerprint does not cover it).
DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
SINGLE = "<param>"  # key of a lone TransferPlan's parameter


# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    plan: TransferPlan
    dtype: torch.dtype
    esize: int


def label(name: str) -> str:
    return "the parameter" if name == SINGLE else f"parameter {name!r}"


def _local_problems(named, local, me: int, device: torch.device) -> list[str]:
    """What is wrong with this rank's own shards (empty when they match the plan)."""
    if not isinstance(local, Mapping):
        return [f"rank {me} passed local_shards as a {type(local).__name__}; for a ModelPlan it maps "
                f"parameter names to tensors"]
    out = _unknown(named, local, me, "shards")
    for name, p in named:
        want = p.source_shards.get(me)
        t = local.get(name)
        if t is None:
            if want is not None:
                out.append(f"{label(name)}: rank {me} passed no source shard; the plan expects shape {list(want)}")
            continue
        if not isinstance(t, torch.Tensor):
            out.append(f"{label(name)}: rank {me} passed a {type(t).__name__}, not a tensor")
        elif want is None:
            out.append(f"{label(name)}: rank {me} passed a source shard {list(t.shape)}, "
                       f"but the plan gives rank {me} none")
        elif tuple(t.shape) != tuple(want):
            out.append(f"{label(name)}: rank {me} source shard has shape {list(t.shape)}, "
                       f"the plan expects {list(want)}")
        elif t.device != device:
            out.append(f"{label(name)}: rank {me} source shard is on {t.device}, the transfer runs on {device}")
    return out


def _unknown(named, given: Mapping, me: int, what: str) -> list[str]:
    known = {n for n, _ in named}
    extra = sorted((k for k in given if k not in known), key=repr)
    return [f"rank {me} passed {what} for parameters the plan does not have: {extra[:5]}"] if extra else []


def _out_problems(named, out, local, me: int, device: torch.device) -> list[str]:
    """What is wrong with this rank's ``out`` tensors (their dtype is agreed in step 1b)."""
    if not isinstance(out, Mapping):
        return [f"rank {me} passed out as a {type(out).__name__}; for a ModelPlan it maps parameter names "
                f"to tensors"]
    problems = _unknown(named, out, me, "out tensors")
    held = local if isinstance(local, Mapping) else {}
    for name, p in named:
        t, want, src = out.get(name), p.target_shards.get(me), held.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"{label(name)}: rank {me} passed out as a {type(t).__name__}, not a tensor")
        elif want is None:
            problems.append(f"{label(name)}: rank {me} passed out {list(t.shape)}, but the plan gives rank "
                            f"{me} no target shard")
        elif tuple(t.shape) != tuple(want) or not t.is_contiguous() or t.device != device:
            problems.append(f"{label(name)}: rank {me} out is {list(t.shape)} on {t.device}"
                            f"{'' if t.is_contiguous() else ', not contiguous'}; the plan expects a contiguous "
                            f"{list(want)} on {device}")
        elif isinstance(src, torch.Tensor) and src.dtype != t.dtype:
            problems.append(f"{label(name)}: rank {me} out is {t.dtype}, its source shard {src.dtype}")
    return problems


def fingerprint(named, max_inflight_bytes, scale_power) -> int:
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


def check(named, local, out, me: int, world: int, group, device, max_inflight_bytes, scale_power
           ) -> tuple[list[Param], int]:
    """Run the check of the wire protocol (step 1); every rank returns the same parameters (and
    the fingerprint) or raises the same error."""
    mine = _local_problems(named, local, me, device) + _out_problems(named, out, local, me, device)
    mine_codes = _codes(named, local, out)
    fp = fingerprint(named, max_inflight_bytes, scale_power)
    heads = _agree_on_plan(fp, len(named), bool(mine), _uniform(mine_codes), world, group, device)
    _check_plan_ranks(named, world)  # plans agree now, so every rank raises alike
    flagged = any(h[0] for h in heads)
    codes = _all_codes(named, heads, flagged, mine_codes, world, group, device)
    problems: list[str] = []
    if flagged:  # only now, and on every rank alike, is the cost of pickling messages paid
        lines: list[object] = [None] * world
        dist.all_gather_object(lines, mine, group=group)
        problems = [line for rank_lines in lines for line in (rank_lines or [])]
    params = []
    for k, (name, p) in enumerate(named):
        holders = set(p.source_shards) | set(p.target_shards)  # out tensors have a dtype too
        prm = _agreed_param(name, p, {r: codes[r][k] for r in holders}, scale_power, problems)
        if prm is not None:
            params.append(prm)
    if problems:
        raise ShardError("transfer: shards disagree with the plan:\n  " + "\n  ".join(problems))
    return params, fp


def _codes(named, local, out) -> list[int]:
    """This rank's dtype code per parameter: its source shard's, else its ``out`` tensor's, else -1."""
    held = [t if isinstance(t, Mapping) else {} for t in (local, out)]
    codes = []
    for n, _ in named:
        t = next((h[n] for h in held if isinstance(h.get(n), torch.Tensor)), None)
        codes.append(-1 if t is None else DTYPE_CODE[t.dtype])
    return codes


def _uniform(codes: list[int]) -> int:
    """The one dtype code of every tensor this rank holds: -1 for none, -2 for several."""
    held = set(codes) - {-1}
    return held.pop() if len(held) == 1 else (-1 if not held else -2)


def _agree_on_plan(fp: int, n: int, flagged: bool, uniform: int, world: int, group, device) -> list[list[int]]:
    """Step 1a: gather (problem flag, fingerprint, parameter count, uniform dtype code); raise
    :class:`PlanError` on every rank if the plans differ."""
    head = torch.tensor([int(flagged), fp, n, uniform], dtype=torch.int64, device=device)
    heads = [h.tolist() for h in _gather(head, group, world)]
    odd = [r for r, h in enumerate(heads) if h[1:3] != heads[0][1:3]]
    if odd:
        raise PlanError(f"transfer: ranks disagree on the plan or its options (max_inflight_bytes, scale_power): "
                        f"ranks {odd} differ from rank 0")
    return heads


def _all_codes(named, heads, flagged: bool, mine: list[int], world: int, group, device) -> list[list[int]]:
    """Step 1b: every rank's dtype code per parameter. When no rank flagged a problem and every
    rank holds tensors of one and the same dtype, step 1a has said it all: each source holder
    holds exactly its planned shards, so the codes follow from the plans without a second
    collective (the common case: a model, or an optimizer state, in one dtype)."""
    uniform = {h[3] for h in heads} - {-1}
    if not flagged and len(uniform) == 1 and min(uniform) >= 0 and all(p.source_shards for _, p in named):
        c = min(uniform)
        return [[c if r in p.source_shards else -1 for _, p in named] for r in range(world)]
    if not named:
        return [[] for _ in range(world)]
    return [c.tolist() for c in _gather(torch.tensor(mine, dtype=torch.int64, device=device), group, world)]


def _agreed_param(name: str, p: TransferPlan, codes: Mapping[int, int], scale_power: int,
                  problems: list[str]) -> Param | None:
    """The parameter with the dtype its holders agree on; appends to ``problems`` otherwise."""
    by_dtype: dict[int, list[int]] = defaultdict(list)
    for r in sorted(codes):
        if codes[r] >= 0:
            by_dtype[codes[r]].append(r)
    if len(by_dtype) > 1:
        parts = "; ".join(f"rank(s) {rs} hold {DTYPES[c]}" for c, rs in sorted(by_dtype.items(), key=lambda x: x[1]))
        problems.append(f"{label(name)}: shards disagree on dtype: {parts}")
        return None
    if not by_dtype:
        return None  # every holder has reported a problem of its own
    dtype = DTYPES[next(iter(by_dtype))]
    if not (dtype.is_floating_point or dtype.is_complex) and any(s.factor ** scale_power != 1.0 for s in p.segments):
        problems.append(f"{label(name)}: the plan scales some blocks, which integer dtype {dtype} cannot hold")
    return Param(name, p, dtype, torch.empty((), dtype=dtype).element_size())


def _check_plan_ranks(named, world: int) -> None:
    problems = _plan_rank_problems(named, world)
    if problems:
        raise PlanError(f"transfer: {problems[0]}")


# -- per-rank plans --------------------------------------------------------------------------------


def _links(named, me: int) -> tuple[dict[int, dict[int, list[Segment]]], dict[int, dict[int, list[Segment]]]]:
    """For each peer: the remote segments this rank sends it and receives from it, by parameter
    index (into ``named``), in plan order."""
    sends: dict[int, dict[int, list[Segment]]] = defaultdict(dict)
    recvs: dict[int, dict[int, list[Segment]]] = defaultdict(dict)
    for k, (_, p) in enumerate(named):
        for s in p.segments:
            if s.src_rank == me and s.dst_rank != me:
                sends[s.dst_rank].setdefault(k, []).append(s)
            elif s.dst_rank == me and s.src_rank != me:
                recvs[s.src_rank].setdefault(k, []).append(s)
    return sends, recvs


def _link_digest(named, by_param: Mapping[int, list[Segment]], options: tuple) -> int:
    """63-bit digest of what one link carries (both of its ends compute it from their own plans)."""
    if not by_param:
        return 0
    h = hashlib.blake2b(repr(options).encode(), digest_size=8)
    for k in sorted(by_param):
        name, p = named[k]
        h.update(repr((name, p.logical_shape, by_param[k])).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _raise_if_any(plan_lines: list[str], shard_lines: list[str], group, world: int, device) -> None:
    """Collective: when any rank has a problem, every rank raises the same error listing all of
    them (a plan problem before a shard problem)."""
    flags = torch.tensor([int(bool(plan_lines)), int(bool(shard_lines))], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if not flags.any():
        return
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, (plan_lines, shard_lines), group=group)
    plans = sorted({line for g in gathered for line in g[0]})  # type: ignore[index]
    shards = [line for g in gathered for line in g[1]]  # type: ignore[index]
    if plans:
        raise PlanError("transfer: per-rank plans do not fit together:\n  " + "\n  ".join(plans))
    raise ShardError("transfer: shards disagree with the plan:\n  " + "\n  ".join(shards))


def check_per_rank(named, local, out, me: int, world: int, group, device, max_inflight_bytes, scale_power,
                   ranks: frozenset[int]) -> tuple[list[Param], int, dict[Link, int] | None]:
    """Step 1 for plans made per rank (``ModelPlan.ranks``): every rank returns its parameters,
    its plan's fingerprint and, with ``max_inflight_bytes``, each of its links' bytes per round;
    or every rank raises the same error.

    a. Each rank digests, per peer and direction, the segments its plan moves over that link,
       and ``all_to_all`` swaps them (with each rank's number of peers): both ends of a link
       must hold the same segments. A link's budget per round is ``max_inflight_bytes`` over the
       larger of its ends' peer counts, so no rank moves more than that per round.
    b. Each sender tells each receiver the dtype of every parameter on their link
       (``all_to_all`` again, sizes now agreed); dtypes are agreed as for a global plan."""
    plan_lines = [] if me in ranks else [f"rank {me} holds a plan made for rank(s) {sorted(ranks)[:4]}, not for itself"]
    plan_lines += [f"rank {me}: {line}" for line in _plan_rank_problems(named, world)]
    shard_lines = _local_problems(named, local, me, device) + _out_problems(named, out, local, me, device)
    sends, recvs = _links(named, me)
    options = (max_inflight_bytes, scale_power)
    peers = set(sends) | set(recvs)
    mine = torch.zeros(world, 3, dtype=torch.int64, device=device)
    for p in peers:
        if 0 <= p < world:
            mine[p] = torch.tensor([_link_digest(named, sends.get(p, {}), options),
                                    _link_digest(named, recvs.get(p, {}), options), len(peers)])
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group)
    theirs_list, mine_list = theirs.tolist(), mine.tolist()
    for p in range(world):
        if p != me and theirs_list[p][:2] != [mine_list[p][1], mine_list[p][0]]:
            a, b = sorted((me, p))
            plan_lines.append(f"ranks {a} and {b} hold plans that disagree on what moves between them "
                              f"(or on max_inflight_bytes, scale_power)")
    _raise_if_any(plan_lines, shard_lines, group, world, device)
    params, budgets = _per_rank_params(named, local, out, me, world, group, device, sends, recvs, scale_power,
                                       max_inflight_bytes, {p: theirs_list[p][2] for p in peers}, len(peers))
    return params, fingerprint(named, max_inflight_bytes, scale_power), budgets


def _per_rank_params(named, local, out, me, world, group, device, sends, recvs, scale_power, limit,
                     degrees: Mapping[int, int], degree: int) -> tuple[list[Param], dict[Link, int] | None]:
    """Step b: the dtype of every parameter from its holders on this rank's links, and each
    link's budget per round."""
    codes = _codes(named, local, out)
    send_codes = [codes[k] for p in range(world) for k in sorted(sends.get(p, {}))]
    got = torch.empty(sum(len(recvs.get(p, {})) for p in range(world)), dtype=torch.int64, device=device)
    dist.all_to_all_single(got, torch.tensor(send_codes, dtype=torch.int64, device=device),
                           output_split_sizes=[len(recvs.get(p, {})) for p in range(world)],
                           input_split_sizes=[len(sends.get(p, {})) for p in range(world)], group=group)
    holders: dict[int, dict[int, int]] = defaultdict(dict)  # parameter index -> rank -> dtype code
    it = iter(got.tolist())
    for p in range(world):
        for k in sorted(recvs.get(p, {})):
            holders[k][p] = next(it)
    problems: list[str] = []
    params = []
    for k, (name, p) in enumerate(named):
        have = dict(holders.get(k, {}))
        if codes[k] >= 0:
            have[me] = codes[k]
        if not have and me in p.target_shards:
            problems.append(f"rank {me}: {label(name)}: no source sends it any of this parameter and no out "
                            f"tensor gives its dtype; pass out=")
        prm = _agreed_param(name, p, have, scale_power, problems) if have else None
        if prm is not None:
            params.append(prm)
    budgets, plan_lines = None, []
    if limit is not None:
        budgets = {}
        esize = {prm.name: prm.esize for prm in params}
        for (peer, by_param), outgoing in [(x, True) for x in sends.items()] + [(x, False) for x in recvs.items()]:
            link = (me, peer) if outgoing else (peer, me)
            budgets[link] = limit // max(degree, degrees.get(peer, 1))
            need = max(esize.get(named[k][0], 1) for k in by_param)
            if budgets[link] < need:
                plan_lines.append(f"max_inflight_bytes={limit} shared over the links of ranks {sorted(link)} "
                                  f"({budgets[link]} bytes each per round) cannot hold one element ({need} bytes)")
    _raise_if_any(plan_lines, problems, group, world, device)
    return params, budgets


def _plan_rank_problems(named, world: int) -> list[str]:
    out = []
    for name, p in named:
        bad = sorted(r for r in set(p.source_shards) | set(p.target_shards) if not 0 <= r < world)
        if bad:
            out.append(f"{label(name)} names plan ranks {bad}, outside the group of {world}")
    return out
