"""Offline resharding with ZeRO-3 at either end (TP=1), file to file, as DeepSpeed 0.19.8 itself
would have saved the target (so ``engine.load_checkpoint`` loads it natively):

* ZeRO-3 at one DP size to ZeRO-3 at another;
* ZeRO-3 to ZeRO-1/2 (one ``mp_rank_00_model_states.pt`` whose module weights are the fp32 master
  cast to the training dtype, as DeepSpeed's ZeRO-1/2 engine holds them, and flat partitions);
* ZeRO-1/2 (TP=1, no pipeline) to ZeRO-3 (the module weights dropped: ZeRO-3 files hold
  placeholders, and the fp32 master is what a ZeRO-3 engine loads).

Every parameter is one plan: its source map (``zero3(shape, dp, shard="fragment")``, or the
ZeRO-1/2 flat group's fragments) against its target map, planned by ``reshard.planner.Planner``.
Every output file is streamed (``formats.torch_zip``): each flat buffer is a placeholder whose
bytes the plan's segments produce one chunk at a time as the file is written
(``execute.WindowFill``), reading memory-mapped source partitions; no output tensor is ever
whole in memory, and each source byte an output file needs is read once for it. Output is staged
and committed atomically (``formats.output.Staging``); ``OUT/latest`` is written last. Sources
are checked (``formats.deepspeed_zero3.Zero3Source``, ``formats.deepspeed_zero12.Zero12Source``)
before anything is written; the files' dictionaries come from ``formats.deepspeed_zero3`` and
``formats.deepspeed_writer``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .cluster import Cluster, commit, open_staging, run_share
from .errors import CheckpointError, ReshardError, in_context
from .execute import WindowFill
from .formats import deepspeed_writer as dsw
from .formats import deepspeed_zero3 as z3
from .formats.deepspeed import SCALE_POWER, DeepSpeedCheckpoint
from .formats.deepspeed_zero12 import Zero12Source
from .formats.output import Staging
from .formats.torch_zip import Storage, save
from .ir.param_map import ParamMap
from .layouts import zero3
from .layouts.zero import FlatGroup
from .plan import Segment
from .planner import Planner
from .reports import ReshardReport, written
from .workers import run_with_progress

Part = tuple[int, Segment, str]  # (where the segment's target fragment starts in the buffer, segment, parameter)


# -- sources: each parameter's map over the source ranks and its fragments there ------------------


class _Zero3In:
    """A ZeRO-3 source (``Zero3Source``) as the writers read it."""

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.z3 = src = z3.Zero3Source(ck)
        self.ck, self.dp, self.bf16, self.cfg = ck, src.dp, src.bf16, src.cfg
        self.names, self.shapes, self.groups = src.names, src.shapes, src.groups
        self.states = z3.STATES if src.has_moments else ("fp32",)
        self.ds_ids, self.ds_ids_exact = src.ds_ids, src.ds_ids_exact
        self.shared = dict(src.template.get("shared_params") or {})
        self.dtype = _placeholder_dtype(src.template, self.names, ck.model_files[0])

    def map(self, name: str) -> ParamMap:
        return zero3(self.shapes[name], self.dp, shard="fragment")

    def fragment(self, rank: int, name: str, state: str) -> torch.Tensor:
        return self.z3.fragment(rank, name, state)

    def optim_source(self) -> dict:
        return self.ck.optim_state(0, 0)


class _Zero12In:
    """A ZeRO-1/2 source at TP=1 (``Zero12Source``) as the writers read it."""

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.z12 = src = Zero12Source(ck)
        if src.pipe or ck.tp != 1:
            raise ReshardError(f"{ck.tag_dir}: only a TP=1 ZeRO-1/2 checkpoint without pipeline stages is written "
                               f"at ZeRO stage 3 (this one is TP={ck.tp} x PP={ck.pp})")
        self.ck, self.dp, self.bf16, self.dtype = ck, ck.dp, src.bf16, src.dtype
        self.cfg = ck.model_state(0).get("ds_config")
        self.names = src.names
        self.shapes = {n: tuple(src.maps[n].logical_shape) for n in self.names}
        self.groups = [[(n, self.shapes[n]) for n in order] for order in src.order]
        self.states = z3.STATES
        self.shared = dict(src.shared)
        # ZeRO-3 numbers parameters (ds_id) in model order, which the module's key order gives
        module = [k for k in (ck.model_state(0).get("module") or {}) if k in self.shapes]
        self.ds_ids_exact = sorted(module) == sorted(self.names)
        self.ds_ids = {n: i for i, n in enumerate(module if self.ds_ids_exact else self.names)}

    def map(self, name: str) -> ParamMap:
        return self.z12.composite(name)

    def fragment(self, rank: int, name: str, state: str) -> torch.Tensor:
        src, ck = self.z12, self.ck
        d = src.topology.dp_rank(rank)
        flat = ck.flat_state(0, d, src.group_of[name], state)
        return flat.narrow(0, src.start(0, d, name), ck.zero_map_at(name, 0)[1].shard(d).numel)

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


class _Zero3Out:
    """ZeRO-3 files at DP=``dp``: per rank, one flat partition per sub-group."""

    stage = 3

    def __init__(self, src: Source, dp: int) -> None:
        self.dp = dp
        self.subs = z3.sub_groups(src.groups, dp, z3.sub_group_size(src.cfg, str(src.ck.model_files[0])))

    def map(self, name: str, shape: tuple[int, ...]) -> ParamMap:
        return zero3(shape, self.dp, shard="fragment")

    def buffers(self, d: int, maps: dict[str, ParamMap]) -> list[tuple[int, list[tuple[int, str]]]]:
        """Rank ``d``'s flat buffers: ``(elements, [(offset of a fragment, parameter)])``."""
        return [(sg.numel, [(off, n) for n, off in zip(sg.names, sg.offsets) if d in maps[n].shards])
                for sg in self.subs]


