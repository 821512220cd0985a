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

Every output file is built on its own: peak memory is one output file's tensors (one target
rank's optimizer partition, or one target TP rank's module), and each source byte an output file
needs is read once for it. Output is staged and committed atomically like ``reshard convert``
(``formats.output.Staging``); ``OUT/latest`` is written last.

Pipeline (``deepspeed.pipe``) checkpoints, TP=1: each parameter is whole on its stage's
model-parallel rank (a "stage map"), so the same machinery re-partitions every stage's flat
buffers over the target DP ranks. The stages are kept, or merged into one (``pp=1``); layer files
are copied as they are, since no stage count changes them. Another stage count is refused: which
layers form a stage depends on the training script's ``partition_method``, not recorded.

Target TP layouts: at the source's TP degree the source maps are kept; at TP=1 every parameter is
whole on its one rank. Any other TP degree needs the layout DeepSpeed's AutoTP uses there, which a
checkpoint at another degree does not record (it depends on head counts): pass ``layout=`` a
DeepSpeed checkpoint saved at the target TP (its ``universal_checkpoint_info.affine_map``), a map
document / ``{name: ParamMap}``, or ``"geometry"`` to rebuild each source layout at the new degree
from its geometry alone (``reshard.inspect.layout_of``: near-even splits, which can differ from
AutoTP's head-aligned ones).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .errors import CheckpointError, ReshardError
from .formats import deepspeed_writer as dsw
from .formats.deepspeed import SCALE_POWER, STATES, DeepSpeedCheckpoint
from .formats.output import Staging
from .formats.pickling import save
from .ir.apply import strided_copy
from .ir.param_map import ParamMap, maps_from_document
from .ir.piece import prod
from .layouts import compose, flat_ranges, pipeline_stage, replicated
from .memory import release
from .plan import TransferPlan
from .planner import Planner
from .topology import Topology

Layout = str | Path | Mapping[str, Any] | None


@dataclass
class ReshardReport:
    out_dir: Path
    source: dict
    target: dict
    params: int
    files: int
    bytes_written: int
    segments: int
    elements_read: int = 0
    notes: list[str] = field(default_factory=list)


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReshardError(f"{what} must be a positive integer, got {value!r}")
    return value


# -- the source ----------------------------------------------------------------------------------


class _Source:
    """What the source checkpoint says about its ZeRO-1/2 groups, checked against DeepSpeed's
    layout rule."""

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.ck = ck
        # A pipeline checkpoint (TP=1) has one model-parallel rank per stage; each parameter is
        # whole on its stage's rank, which the "stage map" below states. Everything else treats
        # model-parallel ranks alike, whether they are TP ranks or stages.
        self.pipe = bool(ck.layer_files) or ck.pp > 1
        self.mp = ck.mp
        ms0 = ck.model_state(0)
        for key in ("num_experts", "ds_autoep_layers"):
            if ms0.get(key):
                raise CheckpointError(f"{ck.model_files[0]}: mixture-of-experts checkpoints are not supported")
        groups = []
        for t in range(self.mp):
            g = ck.model_state(t).get("param_shapes")
            g = g if isinstance(g, list) else [g]
            groups.append([OrderedDict((n, tuple(s)) for n, s in grp.items()) for grp in g])
        if len({len(g) for g in groups}) != 1:
            raise CheckpointError(f"{ck.tag_dir}: model-parallel ranks record different numbers of parameter groups")
        self.groups = groups  # [tp][group] -> {name: shard shape}
        self.n_groups = len(groups[0])
        self.group_of: dict[str, int] = {}
        self.order: list[list[str]] = []
        for g in range(self.n_groups):
            names = list(dict.fromkeys(n for t in range(self.mp) for n in groups[t][g]))
            for n in names:
                if n in self.group_of:
                    raise CheckpointError(f"{ck.tag_dir}: {n!r} is in parameter groups {self.group_of[n]} and {g}")
                self.group_of[n] = g
            self.order.append(names)
        self.names = [n for grp in self.order for n in grp]
        cfg = ms0.get("ds_config") or {}
        zo = cfg.get("zero_optimization") or {}
        if zo.get("round_robin_gradients"):
            raise CheckpointError(f"{ck.tag_dir}: ZeRO round_robin_gradients reorders the flat buffer by DP size; "
                                  "not supported")
        if zo.get("elastic_checkpoint"):
            raise CheckpointError(f"{ck.tag_dir}: elastic ZeRO checkpoints are not supported")
        first = next((w for n in self.names if (w := ck.module_tensor(n, 0)) is not None), None)
        if first is None:
            raise CheckpointError(f"{ck.model_files[0]}: the module state holds none of the optimized parameters")
        self.dtype = first.dtype
        self.param_alignment_enabled = bool(zo.get("parameter_alignment", False))
        self.param_align = dsw.param_alignment(self.dtype, self.param_alignment_enabled)
        self.bf16 = any(p.name.startswith("bf16_") for p in ck.optim_files.values())
        self._check_layouts()
        self._check_rest(ms0)
        self.maps = {n: _stage_map(ck.param_shapes[ck.mp_rank(n, 0)][n], self.mp, ck.stage_of(n)) if self.pipe
                     else ck.tp_map(n).map for n in self.names}

    def _check_layouts(self) -> None:
        ck = self.ck
        for t in range(self.mp):
            osds = [ck.osd(t, d) for d in range(ck.dp)]
            for d, osd in enumerate(osds):
                base = osd.get("base_optimizer_state")
                if not isinstance(base, dict) or "state" not in base:
                    raise CheckpointError(f"{ck.optim_files[(t, d)]}: base_optimizer_state is not a torch optimizer "
                                          "state_dict (elastic checkpoint?); not supported")
                if len(osd["param_slice_mappings"]) != self.n_groups:
                    raise CheckpointError(f"{ck.optim_files[(t, d)]}: {len(osd['param_slice_mappings'])} groups, "
                                          f"the model states record {self.n_groups}")
            for g in range(self.n_groups):
                names, shapes = list(self.groups[t][g]), list(self.groups[t][g].values())
                layout = dsw.group_layout(names, shapes, ck.dp, param_align=self.param_align)
                dsw.check_source_layout(layout, osds, g, f"{ck.tag_dir} (tp rank {t})")
                for d in range(ck.dp):
                    lean = ck.osd(t, d)["single_partition_of_fp32_groups"][g].numel()
                    want = layout.partition - layout.group_padding(d)
                    if lean != want:
                        raise CheckpointError(f"{ck.optim_files[(t, d)]}: group {g} fp32 partition has {lean} elements, "
                                              f"the layout implies {want}: truncated or not a DeepSpeed 0.19.8 file")

    def _check_rest(self, ms0: dict) -> None:
        ck = self.ck
        for t in range(self.mp):
            frozen = ck.model_state(t).get("frozen_param_shapes") or {}
            real = [n for n, s in frozen.items() if prod(tuple(s))]
            if real:
                raise CheckpointError(f"{ck.model_files[t]}: frozen (non-optimized) parameters such as {real[0]!r} "
                                      "are not supported")
        self.shared = dict(ms0.get("shared_params") or {})
        buffers = set(ms0.get("buffer_names") or [])
        if self.pipe and any(ck.model_state(t).get(k) for t in range(self.mp) for k in ("buffer_names", "shared_params")):
            raise CheckpointError(f"{ck.tag_dir}: pipeline checkpoints with buffers or tied weights are not supported")
        for t in range(self.mp):
            module = ck.model_state(t).get("module") or {}
            unknown = [k for k in module if k not in self.group_of and k not in buffers and k not in self.shared]
            if unknown:
                raise CheckpointError(f"{ck.model_files[t]}: module entries {unknown[:3]} are neither optimized "
                                      "parameters, buffers nor tied aliases (frozen parameters?): not supported")
        steps = set()
        for (t, d) in ck.optim_files:
            for s in ck.osd(t, d)["base_optimizer_state"]["state"].values():
                if "step" in s:
                    steps.add(float(s["step"]))
        if len(steps) > 1:
            raise CheckpointError(f"{ck.tag_dir}: optimizer ranks are at different steps {sorted(steps)}")

    def label(self, t: int, d: int) -> int:
        return d * self.mp + t

    def start(self, t: int, d: int, name: str) -> int:
        g = self.group_of[name]
        return int(self.ck.osd(t, d)["param_slice_mappings"][g][name].start)

    def composite(self, name: str, tp_map: ParamMap) -> ParamMap:
        inner = {}
        for t in tp_map.ranks:
            entry = self.ck.zero_map_at(name, t)
            if entry is None:
                if tp_map.shard(t).numel:
                    raise CheckpointError(f"{self.ck.optim_files[(t, 0)]}: no optimizer fragments for {name!r}")
                inner[t] = ParamMap(tp_map.shard(t).shape, {})
            else:
                inner[t] = entry[1].with_ranks({d: self.label(t, d) for d in entry[1].ranks})
        try:
            return compose(tp_map, inner)
        except ReshardError as e:
            raise type(e)(f"{self.ck.tag_dir}: {name}: composing the TP map with the ZeRO split: {e}") from None


def _stage_map(shape: tuple[int, ...], stages: int, stage: int) -> ParamMap:
    """F whole on pipeline stage ``stage`` of a TP=1 checkpoint, whose model-parallel ranks are
    its stages (the ZeRO split inside the stage is composed on later)."""
    return pipeline_stage(shape, Topology(pp=stages, dp=1, tp=1), stage)


def _holds(m: ParamMap, t: int) -> bool:
    """Whether model-parallel rank ``t`` holds any of the parameter (a TP rank of an uneven
    split may hold none; a pipeline stage holds only its own parameters)."""
    return t in m.shards and m.shards[t].numel > 0


# -- target TP maps ------------------------------------------------------------------------------


def _match_map(maps: Mapping[str, ParamMap], name: str) -> ParamMap | None:
    if name in maps:
        return maps[name]
    key = rf"^{re.escape(name)}$"
    return maps.get(key)


def _target_maps(src: _Source, tp: int, layout: Layout) -> tuple[dict[str, ParamMap], dict | None, str]:
    """Target TP map of every parameter, the ``universal_checkpoint_info`` DeepSpeed would save
    with them, and where they came from."""
    ck = src.ck
    source = {n: ck.tp_map(n).map for n in src.names}
    src_info = ck.model_state(0).get("universal_checkpoint_info")
    if ck.tp > 1 and tp != ck.tp and not src_info:
        raise CheckpointError(f"{ck.tag_dir}: TP={ck.tp} checkpoint without universal_checkpoint_info: how its "
                              "parameters are split over TP ranks is not recorded, so TP cannot change")
    if layout is None:
        if tp == ck.tp:
            return source, src_info, "kept (same TP degree)"
        if tp == 1:
            return {n: replicated(m.valid_shape, 1) for n, m in source.items()}, None, "whole (TP=1)"
        raise ReshardError(
            f"changing TP from {ck.tp} to {tp} needs the layout DeepSpeed's AutoTP uses at TP={tp}, which the "
            f"source does not record: pass layout= a DeepSpeed checkpoint of this model saved at TP={tp}, a map "
            "document, or 'geometry' to rebuild the source layouts at the new degree from their geometry")
    info = None
    if isinstance(layout, str) and layout == "geometry":
        from .inspect import layout_of

        maps = {}
        for n, m in source.items():
            try:
                maps[n] = m if tp == ck.tp else (replicated(m.valid_shape, 1) if tp == 1 else layout_of(m).build(tp))
            except ReshardError as e:
                raise type(e)(f"parameter {n!r}: {e}") from None
        origin = "rebuilt from the source geometry"
    elif isinstance(layout, (str, Path)) and Path(layout).is_dir():
        lck = DeepSpeedCheckpoint.open(layout)
        if lck.tp != tp:
            raise ReshardError(f"layout checkpoint {lck.tag_dir} is at TP={lck.tp}, the target is TP={tp}")
        missing = [n for n in src.names if n not in set(lck.names)]
        if missing:
            raise ReshardError(f"layout checkpoint {lck.tag_dir} has no parameter {missing[0]!r}")
        maps = {n: lck.tp_map(n).map for n in src.names}
        info = lck.model_state(0).get("universal_checkpoint_info")
        origin = f"from {lck.tag_dir}"
        return _checked_maps(source, maps, tp), info, origin
    else:
        doc = layout
        if isinstance(layout, (str, Path)):
            try:
                doc = json.loads(Path(layout).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ReshardError(f"{layout}: cannot read a layout (checkpoint folder or JSON map document): {e}") \
                    from None
        if isinstance(doc, Mapping) and "params" in doc and not isinstance(doc.get("params"), ParamMap):
            doc = maps_from_document(doc)
        if not isinstance(doc, Mapping) or not all(isinstance(m, ParamMap) for m in doc.values()):
            raise ReshardError("layout must be a checkpoint folder, a map document or {name: ParamMap}")
        maps = {}
        for n in src.names:
            m = _match_map(doc, n)
            if m is None:
                raise ReshardError(f"layout has no map for parameter {n!r}")
            maps[n] = m
        origin = "from the given map document"
    maps = _checked_maps(source, maps, tp)
    if tp > 1:
        info = {k: v for k, v in (src_info or {"universal_checkpoint_version": 0.4}).items()
                if k not in ("sub_param_shard_widths", "affine_map")}
        info["affine_map"] = dsw.affine_map_entry(maps)
    return maps, info, origin


def _stage_maps(src: _Source, tp: int, pp: int, layout: Layout, zero_stage: int) -> tuple[dict[str, ParamMap], None, str]:
    """Target maps of a pipeline checkpoint: every parameter whole on its target stage. Stages
    are kept, or merged into one; any other stage count depends on the training script's
    ``partition_method``, which the checkpoint does not record."""
    ck = src.ck
    if tp != 1 or layout is not None:
        raise ReshardError(f"{ck.tag_dir}: a pipeline checkpoint has TP=1 and keeps it (tp=1, no layout)")
    if zero_stage != 1:
        raise ReshardError("DeepSpeed's pipeline engine supports ZeRO stage 1 only")
    if pp not in (1, ck.pp):
        raise ReshardError(f"{ck.tag_dir}: PP={ck.pp} can be kept or merged into PP=1; which layers form each of "
                           f"{pp} stages depends on the training script's partition_method, not recorded in the "
                           "checkpoint")
    maps = {n: _stage_map(m.logical_shape, pp, ck.stage_of(n) if pp == ck.pp else 0) for n, m in src.maps.items()}
    return maps, None, "pipeline stages kept" if pp == ck.pp else "pipeline stages merged into one"


def _checked_maps(source: Mapping[str, ParamMap], maps: Mapping[str, ParamMap], tp: int) -> dict[str, ParamMap]:
    out = {}
    for n, m in maps.items():
        if tuple(m.ranks) != tuple(range(tp)):
            raise ReshardError(f"target map of {n!r} is over ranks {list(m.ranks)}, expected TP ranks 0..{tp - 1}")
        if m.valid_shape != source[n].valid_shape:
            raise ReshardError(f"target map of {n!r} is for F {list(m.valid_shape)}, the source's is "
                               f"{list(source[n].valid_shape)}")
        try:
            m.check()
        except ReshardError as e:
            raise type(e)(f"target map of {n!r}: {e}") from None
        out[n] = m
    return out


# -- the target ----------------------------------------------------------------------------------


class _Target:
    def __init__(self, src: _Source, maps: dict[str, ParamMap], tp: int, dp: int) -> None:
        self.tp, self.dp = tp, dp
        self.maps = maps
        self.layouts: list[list[dsw.GroupLayout]] = []  # [tp rank][group]
        for t in range(tp):
            per_group = []
            for g in range(src.n_groups):
                # a zero-element shard is no optimizer parameter (DeepSpeed's is_optimized_parameter)
                names = [n for n in src.order[g] if _holds(maps[n], t)]
                shapes = [maps[n].shard(t).shape for n in names]
                per_group.append(dsw.group_layout(names, shapes, dp, param_align=src.param_align))
            self.layouts.append(per_group)
        self.empty = [[n for n in src.names if not _holds(maps[n], t)] for t in range(tp)]
        self.index = {}  # (t, name) -> (group, position)
        for t, per_group in enumerate(self.layouts):
            for g, lay in enumerate(per_group):
                for i, n in enumerate(lay.names):
                    self.index[(t, n)] = (g, i)

    def label(self, t: int, d: int) -> int:
        return d * self.tp + t

    def composite(self, name: str) -> ParamMap:
        m = self.maps[name]
        inner = {}
        for t in m.ranks:
            if (t, name) not in self.index:
                inner[t] = ParamMap(m.shard(t).shape, {})
                continue
            g, i = self.index[(t, name)]
            lay = self.layouts[t][g]
            off, n = lay.offsets[i], lay.numels[i]
            ranges = {}
            for d in range(self.dp):
                lo, hi = max(off, d * lay.partition), min(off + n, (d + 1) * lay.partition)
                if lo < hi:
                    ranges[self.label(t, d)] = (hi - lo, [(lo - off, 0, hi - lo)])
            inner[t] = flat_ranges(m.shard(t).shape, ranges)
        return compose(m, inner)


# -- execution -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SameTPRankFirst:
    """Which holder a target partition reads a block from. At an unchanged TP degree, the source
    TP rank with the target's TP index, so every TP rank's copy of a replicated block is carried
    over as it is (replicas that drifted apart stay apart, as in the source); then the planner's
    default (the holder already read from, the least loaded, the lowest)."""

    src_tp: int
    dst_tp: int

    def choose(self, holders, dst_rank, numel, sent, peers=frozenset()):
        pool = list(holders)
        if self.src_tp == self.dst_tp:
            pool = [h for h in pool if h % self.src_tp == dst_rank % self.dst_tp] or pool
        friends = [r for r in pool if r in peers]
        return min(friends or pool, key=lambda r: (sent.get(r, 0), r))


def _by_dst(plan: TransferPlan) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for s in plan.segments:
        out[s.dst_rank].append(s)
    return out


class _Writer:
    def __init__(self, src: _Source, tgt: _Target, zero_stage: int, uc_info: dict | None, staging: Staging,
                 planner: Planner) -> None:
        self.src, self.tgt, self.zero_stage, self.uc_info, self.staging = src, tgt, zero_stage, uc_info, staging
        self.planner = planner
        self.module_planner = Planner(_SameTPRankFirst(src.mp, tgt.tp))
        self._lock = threading.Lock()
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
                p = self.planner.plan(self.src.composite(n, self.src_maps[n]), self.tgt.composite(n))
                q = self.module_planner.plan(self.src_maps[n], self.tgt.maps[n])
            except ReshardError as e:
                raise type(e)(f"parameter {n!r}: {e}") from None
            self.opt_plans[n] = _by_dst(p)
            self.mod_plans[n] = _by_dst(q)
            self.segments += len(p.segments) + len(q.segments)

    # one target (tp, dp) optimizer partition
    def optim(self, t: int, d: int) -> None:
        src, tgt, ck = self.src, self.tgt, self.src.ck
        label = tgt.label(t, d)
        layouts = tgt.layouts[t]
        fp32, moments, read = [], [], 0
        for lay in layouts:
            bufs = {s: torch.zeros(lay.partition, dtype=torch.float32) for s in STATES}
            base = d * lay.partition
            for _, name, lo, hi in lay.fragments(d):
                segs = self.opt_plans[name].get(label, [])
                if sum(s.numel for s in segs) != hi - lo and not tgt.maps[name].is_padded:
                    raise CheckpointError(f"internal: plan for {name!r} fills {sum(s.numel for s in segs)} of the "
                                          f"{hi - lo} elements of target rank (tp {t}, dp {d})")
                for state in STATES:
                    dst = bufs[state].narrow(0, lo - base, hi - lo)
                    power = SCALE_POWER[state]
                    for s in segs:
                        sd, st = divmod(s.src_rank, src.mp)
                        flat = ck.flat_state(st, sd, src.group_of[name], state)
                        entry = ck.zero_map_at(name, st)[1]
                        frag = flat.narrow(0, src.start(st, sd, name), entry.shard(sd).numel)
                        strided_copy(dst, s.dst, frag, s.src, s.shape, s.factor ** power)
                        release(frag)  # mapped pages: drop them from our resident set (a re-read is a minor fault)
                        read += s.numel
            fp32.append(bufs["fp32"])
            moments.append({k: bufs[k] for k in ("exp_avg", "exp_avg_sq")})
        with self._lock:
            self.read += read
        src_file = ck.optim_state(0, 0)
        obj = dsw.optim_states(src_file, layouts=layouts, d=d, fp32=fp32, moments=moments,
                               zero_stage=self.zero_stage, ds_config=self.ds_config, uc_info=self.uc_info)
        with self.staging.open(dsw.optim_file(t, d, bf16=src.bf16)) as f:
            save(obj, f)

    # one target TP rank's model states
    def model(self, t: int) -> None:
        if self.src.pipe:
            return self._stage_model(t)
        src, tgt, ck = self.src, self.tgt, self.src.ck
        ms0 = ck.model_state(0)
        flats, views = [], {}
        for lay in tgt.layouts[t]:
            flat = torch.zeros(lay.total, dtype=src.dtype)
            flats.append(flat)
            for name, off, shape in zip(lay.names, lay.offsets, lay.shapes):
                views[name] = flat.narrow(0, off, prod(shape)).view(shape)
        for name, view in views.items():
            for s in self.mod_plans[name].get(t, []):
                shard = ck.module_tensor(name, s.src_rank)
                if shard is None:
                    raise CheckpointError(f"{ck.model_files[s.src_rank]}: module has no {name!r}")
                if shard.dtype != src.dtype:
                    raise CheckpointError(f"{ck.model_files[s.src_rank]}: {name} is {shard.dtype}, other weights "
                                          f"{src.dtype}: mixed training dtypes are not supported")
                flat_src = shard.detach().reshape(-1)
                flat_dst = view.view(-1)
                strided_copy(flat_dst, s.dst, flat_src, s.src, s.shape, s.factor)
                release(flat_src)
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
        param_shapes = [OrderedDict((n, torch.Size(s)) for n, s in zip(lay.names, lay.shapes))
                        for lay in tgt.layouts[t]]
        empty = OrderedDict((n, views[n]) for n in src.names if n in tgt.empty[t])
        obj = dsw.model_states(ms0, module=module, param_shapes=param_shapes, tp=tgt.tp, dp=tgt.dp, tp_rank=t,
                               zero_stage=self.zero_stage, shared_params=src.shared, uc_info=self.uc_info,
                               ds_config=self.ds_config, empty_params=empty)
        with self.staging.open(dsw.model_file(t)) as f:
            save(obj, f)

    def _stage_model(self, t: int) -> None:
        """One pipeline stage's model-state file: its parameters' shapes and the topology; the
        weights stay in the layer files, which no stage count changes."""
        ms0 = self.src.ck.model_state(0)
        param_shapes = [OrderedDict((n, torch.Size(s)) for n, s in zip(lay.names, lay.shapes))
                        for lay in self.tgt.layouts[t]]
        obj = dsw.model_states(ms0, module=None, param_shapes=param_shapes, tp=1, dp=self.tgt.dp, tp_rank=t,
                               zero_stage=self.zero_stage, shared_params={}, uc_info=None, ds_config=self.ds_config,
                               pp=self.tgt.tp)
        with self.staging.open(dsw.model_file(t)) as f:
            save(obj, f)

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
    layout: Layout = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    checksum: str = "crc32",
) -> ReshardReport:
    """Write the DeepSpeed checkpoint in ``ckpt_dir`` (a tag folder, or its parent with
    ``latest``) into ``out_dir/<tag>`` at TP=``tp`` x DP=``dp`` (default the source's DP) with
    ZeRO ``zero_stage`` (default the source's), plus ``out_dir/latest``, as DeepSpeed 0.19.8 would
    save it there. See the module docstring for ``layout``. Only ZeRO stages 1 and 2
    are supported; a pipeline (``deepspeed.pipe``) checkpoint keeps its stages or merges them into
    ``pp=1``. ``checksum`` is as for :func:`reshard.convert`."""
    tp, pp = _positive(tp, "tp"), _positive(pp, "pp")
    if dp is not None:
        _positive(dp, "dp")
    workers = _positive(workers, "workers")
    ck = DeepSpeedCheckpoint.open(ckpt_dir)
    dp = ck.dp if dp is None else dp
    if ck.zero_stage not in (1, 2):
        raise CheckpointError(f"{ck.tag_dir}: ZeRO stage {ck.zero_stage} checkpoints are not supported (only 1 and 2); "
                              "convert to a universal checkpoint with `reshard convert` instead")
    stage = ck.zero_stage if zero_stage is None else zero_stage
    if stage not in (1, 2):
        raise ReshardError(f"target ZeRO stage {stage!r} is not supported (only 1 and 2, which share one file format)")
    if (Path(out_dir) / ck.tag_dir.name).resolve() == ck.tag_dir.resolve():
        raise ReshardError(f"{ck.tag_dir}: the output would replace the source it is read from; "
                           "choose another output folder")
    src = _Source(ck)
    if src.pipe:
        maps, uc_info, origin = _stage_maps(src, tp, pp, layout, stage)
        mp = pp
    else:
        if pp != 1:
            raise ReshardError(f"{ck.tag_dir}: not a pipeline (deepspeed.pipe) checkpoint; pp={pp} needs one")
        maps, uc_info, origin = _target_maps(src, tp, layout)
        mp = tp
    tgt = _Target(src, maps, mp, dp)
    staging = Staging(out_dir, ck.tag_dir.name, overwrite=overwrite, checksum=checksum)
    writer = _Writer(src, tgt, stage, uc_info, staging, Planner(_SameTPRankFirst(src.mp, mp)))
    jobs: list[Callable[[], None]] = [lambda t=t: writer.model(t) for t in range(mp)]
    jobs += [lambda t=t, d=d: writer.optim(t, d) for t in range(mp) for d in range(dp)]
    # a layer file holds one layer's weights whatever the stage count: copied as it is
    jobs += [lambda p=p: staging.copy(p, p.name) for _, p in sorted(ck.layer_files.items())]
    try:
        writer.plan_all(src.names)
        done = 0
        if workers == 1:
            for job in jobs:
                job()
                done += 1
                if progress:
                    progress(done, len(jobs))
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for fut in [pool.submit(job) for job in jobs]:
                    fut.result()
                    done += 1
                    if progress:
                        progress(done, len(jobs))
    except BaseException:
        staging.abandon()
        raise
    meta = {
        "reshard_version": __version__,
        "format": "deepspeed",
        "source": str(ck.tag_dir),
        "source_topology": {"tp": ck.tp, "dp": ck.dp, "pp": ck.pp, "zero_stage": ck.zero_stage},
        "target_topology": {"tp": tp, "dp": dp, "pp": pp, "zero_stage": stage},
        "target_tp_layout": origin,
    }
    final = staging.commit(meta, latest_name="latest")
    files = [p for p in final.rglob("*") if p.is_file()]
    return ReshardReport(final, meta["source_topology"], meta["target_topology"], len(src.names), len(files),
                         sum(p.stat().st_size for p in files), writer.segments, writer.read,
                         [f"target TP layout {origin}"])


def summary(report: ReshardReport) -> str:
    s, t = report.source, report.target

    def topo(x: dict) -> str:
        return f"TP={x['tp']} x DP={x['dp']}" + (f" x PP={x['pp']}" if x.get("pp", 1) > 1 else "")

    return (f"wrote {report.out_dir}: {topo(s)} ZeRO-{s['zero_stage']} -> {topo(t)} "
            f"ZeRO-{t['zero_stage']} ({report.params} parameters, {report.files} files, "
            f"{report.bytes_written / 2**20:.1f} MiB, {report.segments} plan segments)")
