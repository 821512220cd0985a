"""The one engine under every route: a reader's source, a writer's target, the plans between them.

``run`` is every command's job (``convert``, ``reshard``, any format to any format):

1. **Check**, before any output folder exists: the reader has checked what it read and the
   writer has refused what it cannot write when they were made; here the writer's buffers (its
   one declaration of what it fills, ``Writer.buffers``) are checked (keys unique, every slot
   inside its buffer on a rank its map holds), every source entry is accounted for
   (``jobs.accounted``: written, not carried, dropped, or refused), every target the slots take
   is planned against the source (so a plan that cannot be made refuses the job), and,
   where the target merges the copies of a replicated block (another TP degree, a universal or
   safetensors file), every such block's copies are compared: ranks that drifted apart stop the
   job unless a policy says which copy to take (``on_replica_mismatch``).
2. **Stage** the output folder (``storage.staging``), shared by every process of a launch.
3. **Fill**: the writer's jobs build their files from the declared buffers (a buffer it did not
   declare is an internal error); the engine turns each buffer into a window-by-window fill from
   the memory-mapped source fragments (``execute.local.WindowFill``), or, where the reader
   computes a fragment (a quantized weight decoded), a band of it at a time (``Reader.banded``),
   checking that the plan covers every slot. Files are shared by bytes over processes and workers, large archives stripe
   by stripe (``jobs.cluster``).
4. **Commit** with the manifest and report, once every declared buffer was filled (by some
   process): a declared buffer no job filled is an internal error, and nothing is committed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import CheckpointError, ReplicaMismatchError, ReshardError, in_context
from ..execute.bands import Banded
from ..execute.local import WindowFill
from ..formats.contract import (
    OPTIMIZER,
    SCALE_POWER,
    STATES,
    Buffer,
    Reader,
    Slot,
    Target,
    Writer,
    targets_of,
)
from ..ir.apply import rebuild_mean
from ..ir.param_map import ParamMap
from ..layouts import replicated
from ..plan.planner import DefaultCost, Planner
from ..plan.values import Segment
from ..storage import verified
from ..storage.torch_zip import Storage
from .accounted import account
from .cluster import Cluster, agreed, commit, open_staging, run_share
from .reports import Drift, Report, written
from .workers import run_with_progress

__all__ = ["POLICIES", "Engine", "Policy", "run"]

POLICIES = ("error", "mean")  # and "rank:N"


@dataclass(frozen=True, slots=True)
class Policy:
    """What to do where ranks hold different copies of a replicated block: ``error`` (the
    default), ``mean`` of the copies, or ``rank`` N's copy."""

    text: str
    kind: str
    rank: int | None = None

    @classmethod
    def parse(cls, value: str) -> Policy:
        if value in POLICIES:
            return cls(value, value)
        if isinstance(value, str) and value.startswith("rank:") and value[5:].isdigit():
            return cls(value, "rank", int(value[5:]))
        raise ReshardError(f"on_replica_mismatch (--on-replica-mismatch) must be 'error', 'mean' or 'rank:N', "
                           f"got {value!r}")


@dataclass(frozen=True, slots=True)
class _Planned:
    state: str  # the source state the slot is made from
    by_rank: dict[int, list[Segment]]


