"""Offline resharding: a DeepSpeed ZeRO-1/2 checkpoint at one TP x DP topology to another, file
to file, as DeepSpeed 0.19.8 itself would have saved it at the target topology (so
``engine.load_checkpoint`` loads it natively, no universal checkpoint involved).

For every parameter two plans are made, never a full tensor:

* **optimizer states** (fp32 master, ``exp_avg``, ``exp_avg_sq``): the source's composite map --
  its TP map composed with the ZeRO split of each TP shard into DP fragments, over global ranks
  ``dp_rank * TP + tp_rank`` -- planned against the target's composite map. Each segment copies
  a strided block from a memory-mapped source partition straight into the target partition
  being built, scaled by ``factor ** scale_power`` (1, -1, -2 for fp32, exp_avg, exp_avg_sq).
* **module weights** (the training dtype): the source TP map planned against the target TP map,
  read from the memory-mapped source model-state files into the target's flat module buffer.

Every output file is streamed (``formats.torch_zip``): its flat buffers are placeholders whose
bytes the plan's segments produce one chunk at a time as the file is written
(``execute.WindowFill``), byte-identical to ``torch.save`` of the built tensors, and cut into
stripes that workers and processes write side by side (``cluster.ArchiveJob``). Peak memory is a
couple of chunks per worker, whatever the checkpoint size; each output byte is computed once, and
each source byte an output file needs is read once for it. Output is staged and committed atomically like ``reshard convert``
(``formats.output.Staging``); ``OUT/latest`` is written last.

Pipeline (``deepspeed.pipe``) checkpoints, with or without Megatron-style TP: each parameter's TP
map sits on its stage's model-parallel ranks ``stage * tp + t`` (a "stage map"), so the same
machinery re-partitions every stage's flat buffers over the target DP ranks and TP ranks. The
stages are kept, or merged into one (``pp=1``); TP is kept, or changed where the checkpoint's
``universal_checkpoint_info`` categories fix the layout (``target_layout``). Layer files
(``layer_LL[-model_TT]-model_states.pt``) are copied as they are at an unchanged TP degree, since
no stage count changes them, and otherwise written per target TP rank from the module plans.
Another stage count is refused: which layers form a stage depends on the training script's
``partition_method``, not recorded.

The source is read and checked by ``formats.deepspeed_zero12.Zero12Source``; the target's
model-parallel maps come from ``target_layout`` (``layout=``); both composites are built by
``layouts.compose_zero``; the files are written in DeepSpeed's format by ``formats.deepspeed_writer``.
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
from ..formats.deepspeed.checkpoint import SCALE_POWER, STATES, DeepSpeedCheckpoint
from ..formats.deepspeed.target_layout import TargetLayout, layout_sources, target_stage_maps, target_tp_maps
from ..formats.deepspeed.zero12 import Zero12Source
from ..ir.param_map import ParamMap
from ..ir.piece import prod
from ..layouts import compose_zero
from ..layouts.topology import Topology
from ..layouts.zero import FlatGroup
from ..plan.planner import DefaultCost, Planner
from ..plan.values import Segment, TransferPlan
from ..storage.staging import Staging
from ..storage.torch_zip import Storage
from .cluster import ArchiveJob, Cluster, OutputJob, commit, open_staging, run_share
from .offline_experts import reshard_experts
from .offline_experts_zero3 import reshard_autoep_zero3
from .offline_moe import reshard_moe
from .offline_zero3 import reshard_zero3
from .reports import ReshardReport, written
from .workers import run_with_progress


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReshardError(f"{what} must be a positive integer, got {value!r}")
    return value


def _holds(m: ParamMap, t: int) -> bool:
    """Whether model-parallel rank ``t`` holds any of the parameter (a TP rank of an uneven
    split may hold none; a pipeline stage holds only its own parameters)."""
    return t in m.shards and m.shards[t].numel > 0


# -- the target ----------------------------------------------------------------------------------


class _Target:
    def __init__(self, src: Zero12Source, maps: dict[str, ParamMap], tp: int, dp: int) -> None:
        self.tp, self.dp = tp, dp
        self.topology = Topology(1, dp, tp)
        self.maps = maps
        self.groups: list[list[FlatGroup]] = []  # [model-parallel rank][parameter group]
        for t in range(tp):
            per_group = []
            for g in range(src.n_groups):
                # a zero-element shard is no optimizer parameter (DeepSpeed's is_optimized_parameter)
                names = [n for n in src.order[g] if _holds(maps[n], t)]
                shapes = [maps[n].shard(t).shape for n in names]
                per_group.append(dsw.flat_group(names, shapes, dp, param_align=src.param_align))
            self.groups.append(per_group)
        self.empty = [[n for n in src.names if not _holds(maps[n], t)] for t in range(tp)]
        self.index = {}  # (t, name) -> (group, position)
        for t, per_group in enumerate(self.groups):
            for g, grp in enumerate(per_group):
                for i, n in enumerate(grp.names):
                    self.index[(t, n)] = (g, i)

    def composite(self, name: str) -> ParamMap:
        """``name``'s target model-parallel map composed with the ZeRO split of the target's flat
        groups, over global ranks ``topology.rank(0, dp, mp)``."""
        zero = {}
        for t in self.maps[name].ranks:
            where = self.index.get((t, name))
            zero[t] = None if where is None else self.groups[t][where[0]].param_map(where[1])
        return compose_zero(self.maps[name], zero, self.topology)


# -- execution -----------------------------------------------------------------------------------


def _same_tp_rank(src_mp: int, dst_mp: int, src_tp: int | None = None, dst_tp: int | None = None) -> DefaultCost:
    """At an unchanged TP degree, read every block from the source rank with the target's TP
    index, so each TP rank's copy of a replicated block is carried over as it is (replicas that
    drifted apart stay apart, as in the source). Model-parallel rank ``m`` is ``stage * tp + t``;
    without a pipeline ``tp`` is ``mp``."""
    src_tp, dst_tp = src_tp or src_mp, dst_tp or dst_mp
    if src_tp != dst_tp:
        return DefaultCost()
    return DefaultCost(prefer=lambda holder, dst: holder % src_mp % src_tp == dst % dst_mp % dst_tp)


def _by_dst(plan: TransferPlan) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for s in plan.segments:
        out[s.dst_rank].append(s)
    return out


class _Writer:
    def __init__(self, src: Zero12Source, tgt: _Target, zero_stage: int, uc_info: dict | None, staging: Staging,
                 planner: Planner, tp: int, pp: int) -> None:
        self.src, self.tgt, self.zero_stage, self.uc_info, self.staging = src, tgt, zero_stage, uc_info, staging
        self.planner = planner
        self.tp, self.pp = tp, pp  # the target's TP ranks and stages (tgt.tp = tp * pp model-parallel ranks)
        self.module_planner = Planner(_same_tp_rank(src.mp, tgt.tp, src.ck.tp, tp))
        ms0 = src.ck.model_state(0)
        self.ds_config = dsw.target_ds_config(ms0.get("ds_config"), tp=1 if src.pipe else tgt.tp, dp=tgt.dp,
                                              zero_stage=zero_stage)
        self.src_maps = src.maps
        self.opt_plans: dict[str, dict[int, list]] = {}
        self.mod_plans: dict[str, dict[int, list]] = {}
        self.segments = 0
        self.read = 0

    def plan_all(self, names: list[str]) -> None:
        for n in names:
            try:
                p = self.planner.plan(self.src.composite(n), self.tgt.composite(n))
                q = self.module_planner.plan(self.src_maps[n], self.tgt.maps[n])
            except ReshardError as e:
                raise in_context(e, f"parameter {n!r}") from None
            self.opt_plans[n] = _by_dst(p)
            self.mod_plans[n] = _by_dst(q)
            self.segments += len(p.segments) + len(q.segments)
            self.read += len(STATES) * sum(s.numel for s in p.segments)

    # one target (tp, dp) optimizer partition: each state's partition a placeholder whose bytes the
    # plan's segments produce chunk by chunk while the file is written (never the whole partition)
    def optim(self, t: int, d: int) -> Any:
        tgt, ck = self.tgt, self.src.ck
        rank = tgt.topology.rank(0, d, t)
        groups = tgt.groups[t]
        fp32, moments = [], []
        for g, grp in enumerate(groups):
            base = d * grp.partition
            parts = []
            for i, lo, hi in grp.fragments(d):
                name = grp.names[i]
                segs = self.opt_plans[name].get(rank, [])
                if sum(s.numel for s in segs) != hi - lo and not tgt.maps[name].is_padded:
                    raise CheckpointError(f"internal: plan for {name!r} fills {sum(s.numel for s in segs)} of the "
                                          f"{hi - lo} elements of target rank (tp {t}, dp {d})")
                parts += [(lo - base, s, name) for s in segs]
            flats = {state: Storage(torch.float32, grp.partition, self._optim_fill(parts, state),
                                    label=f"{state} of group {g}") for state in STATES}
            fp32.append(flats["fp32"])
            moments.append({k: flats[k].view((grp.partition,)) for k in dsw.MOMENTS})
        return dsw.optim_states(ck.optim_state(0, 0), groups=groups, d=d, fp32=fp32, moments=moments,
                                zero_stage=self.zero_stage, ds_config=self.ds_config, uc_info=self.uc_info)

    def _optim_fill(self, parts: list[tuple[int, Segment, str]], state: str) -> WindowFill:
        """One state of a partition from ``(offset in the partition, segment, parameter)``: each
        segment reads the parameter's fragment of a memory-mapped source partition."""
        src, ck = self.src, self.src.ck

        def fragment(s: Segment, name: str) -> torch.Tensor:
            sd, st = src.topology.dp_rank(s.src_rank), src.topology.tp_rank(s.src_rank)
            flat = ck.flat_state(st, sd, src.group_of[name], state)
            return flat.narrow(0, src.start(st, sd, name), ck.zero_map_at(name, st)[1].shard(sd).numel)

        return WindowFill([(base, s, lambda s=s, name=name: fragment(s, name)) for base, s, name in parts],
                          scale_power=SCALE_POWER[state])

    # one target TP rank's model states: each flat group a placeholder filled chunk by chunk
    def model(self, t: int) -> Any:
        if self.src.pipe:
            return self._stage_model(t)
        src, tgt, ck = self.src, self.tgt, self.src.ck
        ms0 = ck.model_state(0)
        views: dict[str, Any] = {}
        for g, grp in enumerate(tgt.groups[t]):
            parts = [(off, s, lambda s=s, name=name: self._module_source(name, s.src_rank))
                     for name, off in zip(grp.names, grp.offsets) for s in self.mod_plans[name].get(t, [])]
            flat = Storage(src.dtype, grp.total, WindowFill(parts), label=f"module group {g}")
            for name, off, shape in zip(grp.names, grp.offsets, grp.shapes):
                views[name] = flat.view(shape, offset=off)
        for name in tgt.empty[t]:
            views[name] = torch.empty(tgt.maps[name].shard(t).shape, dtype=src.dtype)
        module = OrderedDict()
        for key, value in (ms0.get("module") or {}).items():
            if key in views:
                module[key] = views[key]
            elif key in src.shared:
                module[key] = None  # filled below, sharing the canonical tensor
            else:
                module[key] = self._buffer(key, value, t)
        for key, canonical in src.shared.items():
            if key in module:
                module[key] = views.get(canonical, module.get(canonical))
                if module[key] is None:
                    raise CheckpointError(f"{ck.model_files[0]}: {key!r} is tied to {canonical!r}, which the module "
                                          "does not hold")
        param_shapes = self._param_shapes(t)
        empty = OrderedDict((n, views[n]) for n in src.names if n in tgt.empty[t])
        return dsw.model_states(ms0, module=module, param_shapes=param_shapes, tp=tgt.tp, dp=tgt.dp, tp_rank=t,
                                zero_stage=self.zero_stage, shared_params=src.shared, uc_info=self.uc_info,
                                ds_config=self.ds_config, empty_params=empty)

    def _stage_model(self, t: int) -> Any:
        """One model-parallel rank's model-state file of a pipeline checkpoint: its parameters'
        shapes, the topology and the training script's ``universal_checkpoint_info``; the weights
        are in the layer files."""
        ms0 = self.src.ck.model_state(0)
        return dsw.model_states(ms0, module=None, param_shapes=self._param_shapes(t), tp=self.tp, dp=self.tgt.dp,
                                tp_rank=t % self.tp, zero_stage=self.zero_stage, shared_params={},
                                uc_info=self.uc_info, ds_config=self.ds_config, pp=self.pp)

    def layer(self, layer: int, t: int) -> Any:
        """Layer file ``layer`` of target TP rank ``t``: each parameter's target shard in a storage
        of its own (DeepSpeed clones every tensor before saving), in the source file's key order,
        produced from the source layer files through the module plans."""
        ck, src = self.src.ck, self.src
        state = OrderedDict()
        for key in ck.layer_state(ck.layer_files[(layer, 0)]):
            name = f"{layer}.{key}"
            m = self.tgt.maps[name]
            dst = min(m.ranks) + t  # TP rank t of the target stage: stage * tp + t
            parts = [(0, s, lambda s=s, name=name: self._module_source(name, s.src_rank))
                     for s in self.mod_plans[name].get(dst, [])]
            shape = m.shard(dst).shape
            state[key] = Storage(src.dtype, prod(shape), WindowFill(parts), label=name).view(shape)
        return state

    def _param_shapes(self, t: int) -> list[OrderedDict]:
        """``param_shapes`` of target model-parallel rank ``t``: one ordered dict per flat group."""
        return [OrderedDict((n, torch.Size(s)) for n, s in zip(grp.names, grp.shapes)) for grp in self.tgt.groups[t]]

    def _module_source(self, name: str, rank: int) -> torch.Tensor:
        """Source model-parallel rank ``rank``'s module weight of ``name``, flat (memory-mapped):
        from its model-state file, or a pipeline checkpoint's layer file of that TP rank."""
        ck = self.src.ck
        t = rank % ck.tp
        shard = ck.module_tensor(name, t)
        where = ck.model_files[rank]
        if self.src.pipe:
            where = ck.layer_files.get((int(name.partition(".")[0]), t), where)
        if shard is None:
            raise CheckpointError(f"{where}: module has no {name!r} (model-parallel rank {rank})")
        if shard.dtype != self.src.dtype:
            raise CheckpointError(f"{where}: {name} (model-parallel rank {rank}) is {shard.dtype}, other weights "
                                  f"{self.src.dtype}: mixed training dtypes are not supported")
        return shard.detach().reshape(-1)

    def _buffer(self, key: str, value: torch.Tensor, t: int) -> torch.Tensor:
        """A non-parameter module entry (a persistent buffer), copied: at an unchanged TP degree
        from the same TP rank; else AutoTP leaves buffers whole on every TP rank, so every source
        rank must hold the same one."""
        ck = self.src.ck
        if ck.tp == self.tgt.tp:
            return (ck.model_state(t).get("module") or {})[key].clone()
        for r in range(1, ck.tp):
            other = (ck.model_state(r).get("module") or {}).get(key)
            if other is None or other.shape != value.shape or not torch.equal(other, value):
                raise CheckpointError(f"{ck.model_files[r]}: buffer {key!r} differs from TP rank 0's; cannot tell "
                                      "how it is split")
        return value.clone()


