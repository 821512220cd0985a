"""A DeepSpeed AutoEP checkpoint saved under ZeRO-3 (TP = PP = 1) to another
expert-parallel (EP) degree and world size at ZeRO-3, as DeepSpeed 0.19.8 saves it there
(issue #12; the files: docs/deepspeed-checkpoints.md §11.1).

Under ZeRO-3 every trainable parameter is partitioned on its own: a dense one over all ``W`` DP
ranks (``zero3(shape, W)``), a fused expert parameter of EP rank ``e`` over ``e``'s
expert-data-parallel (EDP) group of ``W / E`` ranks (``zero3(EP-local shape, W / E)``). Each
parameter's source composite (its placement map over EP ranks composed with those splits,
``formats.deepspeed.experts``) is planned against the target composite built the same way at the
target ``E`` x ``W`` with AutoEP's uniform placement, and the flat sub-group partitions are
slots of each rank's flat buffers, which the engine fills. What changes with the topology,
as DeepSpeed writes it: per DP rank a model-state file whose ``param_shapes`` has the EP-local
expert shapes (plain tuples) and whose ``ds_autoep_layers`` (also in
``universal_checkpoint_info``) are that rank's view (EP rank, EDP rank and size, placement,
affine maps); per DP rank an optimizer file whose ``ds_zero_partition_groups`` records each
sub-group's partition count, rank and global ranks. Sub-groups are cut by DeepSpeed's rule over
each group's own partition sizes (``zero_optimization.sub_group_size``)."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import prod
from ...layouts import autoep_placement, compose_zero, zero3
from ...layouts.topology import Topology
from ...storage.torch_zip import save
from ..contract import OPTIMIZER, Buffer
from . import experts as dse
from . import zero3 as z3
from . import zero12 as dsw
from .buffers import Declared, partition, partition_buffers
from .checkpoint import DeepSpeedCheckpoint
from .target_experts import ds_affine_entry, uniform_placement
from .templates import ds_id_notes

__all__ = ["AutoEPZero3Partitions", "AutoEPZero3Target", "check_autoep_zero3"]


def _ds_ids(ck: DeepSpeedCheckpoint, ax: dse.AutoEP, names: list[str]) -> tuple[dict[str, int], bool]:
    """Each parameter's ``ds_id`` (its index in ``model.parameters()``): the module's owned
    parameters in order, each MoE layer's ``w1, w2, w3`` right after the last owned parameter
    under its ``module_path`` (the router; DeepSpeed's AutoEP layer registers its experts after
    it), checked against the ``"<first>_<last>"`` ids of the source's flat groups."""
    module = [n for n in (ck.model_state(0).get("module") or {}) if n in set(names)]
    layers = {}
    for p in ax.params.values():
        layers.setdefault(p.name.rsplit(".experts.", 1)[0], []).append(p.name)
    order: list[str] = []
    for i, n in enumerate(module):
        order.append(n)
        for path, experts in layers.items():
            nxt = module[i + 1] if i + 1 < len(module) else ""
            if n.startswith(path + ".") and not nxt.startswith(path + "."):
                order.extend(experts)
    exact = sorted(order) == sorted(names)
    ids = {n: i for i, n in enumerate(order if exact else names)}
    flats = ck.osd(0, 0)["fp32_flat_groups"]
    for k, sg in enumerate(ck.model_state(0)["param_shapes"]):
        got = str(getattr(flats[k], "ds_id", ""))
        if got != f"{ids[next(iter(sg))]}_{ids[list(sg)[-1]]}":
            exact = False
    return ids, exact


class AutoEPZero3Partitions:
    """A ZeRO-3 AutoEP source's groups, sub-groups and parameter ids, checked."""

    tp = 1

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.ck, self.ax = ck, ck.experts
        self.template = ck.model_state(0)
        self.cfg = self.template.get("ds_config")
        shapes = dse._param_groups(self.template, ck.model_files[0])
        self.group_names = self._groups(shapes)
        self.names = [n for g in self.group_names for n in g]
        self.shapes = {n: s for sg in shapes for n, s in sg.items()}
        self.bf16 = any(p.name.startswith("bf16_") for p in ck.optim_files.values())
        self.states = z3.STATES
        self.ds_ids, self.ds_ids_exact = _ds_ids(ck, self.ax, self.names)
        self.ep_of = {d: e for e in range(self.ax.ep) for d in self.ax.members(e)}

    def _groups(self, subs: list[dict]) -> list[list[str]]:
        """Optimizer parameter groups (names in order) from the sub-groups and param_groups."""
        path = self.ck.optim_files[(0, 0)]
        try:
            lists = [list(pg["params"]) for pg in self.ck.osd(0, 0)["optimizer_state_dict"]["param_groups"]]
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: optimizer_state_dict has no torch param_groups") from None
        if [i for lst in lists for i in lst] != list(range(len(subs))) or any(not lst for lst in lists):
            raise CheckpointError(f"{path}: param_groups number the sub-groups {lists}, expected 0..{len(subs) - 1} "
                                  "in order: an unknown layout")
        groups = [[n for k in lst for n in subs[k]] for lst in lists]
        for g, lst in enumerate(lists):
            kinds = {k in self.ax.groups for k in lst}
            if len(kinds) != 1:
                raise CheckpointError(f"{path}: optimizer group {g} mixes expert and dense sub-groups")
        self.expert_groups = {g for g, lst in enumerate(lists) if lst[0] in self.ax.groups}
        return groups

