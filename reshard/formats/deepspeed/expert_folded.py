"""DeepSpeed AutoEP x AutoTP ("folding") at ZeRO-1/2: AutoEP at TP > 1, as DeepSpeed 0.19.8 lays it
out (folding.py), built on the unfolded AutoEP target's per-expert model files (at ZeRO-3 it is
``target.autoep_zero3`` at TP > 1)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...ir.param_map import ParamMap
from ..contract import MODULE, OPTIMIZER, Buffer, Slot
from . import experts as dse
from . import folding
from . import zero12 as dsw
from .checkpoint import DeepSpeedCheckpoint
from .expert_target import (
    ExpertWeightFiles,
    _fresh_placement,
    _with_clip,
    fresh_model_template,
    router_aliases,
)
from .layout import Group, Layout, Part, Unit
from .placement import AutoEPPlacement
from .target import DeepSpeedTarget, unfolded
from .templates import Templates

__all__ = ["FoldedFiles", "autoep_folded_fresh_target", "autoep_folded_target", "folded_target"]


def autoep_folded_target(ck: DeepSpeedCheckpoint, tp: int, ep: int, dp: int, stage: int, maps: Mapping[str, ParamMap],
                         info: dict | None) -> DeepSpeedTarget:
    """AutoEP ZeRO-1/2 at TP ``tp`` > 1, folded as DeepSpeed 0.19.8 lays it (folding.py), built on a
    DeepSpeed AutoEP source's own files (:func:`folded_target`)."""
    template = unfolded(ck.model_state(0))
    names = [n for grp in ck.groups(0) for n in grp]
    return folded_target(ck.experts, [list(grp) for grp in ck.groups(0)], template,
                         lambda: unfolded(ck.optim_state(0, 0)), tp=tp, ep=ep, dp=dp, stage=stage, maps=maps,
                         info=info, dtype=ck.module_dtype, bf16=ck.bf16,
                         aliases=router_aliases(template, names, str(ck.model_files[0])))


def autoep_folded_fresh_target(tpl: Templates, layers: Sequence[Any], shapes: Mapping[str, tuple[int, ...]], *,
                               tp: int, ep: int, dp: int, stage: int, aliases: Mapping[str, str],
                               maps: Mapping[str, ParamMap], info: dict | None,
                               clip_grad: float | None) -> DeepSpeedTarget:
    """AutoEP ZeRO-1/2 folded over TP ``tp`` > 1 from a source that is no DeepSpeed checkpoint (a
    universal or DCP checkpoint, an HF folder read through ``autoep_view``): the files of a fresh
    ZeRO job (``tpl``) as ``expert_target.autoep_fresh_target`` builds them at TP 1, laid out by
    :func:`folded_target` with the dense TP maps and ``universal_checkpoint_info`` of a folded
    DeepSpeed checkpoint (``--layout``)."""
    groups, ax, _ = _fresh_placement(tpl, layers, shapes, ep, tp * dp, aliases)
    return folded_target(ax, tpl.group_names, fresh_model_template(tpl, layers, aliases),
                         lambda: _with_clip(tpl.optim_z12(), clip_grad), tp=tp, ep=ep, dp=dp, stage=stage, maps=maps,
                         info=info, dtype=tpl.dtype, bf16=tpl.bf16, aliases=aliases,
                         group_names=dict.fromkeys(groups, f"ep_size_{ep}"))


def folded_target(ax: dse.AutoEP, groups: Sequence[Sequence[str]], template: dict, optim: Callable[[], dict], *,
                  tp: int, ep: int, dp: int, stage: int, maps: Mapping[str, ParamMap], info: dict | None,
                  dtype: torch.dtype, bf16: bool, aliases: Mapping[str, str],
                  group_names: Mapping[int, str] | None = None) -> DeepSpeedTarget:
    """AutoEP ZeRO-1/2 at TP ``tp`` > 1, folded as DeepSpeed 0.19.8 lays it (folding.py): world
    ``tp * dp``; each dense parameter's TP map (``maps``) with its TP rank's shard flat over that
    rank's ``dp`` DP ranks, each fused expert at EP rank ``e`` (global rank ``g``: ``g % ep``) flat
    over its EDP group; one model state per TP rank (``template``'s keys: its shards, its EP rank's
    view of the layers, ``info`` with the layers placed), per-expert files named by their writer's
    TP rank, a ``folding`` record in every file (``optim()``'s keys). ``groups``: the optimizer
    groups' names, the experts' those of ``ax.groups``."""
    world = tp * dp
    placement = AutoEPPlacement(ax, ep, world)
    zo = (template.get("ds_config") or {}).get("zero_optimization") or {}
    align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
    dense = Group.dense(tp, dp)
    outer: dict[str, ParamMap] = {**maps, **placement.maps}
    units = []
    for g, grp in enumerate(groups):
        if g in ax.groups:
            names = list(grp)
            fg = dsw.flat_group(names, [placement.maps[n].shards[0].shape for n in names], placement.edp,
                                param_align=align)
            units.append(Unit(placement.group(), dict.fromkeys(range(ep), Part(fg, fg.names))))
            continue
        parts = {}
        for t in range(tp):
            names = [n for n in grp if t in maps[n].shards and maps[n].shards[t].numel > 0]
            fg = dsw.flat_group(names, [maps[n].shards[t].shape for n in names], dp, param_align=align)
            parts[t] = Part(fg, fg.names)
        units.append(Unit(dense, parts))
    layout = Layout("flat", outer, units, [d * tp + t for t in range(tp) for d in range(dp)])
    cfg = dsw.target_ds_config(template.get("ds_config"), tp=tp, dp=dp, zero_stage=stage)
    ds_config = placement.ds_config(cfg)
    names = [n for grp in groups for n in grp]
    models = FoldedFiles(None, template, tp=tp, dp=dp, stage=stage, ds_config=ds_config, placement=placement,
                         dtype=dtype, names=names, outer=outer, info=info, aliases=aliases)
    edp = placement.edp
    plain = [list(grp) for grp in groups]

    def record(rank: int) -> dict:
        t, d = rank % tp, rank // tp
        e = placement.ep_of[rank]
        return {folding.KEY: folding.optim_record(tp, t, ep, e, dp, d, edp, placement.ax.members(e).index(rank),
                                                  plain)}

    return DeepSpeedTarget(layout, tp=tp, dp=dp, stage=stage, bf16=bf16, states=OPTIMIZER,
                           optim_template=optim, ds_config=ds_config, uc_info=None,
                           models=models, per_rank=record, group_names=group_names,
                           notes=[f"AutoEP experts at EP {ep} folded over TP {tp} (DP {dp}, EDP {edp}), uniform "
                                  "placement, a folding record in every file"])