class _Zero12Out:
    """ZeRO-1/2 files at TP=1 x DP=``dp``: per rank, one flat partition per parameter group."""

    def __init__(self, src: Source, dp: int, stage: int) -> None:
        self.dp, self.stage = dp, stage
        zo = (src.cfg or {}).get("zero_optimization") if isinstance(src.cfg, dict) else None
        align = dsw.param_alignment(src.dtype, bool((zo or {}).get("parameter_alignment", False)))
        self.groups: list[FlatGroup] = [dsw.flat_group([n for n, _ in g], [s for _, s in g], dp, param_align=align)
                                        for g in src.groups]
        self.index = {n: (grp, i) for grp in self.groups for i, n in enumerate(grp.names)}

    def map(self, name: str, shape: tuple[int, ...]) -> ParamMap:
        grp, i = self.index[name]
        return grp.param_map(i)

    def buffers(self, d: int, maps: dict[str, ParamMap]) -> list[tuple[int, list[tuple[int, str]]]]:
        return [(grp.partition, [(lo - d * grp.partition, grp.names[i]) for i, lo, _ in grp.fragments(d)])
                for grp in self.groups]


Target = _Zero3Out | _Zero12Out


# -- the writer ------------------------------------------------------------------------------------


class _Writer:
    def __init__(self, src: Source, tgt: Target, staging: Staging) -> None:
        self.src, self.tgt, self.staging = src, tgt, staging
        self.ds_config = dsw.target_ds_config(src.cfg, tp=1, dp=tgt.dp, zero_stage=tgt.stage)
        self.maps = {n: tgt.map(n, src.shapes[n]) for n in src.names}
        self.plans: dict[str, dict[int, list[Segment]]] = {}
        self.segments = 0
        self.read = 0
        self._lock = threading.Lock()

    def plan_all(self) -> None:
        planner = Planner()  # one source holds each element (TP=1): nothing to choose between
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

    def parts(self, d: int, fragments: list[tuple[int, str]]) -> list[Part]:
        """Every segment filling target rank ``d``'s fragments (``(offset, parameter)``) of one
        buffer, checked to fill each whole."""
        out: list[Part] = []
        for off, name in fragments:
            segs = self.plans[name].get(d, [])
            n = self.maps[name].shard(d).numel
            if sum(s.numel for s in segs) != n:
                raise CheckpointError(f"internal: the plan for {name!r} fills {sum(s.numel for s in segs)} of dp rank "
                                      f"{d}'s {n} elements")
            out += [(off, s, name) for s in segs]
        return out

    def fill(self, parts: list[Part], state: str, scale_power: int | None = None) -> WindowFill:
        """One state's buffer, produced window by window from memory-mapped source fragments."""
        src = self.src
        return WindowFill([(off, s, lambda s=s, n=n: src.fragment(s.src_rank, n, state)) for off, s, n in parts],
                          scale_power=SCALE_POWER[state] if scale_power is None else scale_power)

    def flats(self, d: int) -> tuple[list[Storage], list[dict[str, Any]]]:
        """Rank ``d``'s optimizer partitions: per buffer an fp32 placeholder and the moments' views."""
        fp32, moments, read = [], [], 0
        for k, (numel, fragments) in enumerate(self.tgt.buffers(d, self.maps)):
            parts = self.parts(d, fragments)
            read += len(self.src.states) * sum(s.numel for _, s, _ in parts)
            bufs = {state: Storage(torch.float32, numel, self.fill(parts, state), label=f"{state} of buffer {k}")
                    for state in self.src.states}
            fp32.append(bufs["fp32"])
            moments.append({m: bufs[m].view((numel,)) for m in z3.MOMENTS if m in bufs})
        with self._lock:
            self.read += read
        return fp32, moments

    # -- ZeRO-3 files
    def z3_optim(self, d: int) -> None:
        src, tgt = self.src, self.tgt
        fp32, moments = self.flats(d)
        has_moments = "exp_avg" in src.states
        obj = z3.optim_states(src.optim_source(), subs=tgt.subs, dp=tgt.dp, fp32=fp32,
                              moments=moments if has_moments else None, ds_ids=src.ds_ids, ds_config=self.ds_config)
        with self.staging.open(z3.optim_file(d, bf16=src.bf16)) as f:
            save(obj, f)

    def z3_model(self, d: int) -> None:
        src = self.src
        if isinstance(src, _Zero3In):
            template = src.z3.template
        else:
            template = z3.model_template_from_zero12(src.ck.model_state(0), params=src.names, shared=src.shared,
                                                     dtype=src.dtype)
        obj = z3.model_states(template, subs=self.tgt.subs, d=d, dp=self.tgt.dp, ds_config=self.ds_config)
        with self.staging.open(z3.model_file(d)) as f:
            save(obj, f)

    # -- ZeRO-1/2 files
    def z12_optim(self, d: int) -> None:
        src, tgt = self.src, self.tgt
        fp32, moments = self.flats(d)
        clip = src.cfg.get("gradient_clipping", 0.0) if isinstance(src.cfg, dict) else 0.0
        source = z3.optim_source_from_zero3(src.optim_source(), clip_grad=clip)
        obj = dsw.optim_states(source, groups=tgt.groups, d=d, fp32=fp32, moments=moments, zero_stage=tgt.stage,
                               ds_config=self.ds_config, uc_info=None)
        with self.staging.open(dsw.optim_file(0, d, bf16=src.bf16)) as f:
            save(obj, f)

    def z12_model(self) -> None:
        """``mp_rank_00_model_states.pt``: each group's weights one flat buffer of the training dtype,
        the fp32 master cast, every partition's fragments at their place in the whole buffer."""
        src, tgt = self.src, self.tgt
        template = src.z3.template
        views: dict[str, Any] = {}
        for g, grp in enumerate(tgt.groups):
            parts = [p for d in range(tgt.dp) for p in self.parts(d, [(lo, grp.names[i]) for i, lo, _ in
                                                                      grp.fragments(d)])]
            flat = Storage(src.dtype, grp.total, self.fill(parts, "fp32", scale_power=1), label=f"module group {g}")
            for name, off, shape in zip(grp.names, grp.offsets, grp.shapes):
                views[name] = flat.view(shape, offset=off)
        module: OrderedDict = OrderedDict()
        for key, value in (template.get("module") or {}).items():
            canonical = src.shared.get(key, key)
            module[key] = views[canonical] if canonical in views else value  # buffers are whole in ZeRO-3 files
        shapes = [OrderedDict((n, torch.Size(s)) for n, s in zip(grp.names, grp.shapes)) for grp in tgt.groups]
        obj = dsw.model_states(template, module=module, param_shapes=shapes, tp=1, dp=tgt.dp, tp_rank=0,
                               zero_stage=tgt.stage, shared_params=src.shared, uc_info=None, ds_config=self.ds_config)
        with self.staging.open(dsw.model_file(0)) as f:
            save(obj, f)

    def jobs(self) -> list[tuple[int, Callable[[], None]]]:
        """``(bytes, job)`` for every output file."""
        tgt, n_states = self.tgt, len(self.src.states)
        if isinstance(tgt, _Zero3Out):
            part = sum(sg.numel for sg in tgt.subs) * 4 * n_states
            model = self.src.ck.model_files[0].stat().st_size
            return ([(part, lambda d=d: self.z3_optim(d)) for d in range(tgt.dp)]
                    + [(model, lambda d=d: self.z3_model(d)) for d in range(tgt.dp)])
        part = sum(g.partition for g in tgt.groups) * 4 * n_states
        jobs = [(part, lambda d=d: self.z12_optim(d)) for d in range(tgt.dp)]
        return jobs + [(sum(g.total for g in tgt.groups) * self.src.dtype.itemsize, self.z12_model)]


