"""DeepSpeed checkpoints with experts (ZeRO-1/2, TP = PP = 1) at another expert-parallel (EP)
degree and world size, as DeepSpeed 0.19.8 saves them there: AutoEP's fused experts and classic
``deepspeed.moe.layer.MoE`` experts.

An :class:`ExpertTarget` says where each expert parameter lives at the target, and
:class:`ExpertFiles` lays out the files. Each expert parameter's target composite -- its placement
map over the target EP ranks composed with every EP rank's ZeRO split over its expert-data-parallel
(EDP) group -- is a slot of each DP rank's optimizer partition of the expert group, so every
expert's fp32 master and both Adam moments move with it; dense parameters are split over all DP
ranks, as ZeRO-1/2 at TP = 1 splits them.

AutoEP places experts uniformly at the target (``legacy_uniform_autoep_placement_descriptor``: EP
rank ``e`` holds experts ``[e * L, (e + 1) * L)``, ``L = num_experts / ep``). What DeepSpeed writes
(docs/deepspeed-checkpoints.md §11): the per-expert files ``layer_L_expert_E_mp_rank_00_model_states.pt``
(independent of EP: copied); one ``mp_rank_00_model_states.pt`` whose ``param_shapes`` give the
expert group EP-local shapes and whose ``ds_autoep_layers`` (also in ``universal_checkpoint_info``)
describe EP rank 0's view at the target EP; one optimizer file per DP rank, the expert group
partitioned over its EDP group (``partition_count`` ``[dp, edp]``). Optimizer ``param_groups`` are
the source's, as DeepSpeed keeps them across ``load_universal``.

Classic MoE (§12): EP rank ``e`` holds global experts ``[e * L, (e + 1) * L)`` under the *local*
names ``<prefix>.deepspeed_experts.<j>.<sub>``; each global expert parameter is one parameter of F,
whose target map is all of F on EP rank ``x // L``, composed with the target EDP split of the local
name ``x % L``. The optimizer group of the experts is named ``ep_size_<ep>``: DeepSpeed's ZeRO-1/2
``load_state_dict`` hands the saved ``param_groups`` to ``torch.optim``, which replaces the live
groups' ``name``, and ``stage_1_and_2`` looks the expert process groups up by that name.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import row_major_strides
from ...layouts import autoep_placement, compose_zero, replicated
from ...layouts.topology import Topology
from ...layouts.zero import FlatGroup
from ...storage.torch_zip import save
from ..contract import OPTIMIZER, Buffer
from . import experts as dse
from . import zero12 as dsw
from .buffers import Declared, partition, partition_buffers
from .checkpoint import DeepSpeedCheckpoint
from .moe import LOCAL_RE, _param_groups

__all__ = ["AutoEPTarget", "ExpertFiles", "MoETarget", "check_autoep", "check_moe", "ds_affine_entry",
           "uniform_placement"]

EXPERT_FILE = "layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def uniform_placement(num_experts: int, ep: int) -> dict:
    """AutoEP's placement descriptor at EP ``ep`` (``legacy_uniform_autoep_placement_descriptor``)."""
    local = num_experts // ep
    return {"version": 1, "num_experts": num_experts, "ep_size": ep,
            "ranks": [{"rank": e, "experts": list(range(e * local, (e + 1) * local))} for e in range(ep)]}


def ds_affine_entry(desc: dict, full_shape: tuple[int, ...]) -> dict:
    """A placement's ``affine_maps`` entry exactly as DeepSpeed writes it
    (``autoep_placement_to_affine_map(...).to_dict()``): one piece per run of consecutive experts
    on one holder, full-rank strides, not the canonical (dimension-merged) form reshard keeps."""
    full_shape = tuple(int(x) for x in full_shape)
    rest, per = full_shape[1:], list(row_major_strides(full_shape))[0] if full_shape else 1
    holders: dict[int, list[int]] = {}
    for r in desc["ranks"]:
        for x in r["experts"]:
            holders.setdefault(x, []).append(r["rank"])
    ranks = {}
    for r in sorted(desc["ranks"], key=lambda r: r["rank"]):
        experts, shard = r["experts"], (len(r["experts"]),) + rest
        pieces, start = [], 0
        for j in range(1, len(experts) + 1):
            if j < len(experts) and experts[j] == experts[j - 1] + 1 and holders[experts[j]] == holders[experts[j - 1]] \
                    and len(holders[experts[j]]) == 1:
                continue
            pieces.append({"shape": [j - start, *rest], "source": [experts[start] * per, list(row_major_strides(full_shape))],
                           "dest": [start * per, list(row_major_strides(shard))], "locations": sorted(holders[experts[start]])})
            start = j
        ranks[r["rank"]] = {"shard_shape": list(shard), "pieces": pieces}
    return {"logical_shape": list(full_shape), "ranks": ranks}


