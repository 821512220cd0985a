"""Offline resharding of a DeepSpeed checkpoint with experts (ZeRO-1/2, TP = PP = 1) to another
expert-parallel (EP) degree and world size, as DeepSpeed 0.19.8 saves it there (issue #12).

The machinery is shared by AutoEP (here) and classic ``deepspeed.moe.layer.MoE`` experts
(``reshard.jobs.offline_moe``): an :class:`ExpertTarget` says where each expert parameter lives at the
target, and :func:`write` plans and streams the files. Each expert parameter's source composite
-- its placement map over EP ranks composed with every EP rank's ZeRO split over its
expert-data-parallel (EDP) group (``formats.deepspeed_experts`` / ``deepspeed_moe``) -- is planned
against the target's composite built the same way at the target EP / EDP, so every expert's fp32
master and both Adam moments move with it. Dense parameters are planned between their ZeRO splits
over all DP ranks, as ``reshard.jobs.offline`` does at TP = 1. The optimizer partitions are streamed
from the plans' segments (``execute.WindowFill``).

AutoEP: the experts are placed as AutoEP places them at the target EP
(``legacy_uniform_autoep_placement_descriptor``: EP rank ``e`` holds experts ``[e * L, (e + 1) *
L)``, ``L = num_experts / ep``). What DeepSpeed writes at the target
(docs/deepspeed-checkpoints.md §11): the per-expert files
``layer_L_expert_E_mp_rank_00_model_states.pt`` (independent of EP: copied); one
``mp_rank_00_model_states.pt`` whose ``param_shapes`` give the expert group EP-local shapes and
whose ``ds_autoep_layers`` (also in ``universal_checkpoint_info``) describe EP rank 0's view at
the target EP; one optimizer file per DP rank, the expert group partitioned over its EDP group
(``partition_count`` ``[dp, edp]``). Optimizer ``param_groups`` are the source's, as DeepSpeed
keeps them across ``load_universal`` (the expert group keeps its name, e.g. ``ep_size_2``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import CheckpointError, ReshardError, in_context
from ..execute.local import WindowFill
from ..formats.deepspeed import experts as dse
from ..formats.deepspeed import writer as dsw
from ..formats.deepspeed.checkpoint import SCALE_POWER, STATES, DeepSpeedCheckpoint
from ..ir.param_map import ParamMap
from ..layouts import autoep_placement, compose_zero
from ..layouts.topology import Topology
from ..layouts.zero import FlatGroup
from ..plan.planner import Planner
from ..plan.values import Segment
from ..storage.torch_zip import Storage, save
from .cluster import Cluster, commit, open_staging, run_share
from .reports import ReshardReport, written
from .workers import run_with_progress

EXPERT_FILE = "layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def uniform_placement(num_experts: int, ep: int) -> dict:
    """AutoEP's placement descriptor at EP ``ep`` (``legacy_uniform_autoep_placement_descriptor``)."""
    local = num_experts // ep
    return {"version": 1, "num_experts": num_experts, "ep_size": ep,
            "ranks": [{"rank": e, "experts": list(range(e * local, (e + 1) * local))} for e in range(ep)]}


def _strides(shape: tuple[int, ...]) -> list[int]:
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return out


def ds_affine_entry(desc: dict, full_shape: tuple[int, ...]) -> dict:
    """A placement's ``affine_maps`` entry exactly as DeepSpeed writes it
    (``autoep_placement_to_affine_map(...).to_dict()``): one piece per run of consecutive experts
    on one holder, full-rank strides, not the canonical (dimension-merged) form reshard keeps."""
    full_shape = tuple(int(x) for x in full_shape)
    rest, per = full_shape[1:], _strides(full_shape)[0] if full_shape else 1
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
            pieces.append({"shape": [j - start, *rest], "source": [experts[start] * per, _strides(full_shape)],
                           "dest": [start * per, _strides(shard)], "locations": sorted(holders[experts[start]])})
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


class _AutoEPTarget(ExpertTarget):
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


