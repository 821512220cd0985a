"""DeepSpeed ZeRO-1/2 files at a TP x DP (x PP) topology, laid out as DeepSpeed 0.19.8 saves them
(so ``engine.load_checkpoint`` loads them natively), from any source.

Per model-parallel rank ``m = stage * tp + t`` and parameter group, the target TP shards the rank
holds form one flat group (``zero12.flat_group``), cut into DP partitions. Every buffer is a list
of slots the engine fills:

* each DP rank's optimizer file: per group and state (fp32, exp_avg, exp_avg_sq) the partition,
  each parameter's fragment a slot of its *composite* map (its target stage map composed with
  the ZeRO split of its flat group, over global ranks ``dp_rank * mp + m``);
* each model-parallel rank's model states: per group one buffer of the training dtype, each
  parameter's TP shard a slot of its stage map (the source's module weights, else its masters
  cast);
* a pipeline checkpoint's layer files (``layer_LL-model_TT-model_states.pt``): copied as they
  are at an unchanged TP degree, since no stage count changes them, else one tensor per
  parameter of its target TP shard.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import compose_zero
from ...layouts.topology import Topology
from ..contract import MODULE, MOMENTS, Buffer, Slot
from . import zero12 as dsw
from .buffers import Declared, partition, partition_buffers
from .templates import Templates

__all__ = ["Zero12Target"]


def _holds(m: ParamMap, t: int) -> bool:
    """Whether model-parallel rank ``t`` holds any of the parameter (a TP rank of an uneven
    split may hold none; a pipeline stage holds only its own parameters)."""
    return t in m.shards and m.shards[t].numel > 0


class Zero12Target:
    """The files of ZeRO stage ``stage`` (1 or 2) at ``tp`` x ``dp`` x ``pp``, ``maps`` each
    parameter's target stage map (over model-parallel ranks ``stage * tp + t``)."""

    def __init__(self, tpl: Templates, maps: dict[str, ParamMap], *, tp: int, dp: int, pp: int, stage: int,
                 uc_info: dict | None, pipe: bool = False, layer_files: dict | None = None,
                 source_ck: Any = None) -> None:
        self.tpl, self.maps, self.tp, self.dp, self.pp, self.stage = tpl, maps, tp, dp, pp, stage
        self.mp = tp * pp
        self.uc_info = uc_info
        self.pipe = pipe  # a deepspeed.pipe source: weights in layer files, model states without module
        self.layer_files = layer_files or {}  # the source's (layer, TP rank) -> file
        self.source_ck = source_ck
        self.topology = Topology(1, dp, self.mp)
        self.groups: list[list[dsw.FlatGroup]] = []  # [model-parallel rank][parameter group]
        for t in range(self.mp):
            per_group = []
            for names in tpl.group_names:
                # a zero-element shard is no optimizer parameter (DeepSpeed's is_optimized_parameter)
                held = [n for n in names if _holds(maps[n], t)]
                per_group.append(dsw.flat_group(held, [maps[n].shard(t).shape for n in held], dp,
                                                param_align=tpl.param_align))
            self.groups.append(per_group)
        self.empty = [[n for n in tpl.names if not _holds(maps[n], t)] for t in range(self.mp)]
        self.index = {(t, n): (g, i) for t, per_group in enumerate(self.groups)
                      for g, grp in enumerate(per_group) for i, n in enumerate(grp.names)}
        self._composites: dict[str, ParamMap] = {}
        self.states = ("fp32",) + (MOMENTS if tpl.has_moments or not tpl.native else ())
        self.ds_config = dsw.target_ds_config(tpl.cfg, tp=1 if pipe else self.mp, dp=dp, zero_stage=stage)
        self.declared = Declared(self._declare)

    def composite(self, name: str) -> ParamMap:
        """``name``'s target stage map composed with the ZeRO split of its flat groups, over
        global ranks ``dp_rank * mp + m``."""
        m = self._composites.get(name)
        if m is None:
            zero = {}
            for t in self.maps[name].ranks:
                where = self.index.get((t, name))
                zero[t] = None if where is None else self.groups[t][where[0]].param_map(where[1])
            m = self._composites[name] = compose_zero(self.maps[name], zero, self.topology)
        return m

    def buffers(self) -> list[Buffer]:
        return self.declared.buffers()

    def _declare(self) -> list[Buffer]:
        """Each model-parallel rank's module weights (per group one flat buffer; none in a pipeline's
        model states), each (model-parallel, DP) rank's optimizer partitions, and the layer files
        of a pipeline written at another TP degree (each weight's shard)."""
        out = []
        if not self.pipe:
            for t in range(self.mp):
                for g, grp in enumerate(self.groups[t]):
                    slots = tuple(Slot(off, n, MODULE, self.maps[n], t) for n, off in zip(grp.names, grp.offsets))
                    out.append(Buffer(f"{dsw.model_file(t)}:{g}", self.tpl.dtype, grp.total, slots))
        for t in range(self.mp):
            for d in range(self.dp):
                rank = self.topology.rank(0, d, t)
                for g, grp in enumerate(self.groups[t]):
                    base = d * grp.partition
                    frags = [(lo - base, grp.names[i]) for i, lo, _ in grp.fragments(d)]
                    out += partition_buffers(self._optim_key(t, d, g), grp.partition, frags, self.composite, rank,
                                             self.states)
        if self.layer_files and self.tp != self.source_ck.tp:
            for L in sorted({layer for layer, _ in self.layer_files}):
                for t in range(self.tp):
                    for key in self.source_ck.layer_state(self.layer_files[(L, 0)]):
                        m = self.maps[f"{L}.{key}"]
                        dst = min(m.ranks) + t  # TP rank t of the target stage: stage * tp + t
                        out.append(Buffer(f"{dsw.layer_file(L, t)}:{key}", self.tpl.dtype, prod(m.shard(dst).shape),
                                          (Slot(0, f"{L}.{key}", MODULE, m, dst),)))
        return out

    def _optim_key(self, t: int, d: int, g: int) -> str:
        return f"{dsw.optim_file(t, d, bf16=self.tpl.bf16)}:{g}"

    def tp_index(self, rank: int) -> int:
        return rank % self.mp % self.tp

    # -- files -----------------------------------------------------------------------------------
    def optim(self, engine: Any, t: int, d: int) -> dict:
        """(model-parallel ``t``, DP ``d``)'s optimizer file: per group and state the partition."""
        fp32, moments = [], []
        declared = self.declared.by_key()
        for g, grp in enumerate(self.groups[t]):
            flat, views = partition(engine, declared, self._optim_key(t, d, g), grp.partition, self.states)
            fp32.append(flat)
            moments.append(views)
        return dsw.optim_states(self.tpl.optim_z12(), groups=self.groups[t], d=d, fp32=fp32, moments=moments,
                                zero_stage=self.stage, ds_config=self.ds_config, uc_info=self.uc_info)

    def _views(self, engine: Any, t: int) -> dict[str, Any]:
        """Model-parallel rank ``t``'s module weights: per group one flat buffer, each parameter
        a view at its place; a zero-element shard an empty tensor."""
        views: dict[str, Any] = {}
        declared = self.declared.by_key()
        for g, grp in enumerate(self.groups[t]):
            flat = engine.storage(declared[f"{dsw.model_file(t)}:{g}"])
            for name, off, shape in zip(grp.names, grp.offsets, grp.shapes):
                views[name] = flat.view(shape, offset=off)
        for name in self.empty[t]:
            views[name] = torch.empty(self.maps[name].shard(t).shape, dtype=self.tpl.dtype)
        return views

    def model(self, engine: Any, t: int) -> dict:
        """``mp_rank_TT_model_states.pt``: the template's keys in its order, the module's weights
        the target's, tied aliases sharing their parameter's tensor, buffers as the source holds them."""
        tpl = self.tpl
        if self.pipe:
            return dsw.model_states(tpl.model, module=None, param_shapes=self._param_shapes(t), tp=self.tp,
                                    dp=self.dp, tp_rank=t % self.tp, zero_stage=self.stage, shared_params={},
                                    uc_info=self.uc_info, ds_config=self.ds_config, pp=self.pp)
        views = self._views(engine, t)
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
                    from ...errors import CheckpointError

                    raise CheckpointError(f"{key!r} is tied to {canonical!r}, which the module does not hold")
        empty = OrderedDict((n, views[n]) for n in tpl.names if n in self.empty[t])
        return dsw.model_states(tpl.model, module=module, param_shapes=self._param_shapes(t), tp=self.mp, dp=self.dp,
                                tp_rank=t, zero_stage=self.stage, shared_params=tpl.shared, uc_info=self.uc_info,
                                ds_config=self.ds_config, empty_params=empty)

    def _param_shapes(self, t: int) -> list[OrderedDict]:
        return [OrderedDict((n, torch.Size(s)) for n, s in zip(grp.names, grp.shapes)) for grp in self.groups[t]]

    def layer(self, engine: Any, layer: int, t: int) -> dict:
        """Layer file ``layer`` of target TP rank ``t``: each parameter's target shard in a storage
        of its own (DeepSpeed clones every tensor before saving), in the source file's key order."""
        state = OrderedDict()
        declared = self.declared.by_key()
        for key in self.source_ck.layer_state(self.layer_files[(layer, 0)]):
            m = self.maps[f"{layer}.{key}"]
            shape = m.shard(min(m.ranks) + t).shape  # TP rank t of the target stage: stage * tp + t
            state[key] = engine.storage(declared[f"{dsw.layer_file(layer, t)}:{key}"]).view(shape)
        return state

    def jobs(self, engine: Any, staging: Any, archive: Callable[..., Any]) -> list:
        """Every file, the large ones as archives written in stripes (``archive(rel, size, build)``)."""
        esize = self.tpl.dtype.itemsize
        jobs = [archive(dsw.model_file(t), sum(g.total for g in self.groups[t]) * esize,
                        lambda t=t: self.model(engine, t)) for t in range(self.mp)]
        jobs += [archive(dsw.optim_file(t, d, bf16=self.tpl.bf16),
                         sum(g.partition for g in self.groups[t]) * 4 * len(self.states),
                         lambda t=t, d=d: self.optim(engine, t, d)) for t in range(self.mp) for d in range(self.dp)]
        if self.layer_files:
            ck = self.source_ck
            if self.tp == ck.tp:  # a layer file holds one layer's weights of one TP rank at any stage count
                jobs += [(p.stat().st_size, lambda p=p: staging.copy(p, p.name)) for _, p in sorted(self.layer_files.items())]
            else:
                layers = sorted({layer for layer, _ in self.layer_files})
                jobs += [archive(dsw.layer_file(L, t), self.layer_files[(L, 0)].stat().st_size // ck.tp,
                                 lambda L=L, t=t: self.layer(engine, L, t)) for L in layers for t in range(self.tp)]
        return jobs

