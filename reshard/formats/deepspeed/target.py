"""A DeepSpeed 0.19.8 checkpoint at a target topology, laid out as DeepSpeed saves it there (so
``engine.load_checkpoint`` loads it natively), from any source: one :class:`DeepSpeedTarget`, a
:class:`~reshard.formats.deepspeed.layout.Layout` and the files built on it.

The layout says every rank's optimizer partitions, whatever the kind: ZeRO-1/2 flat groups or
ZeRO-3 sub-groups, over TP / pipeline-stage maps or expert placements (``layout``). Every
optimizer file is the partitions of one global rank (``zero12.optim_states`` under the flat rule,
``zero3.optim_states`` under the sub-group rule); each parameter's fragment is a slot of its
composite map, so its fp32 master and both Adam moments move with it. What the model-state files
hold depends on the rule and the outer maps, and is the one part a kind says itself:

* :class:`ModuleFiles` (ZeRO-1/2, TP / stage maps): per model-parallel rank the module's weights,
  per group one flat buffer of the training dtype, each parameter's TP shard a slot of its stage
  map (the source's module weights, else its masters cast); a pipeline checkpoint's layer files
  (``layer_LL-model_TT-model_states.pt``) copied at an unchanged TP degree, else one tensor per
  parameter of its target TP shard;
* :class:`PlaceholderFiles` (ZeRO-3): per (TP, DP) rank the source's model states with
  placeholders (the fp32 master is what a ZeRO-3 engine loads), and under AutoEP that rank's view
  of the placement (``ds_autoep_layers``);
* :class:`ExpertModelFile` (ZeRO-1/2 with experts): one ``mp_rank_00_model_states.pt`` (the expert
  group's EP-local shapes, EP rank 0's view of the placement), the per-expert files copied (they
  do not depend on EP).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import autoep_placement, replicated
from ...storage.torch_zip import save
from ..contract import MODULE, MOMENTS, OPTIMIZER, Buffer, Slot
from . import experts as dse
from . import zero3 as z3
from . import zero12 as dsw
from .checkpoint import DeepSpeedCheckpoint
from .experts_zero3 import AutoEPZero3Partitions
from .layout import Group, Layout, Part, Unit
from .placement import EXPERT_FILE, AutoEPPlacement, split_local, uniform_placement
from .templates import Templates, ds_id_notes

__all__ = ["DeepSpeedTarget", "autoep_fresh_target", "autoep_from_zero3_target", "autoep_target", "autoep_zero3_target",
           "moe_target", "zero3_target", "zero12_target"]


class DeepSpeedTarget:
    """The files of a DeepSpeed checkpoint at ``tp`` x ``dp`` (x ``pp``), ZeRO stage ``stage``:
    ``layout``'s optimizer partitions, one optimizer file per global rank, and the model-state
    files ``models`` builds."""

    def __init__(self, layout: Layout, *, tp: int, dp: int, stage: int, bf16: bool, states: Sequence[str],
                 optim_template: Callable[[], dict], ds_config: dict | None, uc_info: dict | None, models: Any,
                 pp: int = 1, ds_ids: Mapping[str, int] | None = None, group_names: Mapping[int, str] | None = None,
                 placement: AutoEPPlacement | None = None, notes: Sequence[str] = ()) -> None:
        self.layout, self.tp, self.pp, self.dp, self.stage, self.bf16 = layout, tp, pp, dp, stage, bf16
        self.mp = tp * pp
        self.states = tuple(states)
        self.optim_template, self.ds_config, self.uc_info = optim_template, ds_config, uc_info
        self.models, self.ds_ids, self.placement = models, ds_ids or {}, placement
        self.group_names = dict(group_names or {})  # optimizer group -> the name DeepSpeed looks its ranks up by
        self.notes = list(notes)
        self._by_key: dict[str, Buffer] | None = None

    # -- what the engine fills -------------------------------------------------------------------
    def optim_file(self, rank: int) -> str:
        t, d = rank % self.mp, rank // self.mp
        if self.layout.rule == "flat":
            return dsw.optim_file(t, d, bf16=self.bf16)
        return z3.optim_file(d, bf16=self.bf16, t=t)

    def _key(self, rank: int, k: int) -> str:
        return f"{self.optim_file(rank)}:{k}"

    def by_key(self) -> dict[str, Buffer]:
        """Every buffer, declared once (before any output folder exists); the jobs find them by key."""
        if self._by_key is None:
            bufs = self.models.before() + self.layout.buffers(self._key, self.states) + self.models.after()
            self._by_key = {b.key: b for b in bufs}
        return self._by_key

    def buffers(self) -> list[Buffer]:
        return list(self.by_key().values())

    def tp_index(self, rank: int) -> int:
        return rank % self.mp % self.tp

    # -- files -----------------------------------------------------------------------------------
    def optim(self, engine: Any, rank: int) -> dict:
        """Global rank ``rank``'s optimizer file: its partition of every unit."""
        units = self.layout.rank_units(rank)
        fp32, moments = self.layout.partitions(engine, self.by_key(), self._key, rank, self.states)
        if self.layout.rule == "sub":
            obj = z3.optim_states(self.optim_template(), subs=[p.unit for _, p, _ in units], dp=self.dp, fp32=fp32,
                                  moments=moments if len(self.states) > 1 else None, ds_ids=self.ds_ids,
                                  ds_config=self.ds_config)
            if self.placement is not None:
                obj["optimizer_state_dict"]["ds_zero_partition_groups"] = \
                    self.placement.partition_groups(self.layout, rank)
            return obj
        obj = dsw.optim_states(self.optim_template(), groups=[p.unit for _, p, _ in units], d=[q for _, _, q in units],
                               fp32=fp32, moments=moments, zero_stage=self.stage, ds_config=self.ds_config,
                               uc_info=self.uc_info)
        if self.group_names:
            base = obj["optimizer_state_dict"]["base_optimizer_state"]
            base["param_groups"] = [{**pg, "name": self.group_names[g]} if g in self.group_names else pg
                                    for g, pg in enumerate(base["param_groups"])]
        return obj

    def jobs(self, engine: Any, staging: Any, archive: Callable[..., Any]) -> list:
        """Every file, the optimizer files as archives written in stripes (``archive(rel, size, build)``)."""
        before, after = self.models.jobs(self, engine, staging, archive)
        optim = [archive(self.optim_file(r), sum(p.numel for _, p, _ in self.layout.rank_units(r)) * 4 * len(self.states),
                         lambda r=r: self.optim(engine, r)) for r in self.layout.ranks]
        return before + optim + after


