"""Offline resharding with ZeRO-3 at either end, at TP=1 or under AutoTP at any TP degree, file
to file, as DeepSpeed 0.19.8 itself would have saved the target (so ``engine.load_checkpoint``
loads it natively):

* ZeRO-3 at one TP x DP topology to ZeRO-3 at another;
* ZeRO-3 to ZeRO-1/2 (one ``mp_rank_TT_model_states.pt`` per TP rank whose module weights are the
  fp32 master cast to the training dtype, as DeepSpeed's ZeRO-1/2 engine holds them, and flat
  partitions);
* ZeRO-1/2 (no pipeline) to ZeRO-3 (the module weights dropped: ZeRO-3 files hold placeholders,
  and the fp32 master is what a ZeRO-3 engine loads).

Every parameter is one plan: its source composite map -- its TP map composed with the ZeRO split
of each TP shard (``zero3(shard, dp, shard="fragment")``, or the ZeRO-1/2 flat group's fragments),
over global ranks ``dp_rank * TP + tp_rank`` -- against the target's composite, planned by
``reshard.plan.planner.Planner``. The target TP maps come from ``target_layout.target_tp_maps`` (kept at
the source's TP degree, whole at TP=1, else from ``layout=``). Every output file is streamed
(``formats.torch_zip``): each flat buffer is a placeholder whose bytes the plan's segments produce
one chunk at a time as the file is written (``execute.WindowFill``), reading memory-mapped source
partitions; no output tensor is ever whole in memory, and each source byte an output file needs
is read once for it. Output is staged and committed atomically (``formats.output.Staging``);
``OUT/latest`` is written last. Sources are checked (``formats.deepspeed_zero3.Zero3Source``,
``formats.deepspeed_zero12.Zero12Source``) before anything is written; the files' dictionaries
come from ``formats.deepspeed_zero3`` and ``formats.deepspeed_writer``.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import CheckpointError, ReshardError, in_context
from ..execute.local import WindowFill
from ..formats.deepspeed import writer as dsw
from ..formats.deepspeed import zero3 as z3
from ..formats.deepspeed.checkpoint import SCALE_POWER, DeepSpeedCheckpoint
from ..formats.deepspeed.target_layout import layout_sources, target_tp_maps
from ..formats.deepspeed.zero12 import Zero12Source
from ..ir.param_map import ParamMap
from ..ir.piece import prod
from ..layouts import compose_zero, zero3
from ..layouts.topology import Topology
from ..layouts.zero import FlatGroup
from ..plan.planner import DefaultCost, Planner
from ..plan.values import Segment
from ..storage.staging import Staging
from ..storage.torch_zip import Storage, save
from .cluster import ArchiveJob, Cluster, OutputJob, commit, open_staging, run_share
from .reports import ReshardReport, written
from .workers import run_with_progress

Part = tuple[int, Segment, str]  # (where the segment's target fragment starts in the buffer, segment, parameter)


# -- sources: each parameter's map over the source ranks and its fragments there ------------------


class _Zero3In:
    """A ZeRO-3 source (``Zero3Source``) as the writers read it."""

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.z3 = src = z3.Zero3Source(ck)
        self.ck, self.tp, self.dp, self.bf16, self.cfg = ck, src.tp, src.dp, src.bf16, src.cfg
        self.names, self.group_names = src.names, src.group_names
        self.topology = Topology(1, self.dp, self.tp)  # global rank = dp_rank * tp + tp_rank
        self.states = z3.STATES if src.has_moments else ("fp32",)
        self.ds_ids, self.ds_ids_exact = src.ds_ids, src.ds_ids_exact
        self.shared = dict(src.template.get("shared_params") or {})
        self.dtype = _placeholder_dtype(src.template, self.names, ck.model_files[0])
        self.template = src.template

    def map(self, name: str) -> ParamMap:
        if self.tp == 1:
            return zero3(self.z3.shapes[name], self.dp, shard="fragment")
        return self.ck.composite_map(name, self.ck.tp_map(name).map)

    def fragment(self, rank: int, name: str, state: str) -> torch.Tensor:
        return self.z3.fragment(self.topology.tp_rank(rank), self.topology.dp_rank(rank), name, state)

    def optim_source(self) -> dict:
        return self.ck.optim_state(0, 0)


class _Zero12In:
    """A ZeRO-1/2 source without pipeline stages (``Zero12Source``) as the writers read it."""

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.z12 = src = Zero12Source(ck)
        if src.pipe:
            raise ReshardError(f"{ck.tag_dir}: only a ZeRO-1/2 checkpoint without pipeline stages is written at "
                               f"ZeRO stage 3 (this one is TP={ck.tp} x PP={ck.pp})")
        self.ck, self.tp, self.dp, self.bf16, self.dtype = ck, ck.tp, ck.dp, src.bf16, src.dtype
        self.topology = src.topology
        self.cfg = ck.model_state(0).get("ds_config")
        self.names, self.group_names = src.names, src.order
        self.states = z3.STATES
        self.shared = dict(src.shared)
        # ZeRO-3 numbers parameters (ds_id) in model order, which the module's key order gives
        module = [k for k in (ck.model_state(0).get("module") or {}) if k in src.group_of]
        self.ds_ids_exact = sorted(module) == sorted(self.names)
        self.ds_ids = {n: i for i, n in enumerate(module if self.ds_ids_exact else self.names)}
        self.template = z3.model_template_from_zero12(ck.model_state(0), params=self.names, shared=self.shared,
                                                      dtype=self.dtype)

    def map(self, name: str) -> ParamMap:
        return self.z12.composite(name)

    def fragment(self, rank: int, name: str, state: str) -> torch.Tensor:
        src, ck = self.z12, self.ck
        d, t = src.topology.dp_rank(rank), src.topology.tp_rank(rank)
        flat = ck.flat_state(t, d, src.group_of[name], state)
        return flat.narrow(0, src.start(t, d, name), ck.zero_map_at(name, t)[1].shard(d).numel)

    def optim_source(self) -> dict:
        return z3.optim_source_from_zero12(self.ck.optim_state(0, 0))


Source = _Zero3In | _Zero12In


def _placeholder_dtype(template: dict, names: list[str], where: Any) -> torch.dtype:
    """The training dtype: that of the module's parameter placeholders (all alike)."""
    module = template.get("module") or {}
    dtypes = {module[n].dtype for n in names if isinstance(module.get(n), torch.Tensor)}
    if len(dtypes) != 1:
        raise CheckpointError(f"{where}: the module's parameter placeholders have dtypes {sorted(map(str, dtypes))}; "
                              "expected one training dtype")
    return dtypes.pop()


