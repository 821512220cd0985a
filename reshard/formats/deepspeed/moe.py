"""Classic DeepSpeed MoE (``deepspeed.moe.layer.MoE``) experts in a ZeRO-1/2 checkpoint.

Each MoE layer's experts are ordinary modules ``<prefix>.deepspeed_experts.<j>.<sub>`` where ``j``
is the *local* expert index on its EP rank: every EP rank names its experts ``0..local-1``, so
the same name means a different expert on each EP rank. DeepSpeed writes:

* ``mp_rank_00_model_states.pt`` (by rank 0) without the expert weights in ``module``, with
  ``num_experts`` (one count per MoE layer) and ``param_shapes`` listing rank 0's local names;
* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` per MoE layer ``L`` and *global* expert
  ``E = ep_rank * local + j``, holding that expert's weights under its global name;
* one optimizer group per EP size (``moe: True``, named ``ep_size_N``) partitioned over the
  expert-data-parallel (EDP) group of each EP rank, its ``param_slice_mappings`` keyed by local
  names. EP rank ``e`` of DP rank ``d`` is ``d % ep`` (``d // edp`` with
  ``use_data_before_expert_parallelism``), as for AutoEP.

At TP > 1 (a Megatron-style ``mpu`` handed to ``deepspeed.initialize``) with
``enable_expert_tensor_parallelism=False``, DeepSpeed 0.19.8 builds the expert groups as without TP,
over *global* ranks ``g = dp_rank * tp + tp_rank`` (``groups._create_expert_and_data_parallel``: EP
groups of consecutive global ranks, EDP groups strided by ``ep``): EP rank ``g % ep``, EDP size
``world / ep``, the EDP group spanning TP ranks where ``ep < tp``. No expert is split or
replicated over TP: EP rank ``e``'s experts are written once, by its first EDP member ``g0``, as
``layer_L_expert_E_mp_rank_{g0 % tp}``; every model-state file lists the same local expert names.
With ``enable_expert_tensor_parallelism=True`` the experts are the user's TP modules: DeepSpeed cuts
each TP rank's DP group into EP groups of consecutive members (``groups._get_expert_parallel_ranks``)
and writes one file per expert *and* TP rank, that rank's shard. An expert parameter's map is then its
TP split (lowered from every TP rank's ``param_shapes`` of its local name and
``universal_checkpoint_info``, as a dense parameter's) on holders ``ep_rank * tp + t``, each holder's
share cut over its EDP group.

The universal form (docs/deepspeed-checkpoints.md §12): one tensor per *global* expert parameter,
under the name the per-expert file gives it (whose shape must be ``param_shapes``' for its local
name). Its map (docs/spec.md §7.2) is one piece located on
the EP rank holding that expert: the outer map of ``layout.source``, which composes it with that
rank's EDP split, whose ranks are the DP ranks whose flat partitions hold the fragments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...layouts import replicated
from ...storage.safe_load import load
from .lowering import Lowered, lower
from .module_entries import check_module_entries

# a ``formats.deepspeed.DeepSpeedCheckpoint``, which imports this module (its hooks call these)
DeepSpeedCheckpoint = Any

LOCAL_RE = re.compile(r"^(?P<prefix>.+\.deepspeed_experts)\.(?P<local>\d+)\.(?P<sub>.+)$")
FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
FAMILY = "moe expert"


@dataclass(frozen=True, slots=True)
class MoEParam:
    """One global expert parameter: which EP rank holds it, under which local name."""

    name: str  # global: <prefix>.<E>.<sub>, as in the per-expert file
    local: str  # the name EP rank ``ep_rank``'s optimizer partitions use
    layer: int  # moe_layer_id (the L of layer_L_expert_E)
    expert: int  # global expert index E
    ep_rank: int
    shape: tuple[int, ...]  # F: the whole expert parameter (with expert TP: its TP shards joined)
    group: int  # optimizer parameter group index
    tp_map: ParamMap | None = None  # with expert TP: its split over TP ranks (lowered as a dense parameter)


@dataclass(frozen=True, slots=True)
class ClassicMoE:
    """The classic MoE experts of a checkpoint (``ck.moe``)."""

    params: Mapping[str, MoEParam]  # by global name, in layer, expert, parameter order
    local_names: frozenset[str]  # the local names param_shapes lists (never parameters of F)
    groups: frozenset[int]
    ep: int
    edp: int
    data_before_expert: bool
    files: Mapping[tuple[int, int], Path]  # (layer, global expert) -> per-expert file (expert TP: TP rank 0's)
    etp: int = 1  # expert TP: the TP size the experts are split over (1: unsplit)
    tp_files: Mapping[tuple[int, int, int], Path] = field(default_factory=dict)  # expert TP: (layer, E, t)

    @property
    def holders(self) -> int:
        """Holders of the expert group: EP ranks, or with expert TP (EP rank ``e``, TP rank ``t``) as
        ``e * etp + t``."""
        return self.ep * self.etp

    def members(self, h: int) -> list[int]:
        """Holder ``h``'s EDP group in EDP rank order: global ranks ``dp_rank * tp + tp_rank`` (the
        DP ranks at TP 1). With expert TP DeepSpeed cuts each TP rank's DP group into EP groups of
        consecutive members (``groups._get_expert_parallel_ranks``): EP rank ``e``, TP rank ``t`` is
        DP rank ``i * ep + e`` of TP rank ``t``, global ``(i * ep + e) * etp + t``."""
        if self.etp > 1:
            e, t = divmod(h, self.etp)
            return [(i * self.ep + e) * self.etp + t for i in range(self.edp)]
        if self.data_before_expert:
            return [h * self.edp + k for k in range(self.edp)]
        return [h + k * self.ep for k in range(self.edp)]


def writer_mp(ax_members: list[int], tp: int) -> int:
    """The model-parallel rank in an EP rank's per-expert file names: its first EDP member's TP rank
    (DeepSpeed's ``checkpoint_mp_rank`` of the rank that saves them)."""
    return ax_members[0] % tp


def read(ck: DeepSpeedCheckpoint) -> ClassicMoE | None:
    """The classic MoE experts ``ck`` holds, checked against its files; ``None`` without them."""
    state, path = ck.model_state(0), ck.model_files[0]
    counts = state.get("num_experts")
    if state.get("ds_autoep_layers") or not isinstance(counts, list) or not counts:
        return None
    if ck.zero_stage == 3 or ck.pp != 1:
        raise CheckpointError(f"{path}: classic MoE experts are read only from ZeRO-1/2 checkpoints without "
                              f"pipeline parallelism (this one: ZeRO-{ck.zero_stage}, TP={ck.tp}, PP={ck.pp})")
    groups = ck.groups(0)
    for t in range(1, ck.tp):  # every TP rank's saver lists the same counts (its own EP rank's local names)
        if ck.model_state(t).get("num_experts") != counts:
            raise CheckpointError(f"{ck.model_files[t]}: num_experts {ck.model_state(t).get('num_experts')} differs "
                                  f"from {counts} in {path.name}")
    layers = _local_layers(groups, path)
    if len(layers) != len(counts):
        raise CheckpointError(f"{path}: num_experts lists {len(counts)} MoE layers, param_shapes has expert "
                              f"parameters of {len(layers)} ({list(layers)})")
    locals_ = {len({j for j, _ in entries}) for entries in layers.values()}
    if len(locals_) != 1 or any(n % next(iter(locals_)) for n in counts):
        raise CheckpointError(f"{path}: local expert counts {sorted(locals_)} do not divide num_experts {counts}")
    local = locals_.pop()
    ep = counts[0] // local
    world = ck.dp * ck.tp  # without TP the DP size
    if any(n // local != ep for n in counts) or world % ep:
        raise CheckpointError(f"{path}: num_experts {counts} with {local} local experts give EP sizes that do not "
                              f"divide the {'world' if ck.tp > 1 else 'DP'} size {world} as one EP group")
    cfg = state.get("ds_config") if isinstance(state.get("ds_config"), dict) else {}
    before = bool(cfg.get("use_data_before_expert_parallelism", False))
    found = _found_files(ck.tag_dir)
    if ck.tp > 1 and _split_over_tp(found):
        return _read_expert_tp(ck, found, layers, counts, local, ep, before)
    members = ClassicMoE({}, frozenset(), frozenset(), ep, world // ep, before, {}).members
    files = _expert_files(ck.tag_dir, found, counts, local, {e: writer_mp(members(e), ck.tp) for e in range(ep)},
                          ck.tp)
    params = _global_params(layers, groups, local, ep, files)
    expert_groups, local_names = _check_groups(ck, params, ep, same_shapes=True)
    return ClassicMoE(params, local_names, expert_groups, ep, world // ep, before, files)


def _check_groups(ck: DeepSpeedCheckpoint, params: Mapping[str, MoEParam], ep: int,
                  same_shapes: bool) -> tuple[frozenset[int], frozenset[str]]:
    """The expert groups hold experts only, are named for ``ep``, and every TP rank's saver lists the
    same local names (with the same shapes, unless the experts are split over TP)."""
    path, groups = ck.model_files[0], ck.groups(0)
    expert_groups = frozenset(p.group for p in params.values())
    local_names = frozenset(p.local for p in params.values())
    for g in expert_groups:
        strays = [n for n in groups[g] if n not in local_names]
        if strays:
            raise CheckpointError(f"{path}: optimizer group {g} holds experts and also {strays[:3]}")
    _check_group_names(ck, expert_groups, ep)
    for t in range(1, ck.tp):
        other = ck.groups(t)
        for g in expert_groups:
            if len(other) <= g or (other[g] != groups[g] if same_shapes else list(other[g]) != list(groups[g])):
                raise CheckpointError(f"{ck.model_files[t]}: param_shapes of expert group {g} differ from "
                                      f"{path.name}'s (every saver lists its EP rank's local experts, alike)")
    check_module_entries(path, ck.model_state(0), {n for g in groups for n in g})
    return expert_groups, local_names


def _read_expert_tp(ck: DeepSpeedCheckpoint, found: Mapping[tuple[int, int, int], Path], layers: dict,
                    counts: list[int], local: int, ep: int, before: bool) -> ClassicMoE:
    """Experts split over TP (``enable_expert_tensor_parallelism=True``): one file per expert and TP
    rank, each that rank's shard; each expert parameter's TP map lowered from every TP rank's
    ``param_shapes`` of its local name and ``universal_checkpoint_info``, as a dense parameter's."""
    path = ck.model_files[0]
    if before:
        raise CheckpointError(f"{path}: experts split over TP with use_data_before_expert_parallelism are not read "
                              "(no DeepSpeed checkpoint of that layout here)")
    if ck.dp % ep:
        raise CheckpointError(f"{path}: EP size {ep} does not divide the DP size {ck.dp} (expert TP cuts each TP "
                              "rank's DP group into EP groups)")
    want = {(L, x, t) for L, n in enumerate(counts) for x in range(n) for t in range(ck.tp)}
    missing = sorted(want - set(found))
    if missing:
        L, x, t = missing[0]
        raise CheckpointError(f"{ck.tag_dir}: layer_{L}_expert_{x}_mp_rank_{t:02d}_model_states.pt is missing (TP rank "
                              f"{t}'s shard of expert {x}, split over TP: {len(missing)} per-expert files missing)")
    extra = sorted(set(found) - want)
    if extra:
        raise CheckpointError(f"{found[extra[0]]}: a per-expert file DeepSpeed does not write for this layout")
    params: dict[str, MoEParam] = {}
    for layer, (prefix, entries) in enumerate(layers.items()):
        for e in range(ep):
            for j in range(local):
                x = e * local + j
                keys = [_file_keys(found[(layer, x, t)]) for t in range(ck.tp)]
                for jj, sub in entries:
                    if jj != j:
                        continue
                    name, lname = f"{prefix}.{x}.{sub}", f"{prefix}.{j}.{sub}"
                    g = next(i for i, grp in enumerate(ck.groups(0)) if lname in grp)
                    shapes = [ck.groups(t)[g].get(lname) for t in range(ck.tp)]
                    for t in range(ck.tp):
                        f = found[(layer, x, t)]
                        if name not in keys[t]:
                            raise CheckpointError(f"{f}: no {name!r} (global expert {x} of MoE layer {layer}, TP "
                                                  f"rank {t})")
                        if shapes[t] is None or keys[t][name] != tuple(shapes[t]):
                            raise CheckpointError(f"{f}: {name!r} has shape {list(keys[t][name] or ())}, TP rank "
                                                  f"{t}'s param_shapes give its local name {lname!r} {list(shapes[t] or ())}")
                    try:
                        low = lower(lname, [tuple(s) for s in shapes if s is not None], ck.uc_info)
                    except ReshardError as err:
                        raise CheckpointError(f"{path}: expert parameter {name!r} ({lname!r}): {err}") from None
                    params[name] = MoEParam(name, lname, layer, x, e, tuple(low.map.valid_shape), g, low.map)
    expert_groups, local_names = _check_groups(ck, params, ep, same_shapes=False)
    files = {(L, x): found[(L, x, 0)] for L, n in enumerate(counts) for x in range(n)}
    return ClassicMoE(params, local_names, expert_groups, ep, ck.dp // ep, before, files, ck.tp, dict(found))


def _check_group_names(ck: DeepSpeedCheckpoint, expert_groups: frozenset[int], ep: int) -> None:
    """Every rank's optimizer names its expert group DeepSpeed's way for this EP size: ``ep_size_<ep>``
    (``split_params_into_different_moe_groups_for_optimizer``), the size ``num_experts`` implies."""
    for (t, d), path in sorted(ck.optim_files.items()):
        base = ck.osd(t, d).get("base_optimizer_state")
        groups = base.get("param_groups") if isinstance(base, dict) else None
        if not isinstance(groups, list):
            continue  # an optimizer layout without param groups: the flat checks name it
        for g in sorted(expert_groups):
            name = groups[g].get("name") if g < len(groups) and isinstance(groups[g], dict) else None
            if isinstance(name, str) and name.startswith("ep_size_") and name != f"ep_size_{ep}":
                raise CheckpointError(f"{path}: optimizer group {g} is named {name!r}, but num_experts and the local "
                                      f"experts of param_shapes give EP size {ep} ('ep_size_{ep}')")


def _local_layers(groups: list[dict], path: Path) -> dict[str, list[tuple[int, str]]]:
    """Expert prefix -> its ``(local index, sub-name)`` entries, prefixes in model order (which is
    DeepSpeed's ``moe_layer_id`` order: it numbers MoE modules as ``named_modules`` meets them)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for g in groups:
        for n in g:
            if (m := LOCAL_RE.match(n)) is not None:
                out.setdefault(m["prefix"], []).append((int(m["local"]), m["sub"]))
    if not out:
        raise CheckpointError(f"{path}: num_experts is set but param_shapes has no '*.deepspeed_experts.<j>.*' "
                              "parameters")
    return out


def _split_over_tp(found: Mapping[tuple[int, int, int], Path]) -> bool:
    """Whether the experts are saved split over TP: most experts have files of several TP ranks (so a
    stray copy beside unsplit experts, or one missing shard of split ones, is named as such)."""
    ranks: dict[tuple[int, int], int] = {}
    for L, x, _ in found:
        ranks[(L, x)] = ranks.get((L, x), 0) + 1
    return 2 * sum(n > 1 for n in ranks.values()) > len(ranks)


def _found_files(tag: Path) -> dict[tuple[int, int, int], Path]:
    """Every per-expert file of the tag folder: ``(layer, global expert, model-parallel rank) -> path``."""
    return {(int(m[1]), int(m[2]), int(m[3])): tag / f.name for f in tag.iterdir() if (m := FILE_RE.match(f.name))}


def _expert_files(tag: Path, found: Mapping[tuple[int, int, int], Path], counts: list[int], local: int,
                  mp_of: Mapping[int, int], tp: int) -> dict[tuple[int, int], Path]:
    """``(layer, global expert) -> file``: expert ``x`` in the file named by its EP rank's saver
    (``mp_of``), every such file present and no other per-expert file beside them."""
    want = {(L, x, mp_of[x // local]) for L, n in enumerate(counts) for x in range(n)}
    missing = sorted(want - set(found))
    if missing:
        L, x, m = missing[0]
        raise CheckpointError(f"{tag}: layer_{L}_expert_{x}_mp_rank_{m:02d}_model_states.pt is missing "
                              f"({len(missing)} per-expert files missing in all)")
    extra = sorted(set(found) - want)
    if extra:
        raise CheckpointError(f"{found[extra[0]]}: a per-expert file DeepSpeed does not write for this layout (EP "
                              f"rank {extra[0][1] // local}'s experts are saved by model-parallel rank "
                              f"{mp_of.get(extra[0][1] // local, 0)} only)")
    return {(L, x): found[(L, x, m)] for L, x, m in sorted(want)}


def _global_params(layers: dict, groups: list[dict], local: int, ep: int,
                   files: Mapping[tuple[int, int], Path]) -> dict[str, MoEParam]:
    """Every global expert parameter; its name checked against the per-expert file's keys."""
    out: dict[str, MoEParam] = {}
    for layer, (prefix, entries) in enumerate(layers.items()):
        for e in range(ep):
            for j in range(local):
                x = e * local + j
                keys = _file_keys(files[(layer, x)])
                for jj, sub in entries:
                    if jj != j:
                        continue
                    name, lname = f"{prefix}.{x}.{sub}", f"{prefix}.{j}.{sub}"
                    if name not in keys:
                        raise CheckpointError(f"{files[(layer, x)]}: no {name!r} (global expert {x} of MoE layer "
                                              f"{layer}, local expert {j} of EP rank {e})")
                    g = next(i for i, grp in enumerate(groups) if lname in grp)
                    if keys[name] != groups[g][lname]:
                        raise CheckpointError(f"{files[(layer, x)]}: {name!r} has shape {list(keys[name])}, "
                                              f"param_shapes gives its local name {lname!r} {list(groups[g][lname])}")
                    out[name] = MoEParam(name, lname, layer, x, e, groups[g][lname], g)
    return out


def _file_keys(path: Path) -> dict[str, tuple[int, ...] | None]:
    """The per-expert file's keys and their tensors' shapes (``None`` for a non-tensor)."""
    sd = load(path)
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: expected a dict of expert weights, got {type(sd).__name__}")
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


# -- maps and tensors ----------------------------------------------------------------------------


def lowered(p: MoEParam, etp: int = 1) -> Lowered:
    """The expert's map: all of F, one piece, located on the EP rank holding it; with expert TP its
    TP map on holders ``ep_rank * etp + t``."""
    if p.tp_map is None:
        return Lowered(replicated(p.shape, [p.ep_rank]), FAMILY, {})
    return Lowered(p.tp_map.with_ranks({t: p.ep_rank * etp + t for t in p.tp_map.ranks}), FAMILY, {})