def _states(tpl: Templates) -> tuple[str, ...]:
    return ("fp32",) + (MOMENTS if tpl.has_moments or not tpl.native else ())


# -- ZeRO-1/2 over TP / stage maps -----------------------------------------------------------------


def _holds(m: ParamMap, t: int) -> bool:
    """Whether model-parallel rank ``t`` holds any of the parameter (a TP rank of an uneven
    split may hold none; a pipeline stage holds only its own parameters)."""
    return t in m.shards and m.shards[t].numel > 0


def zero12_target(tpl: Templates, maps: dict[str, ParamMap], *, tp: int, dp: int, pp: int, stage: int,
                  uc_info: dict | None, pipe: bool = False, layer_files: dict | None = None,
                  source_ck: Any = None) -> DeepSpeedTarget:
    """ZeRO stage ``stage`` (1 or 2) at ``tp`` x ``dp`` x ``pp``, ``maps`` each parameter's target
    stage map (over model-parallel ranks ``stage * tp + t``): per model-parallel rank and
    parameter group one flat group of the TP shards it holds, over its DP ranks."""
    mp = tp * pp
    groups = []  # [model-parallel rank][parameter group]
    for t in range(mp):
        # a zero-element shard is no optimizer parameter (DeepSpeed's is_optimized_parameter)
        held = [[n for n in names if _holds(maps[n], t)] for names in tpl.group_names]
        groups.append([dsw.flat_group(h, [maps[n].shard(t).shape for n in h], dp, param_align=tpl.param_align)
                       for h in held])
    group = Group.dense(mp, dp)
    units = [Unit(group, {t: Part(groups[t][g], groups[t][g].names) for t in range(mp)})
             for g in range(len(tpl.group_names))]
    layout = Layout("flat", maps, units, [d * mp + t for t in range(mp) for d in range(dp)])
    ds_config = dsw.target_ds_config(tpl.cfg, tp=1 if pipe else mp, dp=dp, zero_stage=stage)
    models = ModuleFiles(tpl, maps, groups, tp=tp, pp=pp, dp=dp, stage=stage, uc_info=uc_info, ds_config=ds_config,
                         pipe=pipe, layer_files=layer_files or {}, source_ck=source_ck)
    return DeepSpeedTarget(layout, tp=tp, pp=pp, dp=dp, stage=stage, bf16=tpl.bf16, states=_states(tpl),
                           optim_template=tpl.optim_z12, ds_config=ds_config, uc_info=uc_info, models=models)