class Engine:
    """Plans and fills for one job. Plans are made once per (parameter, wanted states, target
    map), before staging (:meth:`plan_all`); buffers are filled from them by any worker."""

    def __init__(self, reader: Reader, *, keeps_replicas: bool, policy: Policy | None = None,
                 target_tp: Callable[[int], int] | None = None) -> None:
        self.reader = reader
        self.policy = policy or Policy.parse("error")
        self.keeps_replicas = keeps_replicas
        self.target_tp = target_tp or (lambda rank: 0)  # the TP rank a target rank is (writers that keep TP)
        self._planner = Planner()
        self._plans: dict[tuple[str, tuple[str, ...], int], _Planned | None] = {}
        self._overrides: dict[tuple[str, str], tuple[ParamMap, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._targets: list[ParamMap] = []  # keeps every planned target map alive, so its id stays its own
        self.sealed = False  # once staging begins, every slot filled must have been planned (declared) before
        self.declared: dict[str, Buffer] = {}  # the writer's buffers by key (Writer.buffers), once declared
        self.segments = 0
        self.reads: dict[str, int] = {}  # elements read per buffer key (the same in any process)
        self.missing: dict[str, set[str]] = defaultdict(set)  # states filled with zeros: state -> names

    # -- planning ------------------------------------------------------------------------------
    def state_for(self, name: str, want: Sequence[str]) -> str | None:
        """The first state in ``want`` the source holds of ``name``."""
        have = self.reader.states(name)
        return next((s for s in want if s in have), None)

    def _cost(self, name: str, state: str, target: ParamMap) -> DefaultCost:
        """Which copy of a replicated block to read: with ``rank:N``, TP rank N's; where the target
        keeps replicas apart (same TP degree), the copy of the target's own TP rank."""
        tp_of = partial(self.reader.tp_index, name, state)
        if self.policy.kind == "rank":
            n = self.policy.rank
            return DefaultCost(prefer=lambda holder, dst: tp_of(holder) == n, local=False)
        if self.keeps_replicas:
            return DefaultCost(prefer=lambda holder, dst: tp_of(holder) == self.target_tp(dst), local=False)
        return DefaultCost(local=False)

    def declare(self, buffers: Sequence[Buffer]) -> list[Target]:
        """Take the writer's buffers as its one declaration of what it fills: each key once, each
        slot inside its buffer on a rank its map holds (else an internal error, before any output
        folder exists). Returns what the engine plans: the distinct targets their slots take."""
        declared: dict[str, Buffer] = {}
        for b in buffers:
            if b.key in declared:
                raise ReshardError(f"internal: the writer declares buffer {b.key!r} twice")
            declared[b.key] = b
            for slot in b.slots:
                _check_slot(b, slot)
        self.declared = declared
        return targets_of(buffers)

    def check_filled(self, filled: Iterable[str]) -> None:
        """Every declared buffer was filled (``filled``: the keys every process filled): a
        declared buffer no job wrote would leave a file without the tensor the plan read for it."""
        done = set(filled)
        left = [k for k in self.declared if k not in done]
        if left:
            raise ReshardError(f"internal: the writer's jobs did not fill {len(left)} declared buffer(s): "
                               + ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""))

    def plan_all(self, targets: Iterable[Target]) -> None:
        for t in targets:
            self._plan(t.name, tuple(t.want), t.map)

    def seal(self) -> None:
        """No plan is made from here on: a slot the writer did not declare in ``buffers()`` (so
        neither planned nor replica-checked before the output folder existed) is an internal error."""
        self.sealed = True

    def _plan(self, name: str, want: tuple[str, ...], target: ParamMap) -> _Planned | None:
        key = (name, want, id(target))
        with self._lock:
            if key in self._plans:
                return self._plans[key]
        if self.sealed:
            raise ReshardError(f"internal: the writer fills a slot of {name!r} ({', '.join(want)}) that its "
                               "buffers() did not declare, so it was not planned before the output folder existed")
        state = self.state_for(name, want)
        planned = None
        if state is None:
            with self._lock:
                for w in want:
                    self.missing[w].add(name)
        else:
            source = self.source_map(name, state)
            try:
                p = self._planner.plan(source, target, cost=self._cost(name, state, target))
            except ReshardError as e:
                raise in_context(e, f"parameter {name!r} ({state})") from None
            by_rank: dict[int, list[Segment]] = defaultdict(list)
            for s in p.segments:
                by_rank[s.dst_rank].append(s)
            planned = _Planned(state, dict(by_rank))
            with self._lock:
                self.segments += len(p.segments)
        with self._lock:
            self._plans[key] = planned
            self._targets.append(target)
        return planned

    def source_map(self, name: str, state: str) -> ParamMap:
        over = self._overrides.get((name, state))
        return over[0] if over is not None else self.reader.map(name, state)

    def _fragment(self, name: str, state: str, rank: int) -> torch.Tensor | Banded:
        over = self._overrides.get((name, state))
        if over is not None:
            return over[1]
        banded = self.reader.banded(name, state, rank)  # computed a band at a time (a decoded weight)
        return banded if banded is not None else self.read(name, state, rank)

    def read(self, name: str, state: str, rank: int) -> torch.Tensor:
        """The source fragment, its records marked as read: checked before the job commits
        (``storage.verified``), by the CRCs the writers take as they copy it, or a read of its own."""
        t = self.reader.fragment(name, state, rank)
        verified.touch(t, f"{name} ({state}, rank {rank})")
        return t

    # -- filling -------------------------------------------------------------------------------
    def fill(self, buffer: Buffer) -> WindowFill:
        """``buffer`` produced window by window from the source fragments its slots' plans read."""
        if self.declared.get(buffer.key) is not buffer:
            raise ReshardError(f"internal: the writer fills buffer {buffer.key!r}, which its buffers() did not "
                               "declare, so it was not planned before the output folder existed")
        parts: list[tuple[int, Segment, Callable[[], torch.Tensor]]] = []
        powers, read = set(), 0
        for slot in buffer.slots:
            planned = self._plan(slot.name, slot.want, slot.map)
            if planned is None:
                continue  # a state the source lacks: zeros
            segs = planned.by_rank.get(slot.rank, [])
            _check_covers(slot, segs, buffer.key)
            powers.add(SCALE_POWER.get(planned.state, 1))
            parts += [(slot.offset, s, partial(self._fragment, slot.name, planned.state, s.src_rank)) for s in segs]
            if slot.want[0] in OPTIMIZER:  # reports count the optimizer states' reads
                read += sum(s.numel for s in segs)
        if len(powers) > 1:
            raise ReshardError(f"internal: buffer {buffer.key} mixes states that scale differently")
        with self._lock:
            self.reads[buffer.key] = read
        return WindowFill(parts, scale_power=powers.pop() if powers else 1)

    def storage(self, buffer: Buffer) -> Storage:
        """``buffer`` as a ``torch_zip`` placeholder storage, filled while its file is written."""
        return Storage(buffer.dtype, buffer.numel, self.fill(buffer), label=buffer.key)

    # -- replicas ------------------------------------------------------------------------------
    def check_replicas(self, targets: Iterable[Target]) -> list[Drift]:
        """Where the target merges copies of a replicated block, compare the copies of every
        block that has several (the states the target reads). Drift is collected for every
        parameter state; the ``mean`` policy replaces a drifted state by the mean of its copies."""
        if self.keeps_replicas:
            return []
        seen: set[tuple[str, str]] = set()
        drift: list[Drift] = []
        for t in targets:
            state = self.state_for(t.name, t.want)
            if state is None or (t.name, state) in seen:
                continue
            seen.add((t.name, state))
            m = self.reader.map(t.name, state)
            if not any(len(p.locations) > 1 for _, _, p in m.pieces()):
                continue
            found = self._compare(t.name, state, m)
            if found is not None:
                drift.append(found)
        drift.sort(key=lambda d: (d.param, STATES.index(d.state) if d.state in STATES else len(STATES)))
        return drift

    def _compare(self, name: str, state: str, m: ParamMap) -> Drift | None:
        shards = {r: self.read(name, state, r) for r in m.ranks}
        try:
            m.rebuild(shards, SCALE_POWER.get(state, 1), valid_only=True)
        except ReplicaMismatchError as e:
            ranks = tuple(sorted({self._tp_rank(name, state, r) for r in e.ranks}))
            if self.policy.kind == "mean":
                full = rebuild_mean(m, shards, SCALE_POWER.get(state, 1))
                if m.is_padded:
                    full = full[tuple(slice(0, n) for n in m.valid_shape)].contiguous()
                self._overrides[(name, state)] = (replicated(m.valid_shape, 1), full.reshape(-1))
            return Drift(name, state, ranks, e.max_abs_diff)
        return None

    def _tp_rank(self, name: str, state: str, rank: int) -> int:
        t = self.reader.tp_index(name, state, rank)
        return rank if t is None else t


def _check_slot(buffer: Buffer, slot: Slot) -> None:
    """A slot on a rank its map holds (nothing would fill it otherwise: a writer's slip, never
    silent zeros), inside its buffer."""
    if slot.rank not in slot.map.shards:
        raise ReshardError(f"internal: buffer {buffer.key}: a slot of {slot.name!r} on target rank "
                           f"{slot.rank}, which its map does not hold")
    end = slot.offset + slot.map.shard(slot.rank).numel
    if slot.offset < 0 or end > buffer.numel:
        raise ReshardError(f"internal: buffer {buffer.key}: the slot of {slot.name!r} (rank {slot.rank}) spans "
                           f"elements {slot.offset}..{end} of its {buffer.numel}")


def _check_covers(slot: Slot, segs: list[Segment], where: str) -> None:
    """The plan's segments must produce every element of the slot's shard (a padded target
    map's padding excepted)."""
    if slot.map.is_padded:
        return
    want = slot.map.shard(slot.rank).numel if slot.rank in slot.map.shards else 0
    got = sum(s.numel for s in segs)
    if got != want:
        raise CheckpointError(f"internal: {where}: the plan for {slot.name!r} fills {got} of target rank "
                              f"{slot.rank}'s {want} elements")


def _drift_error(reader: Reader, drift: list[Drift]) -> ReplicaMismatchError:
    listing = "; ".join(str(d) for d in drift)
    return ReplicaMismatchError(
        f"{reader.sources[-1]}: replicated blocks differ between ranks in {len(drift)} parameter state(s): "
        f"{listing}. Convert anyway with --on-replica-mismatch rank:N or mean (on_replica_mismatch=; recorded in "
        "the output).", ranks=drift[0].ranks, max_abs_diff=max(d.max_abs_diff for d in drift))


def run(reader: Reader, writer: Writer, out_dir: str | Path, *, workers: int = 1, overwrite: bool = False,
        checksum: str = "crc32", cluster: Cluster | None = None, progress: Any = None,
        on_replica_mismatch: str = "error", extra_sources: Sequence[Path] = (),
        staging: Any = None, notes: Sequence[str] = (), drop: Sequence[str] = ()) -> Report:
    """Write ``writer``'s target from ``reader``'s source into ``out_dir/<tag>`` (module doc).
    ``staging``: a staging folder already opened for this job (the command's early copies);
    ``notes``: what the report says beside the writer's (the checks the command ran); ``drop``:
    regexes of the source entries the job leaves out (``jobs.accounted``: weights the target has no
    place for are refused otherwise)."""
    policy = Policy.parse(on_replica_mismatch)
    verified.forget_pending()  # what an earlier job left unchecked is not this one's
    reader = writer.view(reader)  # the source as the target reads it (never changed by the writer)
    engine = Engine(reader, keeps_replicas=writer.keeps_replicas, policy=policy, target_tp=writer.tp_index)
    targets = engine.declare(writer.buffers())  # the writer's one declaration of what it fills
    accounted = account(reader, writer, targets, drop)
    drift = engine.check_replicas(targets)
    if drift and policy.kind == "error":
        raise _drift_error(reader, drift)
    engine.plan_all(targets)
    engine.seal()
    cluster = cluster or Cluster.from_env()
    if staging is None:  # a writer without a tag writes the output folder itself (a model folder)
        parent, tag = (Path(out_dir), writer.tag) if writer.tag is not None else (Path(out_dir).parent, Path(out_dir).name)
        staging = open_staging(cluster, parent, tag, sources=(*reader.sources, *extra_sources),
                               overwrite=overwrite, checksum=checksum, verify_source=verified.enabled())
    try:
        jobs = writer.jobs(engine, staging)
    except BaseException:
        if cluster.rank == 0:  # every process builds the same jobs, so every one fails alike
            staging.abandon()
        raise
    def share(mine: list) -> None:
        run_with_progress(mine, workers, progress, "file", f"reshard -> {writer.format}")
        verified.finish()  # what this process read and the writers' CRCs did not check: before anything commits

    run_share(cluster, staging, jobs, share)
    filled = {k for part in cluster.gather(sorted(engine.reads)) for k in part}
    agreed(cluster, staging, partial(engine.check_filled, filled))  # no declared buffer left unwritten
    # what one process writes last, from every process's files (DCP's .metadata); by default nothing
    agreed(cluster, staging, lambda: writer.finish(staging, cluster.gather, cluster.rank))
    meta = {"reshard_version": __version__, "format": writer.format, "source": str(reader.sources[-1]),
            "source_format": reader.format, "source_topology": reader.topology, **writer.meta(),
            "on_replica_mismatch": policy.text, "replica_drift": [str(d) for d in drift],
            "source_verified": verified.enabled(), **accounted.meta()}
    final = commit(cluster, staging, meta, writer.latest)
    reads = {k: v for part in cluster.gather(engine.reads) for k, v in part.items()}
    notes = [*notes, *writer.notes(), *accounted.notes()]
    if not verified.enabled():
        notes.append("source not verified (--no-verify-source): its records' CRC-32s were not checked, and the "
                     "manifest says so (source_verified: false)")
    for state in ("exp_avg", "exp_avg_sq"):
        if engine.missing.get(state):
            notes.append(f"the source holds no {state}: written as zeros, as a fresh optimizer holds them "
                         f"({len(engine.missing[state])} parameters)")
    files, size = written(final, manifest=False)
    tmeta = writer.meta()
    return Report(out_dir=final, source=dict(tmeta.get("source_topology", reader.topology)),
                  target=dict(tmeta.get("target_topology", {})), params=len(reader.names), files=files,
                  bytes_written=size, segments=engine.segments, elements_read=sum(reads.values()), policy=policy.text,
                  drift=drift, notes=notes, source_description=reader.description, target_format=writer.format,
                  not_carried=[h.key for h in accounted.not_carried], dropped=[h.key for h in accounted.dropped])
