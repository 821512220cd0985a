"""Live weight sync: a training job's shards moved into an inference engine's own tensors, every step.

RL post-training (verl, OpenRLHF, slime, NeMo-RL) pushes the trainer's weights into the rollout
engine (vLLM, SGLang) after every optimizer step. The common path all-gathers every full tensor
on the trainer and broadcasts it; :class:`WeightSync` sends each inference rank exactly the bytes
its shards need, shard to shard, cast to the engine's dtype on the sender.

Ranks. Source maps (the trainer's layout) and target maps (the engine's, e.g. from
:func:`reshard.layouts.arch.inference_targets`) are over *global* ranks. Trainer and engine are
disjoint rank sets of one world, or of a sub-group (``group``), or the same ranks (colocated: the
move is a local cast-copy). Every rank of the group constructs the sync and calls every ``push``.

Plan once (constructor; collective over the group):

1. each rank plans only what it sends or receives (:func:`reshard.plan.planner.plan_for_rank`);
2. the two ends of every link compare digests of what moves between them (``all_to_all`` of
   ``[send digest, receive digest, peers]`` per peer, then an ``all_reduce`` of problem flags);
   any problem, on any rank, becomes the same :class:`~reshard.PlanError` on every rank;
3. rounds are cut link by link (:func:`reshard.execute.schedule.schedule_links`), each link's
   budget ``max_inflight_bytes`` over the larger of its ends' peer counts, so no rank sends plus
   receives more than ``max_inflight_bytes`` wire bytes in a round.

Push every step. A push does no planning and no metadata exchange:

a. **check**: each rank compares the tensors it was handed with the plan (shapes, devices,
   contiguity; the engine tensors' dtype; the sources' dtype against the first push's). One
   ``all_reduce(MAX)`` of one ``int64`` says whether any rank found a problem; only then are the
   problem lines gathered and every rank raises the same :class:`~reshard.ShardError`, before
   any data moves. Measured here (4 gloo processes on 2 cores), a whole push of a 1-element
   model, both all-reduces and one message, takes 3.1–3.4 ms (``benchmarks/bench_sync.py``).
b. the first push compiles the rank's program (:mod:`reshard.execute.sync_program`: every pack
   with its cast, every message and staging place, every unpack) from the source dtypes it sees,
   and takes its one staging allocation (a :class:`~reshard.execute.memory.Workspace`);
   later pushes allocate nothing;
c. **rounds**: receives posted, then sends (from the source shard when nothing changes on the
   way, else packed and cast into staging), local segments cast-copied while the wire is busy,
   staged receives unpacked as they land; padding (``plan.unfilled``) zeroed;
d. **end**: one ``all_reduce(MAX)`` of a ``world``-long ``int64`` vector of failures, so that
   a rank that dies mid-push makes every rank raise :class:`~reshard.TransferError` in this push
   (within the process group's timeout), not some later one.

Results are bit-exact: each target element is ``cast(F * target_scale)`` computed as the
in-memory executor computes it (``(master * s).to(bf16)``; for scale 1 ``master.to(bf16)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from ..errors import CheckpointError, PlanError, QuantizedError, ReshardError, ShardError, TransferError
from ..ir.apply import view_of
from ..ir.param_map import ParamMap
from ..ir.piece import prod
from ..layouts.inference import Placed, check_placed, placed
from ..plan.planner import plan_for_rank
from .lazy import LazyShards
from .live import _transfer_device, _Wire
from .memory import Workspace
from .sync_program import Bound, Param, Program, compile_program, post_round, rounds_for, run_copy
from .sync_quant import (
    COVER,
    Fp8Block,
    QuantTarget,
    RankQuant,
    compile_rank,
    quantize_rank,
    quantized_targets,
)

__all__ = ["Fp8Block", "WeightSync"]


@dataclass(frozen=True, slots=True)
class _Expect:
    """What a push must hand this rank: source shards by name (shape), engine tensors by name
    (shape; their dtype where it is not the sync's: FP8 payloads and their scales)."""

    sources: dict[str, tuple[int, ...]]
    targets: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]


