"""Classic DeepSpeed MoE (``deepspeed.moe.layer.MoE``) saved at TP > 1 through a Megatron-style
``mpu``, written as DeepSpeed 0.19.8 saves it (moe.py says what that is): at the source's own TP
(either expert mode), or at TP 1 (the dense TP shards joined, the experts whole).

The layout is the folded AutoEP target's (``expert_folded.folded_target``): a dense group per TP
rank flat over its DP ranks (global rank ``d * tp + t``), an expert group per holder flat over its
EDP group; only the holders differ. Without expert TP a holder is an EP rank ``e`` (EP groups of
consecutive global ranks, ``groups._create_expert_and_data_parallel``); with it a holder is
(EP rank ``e``, TP rank ``t``) = ``e * tp + t``, its EDP group cut from TP rank ``t``'s DP group
(``groups._get_expert_parallel_ranks``). The files: one ``mp_rank_0T_model_states.pt`` per TP rank
(its module's dense TP shards, every tensor in a storage of its own as DeepSpeed's MoE save
clones them; ``param_shapes`` with the local expert names of the EP rank global rank ``t`` belongs
to), one per-expert file per global expert -- named by the TP rank of its EP rank's first EDP
member -- or with expert TP one per expert and TP rank, and one optimizer file per global rank."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...layouts import replicated
from ..contract import MODULE, OPTIMIZER, Buffer, Slot
from . import zero12 as dsw
from .checkpoint import DeepSpeedCheckpoint
from .layout import Group, Layout, Part, Unit
from .moe import ClassicMoE, writer_mp
from .placement import split_local
from .target import DeepSpeedTarget

__all__ = ["MoETPFiles", "moe_tp_target"]


def _expert_file(layer: int, x: int, t: int) -> str:
    return f"layer_{layer}_expert_{x}_mp_rank_{t:02d}_model_states.pt"


def moe_tp_target(ck: DeepSpeedCheckpoint, tp: int, ep: int, dp: int, stage: int,
                  maps: Mapping[str, ParamMap] | None = None, info: dict | None = None) -> DeepSpeedTarget:
    """A classic MoE checkpoint saved at TP ``ck.tp`` > 1 written at TP ``tp`` (``ck.tp`` or 1), EP
    ``ep``, DP ``dp`` (world ``tp * dp``), ZeRO stage ``stage`` (1 or 2); the experts split over TP
    at the target where the source's are and ``tp`` > 1 (placement.check_moe refuses the rest). A
    TP-1 source at TP ``tp`` > 1: the dense TP ``maps`` and ``universal_checkpoint_info`` ``info`` of a
    DeepSpeed checkpoint of the model saved there (``--layout``), the experts unsplit."""
    ax = ck.moe
    ms0 = ck.model_state(0)
    counts = ms0["num_experts"]
    etp = tp if ax.etp > 1 and tp > 1 else 1
    world = tp * dp
    target = ClassicMoE({}, frozenset(), frozenset(), ep, (dp if etp > 1 else world) // ep, ax.data_before_expert,
                        {}, etp)
    holders = ep * etp
    zo = (ms0.get("ds_config") or {}).get("zero_optimization") or {}
    dtype = ck.module_dtype
    align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
    src_groups = ck.groups(0)

    # the experts: global expert x of a layer is local expert x % L of EP rank x // L (L = its count / ep)
    local = {p.layer: counts[p.layer] // ep for p in ax.params.values()}
    outer: dict[str, ParamMap] = {}
    at: dict[tuple[int, str, int], str] = {}  # (group, local name, EP rank) -> global name
    order: dict[int, list[tuple[str, str]]] = {}  # group -> (prefix, sub) in the source's local order
    for name, p in ax.params.items():
        prefix, x, sub = split_local(name)
        e, j = divmod(x, local[p.layer])
        at[(p.group, f"{prefix}.{j}.{sub}", e)] = name
        if (prefix, sub) not in order.setdefault(p.group, []):
            order[p.group].append((prefix, sub))
        if etp > 1 and p.tp_map is not None:
            outer[name] = p.tp_map.with_ranks({t: e * etp + t for t in p.tp_map.ranks})
        else:
            outer[name] = replicated(p.shape, [e * etp])
    for g, subs in order.items():  # DeepSpeed's model order: MoE layer, local expert, parameter
        prefixes = list(dict.fromkeys(pre for pre, _ in subs))
        want = [f"{pre}.{j}.{sub}" for pre in prefixes for j in range(counts[_layer(ax, g, pre)] // ax.ep)
                for p2, sub in subs if p2 == pre]
        if list(src_groups[g]) != want:
            raise CheckpointError(f"{ck.model_files[0]}: param_shapes group {g} does not list the experts in "
                                  "DeepSpeed's model order (MoE layer, local expert, parameter); cannot tell the "
                                  "target order")

    def expert_part(g: int, h: int) -> Part:
        e, t = divmod(h, etp)
        prefixes = list(dict.fromkeys(pre for pre, _ in order[g]))
        lnames = [f"{pre}.{j}.{sub}" for pre in prefixes for j in range(local[_layer(ax, g, pre)])
                  for p2, sub in order[g] if p2 == pre]
        gnames = [at[(g, n, e)] for n in lnames]
        shapes = [tuple(outer[n].shards[h].shape) for n in gnames]
        fg = dsw.flat_group(lnames, shapes, target.edp, param_align=align)
        return Part(fg, tuple(gnames))

    # the dense parameters: the source's TP maps at its own TP, else whole on TP rank 0
    dense = Group.dense(tp, dp)
    experts = Group(tuple(tuple(target.members(h)) for h in range(holders)))
    units = []
    for g, grp in enumerate(src_groups):
        if g in ax.groups:
            units.append(Unit(experts, {h: expert_part(g, h) for h in range(holders)}))
            continue
        for n in grp:
            m = ck.tp_map(n).map
            outer[n] = maps[n] if maps is not None else m if tp == ck.tp else replicated(tuple(m.valid_shape), 1)
        parts = {}
        for t in range(tp):
            names = [n for n in grp if t in outer[n].shards and outer[n].shards[t].numel > 0]
            fg = dsw.flat_group(names, [tuple(outer[n].shards[t].shape) for n in names], dp, param_align=align)
            parts[t] = Part(fg, fg.names)
        units.append(Unit(dense, parts))
    layout = Layout("flat", outer, units, [d * tp + t for t in range(tp) for d in range(dp)])
    # the TP degree is the mpu's, not the config's: no AutoTP section where the source's config has none
    cfg = ms0.get("ds_config")
    ds_config = dsw.target_ds_config(cfg, tp=tp if isinstance(cfg, dict) and "tensor_parallel" in cfg else 1, dp=dp,
                                     zero_stage=stage)
    models = MoETPFiles(ck, tp=tp, dp=dp, stage=stage, etp=etp, target=target, ds_config=ds_config, outer=outer,
                        dtype=dtype, info=info if maps is not None else ms0.get("universal_checkpoint_info"))
    mode = "split over TP (expert TP)" if etp > 1 else "whole, EP groups over global ranks"
    return DeepSpeedTarget(layout, tp=tp, dp=dp, stage=stage, bf16=ck.bf16, states=OPTIMIZER,
                           optim_template=lambda: ck.optim_state(0, 0), ds_config=ds_config, uc_info=None,
                           models=models, group_names=dict.fromkeys(ax.groups, f"ep_size_{ep}"),
                           notes=[f"classic MoE at TP {tp} (from TP {ck.tp}), EP {ep} (EDP {target.edp}): experts "
                                  f"{mode}; EP rank e holds experts [e*L, (e+1)*L)"])


def _layer(ax: ClassicMoE, g: int, prefix: str) -> int:
    """The MoE layer (``moe_layer_id``) of an expert prefix."""
    return next(p.layer for p in ax.params.values() if p.group == g and p.name.startswith(prefix + "."))


class MoETPFiles:
    """The model states (one per TP rank) and per-expert files of :func:`moe_tp_target`: every
    weight a buffer of its own filled from the source's weights."""

    def __init__(self, ck: DeepSpeedCheckpoint, *, tp: int, dp: int, stage: int, etp: int, target: ClassicMoE,
                 ds_config: dict | None, outer: Mapping[str, ParamMap], dtype: torch.dtype, info: dict | None) -> None:
        self.ck, self.tp, self.dp, self.stage, self.etp, self.target = ck, tp, dp, stage, etp, target
        self.info = info  # universal_checkpoint_info: the source's, or the --layout checkpoint's
        self.ds_config, self.outer, self.dtype = ds_config, outer, dtype
        self.template = ck.model_state(0)
        self.weights = [k for k in self.template.get("module") or {} if k in outer]
        # (layer, x) -> its global parameter names, in the per-expert file's order
        self.experts: dict[tuple[int, int], list[str]] = {}
        for name, p in ck.moe.params.items():
            self.experts.setdefault((p.layer, p.expert), []).append(name)
        local = {p.layer: ck.model_state(0)["num_experts"][p.layer] // target.ep for p in ck.moe.params.values()}
        self.ep_of = {k: k[1] // local[k[0]] for k in self.experts}

    def _files(self, layer: int, x: int) -> list[tuple[str, int]]:
        """``(file, holder)`` of expert ``x``: its EP rank's saver's TP rank names the one file; with
        expert TP one per TP rank, each that rank's shard."""
        e = self.ep_of[(layer, x)]
        if self.etp > 1:
            return [(_expert_file(layer, x, t), e * self.etp + t) for t in range(self.etp)]
        return [(_expert_file(layer, x, writer_mp(self.target.members(e), self.tp)), e)]

    def before(self) -> list[Buffer]:
        return [Buffer(f"{dsw.model_file(t)}:module:{key}", self.dtype, self.outer[key].shards[t].numel,
                       (Slot(0, key, MODULE, self.outer[key], t),))
                for t in range(self.tp) for key in self.weights if t in self.outer[key].shards]

    def after(self) -> list[Buffer]:
        return [Buffer(f"{f}:{n}", self.dtype, self.outer[n].shards[h].numel, (Slot(0, n, MODULE, self.outer[n], h),))
                for (layer, x), names in sorted(self.experts.items()) for f, h in self._files(layer, x) for n in names]

    def model(self, tgt: DeepSpeedTarget, engine: Any, t: int) -> dict:
        """``mp_rank_0T_model_states.pt``: the source's keys (TP rank ``t``'s file at an unchanged TP),
        the module's dense TP shards, ``param_shapes`` as plain tuples (DeepSpeed's MoE save passes
        the state through ``clone_tensors_for_torch_save``)."""
        src = self.ck.model_state(t if self.tp == self.ck.tp else 0)
        declared = tgt.by_key()
        module = OrderedDict()
        for key, value in (src.get("module") or {}).items():
            if key in self.outer:
                module[key] = engine.storage(declared[f"{dsw.model_file(t)}:module:{key}"]).view(
                    tuple(self.outer[key].shards[t].shape))
            else:
                module[key] = value  # a buffer, whole on every TP rank
        shapes = [OrderedDict((n, tuple(s)) for n, s in zip(p.unit.names, p.unit.shapes))
                  for _, p, _ in tgt.layout.rank_units(t)]
        return dsw.model_states(src, module=module, param_shapes=shapes, tp=self.tp, dp=self.dp, tp_rank=t,
                                zero_stage=self.stage, shared_params=src.get("shared_params") or {},
                                uc_info=self.info, ds_config=self.ds_config)

    def expert(self, tgt: DeepSpeedTarget, engine: Any, f: str, names: list[str], h: int) -> dict:
        declared = tgt.by_key()
        return {n: engine.storage(declared[f"{f}:{n}"]).view(tuple(self.outer[n].shards[h].shape)) for n in names}

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        esize = self.dtype.itemsize
        before = [archive(dsw.model_file(t), sum(self.outer[k].shards[t].numel for k in self.weights
                                                 if t in self.outer[k].shards) * esize,
                          lambda t=t: self.model(tgt, engine, t)) for t in range(self.tp)]
        after = [archive(f, sum(self.outer[n].shards[h].numel for n in names) * esize,
                         lambda f=f, names=names, h=h: self.expert(tgt, engine, f, names, h))
                 for (layer, x), names in sorted(self.experts.items()) for f, h in self._files(layer, x)]
        return before, after