# -- targets: each parameter's map over the target ranks, and the files' flat buffers --------------


class _Out:
    """What both target kinds share: TP maps, the global-rank topology, no empty TP shard."""

    def __init__(self, src: Source, maps: dict[str, ParamMap], tp: int, dp: int) -> None:
        self.tp, self.dp, self.tp_maps = tp, dp, maps
        self.topology = Topology(1, dp, tp)
        self.shard = {(t, n): tuple(maps[n].shard(t).shape) for t in range(tp) for n in src.names}
        empty = next(((t, n) for (t, n), s in self.shard.items() if not prod(s)), None)
        if empty is not None:
            raise ReshardError(f"parameter {empty[1]!r} has no elements on TP rank {empty[0]} at TP={tp}: an uneven "
                               "split is not written with ZeRO-3 at either end")

    def composite(self, name: str, zero: Callable[[int], ParamMap]) -> ParamMap:
        """``name``'s target TP map composed with ``zero(t)``, TP rank ``t``'s ZeRO split."""
        if self.tp == 1:
            return zero(0)
        return compose_zero(self.tp_maps[name], {t: zero(t) for t in self.tp_maps[name].ranks}, self.topology)


class _Zero3Out(_Out):
    """ZeRO-3 files at TP x DP: per (TP, DP) rank one flat partition per sub-group of its TP shards."""

    stage = 3

    def __init__(self, src: Source, maps: dict[str, ParamMap], tp: int, dp: int) -> None:
        super().__init__(src, maps, tp, dp)
        size = z3.sub_group_size(src.cfg, str(src.ck.model_files[0]))
        self.subs = [z3.sub_groups([[(n, self.shard[(t, n)]) for n in g] for g in src.group_names], dp, size)
                     for t in range(tp)]

    def map(self, name: str) -> ParamMap:
        return self.composite(name, lambda t: zero3(self.shard[(t, name)], self.dp, shard="fragment"))

    def buffers(self, t: int, d: int, maps: dict[str, ParamMap]) -> list[tuple[int, list[tuple[int, str]]]]:
        """(TP ``t``, DP ``d``)'s flat buffers: ``(elements, [(offset of a fragment, parameter)])``."""
        rank = self.topology.rank(0, d, t)
        return [(sg.numel, [(off, n) for n, off in zip(sg.names, sg.offsets) if rank in maps[n].shards])
                for sg in self.subs[t]]


