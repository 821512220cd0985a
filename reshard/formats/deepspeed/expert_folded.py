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
from .expert_target import ExpertWeightFiles, router_aliases
from .layout import Group, Layout, Part, Unit
from .placement import AutoEPPlacement
from .target import DeepSpeedTarget, unfolded

__all__ = ["FoldedFiles", "autoep_folded_target"]


def autoep_folded_target(ck: DeepSpeedCheckpoint, tp: int, ep: int, dp: int, stage: int, maps: Mapping[str, ParamMap],
                         info: dict | None) -> DeepSpeedTarget:
    """AutoEP ZeRO-1/2 at TP ``tp`` > 1, folded as DeepSpeed 0.19.8 lays it (folding.py): world
    ``tp * dp``; each dense parameter's TP map (``maps``) with its TP rank's shard flat over that
    rank's ``dp`` DP ranks, each fused expert at EP rank ``e`` (global rank ``g``: ``g % ep``) flat
    over its EDP group; one model state per TP rank (its shards, its EP rank's view of the layers,
    ``info`` with the layers placed), per-expert files named by their writer's TP rank, a ``folding``
    record in every file."""
    ax, ms0 = ck.experts, ck.model_state(0)
    world = tp * dp
    placement = AutoEPPlacement(ax, ep, world)
    zo = (ms0.get("ds_config") or {}).get("zero_optimization") or {}
    dtype = ck.module_dtype
    align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
    dense = Group.dense(tp, dp)
    outer: dict[str, ParamMap] = {**maps, **placement.maps}
    units = []
    for g, grp in enumerate(ck.groups(0)):
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
    cfg = dsw.target_ds_config(ms0.get("ds_config"), tp=tp, dp=dp, zero_stage=stage)
    ds_config = placement.ds_config(cfg)
    template = unfolded(ms0)
    names = [n for grp in ck.groups(0) for n in grp]
    models = FoldedFiles(ck, template, tp=tp, dp=dp, stage=stage, ds_config=ds_config, placement=placement,
                         dtype=dtype, names=names, outer=outer, info=info,
                         aliases=router_aliases(template, names, str(ck.model_files[0])))
    edp = placement.edp

    def record(rank: int) -> dict:
        t, d = rank % tp, rank // tp
        e = placement.ep_of[rank]
        return {folding.KEY: folding.optim_record(tp, t, ep, e, dp, d, edp, placement.ax.members(e).index(rank),
                                                  [list(grp) for grp in ck.groups(0)])}

    return DeepSpeedTarget(layout, tp=tp, dp=dp, stage=stage, bf16=ck.bf16, states=OPTIMIZER,
                           optim_template=lambda: unfolded(ck.optim_state(0, 0)), ds_config=ds_config, uc_info=None,
                           models=models, per_rank=record,
                           notes=[f"AutoEP experts at EP {ep} folded over TP {tp} (DP {dp}, EDP {edp}), uniform "
                                  "placement, a folding record in every file"])


class FoldedFiles(ExpertWeightFiles):
    """The model states of a folded AutoEP target, one per TP rank (its module's TP shards, buffers
    whole, a router alias its router's), and the per-expert files (weights from the masters), each
    with its ``folding`` record."""

    def __init__(self, ck: DeepSpeedCheckpoint, template: dict, *, tp: int, dp: int, stage: int,
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