class ModuleFiles:
    """ZeRO-1/2 model states over TP / stage maps: the module's weights per model-parallel rank
    (none in a pipeline's model states), and a pipeline's layer files."""

    def __init__(self, tpl: Templates, maps: dict[str, ParamMap], groups: list[list[Any]], *, tp: int, pp: int,
                 dp: int, stage: int, uc_info: dict | None, ds_config: dict | None, pipe: bool, layer_files: dict,
                 source_ck: Any) -> None:
        self.tpl, self.maps, self.groups = tpl, maps, groups
        self.tp, self.pp, self.dp, self.stage, self.mp = tp, pp, dp, stage, tp * pp
        self.uc_info, self.ds_config = uc_info, ds_config
        self.pipe = pipe  # a deepspeed.pipe source: weights in layer files, model states without module
        self.layer_files = layer_files  # the source's (layer, TP rank) -> file
        self.source_ck = source_ck
        self.empty = [[n for n in tpl.names if not _holds(maps[n], t)] for t in range(self.mp)]

    def before(self) -> list[Buffer]:
        """Each model-parallel rank's module weights: per group one flat buffer."""
        out = []
        if not self.pipe:
            for t in range(self.mp):
                for g, grp in enumerate(self.groups[t]):
                    slots = tuple(Slot(off, n, MODULE, self.maps[n], t) for n, off in zip(grp.names, grp.offsets))
                    out.append(Buffer(f"{dsw.model_file(t)}:{g}", self.tpl.dtype, grp.total, slots))
        return out

    def after(self) -> list[Buffer]:
        """The layer files of a pipeline written at another TP degree: each weight's shard."""
        out = []
        if self.layer_files and self.tp != self.source_ck.tp:
            for L in sorted({layer for layer, _ in self.layer_files}):
                for t in range(self.tp):
                    for key in self.source_ck.layer_state(self.layer_files[(L, 0)]):
                        m = self.maps[f"{L}.{key}"]
                        dst = min(m.ranks) + t  # TP rank t of the target stage: stage * tp + t
                        out.append(Buffer(f"{dsw.layer_file(L, t)}:{key}", self.tpl.dtype, prod(m.shard(dst).shape),
                                          (Slot(0, f"{L}.{key}", MODULE, m, dst),)))
        return out

    def _views(self, engine: Any, declared: Mapping[str, Buffer], t: int) -> dict[str, Any]:
        """Model-parallel rank ``t``'s module weights: per group one flat buffer, each parameter
        a view at its place; a zero-element shard an empty tensor."""
        views: dict[str, Any] = {}
        for g, grp in enumerate(self.groups[t]):
            flat = engine.storage(declared[f"{dsw.model_file(t)}:{g}"])
            for name, off, shape in zip(grp.names, grp.offsets, grp.shapes):
                views[name] = flat.view(shape, offset=off)
        for name in self.empty[t]:
            views[name] = torch.empty(self.maps[name].shard(t).shape, dtype=self.tpl.dtype)
        return views

    def model(self, engine: Any, declared: Mapping[str, Buffer], t: int) -> dict:
        """``mp_rank_TT_model_states.pt``: the template's keys in its order, the module's weights
        the target's, tied aliases sharing their parameter's tensor, buffers as the source holds them."""
        tpl = self.tpl
        if self.pipe:
            return dsw.model_states(tpl.model, module=None, param_shapes=self._param_shapes(t), tp=self.tp,
                                    dp=self.dp, tp_rank=t % self.tp, zero_stage=self.stage, shared_params={},
                                    uc_info=self.uc_info, ds_config=self.ds_config, pp=self.pp)
        views = self._views(engine, declared, t)
        module = OrderedDict()
        for key, value in (tpl.model.get("module") or {}).items():
            if key in views:
                module[key] = views[key]
            elif key in tpl.shared:
                module[key] = None  # filled below, sharing the canonical tensor
            else:
                module[key] = tpl.buffer(key, value, t, self.tp)
        for key, canonical in tpl.shared.items():
            if key in module:
                module[key] = views.get(canonical, module.get(canonical))
                if module[key] is None:
                    raise CheckpointError(f"{key!r} is tied to {canonical!r}, which the module does not hold")
        empty = OrderedDict((n, views[n]) for n in tpl.names if n in self.empty[t])
        return dsw.model_states(tpl.model, module=module, param_shapes=self._param_shapes(t), tp=self.mp, dp=self.dp,
                                tp_rank=t, zero_stage=self.stage, shared_params=tpl.shared, uc_info=self.uc_info,
                                ds_config=self.ds_config, empty_params=empty)

    def _param_shapes(self, t: int) -> list[OrderedDict]:
        return [OrderedDict((n, torch.Size(s)) for n, s in zip(grp.names, grp.shapes)) for grp in self.groups[t]]

    def layer(self, engine: Any, declared: Mapping[str, Buffer], layer: int, t: int) -> dict:
        """Layer file ``layer`` of target TP rank ``t``: each parameter's target shard in a storage
        of its own (DeepSpeed clones every tensor before saving), in the source file's key order."""
        state = OrderedDict()
        for key in self.source_ck.layer_state(self.layer_files[(layer, 0)]):
            m = self.maps[f"{layer}.{key}"]
            shape = m.shard(min(m.ranks) + t).shape  # TP rank t of the target stage: stage * tp + t
            state[key] = engine.storage(declared[f"{dsw.layer_file(layer, t)}:{key}"]).view(shape)
        return state

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        esize = self.tpl.dtype.itemsize
        before = [archive(dsw.model_file(t), sum(g.total for g in self.groups[t]) * esize,
                          lambda t=t: self.model(engine, tgt.by_key(), t)) for t in range(self.mp)]
        after: list = []
        if self.layer_files:
            ck = self.source_ck
            if self.tp == ck.tp:  # a layer file holds one layer's weights of one TP rank at any stage count
                after = [(p.stat().st_size, lambda p=p: staging.copy(p, p.name)) for _, p in sorted(self.layer_files.items())]
            else:
                layers = sorted({layer for layer, _ in self.layer_files})
                after = [archive(dsw.layer_file(L, t), self.layer_files[(L, 0)].stat().st_size // ck.tp,
                                 lambda L=L, t=t: self.layer(engine, tgt.by_key(), L, t))
                         for L in layers for t in range(self.tp)]
        return before, after


# -- ZeRO-3 ----------------------------------------------------------------------------------------


def zero3_target(tpl: Templates, maps: dict[str, ParamMap], *, tp: int, dp: int, uc_info: dict | None, where: str,
                 model_size: int) -> DeepSpeedTarget:
    """ZeRO-3 at TP x DP (TP=1, or AutoTP at any degree): per TP rank, every parameter's TP shard
    split over the DP ranks, the partitions in sub-groups."""
    shard = {(t, n): tuple(maps[n].shard(t).shape) for t in range(tp) for n in tpl.names}
    empty = next(((t, n) for (t, n), s in shard.items() if not prod(s)), None)
    if empty is not None:
        raise ReshardError(f"parameter {empty[1]!r} has no elements on TP rank {empty[0]} at TP={tp}: an uneven "
                           "split is not written with ZeRO-3")
    size = z3.sub_group_size(tpl.cfg, where)
    subs = [z3.sub_groups([[(n, shard[(t, n)]) for n in g] for g in tpl.group_names], dp, size) for t in range(tp)]
    group = Group.dense(tp, dp)
    units = [Unit(group, {t: Part(subs[t][k], subs[t][k].names) for t in range(tp) if k < len(subs[t])})
             for k in range(max(len(s) for s in subs))]
    layout = Layout("sub", maps, units, [d * tp + t for t in range(tp) for d in range(dp)])
    ds_config = dsw.target_ds_config(tpl.cfg, tp=tp, dp=dp, zero_stage=3)
    notes = [f"{len(subs[0])} sub-group(s) per rank (sub_group_size {size})"]
    notes += ds_id_notes(tpl.ds_ids_exact, "do not number its parameters consecutively")
    models = PlaceholderFiles(tpl.model_z3, tp=tp, dp=dp, ds_config=ds_config, uc_info=uc_info, size=model_size)
    return DeepSpeedTarget(layout, tp=tp, dp=dp, stage=3, bf16=tpl.bf16, states=_states(tpl),
                           optim_template=tpl.optim_z3, ds_config=ds_config, uc_info=uc_info, models=models,
                           ds_ids=tpl.ds_ids, notes=notes)


