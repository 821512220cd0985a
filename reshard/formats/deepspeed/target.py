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
* ``expert_target.ExpertModelFile`` (classic MoE, ZeRO-1/2): one ``mp_rank_00_model_states.pt`` (the
  expert group's EP-local shapes), the per-expert files copied (they do not depend on EP);
* ``expert_pipe.PipeModelFiles`` (AutoEP, ZeRO-1/2, with or without pipeline stages): per stage its
  model state (EP rank 0's view of the placement) and its per-expert files, copied under their
  stage-local names.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import replicated
from ...layouts.zero import zero3 as zero3_map
from ...layouts.zero import zero3_partition_numel
from ...storage.torch_zip import save
from ..contract import MODULE, MOMENTS, OPTIMIZER, Buffer, Slot
from . import experts as dse
from . import folding
from . import zero3 as z3
from . import zero12 as dsw
from .checkpoint import DeepSpeedCheckpoint
from .layout import Group, Layout, Part, Unit
from .placement import AutoEPPlacement
from .templates import Templates, ds_id_notes

__all__ = ["DeepSpeedTarget", "autoep_sub_layout", "autoep_zero3", "autoep_zero3_target", "zero3_target",
           "zero12_target"]


class DeepSpeedTarget:
    """The files of a DeepSpeed checkpoint at ``tp`` x ``dp`` (x ``pp``), ZeRO stage ``stage``:
    ``layout``'s optimizer partitions, one optimizer file per global rank, and the model-state
    files ``models`` builds."""

    def __init__(self, layout: Layout, *, tp: int, dp: int, stage: int, bf16: bool, states: Sequence[str],
                 optim_template: Callable[[], dict], ds_config: dict | None, uc_info: dict | None, models: Any,
                 pp: int = 1, ds_ids: Mapping[str, int] | None = None, group_names: Mapping[int, str] | None = None,
                 placement: AutoEPPlacement | None = None, notes: Sequence[str] = (),
                 per_rank: Callable[[int], dict] | None = None) -> None:
        self.layout, self.tp, self.pp, self.dp, self.stage, self.bf16 = layout, tp, pp, dp, stage, bf16
        self.mp = tp * pp
        self.states = tuple(states)
        self.optim_template, self.ds_config, self.uc_info = optim_template, ds_config, uc_info
        self.models, self.ds_ids, self.placement = models, ds_ids or {}, placement
        self.group_names = dict(group_names or {})  # optimizer group -> the name DeepSpeed looks its ranks up by
        self.notes = list(notes)
        self.per_rank = per_rank  # entries an optimizer file adds last (a folded AutoEP target's folding record)
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
            torch_osd = obj["optimizer_state_dict"]["optimizer_state_dict"]
            torch_osd["param_groups"] = self._named(torch_osd["param_groups"])
            if self.per_rank is not None:
                obj.update(self.per_rank(rank))
            return obj
        obj = dsw.optim_states(self.optim_template(), groups=[p.unit for _, p, _ in units], d=[q for _, _, q in units],
                               fp32=fp32, moments=moments, zero_stage=self.stage, ds_config=self.ds_config,
                               uc_info=self.uc_info)
        base = obj["optimizer_state_dict"]["base_optimizer_state"]
        base["param_groups"] = self._named(base["param_groups"])
        if self.per_rank is not None:
            obj.update(self.per_rank(rank))
        return obj

    def _named(self, groups: list[dict]) -> list[dict]:
        """The optimizer groups, each of ``group_names`` renamed (an expert group: DeepSpeed's
        engine names it by the target's EP degree, and a native load keeps the saved name)."""
        return [{**pg, "name": self.group_names[g]} if pg.get("name") != self.group_names.get(g, pg.get("name")) else pg
                for g, pg in enumerate(groups)]

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
        # frozen parameters (TP = PP = 1): whole on the one model-parallel rank, a tensor each
        self.frozen = {n: replicated(s, 1) for n, s in tpl.frozen.items()}

    def before(self) -> list[Buffer]:
        """Each model-parallel rank's module weights: per group one flat buffer; a frozen
        parameter in a buffer of its own (DeepSpeed flattens only the optimizer's parameters)."""
        out = []
        if not self.pipe:
            for t in range(self.mp):
                for g, grp in enumerate(self.groups[t]):
                    slots = tuple(Slot(off, n, MODULE, self.maps[n], t) for n, off in zip(grp.names, grp.offsets))
                    out.append(Buffer(f"{dsw.model_file(t)}:{g}", self.tpl.dtype, grp.total, slots))
        out += [Buffer(_frozen_key(dsw.model_file(0), n), self.tpl.dtype, m.shard(0).numel, (Slot(0, n, MODULE, m, 0),))
                for n, m in self.frozen.items()]
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
        for name, m in self.frozen.items():
            views[name] = engine.storage(declared[_frozen_key(dsw.model_file(t), name)]).view(m.shard(t).shape)
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
        # ZeRO-2 records the parameters outside the optimizer, frozen ones (the module entry's tensor) and
        # zero-element shards, in model.parameters() order
        empty = OrderedDict((n, views[n]) for n in module if n in self.frozen)
        empty.update((n, views[n]) for n in tpl.names if n in self.empty[t])
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
    models = PlaceholderFiles(tpl.model_z3, tp=tp, dp=dp, ds_config=ds_config, uc_info=uc_info, size=model_size,
                              frozen=tpl.frozen, dtype=tpl.dtype)
    return DeepSpeedTarget(layout, tp=tp, dp=dp, stage=3, bf16=tpl.bf16, states=_states(tpl),
                           optim_template=tpl.optim_z3, ds_config=ds_config, uc_info=uc_info, models=models,
                           ds_ids=tpl.ds_ids, notes=notes)


def autoep_zero3(ax: dse.AutoEP, group_names: Sequence[Sequence[str]], expert_groups: Set[int], *, ep: int,
                 dp: int, template: dict, optim: Callable[[], dict], cfg: Any, ds_ids: Mapping[str, int], size: int,
                 bf16: bool, model_size: int, notes: Sequence[str], shapes: Mapping[str, tuple[int, ...]] | None = None,
                 tp: int = 1, maps: Mapping[str, ParamMap] | None = None, info: dict | None = None) -> DeepSpeedTarget:
    """AutoEP at ZeRO-3, EP ``ep`` x TP ``tp`` x DP ``dp``, as DeepSpeed 0.19.8 saves it: the layout of
    :func:`autoep_sub_layout` (dense parameters ``shapes`` whole, or folded over ``tp`` > 1 their TP
    maps ``maps``), one model-state and one optimizer file per (TP, DP) rank and no per-expert files:
    ``template``'s keys (placeholders, layer entries ``zero3_partitioned``) with each rank's
    sub-groups and view of the placement, ``optim()``'s with ``ds_zero_partition_groups``. Folded
    (AutoEP x AutoTP, ``tp`` > 1; folding.py): AutoTP's ``universal_checkpoint_info`` (``info``, its
    experts' ``affine_map`` entries at the target's EP-local shape) and a ``folding`` record in every
    file (the optimizer's without ``param_families``), DeepSpeed's EP groups laid over global ranks."""
    placement = AutoEPPlacement(ax, ep, tp * dp)
    layout = autoep_sub_layout(placement, group_names, shapes or {}, expert_groups, size, tp=tp, maps=maps)
    ds_config = placement.ds_config(dsw.target_ds_config(cfg, tp=tp, dp=dp, zero_stage=3))
    record: Callable[[int, int, Mapping[str, Any]], dict] | None = None
    per_rank: Callable[[int], dict] | None = None
    if tp > 1:
        template = {**unfolded(template), "universal_checkpoint_info": folding.folded_info(info, placement.maps, tp)}
        optim = (lambda inner=optim: unfolded(inner()))

        def record(t: int, d: int, module: Mapping[str, Any]) -> dict:
            return {folding.KEY: folding.model_record(tp, t, ep, placement.ep_of[d * tp + t], dp, module, d)}

        def per_rank(rank: int) -> dict:
            e = placement.ep_of[rank]
            return {folding.KEY: folding.optim_record(tp, rank % tp, ep, e, dp, rank // tp, placement.edp,
                                                      placement.ax.members(e).index(rank), None)}

    models = PlaceholderFiles(lambda: template, tp=tp, dp=dp, ds_config=ds_config, uc_info=None, size=model_size,
                              placement=placement, record=record)
    return DeepSpeedTarget(layout, tp=tp, dp=dp, stage=3, bf16=bf16, states=OPTIMIZER, optim_template=optim,
                           ds_config=ds_config, uc_info=None, models=models, ds_ids=ds_ids, placement=placement,
                           notes=notes, per_rank=per_rank, group_names=dict.fromkeys(expert_groups, f"ep_size_{ep}"))


def autoep_zero3_target(ck: DeepSpeedCheckpoint, ep: int, dp: int) -> DeepSpeedTarget:
    """An AutoEP ZeRO-3 checkpoint at EP ``ep`` x world ``dp`` (TP 1; a folded source its TP 1 view):
    a dense parameter split over all ``dp`` ranks, a fused expert parameter of EP rank ``e`` over
    ``e``'s EDP group; sub-groups cut by DeepSpeed's rule over each group's own partition sizes."""
    group_names, expert_groups, size = z3.autoep_groups(ck)
    ids, exact = z3.autoep_ds_ids(ck, [n for g in group_names for n in g])
    template, optim, shapes = tp1_view(ck)
    notes = [f"AutoEP experts at EP {ep} (EDP {dp // ep}), uniform placement, ZeRO-3"]
    notes += ds_id_notes(exact, "do not match the parameter order reshard derives")
    return autoep_zero3(z3.autoep(ck), group_names, expert_groups, ep=ep, dp=dp, template=template, optim=optim,
                        cfg=template.get("ds_config"), ds_ids=ids, size=size, bf16=ck.bf16,
                        model_size=ck.model_files[0].stat().st_size, notes=notes, shapes=shapes)


# what DeepSpeed's AutoEP save at TP = 1 records in universal_checkpoint_info (AutoTP's categories go)
UNFOLDED_UC = ("universal_checkpoint_version", "expert_parameter_patterns", dse.LAYERS_KEY)


def unfolded(state: Mapping[str, Any]) -> dict:
    """A folded (AutoEP x AutoTP) file's state as DeepSpeed writes it at TP = 1: no ``folding``
    record, ``universal_checkpoint_info`` without AutoTP's entries (its tensors replaced later)."""
    out = {k: v for k, v in state.items() if k != "folding"}
    uc = out.get("universal_checkpoint_info")
    if isinstance(uc, Mapping):
        out["universal_checkpoint_info"] = {k: uc[k] for k in UNFOLDED_UC if k in uc}
    return out


def tp1_view(ck: DeepSpeedCheckpoint) -> tuple[dict, Callable[[], dict], dict[str, tuple[int, ...]]]:
    """An AutoEP ZeRO-3 source as a TP 1 target is built on it: rank 0's model state, its optimizer
    file (read when the target asks) and every parameter's ``param_shapes`` shape; folded (AutoEP x
    AutoTP) its TP 1 view: no ``folding`` records, AutoTP's ``universal_checkpoint_info`` entries
    dropped, a dense parameter's shape whole (its TP map's), an expert's its EP-local one."""
    shapes = {n: tuple(s) for sg in ck.groups(0) for n, s in sg.items()}
    if ck.experts is None or not ck.experts.folded:
        return ck.model_state(0), lambda: ck.optim_state(0, 0), shapes
    whole = {n: s if n in ck.experts.params else tuple(ck.tp_map(n).map.valid_shape) for n, s in shapes.items()}
    return unfolded(ck.model_state(0)), lambda: unfolded(ck.optim_state(0, 0)), whole


def autoep_sub_layout(placement: AutoEPPlacement, group_names: Sequence[Sequence[str]],
                      shapes: Mapping[str, tuple[int, ...]], expert_groups: Set[int], size: int, *,
                      tp: int = 1, maps: Mapping[str, ParamMap] | None = None) -> Layout:
    """AutoEP under ZeRO-3 at ``placement`` (over ``tp * dp`` global ranks): a dense parameter
    (``shapes``: whole; folded over ``tp`` > 1 its TP map in ``maps``) split over its TP rank's DP
    ranks (global ranks ``d * tp + t``), a fused expert parameter of EP rank ``e`` (its EP-local
    shape) over ``e``'s EDP group; sub-groups cut per TP rank by DeepSpeed's rule over each group's
    own partition size (``size``: ``sub_group_size``), every TP rank the same number of them."""
    ep, dp = placement.ep, placement.dp // tp
    names = [n for g in group_names for n in g]
    dense = dict(maps) if maps is not None else {n: replicated(shapes[n], 1) for n in names if n not in placement.maps}
    outer = {n: placement.maps[n] if n in placement.maps else dense[n] for n in names}
    parts = [placement.edp if g in expert_groups else dp for g in range(len(group_names))]
    subs = []
    for t in range(tp):  # each TP rank cuts its own shards (the experts are alike on every one)
        shape = {n: tuple(outer[n].shards[t if n in dense else 0].shape) for n in names}
        empty = next((n for n, s in shape.items() if not prod(s)), None) if tp > 1 else None
        if empty is not None:
            raise ReshardError(f"parameter {empty!r} has no elements on TP rank {t} at TP={tp}: an uneven split is "
                               "not written with ZeRO-3")
        subs.append(z3.sub_groups([[(n, shape[n]) for n in g] for g in group_names], parts, size))
    if any([sg.group for sg in s] != [sg.group for sg in subs[0]] for s in subs):
        raise ReshardError(f"the TP shards at TP={tp} cut into other sub-groups on different TP ranks "
                           f"(sub_group_size {size}): one layout has one list of sub-groups, not written")
    group, experts = Group.dense(tp, dp), placement.group()
    units = [Unit(experts, dict.fromkeys(range(ep), Part(sg, sg.names))) if sg.group in expert_groups
             else Unit(group, {t: Part(subs[t][k], subs[t][k].names) for t in range(tp)})
             for k, sg in enumerate(subs[0])]
    return Layout("sub", outer, units, [d * tp + t for t in range(tp) for d in range(dp)])


class PlaceholderFiles:
    """ZeRO-3 model states: per (TP, DP) rank the template's keys with placeholders, the rank's
    sub-groups in ``param_shapes``, and under AutoEP its view of the placement (that of its global
    rank ``d * tp + t``: folded over TP, its EP rank); ``record(t, d, module)``: entries a file adds
    last (a folded AutoEP target's ``folding`` record)."""

    def __init__(self, template: Callable[[], dict], *, tp: int, dp: int, ds_config: dict | None,
                 uc_info: dict | None, size: int, placement: AutoEPPlacement | None = None,
                 record: Callable[[int, int, Mapping[str, Any]], dict] | None = None,
                 frozen: Mapping[str, tuple[int, ...]] | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.template, self.tp, self.dp, self.ds_config, self.uc_info = template, tp, dp, ds_config, uc_info
        self.size, self.placement, self.record = size, placement, record
        # frozen parameters (TP = 1): each DP rank's file holds its ZeRO-3 partition (``param.ds_tensor``)
        self.frozen = {n: zero3_map(s, dp, shard="fragment") for n, s in (frozen or {}).items()}
        self.shapes, self.dtype = dict(frozen or {}), dtype

    def before(self) -> list[Buffer]:
        """Each DP rank's partition of each frozen parameter, a tensor of its own (the padding of
        the last partitions zeros, where DeepSpeed leaves ``torch.empty``'s bytes)."""
        return [Buffer(_frozen_key(z3.model_file(d, 0), n), self.dtype, self._part(n), (Slot(0, n, MODULE, m, d),))
                for n, m in self.frozen.items() for d in range(self.dp) if d in m.shards]

    def _part(self, name: str) -> int:
        return zero3_partition_numel(prod(self.shapes[name]), self.dp)

    def _fragment(self, engine: Any, declared: Mapping[str, Buffer], name: str, d: int) -> Any:
        """DP rank ``d``'s partition of frozen parameter ``name``: its buffer, or zeros where the rank
        holds only padding."""
        key = _frozen_key(z3.model_file(d, 0), name)
        if key not in declared:
            return torch.zeros(self._part(name), dtype=self.dtype)
        return engine.storage(declared[key]).view((self._part(name),))

    def after(self) -> list[Buffer]:
        return []

    def model(self, tgt: DeepSpeedTarget, staging: Any, t: int, d: int, engine: Any = None) -> None:
        subs = [p.unit for _, p, _ in tgt.layout.rank_units(d * self.tp + t)]
        template = self.template()
        if self.placement is None:
            obj = z3.model_states(template, subs=subs, d=d, dp=self.dp, ds_config=self.ds_config, t=t, tp=self.tp,
                                  uc_info=self.uc_info)
            if self.frozen or template.get("frozen_param_shapes"):  # the target's, never the source's partitions
                declared = tgt.by_key()
                obj["frozen_param_shapes"] = OrderedDict((n, torch.Size(s)) for n, s in self.shapes.items())
                obj["frozen_param_fragments"] = OrderedDict((n, self._fragment(engine, declared, n, d))
                                                            for n in self.frozen)
        else:
            g = d * self.tp + t
            layers = [self.placement.layer(entry, g, copied=True) for entry in template[dse.LAYERS_KEY]]
            uc = copy.deepcopy(dict(template.get("universal_checkpoint_info") or {}))
            uc[dse.LAYERS_KEY] = copy.deepcopy(layers)  # its own copy, as DeepSpeed's save clones the state
            obj = z3.model_states(template, subs=subs, d=d, dp=self.dp, ds_config=self.ds_config, t=t, tp=self.tp,
                                  uc_info=uc)
            # plain tuples: DeepSpeed's AutoEP save passes the state through clone_tensors_for_torch_save
            obj["param_shapes"] = [OrderedDict((n, tuple(s)) for n, s in zip(sg.names, sg.shapes)) for sg in subs]
            obj[dse.LAYERS_KEY] = layers
        if self.record is not None:
            obj.update(self.record(t, d, obj.get("module") or {}))
        with staging.open(z3.model_file(d, t)) as f:
            save(obj, f)

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        return [], [(self.size, lambda t=t, d=d: self.model(tgt, staging, t, d, engine))
                    for t in range(self.tp) for d in range(self.dp)]


# -- ZeRO-1/2 with experts -------------------------------------------------------------------------


def _frozen_key(file: str, name: str) -> str:
    """The buffer of a frozen parameter's tensor in model-state file ``file``."""
    return f"{file}:frozen:{name}"
