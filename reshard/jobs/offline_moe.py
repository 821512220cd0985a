"""Offline resharding of a classic ``deepspeed.moe.layer.MoE`` checkpoint (ZeRO-1/2, TP = PP = 1)
to another expert-parallel (EP) degree and world size, as DeepSpeed 0.19.8 saves it there when
the same model is trained with ``MoE(ep_size=ep)`` on ``dp`` ranks (issue #12).

DeepSpeed places the experts of a layer with ``num_experts`` experts uniformly: EP rank ``e`` holds
global experts ``[e * L, (e + 1) * L)``, ``L = num_experts / ep``, under the *local* names
``<prefix>.deepspeed_experts.<j>.<sub>``, ``j = 0..L-1`` (global expert ``e * L + j``). Each global
expert parameter is one parameter of F (``formats.deepspeed_moe``): its source map is all of F on
the EP rank holding it, composed with that rank's ZeRO split over its expert-data-parallel (EDP)
group; its target map is the same at the target EP rank ``x // L``, composed with the target EDP
split of the local name ``x % L`` in the target's expert flat group. The plans between the two
move every expert's fp32 master and both Adam moments with it (``offline_experts.write``).

What DeepSpeed writes at the target (docs/deepspeed-checkpoints.md §12): the per-expert files
``layer_L_expert_E_mp_rank_00_model_states.pt`` (global names: the same at any EP, copied);
``mp_rank_00_model_states.pt`` with the target topology and ``param_shapes`` listing EP rank 0's
local names (``L`` local experts per layer); one optimizer file per DP rank (``bf16_`` prefixed, and
``module`` and per-expert weights bf16, for a bf16 source: ``moe_ep2_bf16_zero2``), the expert group cut
over the rank's EDP group (``partition_count`` ``[dp, edp]``), its ``param_slice_mappings`` keyed by
local names, and its optimizer parameter group named ``ep_size_<ep>``: DeepSpeed's ZeRO-1/2
``load_state_dict`` hands the saved ``param_groups`` to ``torch.optim``, which replaces the live
groups' ``name``, and ``stage_1_and_2`` looks the expert process groups up by that name
(``get_ep_ranks``, ``expert_dp_process_group``), so the name must be the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError, ReshardError
from ..formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from ..formats.deepspeed.moe import LOCAL_RE, _param_groups
from ..ir.param_map import ParamMap
from ..layouts import replicated
from .cluster import Cluster
from .offline_experts import ExpertTarget, check_target, write
from .reports import ReshardReport


def _split(name: str) -> tuple[str, int, str]:
    m = LOCAL_RE.match(name)
    if m is None:  # deepspeed_moe.read only admits names that match
        raise CheckpointError(f"internal: {name!r} is not a classic MoE expert parameter name")
    return m["prefix"], int(m["local"]), m["sub"]


class _MoETarget(ExpertTarget):
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


def _check(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
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


def reshard_moe(ck: DeepSpeedCheckpoint, out_dir: str | Path, *, ep: int, dp: int, tp: int = 1, pp: int = 1,
                zero_stage: int | None = None, workers: int = 1, overwrite: bool = False,
                progress: Callable[[int, int], None] | bool | None = None, checksum: str = "crc32",
                cluster: Cluster | None = None) -> ReshardReport:
    """``reshard.jobs.offline.reshard`` for a classic MoE checkpoint: write it at EP ``ep`` x world
    ``dp``. Every refusal (and a missing or mismatched per-expert file, found when ``ck.moe`` is
    read) comes before the staging folder exists."""
    stage = ck.zero_stage if zero_stage is None else zero_stage
    _check(ck, ep, dp, tp, pp, stage)
    tgt = _MoETarget(ck, ep, dp)
    files = [ck.moe.files[k] for k in sorted(ck.moe.files)]
    return write(ck, out_dir, tgt, stage=stage, expert_files=files, source_ep=ck.moe.ep,
                 note=f"classic MoE experts at EP {ep} (EDP {tgt.edp}): EP rank e holds experts [e*L, (e+1)*L)",
                 workers=workers, overwrite=overwrite, progress=progress, checksum=checksum, cluster=cluster)