def autoep_zero3_target(src: AutoEPZero3Partitions, ep: int, dp: int) -> DeepSpeedTarget:
    """An AutoEP ZeRO-3 checkpoint at EP ``ep`` x world ``dp``: a dense parameter split over all
    ``dp`` ranks, a fused expert parameter of EP rank ``e`` over ``e``'s EDP group; sub-groups cut
    by DeepSpeed's rule over each group's own partition sizes."""
    placement = AutoEPPlacement(src.ax, ep, dp)
    outer = {n: placement.maps[n] if n in placement.maps else replicated(src.shapes[n], 1) for n in src.names}
    shape = {n: (placement.maps[n].shards[0].shape if n in placement.maps else src.shapes[n]) for n in src.names}
    dense, experts = Group.dense(1, dp), placement.group()
    parts = [placement.edp if g in src.expert_groups else dp for g in range(len(src.group_names))]
    units = []
    for sg in z3.sub_groups([[(n, shape[n]) for n in names] for names in src.group_names], parts, src.sub_group_size):
        units.append(Unit(experts, dict.fromkeys(range(ep), Part(sg, sg.names))) if sg.group in src.expert_groups
                     else Unit(dense, {0: Part(sg, sg.names)}))
    layout = Layout("sub", outer, units, range(dp))
    ds_config = placement.ds_config(dsw.target_ds_config(src.cfg, tp=1, dp=dp, zero_stage=3))
    notes = [f"AutoEP experts at EP {ep} (EDP {placement.edp}), uniform placement, ZeRO-3"]
    notes += ds_id_notes(src.ds_ids_exact, "do not match the parameter order reshard derives")
    models = PlaceholderFiles(lambda: src.template, tp=1, dp=dp, ds_config=ds_config, uc_info=None,
                              size=src.ck.model_files[0].stat().st_size, placement=placement)
    return DeepSpeedTarget(layout, tp=1, dp=dp, stage=3, bf16=src.bf16, states=OPTIMIZER,
                           optim_template=lambda: src.ck.optim_state(0, 0), ds_config=ds_config, uc_info=None,
                           models=models, ds_ids=src.ds_ids, placement=placement, notes=notes)


class PlaceholderFiles:
    """ZeRO-3 model states: per (TP, DP) rank the template's keys with placeholders, the rank's
    sub-groups in ``param_shapes``, and under AutoEP its view of the placement."""

    def __init__(self, template: Callable[[], dict], *, tp: int, dp: int, ds_config: dict | None,
                 uc_info: dict | None, size: int, placement: AutoEPPlacement | None = None) -> None:
        self.template, self.tp, self.dp, self.ds_config, self.uc_info = template, tp, dp, ds_config, uc_info
        self.size, self.placement = size, placement

    def before(self) -> list[Buffer]:
        return []

    def after(self) -> list[Buffer]:
        return []

    def model(self, tgt: DeepSpeedTarget, staging: Any, t: int, d: int) -> None:
        subs = [p.unit for _, p, _ in tgt.layout.rank_units(d * self.tp + t)]
        template = self.template()
        if self.placement is None:
            obj = z3.model_states(template, subs=subs, d=d, dp=self.dp, ds_config=self.ds_config, t=t, tp=self.tp,
                                  uc_info=self.uc_info)
        else:
            layers = [self.placement.layer(entry, d, copied=True) for entry in template[dse.LAYERS_KEY]]
            uc = copy.deepcopy(dict(template.get("universal_checkpoint_info") or {}))
            uc[dse.LAYERS_KEY] = copy.deepcopy(layers)  # its own copy, as DeepSpeed's save clones the state
            obj = z3.model_states(template, subs=subs, d=d, dp=self.dp, ds_config=self.ds_config, uc_info=uc)
            # plain tuples: DeepSpeed's AutoEP save passes the state through clone_tensors_for_torch_save
            obj["param_shapes"] = [OrderedDict((n, tuple(s)) for n, s in zip(sg.names, sg.shapes)) for sg in subs]
            obj[dse.LAYERS_KEY] = layers
        with staging.open(z3.model_file(d, t)) as f:
            save(obj, f)

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        return [], [(self.size, lambda t=t, d=d: self.model(tgt, staging, t, d))
                    for t in range(self.tp) for d in range(self.dp)]


# -- ZeRO-1/2 with experts -------------------------------------------------------------------------


