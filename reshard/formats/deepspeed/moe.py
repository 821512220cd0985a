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

The universal form (docs/deepspeed-checkpoints.md §12): one tensor per *global* expert parameter,
under the name the per-expert file gives it (whose shape must be ``param_shapes``' for its local
name). Its map (docs/spec.md §7.2) is one piece located on
the EP rank holding that expert: the outer map of ``layout.source``, which composes it with that
rank's EDP split, whose ranks are the DP ranks whose flat partitions hold the fragments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...layouts import replicated
from ...storage.safe_load import load
from .lowering import Lowered
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
    shape: tuple[int, ...]
    group: int  # optimizer parameter group index


@dataclass(frozen=True, slots=True)
class ClassicMoE:
    """The classic MoE experts of a checkpoint (``ck.moe``)."""

    params: Mapping[str, MoEParam]  # by global name, in layer, expert, parameter order
    local_names: frozenset[str]  # the local names param_shapes lists (never parameters of F)
    groups: frozenset[int]
    ep: int
    edp: int
    data_before_expert: bool
    files: Mapping[tuple[int, int], Path]  # (layer, global expert) -> per-expert file

    def members(self, e: int) -> list[int]:
        """EP rank ``e``'s EDP group: its DP ranks in EDP rank order."""
        if self.data_before_expert:
            return [e * self.edp + k for k in range(self.edp)]
        return [e + k * self.ep for k in range(self.edp)]


def read(ck: DeepSpeedCheckpoint) -> ClassicMoE | None:
    """The classic MoE experts ``ck`` holds, checked against its files; ``None`` without them."""
    state, path = ck.model_state(0), ck.model_files[0]
    counts = state.get("num_experts")
    if state.get("ds_autoep_layers") or not isinstance(counts, list) or not counts:
        return None
    if ck.zero_stage == 3 or ck.mp != 1:
        raise CheckpointError(f"{path}: classic MoE experts are read only from ZeRO-1/2 checkpoints without tensor "
                              f"or pipeline parallelism (this one: ZeRO-{ck.zero_stage}, TP={ck.tp}, PP={ck.pp})")
    groups = ck.groups(0)
    layers = _local_layers(groups, path)
    if len(layers) != len(counts):
        raise CheckpointError(f"{path}: num_experts lists {len(counts)} MoE layers, param_shapes has expert "
                              f"parameters of {len(layers)} ({list(layers)})")
    locals_ = {len({j for j, _ in entries}) for entries in layers.values()}
    if len(locals_) != 1 or any(n % next(iter(locals_)) for n in counts):
        raise CheckpointError(f"{path}: local expert counts {sorted(locals_)} do not divide num_experts {counts}")
    local = locals_.pop()
    ep = counts[0] // local
    if any(n // local != ep for n in counts) or ck.dp % ep:
        raise CheckpointError(f"{path}: num_experts {counts} with {local} local experts give EP sizes that do not "
                              f"divide the DP size {ck.dp} as one EP group")
    cfg = state.get("ds_config") if isinstance(state.get("ds_config"), dict) else {}
    files = _expert_files(ck.tag_dir, counts)
    params = _global_params(layers, groups, local, ep, files)
    expert_groups = frozenset(p.group for p in params.values())
    local_names = frozenset(p.local for p in params.values())
    for g in expert_groups:
        strays = [n for n in groups[g] if n not in local_names]
        if strays:
            raise CheckpointError(f"{path}: optimizer group {g} holds experts and also {strays[:3]}")
    check_module_entries(path, state, {n for g in groups for n in g})
    return ClassicMoE(params, local_names, expert_groups, ep, ck.dp // ep,
                      bool(cfg.get("use_data_before_expert_parallelism", False)), files)


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


def _expert_files(tag: Path, counts: list[int]) -> dict[tuple[int, int], Path]:
    files = {(int(m[1]), int(m[2])): tag / f.name for f in tag.iterdir() if (m := FILE_RE.match(f.name))}
    missing = [(L, e) for L, n in enumerate(counts) for e in range(n) if (L, e) not in files]
    if missing:
        L, e = missing[0]
        raise CheckpointError(f"{tag}: layer_{L}_expert_{e}_mp_rank_00_model_states.pt is missing "
                              f"({len(missing)} per-expert files missing in all)")
    return files


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


def lowered(p: MoEParam) -> Lowered:
    """The expert's map: all of F, one piece, located on the EP rank holding it."""
    return Lowered(replicated(p.shape, [p.ep_rank]), FAMILY, {})