class FoldedFiles(ExpertWeightFiles):
    """The model states of a folded AutoEP target, one per TP rank (its module's TP shards, buffers
    whole, a router alias its router's), and the per-expert files (weights from the masters), each
    with its ``folding`` record."""

    def __init__(self, ck: DeepSpeedCheckpoint | None, template: dict, *, tp: int, dp: int, stage: int,
                 ds_config: dict | None, placement: AutoEPPlacement, dtype: torch.dtype, names: Sequence[str],
                 outer: Mapping[str, ParamMap], aliases: Mapping[str, str], info: dict | None) -> None:
        super().__init__(ck, template, dp=dp, stage=stage, ds_config=ds_config, placement=placement, dtype=dtype,
                         names=names, outer=outer, aliases=aliases)
        self.tp, self.info = tp, info

    def before(self) -> list[Buffer]:
        out = []
        for t in range(self.tp):
            for key in self.weights:
                m = self.outer[self.aliases.get(key, key)]
                out.append(Buffer(self._module_key(key, t), self.dtype, m.shards[t].numel,
                                  (Slot(0, self.aliases.get(key, key), MODULE, m, t),)))
        return out

    def _ep(self, layer: int, x: int) -> int:
        return next(r["rank"] for r in self.placement.placements[layer]["ranks"] if x in r["experts"])

    def _files(self, layer: int, x: int) -> list[tuple[str, int, int]]:
        """``(file, TP rank, EDP rank)`` of expert ``x``'s per-expert files: one per TP rank of its EP
        rank's writers (``folding.expert_writers``), the record that of the first of them."""
        e = self._ep(layer, x)
        writers = folding.expert_writers(self.tp, self.placement.ep, self.tp * self.dp)
        return [(f"layer_{layer}_expert_{x}_mp_rank_{t:02d}_model_states.pt", t, qs[0])
                for (e2, t), qs in sorted(writers.items()) if e2 == e]

    def model_state(self, tgt: DeepSpeedTarget, engine: Any, t: int) -> dict:
        module, shapes = self._module(tgt, engine, t, lambda m: m.shards[t].shape)
        pl = self.placement
        uc = folding.folded_info(self.info, pl.maps, self.tp)
        if dse.LAYERS_KEY in uc:
            uc[dse.LAYERS_KEY] = [pl.layer(entry, t, copied=False) for entry in uc[dse.LAYERS_KEY]]
        obj = dsw.model_states(self.template, module=module, param_shapes=shapes, tp=self.tp, dp=self.dp, tp_rank=t,
                               zero_stage=self.stage, shared_params=self.template.get("shared_params") or {},
                               uc_info=uc or None, ds_config=self.ds_config)
        obj[dse.LAYERS_KEY] = [pl.layer(entry, t, copied=False) for entry in self.template[dse.LAYERS_KEY]]
        obj[folding.KEY] = folding.model_record(self.tp, t, pl.ep, pl.ep_of[t], self.dp, module)
        return obj

    def folded_expert(self, tgt: DeepSpeedTarget, engine: Any, layer: int, x: int, t: int, q: int) -> dict:
        out = self.expert(tgt, engine, layer, x)
        pl = self.placement
        out[folding.KEY] = {**folding.expert_record(self.tp, t, pl.ep, self._ep(layer, x), pl.edp),
                            "zero_partition_rank": q}
        return out

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        esize = self.dtype.itemsize
        before = [archive(dsw.model_file(t), sum(self.outer[self.aliases.get(k, k)].shards[t].numel
                                                 for k in self.weights) * esize,
                          lambda t=t: self.model_state(tgt, engine, t)) for t in range(self.tp)]
        after = [archive(f, sum(self.per_expert[n].shards[x].numel for n in names) * esize,
                         lambda layer=layer, x=x, t=t, q=q: self.folded_expert(tgt, engine, layer, x, t, q))
                 for layer, names in sorted(self.layers.items())
                 for x in range(self.per_expert[names[0]].logical_shape[0]) for f, t, q in self._files(layer, x)]
        return before, after