def reshard(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int,
    dp: int | None = None,
    pp: int = 1,
    zero_stage: int | None = None,
    workers: int = 1,
    layout: TargetLayout = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | bool | None = None,
    checksum: str = "crc32",
    cluster: Cluster | None = None,
    ep: int | None = None,
) -> ReshardReport:
    """Write the DeepSpeed checkpoint in ``ckpt_dir`` (a tag folder, or its parent with
    ``latest``) into ``out_dir/<tag>`` at TP=``tp`` x DP=``dp`` (default the source's DP) with
    ZeRO ``zero_stage`` (default the source's), plus ``out_dir/latest``, as DeepSpeed 0.19.8 would
    save it there. See the module docstring for ``layout``. ZeRO stages 1 and 2 are supported, and
    ZeRO-3 (with or without AutoTP) to another TP x DP or stage (``offline_zero3``); a pipeline (``deepspeed.pipe``)
    checkpoint keeps its stages or merges them into ``pp=1``. ``checksum`` is as for :func:`reshard.convert`.
    Launched by ``torchrun`` (or with ``cluster``), every process writes a share of the files and
    the commit is collective (``reshard.jobs.cluster``). An AutoEP checkpoint goes to
    ``offline_experts``, a classic MoE one to ``offline_moe``, at expert-parallel degree ``ep``
    (default the source's)."""
    tp, pp = _positive(tp, "tp"), _positive(pp, "pp")
    if dp is not None:
        _positive(dp, "dp")
    workers = _positive(workers, "workers")
    ck = DeepSpeedCheckpoint.open(ckpt_dir)
    dp = ck.dp if dp is None else dp
    # AutoEP under ZeRO-3: every expert parameter a ZeRO-3 partition over its EDP group (offline_experts_zero3)
    if ck.zero_stage == 3 and ck.experts is not None:
        ep = _positive(ep, "ep") if ep is not None else ck.experts.ep
        return reshard_autoep_zero3(ck, out_dir, ep=ep, dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, workers=workers,
                                    overwrite=overwrite, progress=progress, checksum=checksum, cluster=cluster)
    # AutoEP / classic MoE experts: their own placement and expert-data-parallel partitions
    # (offline_experts, offline_moe)
    if ep is not None or (ck.zero_stage != 3 and (ck.experts is not None or ck.moe is not None)):
        ep = _positive(ep, "ep") if ep is not None else (ck.experts or ck.moe).ep
        by_kind = reshard_moe if ck.experts is None and ck.zero_stage != 3 and ck.moe is not None else reshard_experts
        return by_kind(ck, out_dir, ep=ep, dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, workers=workers,
                       overwrite=overwrite, progress=progress, checksum=checksum, cluster=cluster)
    # ZeRO-3 at either end (one partition per parameter): a file format and writer of its own
    if ck.zero_stage == 3 or zero_stage == 3:
        return reshard_zero3(ck, out_dir, tp=tp, dp=dp, pp=pp, zero_stage=zero_stage, workers=workers, layout=layout,
                             overwrite=overwrite, progress=progress, checksum=checksum, cluster=cluster)
    if ck.zero_stage not in (1, 2):
        raise CheckpointError(f"{ck.tag_dir}: ZeRO stage {ck.zero_stage} checkpoints are not supported (only 1 and 2); "
                              "convert to a universal checkpoint with `reshard convert` instead")
    stage = ck.zero_stage if zero_stage is None else zero_stage
    if stage not in (1, 2):
        raise ReshardError(f"target ZeRO stage {stage!r} is not supported (only 1 and 2, which share one file format)")
    src = Zero12Source(ck)
    if src.pipe:
        maps, uc_info, origin = target_stage_maps(src, tp, pp, layout, stage)
        mp = pp * tp
    else:
        if pp != 1:
            raise ReshardError(f"{ck.tag_dir}: not a pipeline (deepspeed.pipe) checkpoint; pp={pp} needs one")
        maps, uc_info, origin = target_tp_maps(src, tp, layout)
        mp = tp
    tgt = _Target(src, maps, mp, dp)
    cluster = cluster or Cluster.from_env()
    staging = open_staging(cluster, out_dir, ck.tag_dir.name, sources=(*ck.sources, *layout_sources(layout)),
                           overwrite=overwrite,
                           checksum=checksum)
    writer = _Writer(src, tgt, stage, uc_info, staging, Planner(_same_tp_rank(src.mp, mp, ck.tp, tp)), tp, pp)
    esize = src.dtype.itemsize
    jobs: list[OutputJob] = [ArchiveJob(dsw.model_file(t), sum(g.total for g in tgt.groups[t]) * esize,
                                  lambda t=t: writer.model(t)) for t in range(mp)]
    jobs += [ArchiveJob(dsw.optim_file(t, d, bf16=src.bf16), sum(g.partition for g in tgt.groups[t]) * 4 * len(STATES),
                        lambda t=t, d=d: writer.optim(t, d)) for t in range(mp) for d in range(dp)]
    # a layer file holds one layer's weights of one TP rank whatever the stage count: copied as it
    # is at an unchanged TP degree, else written per target TP rank
    if tp == ck.tp:
        jobs += [(p.stat().st_size, lambda p=p: staging.copy(p, p.name)) for _, p in sorted(ck.layer_files.items())]
    else:
        layers = sorted({layer for layer, _ in ck.layer_files})
        jobs += [ArchiveJob(dsw.layer_file(L, t), ck.layer_files[(L, 0)].stat().st_size // ck.tp,
                            lambda L=L, t=t: writer.layer(L, t)) for L in layers for t in range(tp)]

    def run(mine: list[Callable[[], None]]) -> None:
        writer.plan_all(src.names)
        run_with_progress(mine, workers, progress, "file", "reshard reshard")

    run_share(cluster, staging, jobs, run)
    meta = {
        "reshard_version": __version__,
        "format": "deepspeed",
        "source": str(ck.tag_dir),
        "source_topology": {"tp": ck.tp, "dp": ck.dp, "pp": ck.pp, "zero_stage": ck.zero_stage},
        "target_topology": {"tp": tp, "dp": dp, "pp": pp, "zero_stage": stage},
        "target_tp_layout": origin,
    }
    final = commit(cluster, staging, meta, latest_name="latest")
    return ReshardReport(final, meta["source_topology"], meta["target_topology"], len(src.names), *written(final),
                         writer.segments, writer.read, [f"target TP layout {origin}"])