def _expert_target(ck: DeepSpeedCheckpoint, ax: Any, ep: int, dp: int, stage: int, expert_files: list[Path], *,
                   expert_group: Callable[[int], tuple[list[str], list[tuple[int, ...]]]],
                   holder_names: Callable[[int, Any, int], tuple[str, ...]], outer: Mapping[str, ParamMap],
                   placement: AutoEPPlacement | None, group_names: Mapping[int, str], note: str) -> DeepSpeedTarget:
    """ZeRO-1/2 with experts at EP ``ep`` x world ``dp`` (TP = PP = 1): a dense group flat over all
    DP ranks, an expert group flat over each EP rank's EDP group (``expert_group(g)``: its names
    and shapes there; ``holder_names(g, group, e)``: the parameters of F EP rank ``e`` holds at its
    positions)."""
    ms0 = ck.model_state(0)
    src_groups = ck.groups(0)
    zo = (ms0.get("ds_config") or {}).get("zero_optimization") or {}
    dtype = next(iter((ms0.get("module") or {}).values())).dtype
    align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
    edp = dp // ep
    target_ax = dataclasses.replace(ax, ep=ep, edp=edp)  # same EDP order, new sizes
    dense, experts = Group.dense(1, dp), Group(tuple(tuple(target_ax.members(e)) for e in range(ep)))
    maps, units = dict(outer), []
    for g, grp in enumerate(src_groups):
        if g in ax.groups:
            names, shapes = expert_group(g)
            fg = dsw.flat_group(names, shapes, edp, param_align=align)
            units.append(Unit(experts, {e: Part(fg, holder_names(g, fg, e)) for e in range(ep)}))
        else:
            fg = dsw.flat_group(list(grp), list(grp.values()), dp, param_align=align)
            units.append(Unit(dense, {0: Part(fg, fg.names)}))
            maps.update((n, ck.tp_map(n).map) for n in fg.names)  # dense, TP = 1: whole on one rank
    layout = Layout("flat", maps, units, range(dp))
    cfg = dsw.target_ds_config(ms0.get("ds_config"), tp=1, dp=dp, zero_stage=stage)
    ds_config = placement.ds_config(cfg) if placement is not None else cfg
    bf16 = any(p.name.startswith("bf16_") for p in ck.optim_files.values())  # as the source names them
    models = ExpertModelFile(ck, dp=dp, stage=stage, ds_config=ds_config, placement=placement, expert_files=expert_files)
    return DeepSpeedTarget(layout, tp=1, dp=dp, stage=stage, bf16=bf16, states=OPTIMIZER,
                           optim_template=lambda: ck.optim_state(0, 0), ds_config=ds_config, uc_info=None,
                           models=models, group_names=group_names, notes=[note])


def autoep_target(ck: DeepSpeedCheckpoint, ep: int, dp: int, stage: int, expert_files: list[Path]) -> DeepSpeedTarget:
    """AutoEP's fused experts, placed uniformly at EP ``ep``: each fused parameter's EP-local shape
    in the expert group."""
    placement = AutoEPPlacement(ck.experts, ep, dp)
    src_groups = ck.groups(0)

    def expert_group(g: int) -> tuple[list[str], list[tuple[int, ...]]]:
        names = list(src_groups[g])
        return names, [placement.maps[n].shards[0].shape for n in names]

    return _expert_target(ck, ck.experts, ep, dp, stage, expert_files, expert_group=expert_group,
                          holder_names=lambda g, fg, e: fg.names, outer=placement.maps, placement=placement,
                          group_names={},
                          note=f"AutoEP experts at EP {ep} (EDP {placement.edp}), uniform placement")


