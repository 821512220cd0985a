"""The expert-parallel DeepSpeed targets (AutoEP, classic MoE) on :class:`target.DeepSpeedTarget`: the
layout of experts over expert-data-parallel groups and the per-expert model files."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...layouts import autoep_placement, replicated
from ...storage.torch_zip import save
from ..contract import MODULE, OPTIMIZER, Buffer, Slot
from . import experts as dse
from . import zero3 as z3
from . import zero12 as dsw
from .checkpoint import DeepSpeedCheckpoint
from .experts import router_aliases
from .layout import Group, Layout, Part, Unit
from .placement import EXPERT_FILE, AutoEPPlacement, split_local, uniform_placement
from .target import DeepSpeedTarget, autoep_zero3, tp1_view, unfolded
from .templates import Templates, ds_id_notes, placeholder_dtype


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
    target_ax = dataclasses.replace(ax, ep=ep, edp=edp)  # same EDP order, new sizes (members: not of TP)
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
    models = ExpertModelFile(ck, dp=dp, stage=stage, ds_config=ds_config, placement=placement,
                             expert_files=expert_files)
    return DeepSpeedTarget(layout, tp=1, dp=dp, stage=stage, bf16=ck.bf16, states=OPTIMIZER,
                           optim_template=lambda: ck.optim_state(0, 0), ds_config=ds_config, uc_info=None,
                           models=models, group_names=group_names, notes=[note])


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


def autoep_from_zero3_target(ck: DeepSpeedCheckpoint, ep: int, dp: int, stage: int) -> DeepSpeedTarget:
    """An AutoEP ZeRO-3 checkpoint written at ZeRO stage ``stage`` (1 or 2), EP ``ep`` x world
    ``dp``: the layout of ``expert_pipe.autoep_pipe_target`` (a dense group flat over all ``dp`` ranks, an expert
    group flat over each EP rank's EDP group), the optimizer file built on the source's recast
    (``zero3.optim_source_from_zero3``) and the weights a ZeRO-3 checkpoint keeps only as fp32
    masters -- the module's and each per-expert file's -- cast from them (:class:`ExpertWeightFiles`)."""
    group_names, expert_groups, _ = z3.autoep_groups(ck)
    names = [n for g in group_names for n in g]
    template, optim, shapes = tp1_view(ck)
    placement = AutoEPPlacement(z3.autoep(ck), ep, dp)
    outer = {n: placement.maps[n] if n in placement.maps else replicated(shapes[n], 1) for n in names}
    shape = {n: (placement.maps[n].shards[0].shape if n in placement.maps else shapes[n]) for n in names}
    dtype = placeholder_dtype(ck, names)
    cfg = template.get("ds_config")
    cfg = cfg if isinstance(cfg, dict) else {}
    zo = cfg.get("zero_optimization") or {}
    align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
    dense, experts = Group.dense(1, dp), placement.group()
    units = []
    for g, grp in enumerate(group_names):
        part = placement.edp if g in expert_groups else dp
        fg = dsw.flat_group(list(grp), [shape[n] for n in grp], part, param_align=align)
        units.append(Unit(experts, dict.fromkeys(range(ep), Part(fg, fg.names))) if g in expert_groups
                     else Unit(dense, {0: Part(fg, fg.names)}))
    layout = Layout("flat", outer, units, range(dp))
    ds_config = placement.ds_config(dsw.target_ds_config(template.get("ds_config"), tp=1, dp=dp, zero_stage=stage))
    aliases = router_aliases(template, names, str(ck.model_files[0]))
    models = ExpertWeightFiles(ck, template, dp=dp, stage=stage, ds_config=ds_config, placement=placement,
                               dtype=dtype, names=names, outer=outer, aliases=aliases)
    clip = cfg.get("gradient_clipping", 0.0)
    return DeepSpeedTarget(layout, tp=1, dp=dp, stage=stage, bf16=ck.bf16, states=OPTIMIZER,
                           optim_template=lambda: z3.optim_source_from_zero3(optim(), clip_grad=clip),
                           ds_config=ds_config, uc_info=None, models=models, placement=None,
                           group_names=dict.fromkeys(expert_groups, f"ep_size_{ep}"),
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

    def _module_key(self, key: str, t: int = 0) -> str:
        return f"{dsw.model_file(t)}:module:{key}"

    def _module(self, tgt: DeepSpeedTarget, engine: Any, t: int,
                shape: Callable[[ParamMap], Sequence[int]]) -> tuple[OrderedDict, list[OrderedDict]]:
        """TP rank ``t``'s module (each weight its declared buffer viewed at ``shape(outer map)``, a
        buffer whole from the source) and the ``param_shapes`` of its layout units."""
        declared = tgt.by_key()
        module = OrderedDict()
        for key, value in (self.template.get("module") or {}).items():
            if key not in self.weights:  # a buffer, whole in the source
                module[key] = value
                continue
            m = self.outer[self.aliases.get(key, key)]
            module[key] = engine.storage(declared[self._module_key(key, t)]).view(tuple(shape(m)))
        shapes = [OrderedDict((n, tuple(s)) for n, s in zip(p.unit.names, p.unit.shapes))
                  for _, p, _ in tgt.layout.rank_units(t)]
        return module, shapes

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
        module, shapes = self._module(tgt, engine, 0, lambda m: m.logical_shape)
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


def _fresh_placement(tpl: Templates, layers: Sequence[Any], shapes: Mapping[str, tuple[int, ...]], ep: int, dp: int,
                     aliases: Mapping[str, str]) -> tuple[frozenset[int], dse.AutoEP, AutoEPPlacement]:
    """A fresh job's expert optimizer groups, its AutoEP record and AutoEP's uniform placement of
    the source's expert layers at EP ``ep`` x world ``dp``."""
    expert_names = {n for lay in layers for n in lay.params}
    groups = frozenset(g for g, names in enumerate(tpl.group_names) if expert_names & set(names))
    params = {n: dse.ExpertParam(n, lay.layer, tuple(shapes[n]), (), {}, g) for lay in layers for n in lay.params
              for g in groups if n in tpl.group_names[g]}
    ax = dse.AutoEP(params, groups, ep, dp // ep, False, tuple(aliases))
    return groups, ax, AutoEPPlacement(ax, ep, dp)


def autoep_fresh_target(tpl: Templates, layers: Sequence[Any], shapes: Mapping[str, tuple[int, ...]], ep: int, dp: int,
                        stage: int, aliases: Mapping[str, str], clip_grad: float | None = None) -> DeepSpeedTarget:
    """AutoEP's fused experts at EP ``ep`` x world ``dp``, ZeRO stage ``stage`` (1 or 2), from a
    source that is no DeepSpeed checkpoint (a universal one): the layout of ``expert_pipe.autoep_pipe_target``
    (a dense group flat over all ``dp`` ranks, the expert group flat over each EP rank's EDP group,
    AutoEP's uniform placement), the files of a fresh ZeRO job (``tpl``, ``templates.fresh``), the
    module's and each per-expert file's weights cast from the source (:class:`ExpertWeightFiles`),
    ``ds_autoep_layers`` the source's records (``layers``: ``contract.ExpertLayer``) rewritten at
    the target's placement. Expert-data-parallel groups in DeepSpeed's default order (expert
    before data)."""
    groups, ax, placement = _fresh_placement(tpl, layers, shapes, ep, dp, aliases)
    names = tpl.names
    buffers = list(tpl.model.get("buffer_names") or [])  # module buffers: weights of no optimizer group
    outer = {n: placement.maps[n] if n in placement.maps else replicated(shapes[n], 1) for n in [*names, *buffers]}
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
    template = fresh_model_template(tpl, layers, aliases)
    models = ExpertWeightFiles(None, template, dp=dp, stage=stage, ds_config=ds_config, placement=placement,
                               dtype=tpl.dtype, names=[*names, *buffers], outer=outer, aliases=aliases)
    return DeepSpeedTarget(layout, tp=1, dp=dp, stage=stage, bf16=tpl.bf16, states=OPTIMIZER,
                           optim_template=lambda: _with_clip(tpl.optim_z12(), clip_grad), ds_config=ds_config,
                           uc_info=None, models=models, group_names=dict.fromkeys(groups, f"ep_size_{ep}"),
                           notes=[f"AutoEP experts at EP {ep} (EDP {placement.edp}), uniform placement, EDP groups in "
                                  "DeepSpeed's default order (expert before data)"])


def fresh_model_template(tpl: Templates, layers: Sequence[Any], aliases: Mapping[str, str]) -> dict:
    """A fresh job's AutoEP ZeRO-1/2 model states: no tied weights (the router alias is the module's
    own entry), the experts per layer and each layer's record; a module without the experts (they
    are the per-expert files'), each router alias after its router."""
    module = OrderedDict()
    keys = [k for k in tpl.model["module"] if k not in aliases]  # the model's order, buffers in place
    after = _alias_places(keys, aliases, layers)
    for n in keys:
        if not any(n in lay.params for lay in layers):
            module[n] = tpl.model["module"][n]
            module.update((a, module[aliases[a]]) for a in after.get(n, ()))
    return {**tpl.model, "module": module, "shared_params": {}, "num_experts": [lay.num_experts for lay in layers],
            dse.LAYERS_KEY: [dict(lay.record) for lay in layers]}


def _alias_places(keys: Sequence[str], aliases: Mapping[str, str], layers: Sequence[Any]) -> dict[str, list[str]]:
    """Where the module holds each router alias: AutoEP's layer holds its router module a second
    time under the model's name, so a layer's aliases follow the last of their routers' entries in
    ``keys`` (the router's bias buffer, then its weight: MiniMax-M3), in the order of those entries.
    ``{entry: the aliases after it}``; an alias whose router is not in ``keys`` has no place."""
    pos = {k: i for i, k in enumerate(keys)}
    groups: dict[str, list[str]] = {}
    for a in aliases:
        if aliases[a] in pos:
            path = next((lay.module_path for lay in layers if a.startswith(lay.module_path + ".")), a)
            groups.setdefault(path, []).append(a)
    out: dict[str, list[str]] = {}
    for group in groups.values():
        group.sort(key=lambda a: pos[aliases[a]])
        out.setdefault(aliases[group[-1]], []).extend(group)
    return out


def _with_clip(optim: dict, clip_grad: float | None) -> dict:
    """A fresh ZeRO-1/2 optimizer file with the source's gradient clipping."""
    if clip_grad is None:
        return optim
    return {**optim, "optimizer_state_dict": {**optim["optimizer_state_dict"], "clip_grad": clip_grad}}


# -- AutoEP ZeRO-1/2 -> ZeRO-3 ---------------------------------------------------------------------


def _with_partition_groups(optim: dict) -> dict:
    """A recast ZeRO-3 optimizer file with AutoEP's ``ds_zero_partition_groups`` slot after
    ``partition_count``, where DeepSpeed's AutoEP ZeRO-3 save puts it (filled per rank)."""
    out: dict[str, Any] = {}
    for key, value in optim["optimizer_state_dict"].items():
        out[key] = value
        if key == "partition_count":
            out["ds_zero_partition_groups"] = []
    return {**optim, "optimizer_state_dict": out}


def zero3_template_from_zero12(ck: DeepSpeedCheckpoint) -> tuple[dict, list[list[str]], dict[str, int], bool]:
    """An AutoEP ZeRO-1/2 checkpoint's model state as DeepSpeed's AutoEP ZeRO-3 save writes it (its
    TP 1 view where folded): the module's parameters and router aliases 0-element placeholders of
    the training dtype (buffers whole), no frozen parameters, the layer entries ``checkpoint_format:
    "zero3_partitioned"`` (version 1); with its optimizer groups' names and each parameter's
    ``ds_id`` (``experts.module_ds_ids``, and whether that order holds every parameter)."""
    ax, ms0, path = ck.experts, ck.model_state(0), ck.model_files[0]
    if ax.folded:  # AutoEP x AutoTP: its TP-1 view (no folding records)
        ms0 = unfolded(ms0)
    group_names = [list(g) for g in ck.groups(0)]
    names = [n for g in group_names for n in g]
    module = ms0.get("module") or {}
    dtypes = {module[n].dtype for n in names if isinstance(module.get(n), torch.Tensor)}
    if len(dtypes) != 1:
        raise CheckpointError(f"{path}: the module's dense weights have dtypes {sorted(map(str, dtypes))}; expected "
                              "one training dtype")
    dtype = dtypes.pop()
    aliases = router_aliases(ms0, names, str(path), why="a ZeRO-3 module holds a parameter as a placeholder and a "
                             "buffer whole, and which this entry is is not recorded")
    placeholders = set(names) | set(aliases)
    template = {**ms0, "module": OrderedDict((k, torch.empty(0, dtype=dtype) if k in placeholders else v)
                                             for k, v in module.items()),
                "frozen_param_shapes": OrderedDict(), "frozen_param_fragments": OrderedDict(),
                dse.LAYERS_KEY: [{**entry, "checkpoint_format": "zero3_partitioned", "checkpoint_format_version": 1}
                                 for entry in ms0[dse.LAYERS_KEY]]}
    ids, exact = dse.module_ds_ids(list(module), ax, names)
    return template, group_names, ids, exact


def optim_zero3_from_zero12(ck: DeepSpeedCheckpoint) -> dict:
    """An AutoEP ZeRO-1/2 checkpoint's optimizer file recast for ZeRO-3, with AutoEP's
    ``ds_zero_partition_groups`` slot (its TP 1 view where folded)."""
    return _with_partition_groups(z3.optim_source_from_zero12(unfolded(ck.optim_state(0, 0))))


def autoep_to_zero3_target(ck: DeepSpeedCheckpoint, ep: int, dp: int) -> DeepSpeedTarget:
    """An AutoEP ZeRO-1/2 checkpoint written at ZeRO-3, EP ``ep`` x world ``dp``: the layout of
    ``target.autoep_zero3_target`` (a dense parameter split over all ``dp`` ranks, a fused expert
    parameter of EP rank ``e`` over ``e``'s EDP group, sub-groups by DeepSpeed's rule), one
    model-state and one optimizer file per DP rank and no per-expert files, as DeepSpeed's AutoEP
    ZeRO-3 save writes them (:func:`zero3_template_from_zero12`): each rank's view of the placement
    in the layer entries, the optimizer file the source's recast (``zero3.optim_source_from_zero12``)
    with ``ds_zero_partition_groups``."""
    ax, path = ck.experts, ck.model_files[0]
    template, group_names, ids, exact = zero3_template_from_zero12(ck)
    shapes = {n: (tuple(ax.params[n].full_shape) if n in ax.params else
                  tuple(ck.tp_map(n).map.valid_shape) if ax.folded else tuple(s))
              for g in ck.groups(0) for n, s in g.items()}
    cfg = template.get("ds_config") if isinstance(template.get("ds_config"), dict) else None
    notes = [f"AutoEP experts at EP {ep} (EDP {dp // ep}), uniform placement, ZeRO-{ck.zero_stage} -> ZeRO-3: "
             "one model-state and one optimizer file per DP rank, the per-expert files' weights not written (a "
             "ZeRO-3 engine loads the fp32 masters)"]
    notes += ds_id_notes(exact, "do not match the parameter order reshard derives")
    return autoep_zero3(ax, group_names, ax.groups, ep=ep, dp=dp, template=template,
                        optim=lambda: optim_zero3_from_zero12(ck), cfg=cfg, ds_ids=ids,
                        size=z3.sub_group_size(cfg, str(path)), bf16=ck.bf16, model_size=path.stat().st_size,
                        notes=notes, shapes=shapes)


def autoep_fresh_zero3_target(tpl: Templates, layers: Sequence[Any], shapes: Mapping[str, tuple[int, ...]], ep: int,
                              dp: int, aliases: Mapping[str, str], where: str, *, tp: int = 1,
                              maps: Mapping[str, ParamMap] | None = None, info: dict | None = None) -> DeepSpeedTarget:
    """AutoEP's fused experts at ZeRO-3, EP ``ep`` x world ``dp``, from a source that is no DeepSpeed
    checkpoint (a universal one): the layout of ``target.autoep_zero3_target`` on the files of a
    fresh ZeRO-3 job (``tpl``, ``templates.fresh`` at stage 3) as DeepSpeed's AutoEP ZeRO-3 save
    writes them (:func:`autoep_to_zero3_target`): the module's dense parameters and router
    aliases 0-element placeholders, each rank's view of the placement in ``ds_autoep_layers``
    (``checkpoint_format: "zero3_partitioned"``), ``ds_zero_partition_groups``. EDP groups in
    DeepSpeed's default order (expert before data)."""
    groups, ax, _ = _fresh_placement(tpl, layers, shapes, ep, tp * dp, aliases)
    size = z3.sub_group_size(tpl.cfg, where)
    # a module without the experts (the AutoEP layer keeps them out of its state dict), each router
    # alias after its router, every entry a placeholder of its own
    module = OrderedDict()
    after = _alias_places(tpl.names, aliases, layers)
    for n in tpl.names:
        if not any(n in lay.params for lay in layers):
            module[n] = torch.empty(0, dtype=tpl.dtype)
            module.update((a, torch.empty(0, dtype=tpl.dtype)) for a in after.get(n, ()))
    template = {**tpl.model, "module": module, "frozen_param_shapes": OrderedDict(),
                "frozen_param_fragments": OrderedDict(), "shared_params": {},
                "num_experts": [lay.num_experts for lay in layers],
                dse.LAYERS_KEY: [{**dict(lay.record), "checkpoint_format": "zero3_partitioned",
                                  "checkpoint_format_version": 1} for lay in layers],
                # what DeepSpeed's AutoEP save always records (engine._save_moe_checkpoint); the
                # layer entries are added per rank
                "universal_checkpoint_info": {"universal_checkpoint_version": 0.4,
                                              "expert_parameter_patterns": [r".*\.experts\.w[123]$"]}}
    ids, exact = dse.module_ds_ids(list(module), ax, tpl.names)
    notes = [f"AutoEP experts at EP {ep} (EDP {dp // ep}), uniform placement, ZeRO-3, EDP groups in DeepSpeed's "
             "default order (expert before data)" if tp == 1 else
             f"AutoEP experts at EP {ep} folded over TP {tp} (DP {dp}, EDP {tp * dp // ep}), uniform placement, "
             "ZeRO-3: one model-state and one optimizer file per (TP, DP) rank, a folding record in every file"]
    notes += ds_id_notes(exact, "do not match the parameter order reshard derives")
    return autoep_zero3(ax, tpl.group_names, groups, ep=ep, dp=dp, template=template,
                        optim=lambda: _with_partition_groups(tpl.optim), cfg=tpl.cfg, ds_ids=ids, size=size,
                        bf16=tpl.bf16, model_size=1 << 16, notes=notes, shapes=shapes, tp=tp, maps=maps, info=info)