class AutoEPZero3Target:
    """ZeRO-3 at EP ``ep`` x world ``dp``: sub-groups, maps and each rank's flat buffers."""

    tp, stage = 1, 3

    def __init__(self, src: AutoEPZero3Partitions, ep: int, dp: int) -> None:
        self.ep, self.dp, self.edp = ep, dp, dp // ep
        self.topology = Topology(1, dp, 1)
        self.ax = dataclasses.replace(src.ax, ep=ep, edp=dp // ep)  # the source's EDP order at the new sizes
        self.placements = {p.layer: uniform_placement(p.full_shape[0], ep) for p in src.ax.params.values()}
        self.placement_maps = {n: autoep_placement(self.placements[p.layer], p.full_shape)
                               for n, p in src.ax.params.items()}
        self.shape = {n: (self.placement_maps[n].shards[0].shape if n in src.ax.params else src.shapes[n])
                      for n in src.names}
        size = z3.sub_group_size(src.cfg, str(src.ck.model_files[0]))
        self.subs: list[list[z3.SubGroup]] = [[]]
        for g, names in enumerate(src.group_names):
            parts = self.edp if g in src.expert_groups else dp
            self.subs[0] += [dataclasses.replace(sg, group=g)
                             for sg in z3.sub_groups([[(n, self.shape[n]) for n in names]], parts, size)]
        self.expert_subs = {k for k, sg in enumerate(self.subs[0]) if sg.group in src.expert_groups}
        self.ep_of = {d: e for e in range(ep) for d in self.ax.members(e)}

    def map(self, name: str) -> ParamMap:
        if name not in self.placement_maps:
            return zero3(self.shape[name], self.dp, shard="fragment")
        m = self.placement_maps[name]
        comp = compose_zero(m, dict.fromkeys(m.ranks, zero3(self.shape[name], self.edp, shard="fragment")),
                            Topology(1, self.edp, self.ep))
        return comp.with_ranks({k * self.ep + e: self.ax.members(e)[k] for e in m.ranks for k in range(self.edp)})

    def partition_groups(self, d: int, group_name: str) -> list[dict]:
        """DP rank ``d``'s ``ds_zero_partition_groups`` (``_zero3_partition_group_metadata``)."""
        out = []
        for k in range(len(self.subs[0])):
            if k in self.expert_subs:
                members = self.ax.members(self.ep_of[d])
                out.append({"sub_group": k, "partition_count": self.edp, "partition_rank": members.index(d),
                            "partition_ranks": list(members), "families": ["autoep_expert"],
                            "group_names": [group_name]})
            else:
                out.append({"sub_group": k, "partition_count": self.dp, "partition_rank": d,
                            "partition_ranks": list(range(self.dp)), "families": ["replicated"],
                            "group_names": ["replicated"]})
        return out

    def layer(self, entry: dict, d: int) -> dict:
        """One ``ds_autoep_layers`` entry as DP rank ``d`` writes it at the target."""
        desc = copy.deepcopy(self.placements[int(entry["moe_layer_id"])])
        e = self.ep_of[d]
        local = len(desc["ranks"][e]["experts"])
        out = copy.deepcopy(dict(entry))
        out.update(num_local_experts=local, ep_size=self.ep, expert_placement=desc, ep_group_name=f"ep_size_{self.ep}",
                   ep_rank=e, expert_data_parallel_rank=self.ax.members(e).index(d),
                   expert_data_parallel_world_size=self.edp, global_expert_start=e * local,
                   global_expert_end=(e + 1) * local)
        if "affine_maps" in entry:
            params = {n: ds_affine_entry(desc, self.placement_maps[n].logical_shape)
                      for n in entry["affine_maps"].get("params", {})}
            out["affine_maps"] = {**copy.deepcopy(entry["affine_maps"]), "params": params}
        return out

    # -- the files -------------------------------------------------------------------------------
    def bind(self, src: AutoEPZero3Partitions) -> None:
        self.src = src
        cfg = dsw.target_ds_config(src.cfg, tp=1, dp=self.dp, zero_stage=3)
        if isinstance(cfg, dict) and isinstance(cfg.get("expert_parallel"), dict):
            cfg["expert_parallel"]["autoep_size"] = self.ep
        self.ds_config = cfg
        self._maps = {n: self.map(n) for n in src.names}
        self.declared = Declared(self._declare)

    def buffers(self) -> list[Buffer]:
        return self.declared.buffers()

    def _declare(self) -> list[Buffer]:
        """Each DP rank's partition of each sub-group (an expert sub-group's over its EDP ranks)."""
        out = []
        for d in range(self.dp):
            rel = z3.optim_file(d, bf16=self.src.bf16)
            for k, sg in enumerate(self.subs[0]):
                frags = [(off, n) for n, off in zip(sg.names, sg.offsets) if d in self._maps[n].shards]
                out += partition_buffers(f"{rel}:{k}", sg.numel, frags, self._maps.__getitem__, d, OPTIMIZER)
        return out

    def optim(self, engine: Any, d: int) -> dict:
        src, rel = self.src, z3.optim_file(d, bf16=self.src.bf16)
        fp32, moments = [], []
        declared = self.declared.by_key()
        for k, sg in enumerate(self.subs[0]):
            flat, views = partition(engine, declared, f"{rel}:{k}", sg.numel, OPTIMIZER)
            fp32.append(flat)
            moments.append(views)
        obj = z3.optim_states(src.ck.optim_state(0, 0), subs=self.subs[0], dp=self.dp, fp32=fp32, moments=moments,
                              ds_ids=src.ds_ids, ds_config=self.ds_config)
        obj["optimizer_state_dict"]["ds_zero_partition_groups"] = self.partition_groups(d, f"ep_size_{self.ep}")
        return obj

    def model(self, staging: Any, d: int) -> None:
        template = self.src.template
        layers = [self.layer(entry, d) for entry in template[dse.LAYERS_KEY]]
        uc = copy.deepcopy(dict(template.get("universal_checkpoint_info") or {}))
        uc[dse.LAYERS_KEY] = copy.deepcopy(layers)  # its own copy, as DeepSpeed's save clones the state
        obj = z3.model_states(template, subs=self.subs[0], d=d, dp=self.dp, ds_config=self.ds_config, uc_info=uc)
        # plain tuples: DeepSpeed's AutoEP save passes the state through clone_tensors_for_torch_save
        obj["param_shapes"] = [OrderedDict((n, tuple(s)) for n, s in zip(sg.names, sg.shapes)) for sg in self.subs[0]]
        obj[dse.LAYERS_KEY] = layers
        with staging.open(z3.model_file(d)) as f:
            save(obj, f)

    def jobs(self, engine: Any, staging: Any, archive: Callable[..., Any]) -> list:
        model = self.src.ck.model_files[0].stat().st_size
        optim = sum(sg.numel for sg in self.subs[0]) * 4 * len(OPTIMIZER)
        return ([archive(z3.optim_file(d, bf16=self.src.bf16), optim, lambda d=d: self.optim(engine, d))
                 for d in range(self.dp)] + [(model, lambda d=d: self.model(staging, d)) for d in range(self.dp)])

    def notes(self) -> list[str]:
        notes = [f"AutoEP experts at EP {self.ep} (EDP {self.edp}), uniform placement, ZeRO-3"]
        return notes + ds_id_notes(self.src.ds_ids_exact, "do not match the parameter order reshard derives")


def check_autoep_zero3(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    """What this writer refuses, before anything is written."""
    if tp != 1 or pp != 1:
        raise ReshardError(f"{ck.tag_dir}: AutoEP ZeRO-3 checkpoints are resharded at TP = PP = 1 only "
                           f"(asked tp={tp}, pp={pp})")
    if stage != 3:
        raise ReshardError(f"{ck.tag_dir}: an AutoEP ZeRO-3 checkpoint is written at ZeRO stage 3 only (asked "
                           f"{stage}); moving AutoEP experts between ZeRO-3 and ZeRO-1/2 is not supported")
    if dp % ep:
        raise ReshardError(f"ep={ep} must divide the target world size dp={dp} (EDP = dp / ep)")
    for name, p in ck.experts.params.items():
        if p.full_shape[0] % ep:
            raise ReshardError(f"{ck.model_files[0]}: {name}: {p.full_shape[0]} experts do not split evenly over "
                               f"ep={ep} (AutoEP's uniform placement)")
        if [list(x) for x in p.experts_by_rank] != [r["experts"] for r in uniform_placement(p.full_shape[0],
                                                                                            p.ep)["ranks"]]:
            raise CheckpointError(f"{ck.model_files[0]}: {name}: a non-uniform source placement "
                                  f"{[list(x) for x in p.experts_by_rank]} is not supported yet")
    ms = ck.model_state(0)
    if any(prod(tuple(s)) for s in (ms.get("frozen_param_shapes") or {}).values()):
        raise CheckpointError(f"{ck.model_files[0]}: frozen parameters are not supported")
    ck.check_steps()