class _Zero12Out(_Out):
    """ZeRO-1/2 files at TP x DP: per (TP, DP) rank one flat partition per parameter group."""

    def __init__(self, src: Source, maps: dict[str, ParamMap], tp: int, dp: int, stage: int) -> None:
        super().__init__(src, maps, tp, dp)
        self.stage = stage
        zo = (src.cfg or {}).get("zero_optimization") if isinstance(src.cfg, dict) else None
        align = dsw.param_alignment(src.dtype, bool((zo or {}).get("parameter_alignment", False)))
        self.groups: list[list[FlatGroup]] = [
            [dsw.flat_group(g, [self.shard[(t, n)] for n in g], dp, param_align=align) for g in src.group_names]
            for t in range(tp)]
        self.index = {(t, n): (grp, i) for t in range(tp) for grp in self.groups[t] for i, n in enumerate(grp.names)}

    def map(self, name: str) -> ParamMap:
        def zero(t: int) -> ParamMap:
            grp, i = self.index[(t, name)]
            return grp.param_map(i)
        return self.composite(name, zero)

    def buffers(self, t: int, d: int, maps: dict[str, ParamMap]) -> list[tuple[int, list[tuple[int, str]]]]:
        return [(grp.partition, [(lo - d * grp.partition, grp.names[i]) for i, lo, _ in grp.fragments(d)])
                for grp in self.groups[t]]


Target = _Zero3Out | _Zero12Out


# -- the writer ------------------------------------------------------------------------------------


def _same_tp_rank(src_tp: int, dst_tp: int) -> Planner:
    """At an unchanged TP degree every block is read from the source rank with the target's TP
    index, so each TP rank's copy of a replicated block is carried over as it is."""
    if src_tp != dst_tp:
        return Planner()
    return Planner(DefaultCost(prefer=lambda holder, dst: holder % src_tp == dst % dst_tp))