class WeightSync:
    """Moves a trainer's shards into an engine's tensors, planned once, every step (module docstring).

    ``source_maps``: name -> :class:`ParamMap` of the trainer's layout, over global ranks.
    ``target_maps``: the same names -> the engine's layout, a :class:`ParamMap` (the engine tensor
    ``into[name]`` is the shard) or a :class:`~reshard.layouts.inference.Placed` (the shard is a
    contiguous part of the engine tensor ``into[placed.into]``: fused tensors such as ``qkv_proj``).
    ``dtype``: the engine's dtype, what crosses the wire (sources of another floating dtype are cast
    on the sender). ``max_inflight_bytes``: the most wire bytes a rank sends plus receives per round
    (``None``: one round). ``group``: the process group (default: the world); every rank of it
    constructs the sync and calls every push. ``device``: where shards live (default: the current
    CUDA device under NCCL, else CPU). ``cost`` / ``allow_inexact_scale``: as for the planner.
    ``quantize``: an :class:`Fp8Block`: the weights it chooses arrive as FP8 E4M3 payloads (the engine
    tensor ``into``, ``float8_e4m3fn``) and their scales (``into + "_scale_inv"``), equal to
    transformers' ``Fp8Quantize`` of the full weight in ``dtype`` sliced, whatever the trainer's
    shard boundaries; only the whole blocks each engine rank's shard touches travel
    (:mod:`reshard.execute.sync_quant`).

    Raises :class:`~reshard.PlanError` (on every rank, alike) when the maps cannot be planned or the
    ranks' plans do not fit together, :class:`~reshard.MapError` for an impossible placement."""

    def __init__(self, source_maps: Mapping[str, ParamMap], target_maps: Mapping[str, ParamMap | Placed],
                 dtype: torch.dtype = torch.bfloat16, max_inflight_bytes: int | None = None, group=None, *,
                 device: torch.device | str | None = None, cost=None, allow_inexact_scale: bool = False,
                 quantize: Fp8Block | None = None) -> None:
        self.group, self.dtype, self.limit = group, dtype, max_inflight_bytes
        if quantize is not None and not isinstance(quantize, Fp8Block):
            raise PlanError(f"WeightSync: quantize must be an Fp8Block, got {type(quantize).__name__}")
        self.quantize = quantize
        self._quant: dict[str, QuantTarget] = {}
        self._quant_plans: list[RankQuant] = []
        self._covers: dict[str, torch.Tensor] = {}
        self.me, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.me < 0:
            raise PlanError("WeightSync: this process is not a member of the group")
        self.device = _transfer_device(group, device)
        self.esize = torch.empty((), dtype=dtype).element_size()
        self._flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._done = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        self.workspace = Workspace()
        self.pushes = 0
        self.stats: dict[str, int] = {}
        self._program: Program | None = None
        self._src_dtypes: dict[str, torch.dtype] = {}
        self._lazy = False
        self._broken: str | None = None
        problems: list[str] = []
        try:
            targets = _as_placed(source_maps, target_maps)
            check_placed(targets)
            if quantize is not None:
                chosen = quantize.chosen({n: m.logical_shape for n, m in source_maps.items()})
                targets, self._quant = quantized_targets(targets, chosen, quantize)
            rank_of = self._group_ranks(source_maps, targets)
            src = {n: m.with_ranks(rank_of) for n, m in source_maps.items()}
            self._targets = {n: t.with_ranks(rank_of) for n, t in targets.items()}
            self._quant = {n: QuantTarget(n, q.cover.with_ranks(rank_of), q.payload.with_ranks(rank_of),
                                          q.scale.with_ranks(rank_of)) for n, q in self._quant.items()}
            self.plan = plan_for_rank(src, {n: t.map for n, t in self._targets.items()}, self.me, cost=cost,
                                      allow_inexact_scale=allow_inexact_scale)
        except ReshardError as e:  # every rank must learn of it, or the others would wait on this one
            problems.append(f"rank {dist.get_rank()}: {e}")
            self.plan = None
        self._agree(problems, PlanError, "the maps cannot be planned")
        self.names = sorted(self.plan.params)
        self._expect = self._expected()
        self._rounds = self._check_links()

    # -- construction ---------------------------------------------------------------------------

    def _group_ranks(self, source_maps, targets) -> dict[int, int]:
        ranks = {r for m in source_maps.values() for r in m.ranks} | {r for t in targets.values() for r in t.map.ranks}
        if self.group is None:
            bad = sorted(r for r in ranks if not 0 <= r < self.world)
            if bad:
                raise PlanError(f"maps name ranks {bad[:5]}, outside the world of {self.world}")
            return {r: r for r in ranks}
        members = set(dist.get_process_group_ranks(self.group))
        bad = sorted(ranks - members)
        if bad:
            raise PlanError(f"maps name global ranks {bad[:5]}, which are not in the group {sorted(members)[:8]}")
        return {r: dist.get_group_rank(self.group, r) for r in ranks}

    def _expected(self) -> _Expect:
        me, sources, engine, dtypes = self.me, {}, {}, {}
        for n in self.names:
            p = self.plan.params[n]
            if me in p.source_shards:
                sources[n] = tuple(p.source_shards[me])
            q = self._quant.get(n)
            for t, dtype in (((q.payload, torch.float8_e4m3fn), (q.scale, self.quantize.scale_dtype))  # type: ignore[union-attr]
                             if q is not None else ((self._targets[n], self.dtype),)):
                if me in t.shapes:
                    engine[t.into] = tuple(t.shapes[me])
                    if dtype != self.dtype:
                        dtypes[t.into] = dtype
            rq = compile_rank(q, me, self.quantize.block) if q is not None else None  # type: ignore[union-attr]
            if rq is not None:
                self._quant_plans.append(rq)
        return _Expect(sources, engine, dtypes)

    def _link_digests(self) -> tuple[dict[int, list[int]], set[int]]:
        sends: dict[int, hashlib.blake2b] = {}
        recvs: dict[int, hashlib.blake2b] = {}
        fp8 = None if self.quantize is None else (self.quantize.block, self.quantize.scale, sorted(self._quant))
        opts = repr((str(self.dtype), self.limit, fp8)).encode()
        for n in self.names:
            p = self.plan.params[n]
            for s in p.segments:
                if s.is_local:
                    continue
                side, peer = (sends, s.dst_rank) if s.src_rank == self.me else (recvs, s.src_rank)
                h = side.setdefault(peer, hashlib.blake2b(opts, digest_size=8))
                h.update(repr((n, p.logical_shape, s)).encode())
        peers = set(sends) | set(recvs)
        out = {q: [int.from_bytes(d[q].digest(), "little") >> 1 if q in d else 0 for d in (sends, recvs)]
               for q in peers}
        return out, peers

    def _check_links(self) -> list:
        """Both ends of every link hold the same segments (step 2 of the module docstring); the rounds."""
        digests, peers = self._link_digests()
        mine = torch.zeros(self.world, 3, dtype=torch.int64, device=self.device)
        for q, (s, r) in digests.items():
            if 0 <= q < self.world:
                mine[q] = torch.tensor([s, r, len(peers)])
        theirs = torch.empty_like(mine)
        self._collective(lambda: dist.all_to_all_single(theirs, mine, group=self.group))
        got, sent = theirs.tolist(), mine.tolist()
        problems = []
        for q in range(self.world):
            if q != self.me and got[q][:2] != [sent[q][1], sent[q][0]]:
                a, b = sorted((self.me, q))
                problems.append(f"ranks {a} and {b} (of the group) hold plans that disagree on what moves "
                                f"between them (or on dtype, max_inflight_bytes, quantize)")
        plans = [self.plan.params[n] for n in self.names]
        rounds, small = rounds_for(plans, self.me, self.esize, self.limit, lambda q: got[q][2])
        if small:
            problems.append(f"max_inflight_bytes={self.limit} shared over the links of rank {self.me} "
                            f"cannot hold one {self.dtype} element on links {small[:4]}")
        self._agree(problems, PlanError, "per-rank plans do not fit together")
        return rounds

    # -- collectives ------------------------------------------------------------------------------

    def _collective(self, fn) -> None:
        try:
            fn()
        except RuntimeError as e:  # gloo/NCCL: a peer died or the group timed out
            self._broken = f"a collective failed: {e}"
            raise TransferError(f"WeightSync: rank {self.me} (of the group): {self._broken}") from e

    def _agree(self, lines: list[str], error: type[ReshardError], what: str, classify=None) -> None:
        """Collective: every rank raises the same ``error`` when any rank has problem lines
        (``classify(lines)``'s class where given: the lines of every rank, so alike on every rank)."""
        self._flag.fill_(1 if lines else 0)
        self._collective(lambda: dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group))
        if not self._flag.item():
            return
        gathered: list[object] = [None] * self.world
        self._collective(lambda: dist.all_gather_object(gathered, lines, group=self.group))
        # both ends of a link report a disagreement between them: each line once, in rank order
        every = list(dict.fromkeys(line for g in gathered for line in (g or [])))  # type: ignore[union-attr]
        if classify is not None:
            error, what = classify(every, error, what)
        raise error(f"WeightSync: {what}:\n  " + "\n  ".join(every))

    # -- push -------------------------------------------------------------------------------------

    def push(self, local_sources: Mapping[str, torch.Tensor] | None, into: Mapping[str, torch.Tensor] | None = None):
        """Move the current source shards into the engine tensors (collective on every rank of the
        group). ``local_sources``: this rank's source shards by parameter name (``{}`` for none), or a
        checkpoint's :class:`~reshard.execute.lazy.LazyShards` (``reader_sources``' default: each
        shard read a band at a time as it is packed, and what reading it would refuse -- a damaged
        scale -- refused on every rank before anything moves);
        ``into``: this rank's engine tensors by engine name (``None`` for none), filled in place
        and returned. Raises :class:`~reshard.ShardError` on every rank when any rank's tensors
        disagree with the plan (nothing moves), :class:`~reshard.TransferError` on every rank when
        a rank fails during the move."""
        if self._broken is not None:
            raise TransferError(f"WeightSync: rank {self.me}: an earlier push failed ({self._broken}); this process "
                                f"group cannot be trusted, make a new one")
        local = {} if local_sources is None else local_sources
        given = {} if into is None else into
        lazy = local if isinstance(local, LazyShards) else None
        problems = self._problems(local, given)
        if lazy is not None and not problems:  # what reading the checkpoint would refuse: before anything moves
            problems = [f"rank {self.me}: {READ}{line}" for line in lazy.problems(sorted(self._expect.sources))]
        self._agree(problems, ShardError, "tensors disagree with the plan", _error_class)
        with torch.no_grad():
            if self._program is None:  # the first push: its source dtypes are what the program is built for
                self._lazy = lazy is not None
                self._src_dtypes = {n: _dtype(local, n) for n in self._expect.sources}
                self._compile()
            try:
                self._run(self._bind(local, given))
            finally:
                if lazy is not None:
                    lazy.close()  # the last parameter's band dropped: nothing of the checkpoint held between pushes
            if self._quant:
                self._encode(given)
        self.pushes += 1
        return into

    def _encode(self, given) -> None:
        """Quantize the covers that landed here into the engine's FP8 tensors; a block FP8 cannot
        hold (NaN, inf) on any rank makes every rank raise :class:`~reshard.QuantizedError` naming
        it, with no engine tensor of this step written by the failing rank."""
        into = {n: t.detach().view(-1) for n, t in given.items()}
        lines = quantize_rank(self._quant_plans, self._covers, into, self.quantize, self.me)  # type: ignore[arg-type]
        self._agree(lines, QuantizedError, "a weight cannot be quantized")

    def _problems(self, local, given) -> list[str]:
        me, exp, out = self.me, self._expect, []
        for arg, what in ((local, "local_sources"), (given, "into")):
            if not isinstance(arg, Mapping):
                return [f"rank {me}: {what} is a {type(arg).__name__}, not a dict by name"]
        extra = sorted(set(local) - set(exp.sources), key=repr) + sorted(set(given) - set(exp.targets), key=repr)
        if extra:
            out.append(f"rank {me}: passed tensors the plan does not give it: {extra[:5]}")
        if isinstance(local, LazyShards) and exp.sources and self._program is not None and not self._lazy:
            return [f"rank {me}: local_sources is a lazy checkpoint source, but the first push's were tensors "
                    f"(its program sends some straight from them); make a WeightSync for the lazy source"]
        for name, shape in exp.sources.items():
            if isinstance(local, LazyShards) and name in local:  # read later, a band at a time: its shape and dtype
                out += self._lazy_problem(f"source {name!r}", local, name, shape, self._src_dtypes.get(name))
                continue
            out += self._tensor_problem(f"source {name!r}", local.get(name), shape, self._src_dtypes.get(name), True)
        for name, shape in exp.targets.items():
            out += self._tensor_problem(f"engine tensor {name!r}", given.get(name), shape,
                                        exp.dtypes.get(name, self.dtype), False)
        return out

    def _lazy_problem(self, what: str, local: LazyShards, name: str, shape, dtype) -> list[str]:
        me, got, kind = self.me, local.shape(name), local.dtype(name)
        if got != shape or self.device.type != "cpu":
            return [f"rank {me}: {what} is {list(got)} read from a checkpoint on the CPU; the plan expects "
                    f"{list(shape)} on {self.device}"]
        if dtype is not None and kind != dtype:
            return [f"rank {me}: {what} is {kind}, not {dtype}, the first push's (its staging and casts are compiled)"]
        if not (kind.is_floating_point or kind == self.dtype):
            return [f"rank {me}: {what} is {kind}, which cannot be cast to {self.dtype}"]
        return []

    def _tensor_problem(self, what: str, t, shape, dtype, source: bool) -> list[str]:
        me = self.me
        if not isinstance(t, torch.Tensor):
            return [f"rank {me}: {what}: expected a tensor {list(shape)}, got {type(t).__name__}"]
        if tuple(t.shape) != shape or t.device != self.device or not t.is_contiguous():
            return [f"rank {me}: {what} is {list(t.shape)} on {t.device}{'' if t.is_contiguous() else ', strided'}; "
                    f"the plan expects a contiguous {list(shape)} on {self.device}"]
        if dtype is not None and t.dtype != dtype:
            why = "the first push's (its staging and casts are compiled)" if source else "the sync's dtype"
            return [f"rank {me}: {what} is {t.dtype}, not {dtype}, {why}"]
        if source and not (t.dtype.is_floating_point or t.dtype == self.dtype):
            return [f"rank {me}: {what} is {t.dtype}, which cannot be cast to {self.dtype}"]
        return []

    def _compile(self) -> None:
        me = self.me
        params = []
        for n in self.names:
            t = self._targets[n]
            params.append(Param(n, self.plan.params[n], t.into if me in t.offsets else None, t.offsets.get(me, 0),
                                self._src_dtypes.get(n), self._lazy and n in self._src_dtypes))
        self._index = {n: k for k, n in enumerate(self.names)}
        self._program = compile_program(params, self._rounds, me, self.dtype)
        before = self.workspace.nbytes
        self._staging = self.workspace.get(self._program.staging_bytes, self.device) if self._program.staging_bytes else None
        self.allocated_bytes = self.workspace.nbytes - before
        # the covers of the quantized parameters this rank receives: staging of the sync's dtype, kept
        self._covers = {rq.name: torch.empty(prod(rq.cover_shape), dtype=self.dtype, device=self.device)
                        for rq in self._quant_plans}

    def _bind(self, local, given) -> Bound:
        targets = {n: t.detach().view(-1) for n, t in given.items()}
        targets.update({rq.name + COVER: self._covers[rq.name] for rq in self._quant_plans})
        if isinstance(local, LazyShards):  # nothing read here: each parameter opened when a copy reads it
            opens = {self._index[n]: partial(local.open, n) for n in self._expect.sources}
            return Bound({}, targets, self._staging, self._program.scratch_at, opens)  # type: ignore[union-attr]
        sources = {self._index[n]: t.detach().view(-1) for n, t in local.items()}
        return Bound(sources, targets, self._staging, self._program.scratch_at)  # type: ignore[union-attr]

    def _run(self, b: Bound) -> None:
        prog, failed = self._program, None
        try:
            for i, rp in enumerate(prog.rounds):
                wire = _Wire(self.group, self._peer, self.device)
                inbox = post_round(rp, b, self.dtype, wire.recv, wire.send)
                works = wire.flush()
                if i == 0:
                    self._local(prog, b)
                _finish(works, len(rp.recvs) + len(rp.sends), inbox, b, self.dtype)
            if not prog.rounds:
                self._local(prog, b)
        except RuntimeError as e:
            failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self._done.zero_()
        if failed:
            self._done[self.me].fill_(1)  # a view: no tensor is made
        self._collective(lambda: dist.all_reduce(self._done, op=dist.ReduceOp.MAX, group=self.group))
        bad = [r for r, v in enumerate(self._done.tolist()) if v]
        if failed or bad:
            self._broken = failed or f"rank(s) {bad} failed"
            raise TransferError(f"WeightSync: push {self.pushes + 1} failed on rank(s) {bad} of the group"
                                + (f"; rank {self.me}: {failed}" if failed else ""))
        self.stats = {"rounds": len(prog.rounds), "sent_bytes": prog.sent_bytes, "received_bytes": prog.received_bytes,
                      "local_bytes": prog.local_bytes, "packed_bytes": prog.packed_bytes,
                      "unpacked_bytes": prog.unpacked_bytes, "staging_bytes": prog.staging_bytes,
                      "messages_sent": sum(len(r.sends) for r in prog.rounds),
                      "messages_received": sum(len(r.recvs) for r in prog.rounds)}

    def _peer(self, p: int) -> int:
        return p if self.group is None else dist.get_global_rank(self.group, p)

    @staticmethod
    def _local(prog: Program, b: Bound) -> None:
        for into, view, shape in prog.zero:
            view_of(b.targets[into], shape, view).zero_()
        for c in prog.local:
            run_copy(c, b, b.targets[c.dst[1]].dtype)


