"""DeepSpeed 0.19.8's AutoEP x AutoTP *folding* records (``module_inject/auto_ep_folding.py``).

With ``tensor_parallel.autotp_size`` T > 1 and AutoEP, DeepSpeed lays the EP groups over the
ranks of a stage across TP lanes (EP rank of global rank ``g = dp_rank * T + tp_rank``:
``g % ep``; EDP group of EP rank ``e``: ``e, e + ep, ...``); dense weights are AutoTP shards, the
experts whole per EP rank. Every file it writes then holds a top-level ``"folding"`` record,
which a folded load checks field by field (``engine._validate_autoep_folding_checkpoint_metadata``
-> ``checkpoint.autoep_universal.validate_folding_metadata``) and a non-folded load refuses. The
records are functions of the topology and the parameter names: :func:`model_record`,
:func:`optim_record`, :func:`expert_record` build them as DeepSpeed writes them; :func:`check`
compares every file's with them (docs/deepspeed-checkpoints.md §11.2).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...storage.safe_load import load
from .recorded import first_difference

KEY = "folding"
VERSION = 1
LAYER_RANK_FIELDS = ("ep_rank", "expert_data_parallel_rank", "global_expert_start", "global_expert_end")


def _base(tp: int, t: int, ep: int, e: int, group: str, rank: int, count: int, family: str) -> dict[str, Any]:
    return {"version": VERSION, "tp_size": tp, "tp_rank": t, "ep_size": ep, "ep_rank": e, "etp_size": 1,
            "etp_rank": 0, "zero_partition_group": group, "zero_partition_rank": rank, "zero_partition_count": count,
            "dispatch_strategy": "route_full_partition_dispatch", "shared_expert_placement": "tp_sharded",
            "family": family}


def family(name: str) -> str:
    """A parameter's family, by DeepSpeed's name rule (``engine._autoep_param_family``)."""
    if ".experts." in name:
        return "routed_expert"
    if ".router." in name:
        return "router_gate_replicated"
    return "shared_expert" if ".shared_experts" in name else "dense"


def model_record(tp: int, t: int, ep: int, e: int, dp: int, module: Iterable[str], d: int = 0) -> dict[str, Any]:
    """``mp_rank_TT_model_states.pt``'s record: written by DP rank ``d`` (ZeRO-1/2: 0; ZeRO-3: every
    one, ``zero_pp_rank_D_mp_rank_TT``) of TP rank ``t`` (EP rank ``e``); ``module``: its module's
    keys (the router alias ``.gate.gate.`` counts as dense)."""
    out = _base(tp, t, ep, e, "dense_dp", d, dp, "dense")
    out["param_families"] = {n: "router_gate_replicated" if ".router." in n else
                             "shared_expert" if ".shared_experts" in n else "dense" for n in module}
    return out


def optim_record(tp: int, t: int, ep: int, e: int, dp: int, d: int, edp: int, q: int,
                 groups: Iterable[Iterable[str]] | None) -> dict[str, Any]:
    """``zero_pp_rank_D_mp_rank_TT_optim_states.pt``'s record: DP rank ``d`` of TP rank ``t``, EP
    rank ``e``, EDP rank ``q``; ``groups``: ``param_shapes``' names per group, ``None`` under ZeRO-3
    (DeepSpeed records no ``param_families`` there: ``ds_zero_partition_groups`` says it)."""
    out = _base(tp, t, ep, e, "per_family", d, dp, "zero_optimizer_state")  # its dense DP group's rank, size
    if groups is None:
        return out
    fams: dict[str, Any] = {}
    for names in groups:
        for n in names:
            f = family(n)
            fams[n] = {"family": f, "zero_partition_group": "edp" if f == "routed_expert" else "dense_dp",
                       "zero_partition_rank": q if f == "routed_expert" else d,
                       "zero_partition_count": edp if f == "routed_expert" else dp}
    out["param_families"] = fams
    return out


def expert_record(tp: int, t: int, ep: int, e: int, edp: int) -> dict[str, Any]:
    """``layer_L_expert_X_mp_rank_TT_model_states.pt``'s record: written by EDP rank 0 of EP rank
    ``e``, TP rank ``t``."""
    return _base(tp, t, ep, e, "edp", 0, edp, "routed_expert")


def _same(path: Any, got: Any, want: Mapping[str, Any]) -> None:
    if not isinstance(got, Mapping):
        raise CheckpointError(f"{path}: no '{KEY}' record, which DeepSpeed writes into every file of a folded "
                              "AutoEP x AutoTP checkpoint (and checks on load)")
    at = _difference(want, got, KEY)
    if at is not None:
        raise CheckpointError(f"{path}: {at[0]} is {at[1]!r}, DeepSpeed's folded load expects {at[2]!r}")


def _difference(want: Any, got: Any, at: str) -> tuple[str, Any, Any] | None:
    """(path, got, want) of the first difference (a parameter name's dots kept in the path)."""
    if isinstance(want, Mapping) and isinstance(got, Mapping):
        for k in [*want, *(k for k in got if k not in want)]:
            found = _difference(want.get(k), got.get(k), f"{at}.{k}")
            if found is not None:
                return found
        return None
    return None if type(want) is type(got) and want == got else (at, got, want)


def replicated_entry(shape: Iterable[int], tp: int) -> dict[str, Any]:
    """``universal_checkpoint_info.affine_map``'s entry of an expert parameter under folding: AutoTP
    records it TP-replicated at its EP-local shape, one row-major piece held by every TP rank."""
    shape = [int(n) for n in shape]
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return {"logical_shape": shape, "ranks": {t: {"shard_shape": list(shape), "pieces": [
        {"shape": list(shape), "source": [0, list(strides)], "dest": [0, list(strides)], "locations": list(range(tp))}]}
        for t in range(tp)}}


def folded_info(info: Mapping[str, Any] | None, experts: Mapping[str, ParamMap], tp: int) -> dict:
    """The ``universal_checkpoint_info`` DeepSpeed records at TP ``tp`` (``info``: AutoTP's, from a
    folded checkpoint at that TP) with each fused expert's ``affine_map`` entry (``experts``: their
    placement maps) at the target's EP-local shape, TP-replicated, as AutoTP records it."""
    uc = dict(info or {})
    affine = uc.get("affine_map")
    if isinstance(affine, Mapping) and isinstance(affine.get("params"), Mapping):
        params = dict(affine["params"])
        for n, m in experts.items():
            if f"^{re.escape(n)}$" in params:
                params[f"^{re.escape(n)}$"] = replicated_entry(m.shards[0].shape, tp)
        uc["affine_map"] = {**affine, "params": params}
    return uc


def expert_writers(tp: int, ep: int, world: int) -> dict[tuple[int, int], list[int]]:
    """``(EP rank, TP rank) -> EDP ranks`` of the ranks that write that pair's per-expert files
    (``layer_L_expert_X_mp_rank_TT``): under folding every rank of dense DP rank ``< ep`` writes its EP
    rank's experts, named by its TP rank (``engine._save_moe_checkpoint``), so a pair written by
    several holds the EDP rank of whichever wrote last; a folded load does not check that field."""
    out: dict[tuple[int, int], list[int]] = {}
    for g in range(world):
        if g // tp < ep:
            out.setdefault((g % ep, g % tp), []).append(g // ep)
    return out


def check(ck: Any, ax: Any) -> None:
    """Every file's record equals what DeepSpeed writes at this topology (``ck.tp``, ``ck.dp``,
    ``ax``'s EP placement): the model states, the optimizer files and the per-expert files."""
    tp, dp, ep, edp = ck.tp, ck.dp, ax.ep, ax.edp
    z3 = ck.zero_stage == 3  # every (TP, DP) rank writes its model states, its optimizer record has no families
    for t, d in ((t, d) for t in range(tp) for d in range(dp if z3 else 1)):
        path = ck.z3_model_files[(t, d)] if z3 else ck.model_files[t]
        state = ck.model_state(t) if d == 0 else load(path)
        want = model_record(tp, t, ep, (d * tp + t) % ep, dp, state.get("module") or {}, d)
        _same(path, state.get(KEY), want)
    names = None if z3 else [list(g) for g in ck.groups(0)]
    for (t, d), path in sorted(ck.optim_files.items()):
        g = d * tp + t
        e = g % ep
        want = optim_record(tp, t, ep, e, dp, d, edp, ax.members(e).index(g), names)
        _same(path, ck.optim_state(t, d).get(KEY), want)


def check_expert_file(path: Any, state: Mapping, ck: Any, ax: Any, e: int, t: int) -> None:
    """A per-expert file of EP rank ``e`` named by TP rank ``t``: its record that of one of its writers."""
    want = expert_record(ck.tp, t, ax.ep, e, ax.edp)
    got = state.get(KEY)
    q = got.get("zero_partition_rank") if isinstance(got, Mapping) else None
    if q in expert_writers(ck.tp, ax.ep, ck.tp * ck.dp).get((e, t), []):
        want["zero_partition_rank"] = q
    _same(path, got, want)


def check_layers(ck: Any, ax: Any) -> None:
    """Every TP rank's model state records the same experts: ``param_shapes`` alike, and
    ``ds_autoep_layers`` that of rank 0 but for the writing rank's own fields (its EP rank: that
    of global rank ``t``, DP rank 0)."""
    base = ck.model_state(0).get("ds_autoep_layers") or []
    expert_groups = [k for k in sorted(ax.groups)]
    for t in range(1, ck.mp):
        state, path = ck.model_state(t), ck.model_files[t]
        for k in expert_groups:
            if list(ck.groups(t)[k].items()) != list(ck.groups(0)[k].items()):
                raise CheckpointError(f"{path}: param_shapes group {k} (experts) differs from "
                                      f"{ck.model_files[0].name}'s: every TP rank holds its EP rank's experts whole")
        layers = state.get("ds_autoep_layers")
        if not isinstance(layers, list) or len(layers) != len(base):
            raise CheckpointError(f"{path}: ds_autoep_layers has {len(layers) if isinstance(layers, list) else layers!r}"
                                  f" entries, {ck.model_files[0].name} {len(base)}")
        for i, (x, y) in enumerate(zip(base, layers)):
            if not isinstance(y, Mapping):
                raise CheckpointError(f"{path}: ds_autoep_layers[{i}] is {type(y).__name__}, not a dict")
            a = {k: v for k, v in x.items() if k not in LAYER_RANK_FIELDS}
            b = {k: v for k, v in y.items() if k not in LAYER_RANK_FIELDS}
            at = first_difference(a, b, f"ds_autoep_layers[{i}]")
            if at is not None:
                raise CheckpointError(f"{path}: {at} disagrees with {ck.model_files[0].name}'s")
            if y.get("ep_rank") != t % ax.ep:
                raise CheckpointError(f"{path}: ds_autoep_layers[{i}].ep_rank is {y.get('ep_rank')!r}, but TP rank {t} "
                                      f"(global rank {t}) is EP rank {t % ax.ep} under DeepSpeed's folding")