def _check(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
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


class _Writer:
    def __init__(self, ck: DeepSpeedCheckpoint, tgt: ExpertTarget, staging: Any, stage: int) -> None:
        self.ck, self.tgt, self.staging, self.stage = ck, tgt, staging, stage
        ms0 = ck.model_state(0)
        self.ds_config = tgt.ds_config(dsw.target_ds_config(ms0.get("ds_config"), tp=1, dp=tgt.dp, zero_stage=stage))
        self.src_maps = {n: ck.composite_map(n, ck.tp_map(n).map) for n in tgt.names}
        self.plans: dict[str, dict[int, list[Segment]]] = {}
        self.segments = 0
        self.read = 0

    def plan_all(self) -> None:
        planner = Planner()
        for name, src in self.src_maps.items():
            try:
                p = planner.plan(src, self.tgt.composite(name))
            except ReshardError as e:
                raise in_context(e, f"parameter {name!r}") from None
            self.plans[name] = {}
            for s in p.segments:
                self.plans[name].setdefault(s.dst_rank, []).append(s)
            self.segments += len(p.segments)

    def _fill(self, parts: list[tuple[int, Segment, str]], state: str) -> WindowFill:
        ck = self.ck

        def fragment(s: Segment, name: str) -> torch.Tensor:
            g, key = self.tgt.src_slot(name)
            start = int(ck.osd(0, s.src_rank)["param_slice_mappings"][g][key].start)
            return ck.flat_state(0, s.src_rank, g, state).narrow(0, start, self.src_maps[name].shards[s.src_rank].numel)

        return WindowFill([(off, s, lambda s=s, n=n: fragment(s, n)) for off, s, n in parts],
                          scale_power=SCALE_POWER[state])

    def optim(self, d: int) -> None:
        """Target DP rank ``d``'s optimizer file: the dense group's partition ``d``, the expert
        group's partition of ``d``'s EDP rank."""
        tgt = self.tgt
        fp32, moments, qs = [], [], []
        for g, grp in enumerate(tgt.groups):
            q = tgt.partition_of(g, d)
            qs.append(q)
            parts = []
            for i, lo, hi in grp.fragments(q):
                name = tgt.fill_name(g, i, d)
                segs = self.plans[name].get(d, [])
                if sum(s.numel for s in segs) != hi - lo:
                    raise CheckpointError(f"internal: plan for {name!r} fills {sum(s.numel for s in segs)} "
                                          f"of {hi - lo} elements of target rank {d}")
                parts += [(lo - q * grp.partition, s, name) for s in segs]
                self.read += len(STATES) * (hi - lo)
            flats = {st: Storage(torch.float32, grp.partition, self._fill(parts, st), label=f"{st} of group {g}")
                     for st in STATES}
            fp32.append(flats["fp32"])
            moments.append({k: flats[k].view((grp.partition,)) for k in dsw.MOMENTS})
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
        bf16 = any(p.name.startswith("bf16_") for p in self.ck.optim_files.values())  # as the source names them
        with self.staging.open(dsw.optim_file(0, d, bf16=bf16)) as f:
            save(obj, f)

    def model(self) -> None:
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
        with self.staging.open(dsw.model_file(0)) as f:
            save(obj, f)


def write(ck: DeepSpeedCheckpoint, out_dir: str | Path, tgt: ExpertTarget, *, stage: int, expert_files: list[Path],
          source_ep: int, note: str, workers: int, overwrite: bool, progress: Callable[[int, int], None] | bool | None,
          checksum: str, cluster: Cluster | None) -> ReshardReport:
    """Plan and write ``tgt``'s files (the per-expert ones copied) into ``out_dir/<tag>``."""
    cluster = cluster or Cluster.from_env()
    staging = open_staging(cluster, out_dir, ck.tag_dir.name, sources=ck.sources, overwrite=overwrite,
                           checksum=checksum)
    writer = _Writer(ck, tgt, staging, stage)
    jobs: list[tuple[int, Callable[[], None]]] = [(ck.model_files[0].stat().st_size, writer.model)]
    jobs += [(sum(g.partition for g in tgt.groups) * 4 * len(STATES), lambda d=d: writer.optim(d))
             for d in range(tgt.dp)]
    jobs += [(p.stat().st_size, lambda p=p: staging.copy(p, p.name)) for p in expert_files]  # the same at any EP

    def run(mine: list[Callable[[], None]]) -> None:
        writer.plan_all()
        run_with_progress(mine, workers, progress, "file", "reshard reshard")

    run_share(cluster, staging, jobs, run)
    meta = {
        "reshard_version": __version__,
        "format": "deepspeed",
        "source": str(ck.tag_dir),
        "source_topology": {"tp": 1, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage, "ep": source_ep},
        "target_topology": {"tp": 1, "dp": tgt.dp, "pp": 1, "zero_stage": stage, "ep": tgt.ep},
    }
    final = commit(cluster, staging, meta, latest_name="latest")
    read = sum(cluster.gather(writer.read))
    return ReshardReport(final, meta["source_topology"], meta["target_topology"], len(writer.src_maps),
                         *written(final), writer.segments, read, [note])


def reshard_experts(ck: DeepSpeedCheckpoint, out_dir: str | Path, *, ep: int, dp: int, tp: int = 1, pp: int = 1,
                    zero_stage: int | None = None, workers: int = 1, overwrite: bool = False,
                    progress: Callable[[int, int], None] | bool | None = None, checksum: str = "crc32",
                    cluster: Cluster | None = None) -> ReshardReport:
    """``reshard.jobs.offline.reshard`` for an AutoEP checkpoint: write it at EP ``ep`` x world ``dp``
    (a classic MoE one goes to ``offline_moe.reshard_moe``)."""
    stage = ck.zero_stage if zero_stage is None else zero_stage
    _check(ck, ep, dp, tp, pp, stage)
    experts = sorted(ck.tag_dir.glob("layer_*_expert_*_mp_rank_*_model_states.pt"))
    want = {EXPERT_FILE.format(layer=p.layer, expert=x) for p in ck.experts.params.values()
            for x in range(p.full_shape[0])}
    missing = sorted(want - {p.name for p in experts})
    if missing:  # checked before the staging folder exists, so a refusal leaves nothing behind
        raise CheckpointError(f"{ck.tag_dir}: AutoEP per-expert files missing: {missing[:3]}")
    tgt = _AutoEPTarget(ck, ep, dp)
    return write(ck, out_dir, tgt, stage=stage, expert_files=experts, source_ep=ck.experts.ep,
                 note=f"AutoEP experts at EP {ep} (EDP {tgt.edp}), uniform placement", workers=workers,
                 overwrite=overwrite, progress=progress, checksum=checksum, cluster=cluster)