def _dtype(local, name: str) -> torch.dtype:
    return local.dtype(name) if isinstance(local, LazyShards) else local[name].dtype


READ = "reading the checkpoint: "  # a lazy source's refusal, as its problem lines start


def _error_class(lines: list[str], error: type[ReshardError], what: str) -> tuple[type[ReshardError], str]:
    """The push check's error: where every rank's lines are a lazy source's refusals, the reader's
    class (:class:`~reshard.QuantizedError` where every one is), else ``error``."""
    if not all(READ in line for line in lines):
        return error, what
    quantized = all(f"{READ}QuantizedError: " in line for line in lines)
    return (QuantizedError if quantized else CheckpointError), "the checkpoint source cannot be read"


def _finish(works: list, n_ops: int, inbox, b: Bound, wire: torch.dtype) -> None:
    """Wait for a round; unpack each staged receive as soon as it lands (gloo: one request per
    operation, each waited on exactly once; NCCL: one for the batch)."""
    if len(works) == n_ops:
        waited = set()
        for i, op in inbox:
            works[i].wait()
            waited.add(i)
            for c in op.copies:
                run_copy(c, b, wire)
        for i, w in enumerate(works):
            if i not in waited:
                w.wait()
        return
    for w in works:
        w.wait()
    for _, op in inbox:
        for c in op.copies:
            run_copy(c, b, wire)


def _as_placed(source_maps, target_maps) -> dict[str, Placed]:
    missing = sorted(set(source_maps) ^ set(target_maps))
    if missing:
        raise PlanError(f"source and target maps name different parameters: {missing[:5]}")
    out = {}
    for n, t in target_maps.items():
        if isinstance(t, Placed):
            out[n] = t
        elif isinstance(t, ParamMap):
            out[n] = placed(t, n)
        else:
            raise PlanError(f"target of {n!r} is a {type(t).__name__}, not a ParamMap or Placed")
    return out