class ExpertTarget:
    """The target topology: flat groups (dense over DP, experts over EDP) and composites. A
    subclass places the experts: :meth:`expert_group` (the names and shapes of an expert group's
    flat buffer at the target), :meth:`expert_slot` and :meth:`expert_map` (where a source expert
    parameter goes), :meth:`fill_name` (which source parameter fills a slot on a given rank)."""

    def __init__(self, ck: DeepSpeedCheckpoint, ax: Any, ep: int, dp: int) -> None:
        self.ck, self.src = ck, ax
        self.ep, self.dp, self.edp = ep, dp, dp // ep
        self.ax = dataclasses.replace(ax, ep=ep, edp=dp // ep)  # same EDP order, new sizes
        ms0 = ck.model_state(0)
        self.src_groups = dse._param_groups(ms0, ck.model_files[0])
        zo = (ms0.get("ds_config") or {}).get("zero_optimization") or {}
        dtype = next(iter((ms0.get("module") or {}).values())).dtype
        align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
        self.groups: list[FlatGroup] = []
        for g, grp in enumerate(self.src_groups):
            if g in ax.groups:
                names, shapes = self.expert_group(g)
                self.groups.append(dsw.flat_group(names, shapes, self.edp, param_align=align))
            else:
                self.groups.append(dsw.flat_group(list(grp), list(grp.values()), dp, param_align=align))
        self.dense = {n: (g, i) for g, grp in enumerate(self.groups) if g not in ax.groups
                      for i, n in enumerate(grp.names)}
        self.dense_maps = {n: ck.tp_map(n).map for n in self.dense}
        self.ep_of = {d: e for e in range(ep) for d in self.ax.members(e)}

    # -- what a subclass says --------------------------------------------------------------------
    def expert_group(self, g: int) -> tuple[list[str], list[tuple[int, ...]]]:
        raise NotImplementedError

    def expert_names(self) -> list[str]:
        """The source's expert parameters (names of F)."""
        raise NotImplementedError

    def expert_slot(self, name: str) -> tuple[int, int]:
        """(group, position in the target flat group) of a source expert parameter."""
        raise NotImplementedError

    def expert_map(self, name: str) -> ParamMap:
        """A source expert parameter's map over the target EP ranks."""
        raise NotImplementedError

    def fill_name(self, g: int, i: int, d: int) -> str:
        """The parameter of F whose plan fills position ``i`` of group ``g`` on target rank ``d``."""
        return self.groups[g].names[i]

    def src_slot(self, name: str) -> tuple[int, str]:
        """(group, ``param_slice_mappings`` key) of ``name`` in the source optimizer files."""
        return (self.dense[name][0] if name in self.dense else self.expert_slot(name)[0]), name

    def ds_config(self, cfg: dict | None) -> dict | None:
        return cfg

    def param_groups(self, groups: list[dict]) -> list[dict]:
        return groups

    def model_extras(self, ms0: dict) -> tuple[dict | None, dict]:
        """``universal_checkpoint_info`` and other keys the target's model state replaces."""
        return ms0.get("universal_checkpoint_info"), {}

    # -- the rest is shared ----------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.dense) + self.expert_names()

    def partition_of(self, g: int, d: int) -> int:
        """Global rank ``d``'s partition index in group ``g``: its EDP rank for the experts."""
        if g not in self.ax.groups:
            return d
        return self.ax.members(self.ep_of[d]).index(d)

    def composite(self, name: str) -> ParamMap:
        if name in self.dense:  # dense, TP = 1: the whole parameter on one model-parallel rank
            g, i = self.dense[name]
            return compose_zero(self.dense_maps[name], {0: self.groups[g].param_map(i)}, Topology(1, self.dp, 1))
        g, i = self.expert_slot(name)
        m = self.expert_map(name)
        comp = compose_zero(m, dict.fromkeys(m.ranks, self.groups[g].param_map(i)), Topology(1, self.edp, self.ep))
        return comp.with_ranks({k * self.ep + e: self.ax.members(e)[k] for e in m.ranks for k in range(self.edp)})


class AutoEPTarget(ExpertTarget):
    def __init__(self, ck: DeepSpeedCheckpoint, ep: int, dp: int) -> None:
        self.placements: dict[int, dict] = {}  # moe layer -> descriptor
        self.maps: dict[str, ParamMap] = {}  # expert name -> placement map over target EP ranks
        for name, p in ck.experts.params.items():
            desc = self.placements.setdefault(p.layer, uniform_placement(p.full_shape[0], ep))
            self.maps[name] = autoep_placement(desc, p.full_shape)
        super().__init__(ck, ck.experts, ep, dp)
        self.index = {n: (g, i) for g in self.src.groups for i, n in enumerate(self.groups[g].names)}

    def expert_group(self, g: int) -> tuple[list[str], list[tuple[int, ...]]]:
        names = list(self.src_groups[g])
        return names, [self.maps[n].shards[0].shape for n in names]

    def expert_names(self) -> list[str]:
        return list(self.index)

    def expert_slot(self, name: str) -> tuple[int, int]:
        return self.index[name]

    def expert_map(self, name: str) -> ParamMap:
        return self.maps[name]

    def ds_config(self, cfg: dict | None) -> dict | None:
        if cfg is not None and isinstance(cfg.get("expert_parallel"), dict):
            cfg["expert_parallel"]["autoep_size"] = self.ep
        return cfg

    def model_extras(self, ms0: dict) -> tuple[dict | None, dict]:
        uc = dict(ms0.get("universal_checkpoint_info") or {})
        if dse.LAYERS_KEY in uc:
            uc[dse.LAYERS_KEY] = [self._layer(entry) for entry in uc[dse.LAYERS_KEY]]
        return uc or None, {dse.LAYERS_KEY: [self._layer(entry) for entry in ms0[dse.LAYERS_KEY]]}

    def _layer(self, entry: dict) -> dict:
        """One ``ds_autoep_layers`` entry as EP rank 0 (EDP rank 0) writes it at the target."""
        desc = self.placements[int(entry["moe_layer_id"])]
        local = len(desc["ranks"][0]["experts"])
        out = dict(entry)
        out.update(num_local_experts=local, ep_size=self.ep, expert_placement=desc, ep_group_name=f"ep_size_{self.ep}",
                   ep_rank=0, expert_data_parallel_rank=0, expert_data_parallel_world_size=self.edp,
                   global_expert_start=0, global_expert_end=local)
        if "affine_maps" in entry:
            params = {n: ds_affine_entry(desc, self.maps[n].logical_shape) for n in entry["affine_maps"].get("params", {})}
            out["affine_maps"] = {**entry["affine_maps"], "params": params}
        return out


def check_target(ck: DeepSpeedCheckpoint, what: str, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    """The refusals every expert checkpoint shares (``what``: "AutoEP", "classic MoE")."""
    if tp != 1 or pp != 1 or ck.layer_files:
        raise ReshardError(f"{ck.tag_dir}: {what} checkpoints are resharded at TP = PP = 1 only (asked tp={tp}, pp={pp})")
    if stage not in (1, 2) or stage != ck.zero_stage:
        raise ReshardError(f"{ck.tag_dir}: {what} resharding keeps the source's ZeRO stage {ck.zero_stage} "
                           f"(asked {stage})")
    if dp % ep:
        raise ReshardError(f"ep={ep} must divide the target world size dp={dp} (EDP = dp / ep)")


def check_autoep(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    ax = ck.experts
    if ax is None:
        raise ReshardError(f"{ck.model_files[0]}: ep= needs an AutoEP checkpoint (ds_autoep_layers) or a classic MoE "
                           "one (num_experts); this one has neither")
    check_target(ck, "AutoEP", ep, dp, tp, pp, stage)
    for name, p in ax.params.items():
        if p.full_shape[0] % ep:
            raise ReshardError(f"{ck.model_files[0]}: {name}: {p.full_shape[0]} experts do not split evenly over "
                               f"ep={ep} (AutoEP's uniform placement)")
        uniform = uniform_placement(p.full_shape[0], p.ep)["ranks"]
        if [list(x) for x in p.experts_by_rank] != [r["experts"] for r in uniform]:
            raise CheckpointError(f"{ck.model_files[0]}: {name}: a non-uniform source placement "
                                  f"{[list(x) for x in p.experts_by_rank]} is not supported yet")
    ck.check_steps()




def _split(name: str) -> tuple[str, int, str]:
    m = LOCAL_RE.match(name)
    if m is None:  # deepspeed_moe.read only admits names that match
        raise CheckpointError(f"internal: {name!r} is not a classic MoE expert parameter name")
    return m["prefix"], int(m["local"]), m["sub"]


class MoETarget(ExpertTarget):
    """Classic MoE experts at EP ``ep`` x world ``dp``: EP rank ``e`` holds ``[e * L, (e + 1) * L)``."""

    def __init__(self, ck: DeepSpeedCheckpoint, ep: int, dp: int) -> None:
        ax, path = ck.moe, ck.model_files[0]
        counts = ck.model_state(0)["num_experts"]
        self.layout: dict[int, dict[str, list[str]]] = {}  # group -> prefix -> subs, in model order
        self.local: dict[str, int] = {}  # prefix -> local experts per EP rank at the target
        self.src_local: dict[str, int] = {}  # ... and at the source
        for p in ax.params.values():
            prefix, _, sub = _split(p.name)
            subs = self.layout.setdefault(p.group, {}).setdefault(prefix, [])
            if sub not in subs:
                subs.append(sub)
            self.local[prefix], self.src_local[prefix] = counts[p.layer] // ep, counts[p.layer] // ax.ep
        src_groups = _param_groups(ck.model_state(0), path)
        for g, by_prefix in self.layout.items():  # the target's order is the source's at another L
            src_order = [f"{prefix}.{j}.{sub}" for prefix, subs in by_prefix.items()
                         for j in range(self.src_local[prefix]) for sub in subs]
            if list(src_groups[g]) != src_order:
                raise CheckpointError(f"{path}: param_shapes group {g} does not list the experts in DeepSpeed's model "
                                      f"order (MoE layer, local expert, parameter); cannot tell the target order")
        self.slots: dict[str, tuple[int, int]] = {}
        self.fills: dict[tuple[int, int, int], str] = {}  # (group, position, target EP rank) -> global name
        super().__init__(ck, ax, ep, dp)
        for g in self.layout:
            position = {n: i for i, n in enumerate(self.groups[g].names)}
            for name, p in ax.params.items():
                if p.group != g:
                    continue
                prefix, x, sub = _split(name)
                i = position[f"{prefix}.{x % self.local[prefix]}.{sub}"]
                self.slots[name] = (g, i)
                self.fills[(g, i, x // self.local[prefix])] = name

    def expert_group(self, g: int) -> tuple[list[str], list[tuple[int, ...]]]:
        names = [f"{prefix}.{j}.{sub}" for prefix, subs in self.layout[g].items()
                 for j in range(self.local[prefix]) for sub in subs]
        return names, [self.src_groups[g][f"{prefix}.0.{sub}"] for prefix, subs in self.layout[g].items()
                       for _ in range(self.local[prefix]) for sub in subs]

    def expert_names(self) -> list[str]:
        return list(self.slots)

    def expert_slot(self, name: str) -> tuple[int, int]:
        return self.slots[name]

    def expert_map(self, name: str) -> ParamMap:
        p = self.src.params[name]
        return replicated(p.shape, [p.expert // self.local[_split(name)[0]]])

    def fill_name(self, g: int, i: int, d: int) -> str:
        if g not in self.src.groups:
            return self.groups[g].names[i]
        return self.fills[(g, i, self.ep_of[d])]

    def src_slot(self, name: str) -> tuple[int, str]:
        p = self.src.params.get(name)
        return (p.group, p.local) if p is not None else super().src_slot(name)

    def param_groups(self, groups: list[dict]) -> list[dict]:
        out = list(groups)
        for g in self.src.groups:
            out[g] = {**groups[g], "name": f"ep_size_{self.ep}"}
        return out


def check_moe(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    ax, path = ck.moe, ck.model_files[0]
    check_target(ck, "classic MoE", ep, dp, tp, pp, stage)
    counts = ck.model_state(0)["num_experts"]
    for p in ax.params.values():
        if counts[p.layer] % ep:
            raise ReshardError(f"{path}: MoE layer {p.layer} ({_split(p.name)[0]}): {counts[p.layer]} experts do not "
                               f"split evenly over ep={ep}")
    try:
        groups = ck.optim_state(0, 0)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{ck.optim_files[(0, 0)]}: no optimizer param_groups ({e!r})") from None
    for g in sorted(ax.groups):
        group = groups[g] if g < len(groups) and isinstance(groups[g], dict) else {}
        if not group.get("moe") or group.get("name") != f"ep_size_{ax.ep}":
            raise CheckpointError(f"{ck.optim_files[(0, 0)]}: optimizer group {g} holds the experts but is not "
                                  f"DeepSpeed's MoE group (moe: True, name 'ep_size_{ax.ep}'): "
                                  f"{ {k: group.get(k) for k in ('name', 'moe')} }")
    ck.check_steps()


class ExpertFiles:
    """The files of an expert checkpoint at the target ``tgt`` (ZeRO stage ``stage``): one
    optimizer file per DP rank, the model states, and the per-expert files copied."""

    def __init__(self, ck: DeepSpeedCheckpoint, tgt: ExpertTarget, stage: int, expert_files: list) -> None:
        self.ck, self.tgt, self.stage, self.expert_files = ck, tgt, stage, expert_files
        ms0 = ck.model_state(0)
        self.ds_config = tgt.ds_config(dsw.target_ds_config(ms0.get("ds_config"), tp=1, dp=tgt.dp, zero_stage=stage))
        self._composites = {n: tgt.composite(n) for n in tgt.names}
        self.bf16 = any(p.name.startswith("bf16_") for p in ck.optim_files.values())  # as the source names them
        self.declared = Declared(self._declare)

    def buffers(self) -> list[Buffer]:
        return self.declared.buffers()

    def _declare(self) -> list[Buffer]:
        """Each DP rank's partition of each group (the expert group's of its EDP rank)."""
        tgt, out = self.tgt, []
        for d in range(tgt.dp):
            for g, grp in enumerate(tgt.groups):
                q = tgt.partition_of(g, d)
                frags = [(lo - q * grp.partition, tgt.fill_name(g, i, d)) for i, lo, _ in grp.fragments(q)]
                out += partition_buffers(f"{dsw.optim_file(0, d, bf16=self.bf16)}:{g}", grp.partition, frags,
                                         self._composites.__getitem__, d, OPTIMIZER)
        return out

    def optim(self, engine: Any, staging: Any, d: int) -> None:
        """Target DP rank ``d``'s optimizer file: the dense group's partition ``d``, the expert
        group's partition of ``d``'s EDP rank."""
        tgt = self.tgt
        rel = dsw.optim_file(0, d, bf16=self.bf16)
        fp32, moments, qs = [], [], []
        declared = self.declared.by_key()
        for g, grp in enumerate(tgt.groups):
            qs.append(tgt.partition_of(g, d))
            flat, views = partition(engine, declared, f"{rel}:{g}", grp.partition, OPTIMIZER)
            fp32.append(flat)
            moments.append(views)
        obj = dsw.optim_states(self.ck.optim_state(0, 0), groups=tgt.groups, d=d, fp32=fp32, moments=moments,
                               zero_stage=self.stage, ds_config=self.ds_config, uc_info=None)
        osd = obj["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        base["param_groups"] = tgt.param_groups(base["param_groups"])
        for g, (grp, q) in enumerate(zip(tgt.groups, qs)):  # the expert group: its EDP partition q
            osd["group_paddings"][g] = grp.tail_padding(q)
            osd["param_slice_mappings"][g] = dsw.slice_mappings(grp, q)
            osd["single_partition_of_fp32_groups"][g] = fp32[g].view((grp.partition - grp.tail_padding(q),),
                                                                     requires_grad=True)
        with staging.open(rel) as f:
            save(obj, f)

    def model(self, staging: Any) -> None:
        """``mp_rank_00_model_states.pt``: the source's, with the target's expert group in
        ``param_shapes`` (EP rank 0's), topology and whatever else the target replaces."""
        ck, tgt = self.ck, self.tgt
        ms0 = ck.model_state(0)
        # plain tuples: DeepSpeed's expert save path (_save_moe_checkpoint) passes the state through
        # clone_tensors_for_torch_save, which turns every torch.Size into a tuple
        shapes = [OrderedDict((n, tuple(s)) for n, s in zip(g.names, g.shapes)) for g in tgt.groups]
        uc, extras = tgt.model_extras(ms0)
        obj = dsw.model_states(ms0, module=OrderedDict(ms0.get("module") or {}), param_shapes=shapes, tp=1,
                               dp=tgt.dp, tp_rank=0, zero_stage=self.stage, shared_params=ms0.get("shared_params") or {},
                               uc_info=uc, ds_config=self.ds_config)
        obj.update(extras)
        with staging.open(dsw.model_file(0)) as f:
            save(obj, f)

    def jobs(self, engine: Any, staging: Any) -> list[tuple[int, Callable[[], None]]]:
        tgt = self.tgt
        jobs: list[tuple[int, Callable[[], None]]] = [(self.ck.model_files[0].stat().st_size,
                                                       lambda: self.model(staging))]
        jobs += [(sum(g.partition for g in tgt.groups) * 4 * len(OPTIMIZER), lambda d=d: self.optim(engine, staging, d))
                 for d in range(tgt.dp)]
        jobs += [(p.stat().st_size, lambda p=p: staging.copy(p, p.name)) for p in self.expert_files]  # the same at any EP
        return jobs