class _Writer:
    def __init__(self, src: Source, tgt: Target, staging: Staging, uc_info: dict | None) -> None:
        self.src, self.tgt, self.staging, self.uc_info = src, tgt, staging, uc_info
        self.ds_config = dsw.target_ds_config(src.cfg, tp=tgt.tp, dp=tgt.dp, zero_stage=tgt.stage)
        self.maps = {n: tgt.map(n) for n in src.names}
        self.plans: dict[str, dict[int, list[Segment]]] = {}
        self.segments = 0
        self.reads: dict[tuple[int, int], int] = {}  # elements read for each (TP, DP) rank's optimizer file

    def plan_all(self) -> None:
        planner = _same_tp_rank(self.src.tp, self.tgt.tp)
        for name in self.src.names:
            try:
                p = planner.plan(self.src.map(name), self.maps[name])
            except ReshardError as e:
                raise in_context(e, f"parameter {name!r}") from None
            by_dst: dict[int, list[Segment]] = defaultdict(list)
            for s in p.segments:
                by_dst[s.dst_rank].append(s)
            self.plans[name] = by_dst
            self.segments += len(p.segments)

    def parts(self, rank: int, fragments: list[tuple[int, str]]) -> list[Part]:
        """Every segment filling target (global) rank ``rank``'s fragments (``(offset, parameter)``)
        of one buffer, checked to fill each whole."""
        out: list[Part] = []
        for off, name in fragments:
            segs = self.plans[name].get(rank, [])
            m = self.maps[name]
            n = m.shard(rank).numel if rank in m.shards else 0
            if sum(s.numel for s in segs) != n:
                raise CheckpointError(f"internal: the plan for {name!r} fills {sum(s.numel for s in segs)} of rank "
                                      f"{rank}'s {n} elements")
            out += [(off, s, name) for s in segs]
        return out

    def fill(self, parts: list[Part], state: str, scale_power: int | None = None) -> WindowFill:
        """One state's buffer, produced window by window from memory-mapped source fragments."""
        src = self.src
        return WindowFill([(off, s, lambda s=s, n=n: src.fragment(s.src_rank, n, state)) for off, s, n in parts],
                          scale_power=SCALE_POWER[state] if scale_power is None else scale_power)

    def flats(self, t: int, d: int) -> tuple[list[Storage], list[dict[str, Any]]]:
        """(TP ``t``, DP ``d``)'s optimizer partitions: per buffer an fp32 placeholder and the moments' views."""
        fp32, moments, read = [], [], 0
        rank = self.tgt.topology.rank(0, d, t)
        for k, (numel, fragments) in enumerate(self.tgt.buffers(t, d, self.maps)):
            parts = self.parts(rank, fragments)
            read += len(self.src.states) * sum(s.numel for _, s, _ in parts)
            bufs = {state: Storage(torch.float32, numel, self.fill(parts, state), label=f"{state} of buffer {k}")
                    for state in self.src.states}
            fp32.append(bufs["fp32"])
            moments.append({m: bufs[m].view((numel,)) for m in z3.MOMENTS if m in bufs})
        self.reads[(t, d)] = read  # the same whichever process builds the file, however often
        return fp32, moments

    def report(self, cluster: Cluster, final: Path, source: dict, target: dict, notes: list[str],
               ds_id_note: str) -> ReshardReport:
        """The job's report; the source elements read are summed over every process (a file
        built by several processes counted once)."""
        read = sum({k: v for reads in cluster.gather(self.reads) for k, v in reads.items()}.values())
        if not self.src.ds_ids_exact:
            notes.append(f"the source's ds_id names {ds_id_note}; the written ds_id attributes are a best guess "
                         "(DeepSpeed's loader does not read them)")
        files, size = written(final)
        return ReshardReport(out_dir=final, source=source, target=target, params=len(self.src.names), files=files,
                             bytes_written=size, segments=self.segments, elements_read=read, notes=notes)

    # -- ZeRO-3 files
    def z3_optim(self, t: int, d: int) -> Any:
        src, tgt = self.src, self.tgt
        fp32, moments = self.flats(t, d)
        has_moments = "exp_avg" in src.states
        return z3.optim_states(src.optim_source(), subs=tgt.subs[t], dp=tgt.dp, fp32=fp32,
                               moments=moments if has_moments else None, ds_ids=src.ds_ids, ds_config=self.ds_config)

    def z3_model(self, t: int, d: int) -> None:
        tgt = self.tgt
        obj = z3.model_states(self.src.template, subs=tgt.subs[t], d=d, dp=tgt.dp, ds_config=self.ds_config, t=t,
                              tp=tgt.tp, uc_info=self.uc_info)
        with self.staging.open(z3.model_file(d, t)) as f:
            save(obj, f)

    # -- ZeRO-1/2 files
    def z12_optim(self, t: int, d: int) -> Any:
        src, tgt = self.src, self.tgt
        fp32, moments = self.flats(t, d)
        clip = src.cfg.get("gradient_clipping", 0.0) if isinstance(src.cfg, dict) else 0.0
        source = z3.optim_source_from_zero3(src.optim_source(), clip_grad=clip)
        return dsw.optim_states(source, groups=tgt.groups[t], d=d, fp32=fp32, moments=moments, zero_stage=tgt.stage,
                                ds_config=self.ds_config, uc_info=self.uc_info)

    def z12_model(self, t: int) -> Any:
        """``mp_rank_TT_model_states.pt``: each group's TP shards one flat buffer of the training
        dtype, the fp32 master cast, every partition's fragments at their place in the whole buffer."""
        src, tgt = self.src, self.tgt
        template = src.template
        views: dict[str, Any] = {}
        for g, grp in enumerate(tgt.groups[t]):
            parts = [p for d in range(tgt.dp)
                     for p in self.parts(tgt.topology.rank(0, d, t), [(lo, grp.names[i]) for i, lo, _ in
                                                                      grp.fragments(d)])]
            flat = Storage(src.dtype, grp.total, self.fill(parts, "fp32", scale_power=1), label=f"module group {g}")
            for name, off, shape in zip(grp.names, grp.offsets, grp.shapes):
                views[name] = flat.view(shape, offset=off)
        module: OrderedDict = OrderedDict()
        for key, value in (template.get("module") or {}).items():
            canonical = src.shared.get(key, key)
            module[key] = views[canonical] if canonical in views else value  # buffers are whole in ZeRO-3 files
        shapes = [OrderedDict((n, torch.Size(s)) for n, s in zip(grp.names, grp.shapes)) for grp in tgt.groups[t]]
        return dsw.model_states(template, module=module, param_shapes=shapes, tp=tgt.tp, dp=tgt.dp, tp_rank=t,
                                zero_stage=tgt.stage, shared_params=src.shared, uc_info=self.uc_info,
                                ds_config=self.ds_config)

    def jobs(self) -> list[OutputJob]:
        """Every output file: the large ones as archives written in stripes."""
        tgt, n_states, bf16 = self.tgt, len(self.src.states), self.src.bf16
        ranks = [(t, d) for t in range(tgt.tp) for d in range(tgt.dp)]
        if isinstance(tgt, _Zero3Out):
            model = self.src.ck.model_files[0].stat().st_size
            return ([ArchiveJob(z3.optim_file(d, bf16=bf16, t=t), sum(sg.numel for sg in tgt.subs[t]) * 4 * n_states,
                                lambda t=t, d=d: self.z3_optim(t, d)) for t, d in ranks]
                    + [(model, lambda t=t, d=d: self.z3_model(t, d)) for t, d in ranks])
        jobs: list[OutputJob] = [
            ArchiveJob(dsw.optim_file(t, d, bf16=bf16), sum(g.partition for g in tgt.groups[t]) * 4 * n_states,
                       lambda t=t, d=d: self.z12_optim(t, d)) for t, d in ranks]
        return jobs + [ArchiveJob(dsw.model_file(t), sum(g.total for g in tgt.groups[t]) * self.src.dtype.itemsize,
                                  lambda t=t: self.z12_model(t)) for t in range(tgt.tp)]