def moe_target(ck: DeepSpeedCheckpoint, ep: int, dp: int, stage: int, expert_files: list[Path]) -> DeepSpeedTarget:
    """Classic MoE experts at EP ``ep``: EP rank ``e`` holds global experts ``[e * L, (e + 1) * L)``
    under local names; each global expert parameter is all of F on EP rank ``x // L``, at the
    position of its local name ``x % L``. The experts' optimizer group is named ``ep_size_<ep>``:
    DeepSpeed's ZeRO-1/2 ``load_state_dict`` hands the saved ``param_groups`` to ``torch.optim``,
    which replaces the live groups' ``name``, and ``stage_1_and_2`` looks the expert process groups
    up by that name."""
    ax, path = ck.moe, ck.model_files[0]
    counts = ck.model_state(0)["num_experts"]
    layout: dict[int, dict[str, list[str]]] = {}  # group -> prefix -> subs, in model order
    local: dict[str, int] = {}  # prefix -> local experts per EP rank at the target
    src_local: dict[str, int] = {}  # ... and at the source
    for p in ax.params.values():
        prefix, _, sub = split_local(p.name)
        subs = layout.setdefault(p.group, {}).setdefault(prefix, [])
        if sub not in subs:
            subs.append(sub)
        local[prefix], src_local[prefix] = counts[p.layer] // ep, counts[p.layer] // ax.ep
    src_groups = ck.groups(0)
    for g, by_prefix in layout.items():  # the target's order is the source's at another L
        src_order = [f"{prefix}.{j}.{sub}" for prefix, subs in by_prefix.items()
                     for j in range(src_local[prefix]) for sub in subs]
        if list(src_groups[g]) != src_order:
            raise CheckpointError(f"{path}: param_shapes group {g} does not list the experts in DeepSpeed's model "
                                  f"order (MoE layer, local expert, parameter); cannot tell the target order")

    def expert_group(g: int) -> tuple[list[str], list[tuple[int, ...]]]:
        names = [f"{prefix}.{j}.{sub}" for prefix, subs in layout[g].items() for j in range(local[prefix]) for sub in subs]
        return names, [src_groups[g][f"{prefix}.0.{sub}"] for prefix, subs in layout[g].items()
                       for _ in range(local[prefix]) for sub in subs]

    fills: dict[tuple[int, str, int], str] = {}  # (group, local name, target EP rank) -> global name
    outer: dict[str, ParamMap] = {}
    for name, p in ax.params.items():
        prefix, x, sub = split_local(name)
        fills[(p.group, f"{prefix}.{x % local[prefix]}.{sub}", x // local[prefix])] = name
        outer[name] = replicated(p.shape, [p.expert // local[prefix]])
    return _expert_target(ck, ax, ep, dp, stage, expert_files, expert_group=expert_group,
                          holder_names=lambda g, fg, e: tuple(fills[(g, n, e)] for n in fg.names), outer=outer,
                          placement=None, group_names=dict.fromkeys(ax.groups, f"ep_size_{ep}"),
                          note=f"classic MoE experts at EP {ep} (EDP {dp // ep}): EP rank e holds experts "
                               "[e*L, (e+1)*L)")


class ExpertModelFile:
    """ZeRO-1/2 with experts: the source's ``mp_rank_00_model_states.pt`` with the target's expert
    group in ``param_shapes`` (EP rank 0's), topology and placement, and the per-expert files
    copied (the same at any EP)."""

    def __init__(self, ck: DeepSpeedCheckpoint | None, *, dp: int, stage: int, ds_config: dict | None,
                 placement: AutoEPPlacement | None, expert_files: list[Path]) -> None:
        self.ck, self.dp, self.stage, self.ds_config = ck, dp, stage, ds_config
        self.placement, self.expert_files = placement, expert_files

    def before(self) -> list[Buffer]:
        return []

    def after(self) -> list[Buffer]:
        return []

    def _extras(self, ms0: dict) -> tuple[dict | None, dict]:
        """``universal_checkpoint_info`` and other keys the target's placement replaces."""
        pl = self.placement
        if pl is None:
            return ms0.get("universal_checkpoint_info"), {}
        uc = dict(ms0.get("universal_checkpoint_info") or {})
        if dse.LAYERS_KEY in uc:
            uc[dse.LAYERS_KEY] = [pl.layer(entry, 0, copied=False) for entry in uc[dse.LAYERS_KEY]]
        return uc or None, {dse.LAYERS_KEY: [pl.layer(entry, 0, copied=False) for entry in ms0[dse.LAYERS_KEY]]}

    def model(self, tgt: DeepSpeedTarget, staging: Any) -> None:
        if self.ck is None:
            raise CheckpointError("internal: expert model states without a source DeepSpeed checkpoint")
        ms0 = self.ck.model_state(0)
        # plain tuples: DeepSpeed's expert save path (_save_moe_checkpoint) passes the state through
        # clone_tensors_for_torch_save, which turns every torch.Size into a tuple
        shapes = [OrderedDict((n, tuple(s)) for n, s in zip(p.unit.names, p.unit.shapes))
                  for _, p, _ in tgt.layout.rank_units(0)]
        uc, extras = self._extras(ms0)
        obj = dsw.model_states(ms0, module=OrderedDict(ms0.get("module") or {}), param_shapes=shapes, tp=1,
                               dp=self.dp, tp_rank=0, zero_stage=self.stage, shared_params=ms0.get("shared_params") or {},
                               uc_info=uc, ds_config=self.ds_config)
        obj.update(extras)
        with staging.open(dsw.model_file(0)) as f:
            save(obj, f)

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        if self.ck is None:
            raise CheckpointError("internal: expert model states without a source DeepSpeed checkpoint")
        before = [(self.ck.model_files[0].stat().st_size, lambda: self.model(tgt, staging))]
        return before, [(p.stat().st_size, lambda p=p: staging.copy(p, p.name)) for p in self.expert_files]


# -- AutoEP ZeRO-3 -> ZeRO-1/2 ---------------------------------------------------------------------


def router_aliases(template: Mapping[str, Any], params: Sequence[str], where: str) -> dict[str, str]:
    """The module entries of an AutoEP ZeRO-3 template that are no parameter: each the router's
    alias (DeepSpeed's AutoEP layer sets its router a second time under the name transformers'
    OutputRecorder captures, ``<module_path>.<alias>.<rest>`` for ``<module_path>.router.<rest>``),
    mapped to that router parameter. A buffer (``buffer_names``, held whole) is kept as it is;
    anything else is refused: its value is not in the source."""
    owned, out = set(params) | set(template.get("buffer_names") or []), {}
    paths = [str(e.get("module_path", "")) for e in template.get(dse.LAYERS_KEY) or []]
    for key in template.get("module") or {}:
        if key in owned:
            continue
        path = next((p for p in paths if key.startswith(p + ".")), None)
        rest = key[len(path) + 1:].split(".", 1) if path is not None else []
        router = f"{path}.router.{rest[1]}" if len(rest) == 2 else None
        if router is None or router not in owned:
            raise CheckpointError(f"{where}: module entry {key!r} is neither a parameter nor an AutoEP router alias; "
                                  "its value is not in a ZeRO-3 checkpoint, so it cannot be written at ZeRO-1/2")
        out[key] = router
    return out


def autoep_from_zero3_target(src: AutoEPZero3Partitions, ep: int, dp: int, stage: int) -> DeepSpeedTarget:
    """An AutoEP ZeRO-3 checkpoint written at ZeRO stage ``stage`` (1 or 2), EP ``ep`` x world
    ``dp``: the layout of :func:`autoep_target` (a dense group flat over all ``dp`` ranks, an expert
    group flat over each EP rank's EDP group), the optimizer file built on the source's recast
    (``zero3.optim_source_from_zero3``) and the weights a ZeRO-3 checkpoint keeps only as fp32
    masters -- the module's and each per-expert file's -- cast from them (:class:`ExpertWeightFiles`)."""
    ck, template = src.ck, src.template
    placement = AutoEPPlacement(src.ax, ep, dp)
    outer = {n: placement.maps[n] if n in placement.maps else replicated(src.shapes[n], 1) for n in src.names}
    shape = {n: (placement.maps[n].shards[0].shape if n in placement.maps else src.shapes[n]) for n in src.names}
    module = template.get("module") or {}
    dtypes = {module[n].dtype for n in src.names if isinstance(module.get(n), torch.Tensor)}
    if len(dtypes) != 1:
        raise CheckpointError(f"{ck.model_files[0]}: the module's parameter placeholders have dtypes "
                              f"{sorted(map(str, dtypes))}; expected one training dtype")
    dtype = dtypes.pop()
    cfg = src.cfg if isinstance(src.cfg, dict) else {}
    zo = cfg.get("zero_optimization") or {}
    align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
    dense, experts = Group.dense(1, dp), placement.group()
    units = []
    for g, names in enumerate(src.group_names):
        part = placement.edp if g in src.expert_groups else dp
        fg = dsw.flat_group(list(names), [shape[n] for n in names], part, param_align=align)
        units.append(Unit(experts, dict.fromkeys(range(ep), Part(fg, fg.names))) if g in src.expert_groups
                     else Unit(dense, {0: Part(fg, fg.names)}))
    layout = Layout("flat", outer, units, range(dp))
    ds_config = placement.ds_config(dsw.target_ds_config(src.cfg, tp=1, dp=dp, zero_stage=stage))
    aliases = router_aliases(template, src.names, str(ck.model_files[0]))
    models = ExpertWeightFiles(ck, template, dp=dp, stage=stage, ds_config=ds_config, placement=placement,
                               dtype=dtype, names=src.names, outer=outer, aliases=aliases)
    clip = cfg.get("gradient_clipping", 0.0)
    return DeepSpeedTarget(layout, tp=1, dp=dp, stage=stage, bf16=src.bf16, states=OPTIMIZER,
                           optim_template=lambda: z3.optim_source_from_zero3(ck.optim_state(0, 0), clip_grad=clip),
                           ds_config=ds_config, uc_info=None, models=models, placement=None,
                           notes=[f"AutoEP experts at EP {ep} (EDP {placement.edp}), uniform placement, ZeRO-3 -> "
                                  f"ZeRO-{stage}: the module's and the per-expert files' weights are the fp32 "
                                  f"masters cast to {dtype}, as the ZeRO-3 checkpoint keeps no other copy"])


class ExpertWeightFiles(ExpertModelFile):
    """ZeRO-1/2 with AutoEP experts from a ZeRO-3 source, whose module holds placeholders: the
    module's weights (each in a storage of its own, as DeepSpeed's AutoEP save clones them, a
    router alias its router's) and each per-expert file's (``layer_L_expert_X``: expert ``X`` of
    every fused parameter of layer ``L``) are buffers filled from the masters."""

    def __init__(self, ck: DeepSpeedCheckpoint | None, template: dict, *, dp: int, stage: int, ds_config: dict | None,
                 placement: AutoEPPlacement, dtype: torch.dtype, names: Sequence[str], outer: Mapping[str, ParamMap],
                 aliases: Mapping[str, str]) -> None:
        super().__init__(ck, dp=dp, stage=stage, ds_config=ds_config, placement=placement, expert_files=[])
        self.template, self.dtype, self.names, self.outer, self.aliases = template, dtype, list(names), outer, aliases
        self.placement = placement
        owned = set(self.names) | set(aliases)  # the module entries whose weights are the masters'
        self.weights = [k for k in template.get("module") or {} if k in owned]
        # per fused parameter a map whose rank x holds expert x: one per-expert file's slot
        self.per_expert = {n: autoep_placement(uniform_placement(m.logical_shape[0], m.logical_shape[0]),
                                               m.logical_shape) for n, m in placement.maps.items()}
        self.layers: dict[int, list[str]] = {}
        for n in self.names:
            if n in placement.maps:
                self.layers.setdefault(placement.ax.params[n].layer, []).append(n)

    def _module_key(self, key: str) -> str:
        return f"{dsw.model_file(0)}:module:{key}"

    def _expert_key(self, layer: int, x: int, name: str) -> str:
        return f"{EXPERT_FILE.format(layer=layer, expert=x)}:{name}"

    def before(self) -> list[Buffer]:
        out = []
        for key in self.weights:
            n = self.aliases.get(key, key)
            m = self.outer[n]
            out.append(Buffer(self._module_key(key), self.dtype, m.shards[0].numel, (Slot(0, n, MODULE, m, 0),)))
        return out

    def after(self) -> list[Buffer]:
        out = []
        for layer, names in sorted(self.layers.items()):
            for n in names:
                m = self.per_expert[n]
                for x in range(m.logical_shape[0]):
                    out.append(Buffer(self._expert_key(layer, x, n), self.dtype, m.shards[x].numel,
                                      (Slot(0, n, MODULE, m, x),)))
        return out

    def model_obj(self, tgt: DeepSpeedTarget, engine: Any) -> dict:
        declared = tgt.by_key()
        module = OrderedDict()
        for key, value in (self.template.get("module") or {}).items():
            if key not in self.weights:  # a buffer, whole in the source
                module[key] = value
                continue
            shape = self.outer[self.aliases.get(key, key)].logical_shape
            module[key] = engine.storage(declared[self._module_key(key)]).view(shape)
        shapes = [OrderedDict((n, tuple(s)) for n, s in zip(p.unit.names, p.unit.shapes))
                  for _, p, _ in tgt.layout.rank_units(0)]
        uc, extras = self._extras(self.template)
        for entry in [*(uc or {}).get(dse.LAYERS_KEY, []), *extras[dse.LAYERS_KEY]]:
            # the ZeRO-1/2 expert format (per-expert files), as DeepSpeed's AutoEP ZeRO-1/2 save records it
            entry.update(checkpoint_format="per_expert_files", checkpoint_format_version=None)
        obj = dsw.model_states(self.template, module=module, param_shapes=shapes, tp=1, dp=self.dp, tp_rank=0,
                               zero_stage=self.stage, shared_params=self.template.get("shared_params") or {},
                               uc_info=uc, ds_config=self.ds_config)
        obj.update(extras)
        return obj

    def expert(self, tgt: DeepSpeedTarget, engine: Any, layer: int, x: int) -> dict:
        """``layer_L_expert_X_mp_rank_00_model_states.pt``: ``<fused name>.<X>`` of each of the
        layer's fused parameters, its own storage."""
        declared = tgt.by_key()
        return {f"{n}.{x}": engine.storage(declared[self._expert_key(layer, x, n)]).view(
            self.per_expert[n].logical_shape[1:]) for n in self.layers[layer]}

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        esize = self.dtype.itemsize
        size = sum(self.outer[self.aliases.get(k, k)].shards[0].numel for k in self.weights)
        before = [archive(dsw.model_file(0), size * esize, lambda: self.model_obj(tgt, engine))]
        after = [archive(EXPERT_FILE.format(layer=layer, expert=x),
                         sum(self.per_expert[n].shards[x].numel for n in names) * esize,
                         lambda layer=layer, x=x: self.expert(tgt, engine, layer, x))
                 for layer, names in sorted(self.layers.items())
                 for x in range(self.per_expert[names[0]].logical_shape[0])]
        return before, after


# -- AutoEP from any source ------------------------------------------------------------------------


def autoep_fresh_target(tpl: Templates, layers: Sequence[Any], shapes: Mapping[str, tuple[int, ...]], ep: int, dp: int,
                        stage: int, aliases: Mapping[str, str], clip_grad: float | None = None) -> DeepSpeedTarget:
    """AutoEP's fused experts at EP ``ep`` x world ``dp``, ZeRO stage ``stage`` (1 or 2), from a
    source that is no DeepSpeed checkpoint (a universal one): the layout of :func:`autoep_target`
    (a dense group flat over all ``dp`` ranks, the expert group flat over each EP rank's EDP group,
    AutoEP's uniform placement), the files of a fresh ZeRO job (``tpl``, ``templates.fresh``), the
    module's and each per-expert file's weights cast from the source (:class:`ExpertWeightFiles`),
    ``ds_autoep_layers`` the source's records (``layers``: ``contract.ExpertLayer``) rewritten at
    the target's placement. Expert-data-parallel groups in DeepSpeed's default order (expert
    before data)."""
    expert_names = {n for lay in layers for n in lay.params}
    groups = frozenset(g for g, names in enumerate(tpl.group_names) if expert_names & set(names))
    params = {n: dse.ExpertParam(n, lay.layer, tuple(shapes[n]), (), {}, g) for lay in layers for n in lay.params
              for g in groups if n in tpl.group_names[g]}
    ax = dse.AutoEP(params, groups, ep, dp // ep, False, tuple(aliases))
    placement = AutoEPPlacement(ax, ep, dp)
    names = tpl.names
    outer = {n: placement.maps[n] if n in placement.maps else replicated(shapes[n], 1) for n in names}
    shape = {n: (placement.maps[n].shards[0].shape if n in placement.maps else shapes[n]) for n in names}
    dense, experts = Group.dense(1, dp), placement.group()
    units = []
    for g, group in enumerate(tpl.group_names):
        part = placement.edp if g in groups else dp
        fg = dsw.flat_group(list(group), [shape[n] for n in group], part, param_align=tpl.param_align)
        units.append(Unit(experts, dict.fromkeys(range(ep), Part(fg, fg.names))) if g in groups
                     else Unit(dense, {0: Part(fg, fg.names)}))
    layout = Layout("flat", outer, units, range(dp))
    ds_config = placement.ds_config(dsw.target_ds_config(tpl.cfg, tp=1, dp=dp, zero_stage=stage))
    # DeepSpeed's AutoEP model states: no tied weights (the router alias is the module's own entry),
    # the experts per layer and each layer's record
    # a module without the experts (they are the per-expert files'), each router alias after its router
    module = OrderedDict()
    for n in names:
        if n not in expert_names:
            module[n] = tpl.model["module"][n]
            module.update((a, module[n]) for a, r in aliases.items() if r == n)
    template = {**tpl.model, "module": module, "shared_params": {}, "num_experts": [lay.num_experts for lay in layers],
                dse.LAYERS_KEY: [dict(lay.record) for lay in layers]}
    models = ExpertWeightFiles(None, template, dp=dp, stage=stage, ds_config=ds_config, placement=placement,
                               dtype=tpl.dtype, names=names, outer=outer, aliases=aliases)
    return DeepSpeedTarget(layout, tp=1, dp=dp, stage=stage, bf16=tpl.bf16, states=OPTIMIZER,
                           optim_template=lambda: _with_clip(tpl.optim_z12(), clip_grad), ds_config=ds_config,
                           uc_info=None, models=models,
                           notes=[f"AutoEP experts at EP {ep} (EDP {placement.edp}), uniform placement, EDP groups in "
                                  "DeepSpeed's default order (expert before data)"])


def _with_clip(optim: dict, clip_grad: float | None) -> dict:
    """A fresh ZeRO-1/2 optimizer file with the source's gradient clipping."""
    if clip_grad is None:
        return optim
    return {**optim, "optimizer_state_dict": {**optim["optimizer_state_dict"], "clip_grad": clip_grad}}
