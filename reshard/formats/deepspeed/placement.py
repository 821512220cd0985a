"""Where a DeepSpeed target puts its experts (the outer map of an expert parameter), and what it
refuses before anything is written.

AutoEP places experts uniformly at the target (``legacy_uniform_autoep_placement_descriptor``: EP
rank ``e`` holds experts ``[e * L, (e + 1) * L)``, ``L = num_experts / ep``); each EP rank's
partition group is its expert-data-parallel (EDP) group, the source's EDP order at the new sizes.
What changes in the files with the placement (docs/deepspeed-checkpoints.md §11, §11.1): the
``ds_autoep_layers`` entries (also in ``universal_checkpoint_info``), each a rank's view (EP rank,
EDP rank and size, placement, affine maps), and under ZeRO-3 the optimizer's
``ds_zero_partition_groups``. Classic MoE (§12) places global expert ``x`` on EP rank ``x // L``
under the local name ``<prefix>.deepspeed_experts.<x % L>.<sub>``.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import prod, row_major_strides
from ...layouts import autoep_placement
from . import experts as dse
from .checkpoint import DeepSpeedCheckpoint
from .layout import Group, Layout
from .moe import LOCAL_RE

__all__ = ["EXPERT_FILE", "AutoEPPlacement", "check_autoep", "check_autoep_to_zero3", "check_autoep_zero3",
           "check_folded_target", "check_folded_zero3", "check_moe", "ds_affine_entry", "split_local",
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


# DeepSpeed 0.19.8's own refusals of an AutoEP x AutoTP ("folded") job, quoted: deepspeed.initialize runs
# validate_folding_global (deepspeed/module_inject/auto_ep_folding.py) from DeepSpeedEngine._configure_expert_parallel
# (runtime/engine.py:842, validate_autoep_config), before any step, so DeepSpeed neither trains nor saves such a job
# and a checkpoint written in that layout would be one no DeepSpeed job can load.
_FOLDING = "deepspeed/module_inject/auto_ep_folding.py"
DEEPSPEED_FOLDING_REFUSALS = {
    "ep1": (f"{_FOLDING}:241", "AutoEP+AutoTP folding requires expert_parallel.autoep_size > 1. The ep=1 "
            "local-computation path would duplicate routed-token gradients across TP lanes."),
    "pp": (f"{_FOLDING}:207", "AutoEP+AutoTP folding currently supports pp_size=1 only; got pp_size={pp}. "
           "Pipeline-parallel validation is planned separately."),
    "data_before_expert": (f"{_FOLDING}:245", "expert_parallel with use_data_before_expert_parallel_ is not "
                           "supported with AutoEP+AutoTP folding. Disable use_data_before_expert_parallel_."),
}


def deepspeed_refuses_folding(where: Any, why: str, asked: str, **values: Any) -> ReshardError:
    """The refusal of a folded (AutoEP x AutoTP) target DeepSpeed 0.19.8 itself refuses to train,
    in its own words (``DEEPSPEED_FOLDING_REFUSALS``)."""
    line, text = DEEPSPEED_FOLDING_REFUSALS[why]
    return ReshardError(f"{where}: an AutoEP target folded over TP ({asked}) is refused: DeepSpeed 0.19.8 does not "
                        f"train it, so it could never load it. deepspeed.initialize raises in validate_folding_global "
                        f"({line}): \"{text.format(**values)}\"")


def check_folding(where: Any, tp: int, ep: int, pp: int = 1, data_before_expert: bool = False) -> None:
    """An AutoEP target at TP > 1 is one DeepSpeed's folding admits (``validate_folding_global``)."""
    if tp <= 1:
        return
    asked = f"asked tp={tp}, ep={ep}" + (f", pp={pp}" if pp != 1 else "")
    if pp > 1:
        raise deepspeed_refuses_folding(where, "pp", asked, pp=pp)
    if ep == 1:
        raise deepspeed_refuses_folding(where, "ep1", asked)
    if data_before_expert:
        raise deepspeed_refuses_folding(where, "data_before_expert", asked)