# -- entry point -----------------------------------------------------------------------------------


def _target(ck: DeepSpeedCheckpoint, tp: int, pp: int, stage: int | None, layout: Any) -> int:
    """The target ZeRO stage, after refusing what this module cannot write."""
    stage = ck.zero_stage if stage is None else stage
    if tp != 1 or pp != 1:
        raise ReshardError(f"{ck.tag_dir}: ZeRO-3 is resharded over DP only (TP=1, PP=1); got tp={tp}, pp={pp}")
    if layout is not None:
        raise ReshardError("layout= sets a target TP layout; ZeRO-3 resharding keeps TP=1")
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
    """Write ``ck`` into ``out_dir/<tag>`` at TP=1 x DP=``dp``, plus ``out_dir/latest``: a ZeRO-3
    checkpoint at ZeRO stage ``zero_stage`` (3 by default, or 1/2), or a TP=1 ZeRO-1/2 checkpoint
    at stage 3. Under a launcher (or with ``cluster``) every process writes a share of the files
    and the commit is collective, as for ZeRO-1/2 (``reshard.cluster``)."""
    stage = _target(ck, tp, pp, zero_stage, layout)
    if (Path(out_dir) / ck.tag_dir.name).resolve() == ck.tag_dir.resolve():
        raise ReshardError(f"{ck.tag_dir}: the output would replace the source it is read from; "
                           "choose another output folder")
    src: Source = _Zero3In(ck) if ck.zero_stage == 3 else _Zero12In(ck)
    tgt: Target = _Zero3Out(src, dp) if stage == 3 else _Zero12Out(src, dp, stage)
    cluster = cluster or Cluster.from_env()
    staging = open_staging(cluster, out_dir, ck.tag_dir.name, overwrite=overwrite, checksum=checksum)
    writer = _Writer(src, tgt, staging)

    def run(mine: list[Callable[[], None]]) -> None:
        writer.plan_all()
        run_with_progress(mine, workers, progress, "file", "reshard reshard")

    run_share(cluster, staging, writer.jobs(), run)
    source = {"tp": 1, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage}
    target = {"tp": 1, "dp": dp, "pp": 1, "zero_stage": stage}
    meta = {"reshard_version": __version__, "format": "deepspeed", "source": str(ck.tag_dir),
            "source_topology": source, "target_topology": target, "target_tp_layout": "none (TP=1)"}
    final = commit(cluster, staging, meta, latest_name="latest")
    read = sum(cluster.gather(writer.read))
    notes = []
    if isinstance(tgt, _Zero3Out):
        notes.append(f"{len(tgt.subs)} sub-group(s) per rank (sub_group_size "
                     f"{z3.sub_group_size(src.cfg, str(ck.model_files[0]))})")
    if not src.ds_ids_exact:
        notes.append("the source's ds_id names do not number its parameters consecutively; the written ds_id "
                     "attributes are a best guess (DeepSpeed's loader does not read them)")
    files, size = written(final)
    return ReshardReport(out_dir=final, source=source, target=target, params=len(src.names), files=files,
                         bytes_written=size, segments=writer.segments, elements_read=read, notes=notes)