# -- entry point -----------------------------------------------------------------------------------


def _target(ck: DeepSpeedCheckpoint, pp: int, stage: int | None) -> int:
    """The target ZeRO stage, after refusing what this module cannot write."""
    stage = ck.zero_stage if stage is None else stage
    if pp != 1:
        raise ReshardError(f"{ck.tag_dir}: ZeRO-3 is resharded over TP and DP only (PP=1); got pp={pp}")
    if ck.zero_stage == 3 and stage not in (1, 2, 3):
        raise ReshardError(f"{ck.tag_dir}: a ZeRO-3 checkpoint is written at ZeRO stage 1, 2 or 3, not {stage!r}")
    if ck.zero_stage != 3 and (ck.zero_stage not in (1, 2) or stage != 3):
        raise ReshardError(f"{ck.tag_dir}: ZeRO stage {ck.zero_stage} -> {stage!r} is not written here (ZeRO-1/2 "
                           "-> ZeRO-3 only)")
    return stage


def reshard_zero3(ck: DeepSpeedCheckpoint, out_dir: str | Path, *, tp: int, dp: int, pp: int = 1,
                  zero_stage: int | None = None, workers: int = 1, layout: Any = None,
                  overwrite: bool = False, progress: Callable[[int, int], None] | bool | None = None,
                  checksum: str = "crc32", cluster: Cluster | None = None) -> ReshardReport:
    """Write ``ck`` into ``out_dir/<tag>`` at TP=``tp`` x DP=``dp``, plus ``out_dir/latest``: a
    ZeRO-3 checkpoint at ZeRO stage ``zero_stage`` (3 by default, or 1/2), or a ZeRO-1/2
    checkpoint at stage 3. A new TP degree other than 1 takes its AutoTP layout from ``layout``
    (``target_layout.target_tp_maps``). Under a launcher (or with ``cluster``) every process
    writes a share of the files and the commit is collective, as for ZeRO-1/2 (``reshard.jobs.cluster``)."""
    stage = _target(ck, pp, zero_stage)
    src: Source = _Zero3In(ck) if ck.zero_stage == 3 else _Zero12In(ck)
    maps, uc_info, origin = target_tp_maps(src, tp, layout)  # type: ignore[arg-type]  # reads .ck and .names
    tgt: Target = _Zero3Out(src, maps, tp, dp) if stage == 3 else _Zero12Out(src, maps, tp, dp, stage)
    cluster = cluster or Cluster.from_env()
    staging = open_staging(cluster, out_dir, ck.tag_dir.name, sources=(*ck.sources, *layout_sources(layout)),
                           overwrite=overwrite,
                           checksum=checksum)
    writer = _Writer(src, tgt, staging, uc_info if tp > 1 else None)

    def run(mine: list[Callable[[], None]]) -> None:
        writer.plan_all()
        run_with_progress(mine, workers, progress, "file", "reshard reshard")

    run_share(cluster, staging, writer.jobs(), run)
    source = {"tp": ck.tp, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage}
    target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage}
    meta = {"reshard_version": __version__, "format": "deepspeed", "source": str(ck.tag_dir),
            "source_topology": source, "target_topology": target,
            "target_tp_layout": "none (TP=1)" if tp == 1 and ck.tp == 1 else origin}
    final = commit(cluster, staging, meta, latest_name="latest")
    notes = [] if tp == 1 and ck.tp == 1 else [f"target TP layout {origin}"]
    if isinstance(tgt, _Zero3Out):
        notes.append(f"{len(tgt.subs[0])} sub-group(s) per rank (sub_group_size "
                     f"{z3.sub_group_size(src.cfg, str(ck.model_files[0]))})")
    return writer.report(cluster, final, source, target, notes, "do not number its parameters consecutively")