def check_target(ck: DeepSpeedCheckpoint, what: str, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    """The refusals every expert checkpoint shares (``what``: "AutoEP", "classic MoE")."""
    if tp != 1 or pp != 1 or ck.layer_files:
        example = next(iter(ck.experts.params), "") if ck.experts is not None else ""
        why = ("; an AutoEP pipeline (deepspeed.pipe) target is written from a PipelineModule's AutoEP checkpoint "
               f"only, whose layers are named by their index (N.mlp): this one names them as its model does "
               f"({example}, model.layers.N...), and nothing maps those names to a PipelineModule's layer indices "
               "(docs/deepspeed-checkpoints.md §11.4)" if pp != 1 and what == "AutoEP" else "")
        raise ReshardError(f"{ck.tag_dir}: {what} checkpoints are resharded at TP = PP = 1 only (asked tp={tp}, "
                           f"pp={pp}){why}")
    if stage not in (1, 2) or stage != ck.zero_stage:
        raise ReshardError(f"{ck.tag_dir}: {what} resharding keeps the source's ZeRO stage {ck.zero_stage} "
                           f"(asked {stage})")
    if dp % ep:
        raise ReshardError(f"ep={ep} must divide the target world size dp={dp} (EDP = dp / ep)")


def _check_placements(ck: DeepSpeedCheckpoint, ep: int) -> None:
    """AutoEP's uniform placement at ``ep`` of every fused expert parameter, from a uniform one."""
    for name, p in ck.experts.params.items():
        if p.full_shape[0] % ep:
            raise ReshardError(f"{ck.model_files[0]}: {name}: {p.full_shape[0]} experts do not split evenly over "
                               f"ep={ep} (AutoEP's uniform placement)")
        uniform = uniform_placement(p.full_shape[0], p.ep)["ranks"]
        if [list(x) for x in p.experts_by_rank] != [r["experts"] for r in uniform]:
            raise CheckpointError(f"{ck.model_files[0]}: {name}: a non-uniform source placement "
                                  f"{[list(x) for x in p.experts_by_rank]} is not supported yet")


def check_autoep(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    if ck.experts is None:
        raise ReshardError(f"{ck.model_files[0]}: ep= needs an AutoEP checkpoint (ds_autoep_layers) or a classic MoE "
                           "one (num_experts); this one has neither")
    check_target(ck, "AutoEP", ep, dp, tp, pp, stage)
    _check_placements(ck, ep)
    ck.check_steps()


def _check_zero3_placement(ck: DeepSpeedCheckpoint, ep: int, dp: int) -> None:
    """The checks an AutoEP checkpoint at either end of ZeRO-3 shares: the placement at ``ep`` over
    ``dp`` ranks, no frozen parameters, one optimizer step."""
    if dp % ep:
        raise ReshardError(f"ep={ep} must divide the target world size dp={dp} (EDP = dp / ep)")
    _check_placements(ck, ep)
    ms = ck.model_state(0)
    if any(prod(tuple(s)) for s in (ms.get("frozen_param_shapes") or {}).values()):
        raise CheckpointError(f"{ck.model_files[0]}: frozen parameters are not supported at ZeRO-3 (DeepSpeed's "
                              "AutoEP ZeRO-3 save refuses frozen expert parameters; reshard does not write frozen "
                              "fragments)")
    ck.check_steps()


def check_autoep_to_zero3(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int) -> None:
    """What an AutoEP ZeRO-1/2 checkpoint written at ZeRO-3 refuses, before anything is written."""
    if ck.experts is None:
        raise ReshardError(f"{ck.model_files[0]}: not an AutoEP checkpoint (ds_autoep_layers)")
    if tp != 1 or pp != 1 or ck.layer_files:
        raise ReshardError(f"{ck.tag_dir}: AutoEP checkpoints are resharded at TP = PP = 1 only (asked tp={tp}, "
                           f"pp={pp})")
    _check_zero3_placement(ck, ep, dp)


def split_local(name: str) -> tuple[str, int, str]:
    """A classic MoE expert parameter's (prefix, local expert, sub-name)."""
    m = LOCAL_RE.match(name)
    if m is None:  # deepspeed_moe.read only admits names that match
        raise CheckpointError(f"internal: {name!r} is not a classic MoE expert parameter name")
    return m["prefix"], int(m["local"]), m["sub"]


def check_moe(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int, layout: Any = None) -> None:
    if stage == 3:
        raise ReshardError(f"{ck.tag_dir}: a classic MoE (deepspeed.moe.layer.MoE) checkpoint is not written at ZeRO "
                           "stage 3: DeepSpeed 0.19.8 does not train it there (engine._validate_zero3_moe_compatibility: "
                           "'Native DeepSpeed MoE is not supported with ZeRO Stage 3'); it keeps its ZeRO stage "
                           f"{ck.zero_stage}")
    if ck.tp > 1:  # written at its own TP or at TP 1 (moe_tp_target); the rest has no DeepSpeed layout proven here
        _check_moe_tp(ck, ep, dp, tp, pp, stage)
        return
    if tp > 1 and pp == 1 and isinstance(layout, (str, Path)) and Path(layout).is_dir():
        _check_moe_layout(ck, tp, Path(layout))  # a TP-1 source at the TP of a DeepSpeed checkpoint saved there
        _check_moe_tp(ck, ep, dp, tp, pp, stage, layout_tp=tp)
        return
    check_target(ck, "classic MoE", ep, dp, tp, pp, stage)
    _check_moe_split(ck, ep)


def _check_moe_layout(ck: DeepSpeedCheckpoint, tp: int, layout: Path) -> None:
    """A TP-1 classic MoE source's ``--layout`` checkpoint: a classic MoE one at ``tp`` whose experts
    are not split over TP (a TP-1 source's experts are whole; DeepSpeed's expert-TP split of them is
    not derived here)."""
    lck = DeepSpeedCheckpoint.open(layout)
    if lck.moe is None or lck.tp != tp:
        raise ReshardError(f"layout checkpoint {lck.tag_dir}: a classic MoE target at TP={tp} from a TP-1 source takes "
                           f"its dense TP maps from a classic MoE checkpoint of this model saved at TP={tp} (this one: "
                           f"TP={lck.tp}, {'classic MoE' if lck.moe is not None else 'no classic MoE experts'})")
    if lck.moe.etp > 1:
        raise ReshardError(f"layout checkpoint {lck.tag_dir}: its experts are split over TP "
                           "(enable_expert_tensor_parallelism=True); a TP-1 source's experts are written unsplit "
                           "only")


def _check_moe_tp(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int,
                  layout_tp: int | None = None) -> None:
    """What a classic MoE source saved at TP > 1 (through an mpu) refuses as a DeepSpeed target,
    before anything is written: another TP than its own or 1, PP, another ZeRO stage, EP sizes its
    expert groups cannot be cut into (moe_tp_target)."""
    ax = ck.moe
    if pp != 1 or tp not in (1, ck.tp, layout_tp):
        raise ReshardError(f"{ck.tag_dir}: a classic MoE checkpoint saved at TP={ck.tp} (through an mpu) is written "
                           f"as DeepSpeed files at its own TP={ck.tp} or at TP=1 (PP=1) only (asked tp={tp}, pp={pp}): "
                           f"another TP degree re-cuts the dense shards to a split no DeepSpeed job here has saved "
                           f"(--layout is not offered for it); --format universal, dcp, safetensors or hf are offered")
    if stage not in (1, 2) or stage != ck.zero_stage:
        raise ReshardError(f"{ck.tag_dir}: classic MoE resharding keeps the source's ZeRO stage {ck.zero_stage} "
                           f"(asked {stage})")
    etp = ax.etp > 1 and tp > 1
    if etp and dp % ep:  # expert TP cuts each TP rank's DP group into EP groups
        raise ReshardError(f"ep={ep} must divide the DP size dp={dp} with the experts split over TP (DeepSpeed's "
                           "groups._get_expert_parallel_ranks cuts each TP rank's DP group into EP groups)")
    if not etp and (tp * dp) % ep:
        raise ReshardError(f"ep={ep} must divide the target world size tp*dp={tp * dp} (DeepSpeed builds the EP "
                           "groups over global ranks)")
    if ax.data_before_expert and tp > 1:
        raise ReshardError(f"{ck.tag_dir}: use_data_before_expert_parallelism at TP > 1 is not written (no DeepSpeed "
                           "checkpoint of that layout here)")
    _check_moe_split(ck, ep)


def _check_moe_split(ck: DeepSpeedCheckpoint, ep: int) -> None:
    """Every MoE layer's experts split evenly over ``ep``; the expert groups' names; one step."""
    counts, path = ck.model_state(0)["num_experts"], ck.model_files[0]
    for p in ck.moe.params.values() if ck.moe is not None else ():
        if counts[p.layer] % ep:
            raise ReshardError(f"{path}: MoE layer {p.layer} ({split_local(p.name)[0]}): {counts[p.layer]} experts do not "
                               f"split evenly over ep={ep}")
    _check_moe_groups(ck)
    ck.check_steps()


def _check_moe_groups(ck: DeepSpeedCheckpoint) -> None:
    """The expert optimizer groups are DeepSpeed's MoE groups for the source's EP size."""
    ax = ck.moe
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


def check_folded_target(ck: DeepSpeedCheckpoint, ep: int, tp: int) -> None:
    """What DeepSpeed folds AutoEP over TP with (``validate_folding_global``: :func:`check_folding`)."""
    if ck.experts is None:
        raise ReshardError(f"{ck.model_files[0]}: not an AutoEP checkpoint (ds_autoep_layers)")
    check_folding(ck.tag_dir, tp, ep, 1, ck.experts.data_before_expert)


def check_folded_zero3(ck: DeepSpeedCheckpoint, ep: int, world: int, tp: int, pp: int) -> None:
    """What a folded (AutoEP x AutoTP) ZeRO-3 target refuses, before anything is written: PP, EP 1
    and the placement, frozen parameters and steps every AutoEP ZeRO-3 target checks (``world``:
    TP x DP global ranks, which the EP groups are laid over)."""
    if ck.experts is None:
        raise ReshardError(f"{ck.model_files[0]}: not an AutoEP checkpoint (ds_autoep_layers)")
    if pp != 1 or ck.layer_files:
        raise ReshardError(f"{ck.tag_dir}: AutoEP checkpoints are resharded without pipeline stages only (asked "
                           f"tp={tp}, pp={pp})")
    check_folded_target(ck, ep, tp)
    _check_zero3_placement(ck, ep, world)


def check_autoep_zero3(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    """What an AutoEP ZeRO-3 target refuses, before anything is written."""
    if stage not in (1, 2, 3):
        raise ReshardError(f"{ck.tag_dir}: an AutoEP ZeRO-3 checkpoint is written at ZeRO stage 1, 2 or 3 (asked "
                           f"{stage})")
    if tp != 1 or pp != 1:  # folded at TP > 1 (PP 1): writer._autoep_folded_zero3 / _autoep_folded_from_zero3
        raise ReshardError(f"{ck.tag_dir}: AutoEP ZeRO-3 checkpoints are resharded at TP = PP = 1 only "
                           f"(asked tp={tp}, pp={pp})")
    _check_zero3_placement(ck, ep, dp)


class AutoEPPlacement:
    """AutoEP's uniform placement at EP ``ep`` over ``dp`` ranks: each fused parameter's outer map
    over the EP ranks, each EP rank's EDP group, and the per-rank records that follow from them."""

    def __init__(self, ax: dse.AutoEP, ep: int, dp: int) -> None:
        self.ep, self.dp, self.edp = ep, dp, dp // ep
        self.ax = dataclasses.replace(ax, ep=ep, edp=dp // ep, tp=1)  # the source's EDP order at the new sizes, TP 1
        self.placements = {p.layer: uniform_placement(p.full_shape[0], ep) for p in ax.params.values()}
        self.maps: dict[str, ParamMap] = {n: autoep_placement(self.placements[p.layer], p.full_shape)
                                          for n, p in ax.params.items()}
        self.ep_of = {d: e for e in range(ep) for d in self.ax.members(e)}

    def group(self) -> Group:
        """Each EP rank's partition group: its EDP ranks."""
        return Group(tuple(tuple(self.ax.members(e)) for e in range(self.ep)))

    def ds_config(self, cfg: dict | None) -> dict | None:
        if cfg is not None and isinstance(cfg.get("expert_parallel"), dict):
            cfg["expert_parallel"]["autoep_size"] = self.ep
        return cfg

    def layer(self, entry: dict, d: int, *, copied: bool) -> dict:
        """One ``ds_autoep_layers`` entry as DP rank ``d`` writes it at the target (``copied``: its
        own copies of the source's objects, as DeepSpeed's ZeRO-3 save clones the state)."""
        desc = self.placements[int(entry["moe_layer_id"])]
        desc = copy.deepcopy(desc) if copied else desc
        e = self.ep_of[d]
        local = len(desc["ranks"][e]["experts"])
        out = copy.deepcopy(dict(entry)) if copied else dict(entry)
        out.update(num_local_experts=local, ep_size=self.ep, expert_placement=desc, ep_group_name=f"ep_size_{self.ep}",
                   ep_rank=e, expert_data_parallel_rank=self.ax.members(e).index(d),
                   expert_data_parallel_world_size=self.edp, global_expert_start=e * local,
                   global_expert_end=(e + 1) * local)
        if "affine_maps" in entry:
            params = {n: ds_affine_entry(desc, self.maps[n].logical_shape) for n in entry["affine_maps"].get("params", {})}
            maps = copy.deepcopy(entry["affine_maps"]) if copied else entry["affine_maps"]
            out["affine_maps"] = {**maps, "params": params}
        return out

    def partition_groups(self, layout: Layout, rank: int) -> list[dict]:
        """Global rank ``rank``'s ``ds_zero_partition_groups`` (``_zero3_partition_group_metadata``):
        each sub-group's partition group in global ranks (folded over TP: a dense one its TP rank's
        DP ranks ``d * tp + t``, an expert one its EP rank's EDP group)."""
        out: list[dict[str, Any]] = []
        for k, u in enumerate(layout.units):
            h, q = u.group.place(rank)
            expert = any(n in self.maps for p in u.parts.values() for n in p.names)
            out.append({"sub_group": k, "partition_count": u.group.size, "partition_rank": q,
                        "partition_ranks": list(u.group.members[h]),
                        "families": ["autoep_expert" if expert else "replicated"],
                        "group_names": [f"ep_size_{self.ep}" if expert else "replicated"]})
        return out
