"""DeepSpeed 0.19.8 ZeRO-3 checkpoint files, at TP=1 or under AutoTP, read and written as DeepSpeed
itself saves them: the source checked for ``reshard reshard``, the sub-group layout at any DP
size, the dictionaries of the two files each (TP, DP) rank writes (with :class:`AttrTensorRef` for
a streamed flat group's ``ds_id``), and a ZeRO-1/2 file's dictionaries recast for ZeRO-3 and back
(the optimizer's loss scaler, flags, hyper-parameters and ``step`` are the same objects in both).
No tensor data is moved here (the engine, ``reshard.jobs.engine``, does that). What DeepSpeed does, read from
``deepspeed/runtime/zero/stage3.py`` and ``runtime/engine.py`` and checked against checkpoints it
saved (docs/deepspeed-checkpoints.md, sections 10 and 10.1). Under AutoTP every TP rank ``TT``
writes this layout over its own TP shards (``zero_pp_rank_D_mp_rank_TT_*``, the shard shapes in
``param_shapes``, ``universal_checkpoint_info`` last in the model states):

* **Per-parameter partitions.** Every trainable parameter is flattened, zero-padded to
  ``ceil(numel / dp) * dp`` and cut into ``dp`` equal partitions; DP rank ``d`` holds partition
  ``d`` (the padding sits at the end of the last ranks' partitions).
* **Sub-groups.** Each optimizer parameter group is cut, in order, into sub-groups: parameters
  are added until their partitions reach ``zero_optimization.sub_group_size`` elements (default
  1e9), so the cut depends on the DP size (``_create_fp16_sub_groups``). A sub-group's partitions
  lie end to end in one flat tensor, ``fp32_flat_groups[k]``; the torch optimizer sees one
  parameter per sub-group, numbered in group order, so its ``state[k]`` holds that sub-group's
  ``exp_avg`` / ``exp_avg_sq`` over the same flat range, and ``param_groups[g]['params']`` lists
  the sub-groups of group ``g``. The model states' ``param_shapes`` has one ``OrderedDict`` per
  sub-group (full shapes).
* **Files.** Every DP rank writes ``zero_pp_rank_D_mp_rank_00_model_states.pt`` (``module`` holds
  0-element placeholders, the same on every rank; ``shared_params`` is filled on rank 0 only) and
  ``[bf16_]zero_pp_rank_D_mp_rank_00_optim_states.pt``. Each ``fp32_flat_groups[k]`` carries the
  attribute ``ds_id = "<first>_<last>"`` (the ``ds_id`` of its first and last parameter) and
  ``requires_grad``, and owns its storage: ``_create_fp32_partitions`` means to reuse the flat
  low-precision buffer (one storage for all sub-groups) under fp32 training, but its test compares
  a ``torch.device`` with a device *name* string, which is never equal, so it always copies.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.piece import prod
from ...layouts.zero import zero3_partition_numel
from ...storage.safe_load import ZeroStageEnum, load
from ...storage.torch_zip import Storage, TensorRef
from .experts import AutoEP, module_ds_ids
from .module_entries import check_module_entries
from .recorded import Recorded
from .zero12 import with_config

__all__ = ["AttrTensorRef", "SubGroup", "autoep", "autoep_ds_ids", "autoep_groups", "check", "check_partitions",
           "ds_ids", "model_file", "model_states", "model_template_from_zero12", "optim_file", "optim_groups",
           "optim_source_from_zero3", "optim_source_from_zero12", "optim_states", "sub_group_lists", "sub_groups"]

STATES = ("fp32", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size, DeepSpeed 0.19.8's default
# Keys of a ZeRO-3 optimizer_state_dict, in the order DeepSpeed 0.19.8 writes them. Anything else
# ('ds_zero_partition_groups' of AutoEP, ...) is refused rather than copied unexamined.
OSD_KEYS = ("zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "partition_count",
            "optimizer_state_dict", "fp32_flat_groups")
OPTIM_FILE_KEYS = ("optimizer_state_dict", "ds_config", "ds_version")


def model_file(d: int, t: int = 0) -> str:
    """(DP rank ``d``, TP rank ``t``)'s model-state file."""
    return f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt"


def optim_file(d: int, *, bf16: bool = False, t: int = 0) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"


class AttrTensorRef(TensorRef):
    """A ``torch_zip`` placeholder tensor that also carries Python attributes, pickled as torch
    pickles a tensor with a ``__dict__`` (``torch._tensor._rebuild_from_type_v2``): a streamed
    ``fp32_flat_groups[k]`` with its ``ds_id``."""

    __slots__ = ("attrs",)

    def __init__(self, storage: Storage, shape: Sequence[int], *, attrs: Mapping[str, Any],
                 requires_grad: bool = False) -> None:
        super().__init__(storage, shape, requires_grad=requires_grad)
        self.attrs = dict(attrs)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        rebuild, args = super().__reduce_ex__(protocol)
        return torch._tensor._rebuild_from_type_v2, (rebuild, torch.Tensor, args, dict(self.attrs))


@dataclass(frozen=True, slots=True)
class SubGroup:
    """One sub-group at one DP size: its parameters (model order) and where each one's
    partition sits in the sub-group's flat tensor."""

    group: int  # the optimizer parameter group it belongs to
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dp: int

    @property
    def partitions(self) -> tuple[int, ...]:
        return tuple(zero3_partition_numel(prod(s), self.dp) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, off = [], 0
        for p in self.partitions:
            out.append(off)
            off += p
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.partitions)


def sub_groups(groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]], dp: int | Sequence[int],
               size: int) -> list[SubGroup]:
    """DeepSpeed 0.19.8's ``_create_fp16_sub_groups`` over every parameter group at DP=``dp`` (or
    group ``g`` over ``dp[g]`` ranks: an AutoEP expert group over its EDP group): a group whose
    partitions total at most ``size`` stays whole; otherwise parameters are added until the
    running total reaches ``size``, and the last parameter closes the final one."""
    out: list[SubGroup] = []
    for g, params in enumerate(groups):
        n = dp if isinstance(dp, int) else dp[g]
        parts = [zero3_partition_numel(prod(s), n) for _, s in params]
        if size >= sum(parts):
            cuts = [list(params)]
        else:
            cuts, cur, run = [], [], 0
            for i, (p, part) in enumerate(zip(params, parts)):
                cur.append(p)
                run += part
                if run >= size or i == len(params) - 1:
                    cuts.append(cur)
                    cur, run = [], 0
        for cut in cuts:
            out.append(SubGroup(g, tuple(name for name, _ in cut), tuple(tuple(s) for _, s in cut), n))
    return out


def check_cut(subs: Sequence[SubGroup], recorded: Sequence[Mapping[str, Any]], size: int, where: Any) -> None:
    """Refuse a ZeRO-3 source whose recorded sub-groups (``param_shapes``) are not the ones
    DeepSpeed 0.19.8's rule cuts (:func:`sub_groups`, ``subs``): every later step relies on it."""
    if [sg.names for sg in subs] != [tuple(sg) for sg in recorded]:
        raise CheckpointError(f"{where}: param_shapes records sub-groups of sizes {[len(sg) for sg in recorded]}, "
                              f"DeepSpeed 0.19.8's rule (sub_group_size {size}) gives {[len(sg.names) for sg in subs]}: "
                              "an unknown layout")


def sub_group_lists(ck: Recorded, t: int, n_sub: int) -> list[list[int]]:
    """The sub-groups each parameter group of TP rank ``t`` holds, from the torch optimizer's
    ``param_groups``, whose ``params`` must number the ``n_sub`` sub-groups in order
    (DeepSpeed's bookkeeping)."""
    path = ck.optim_files[(t, 0)]
    try:
        lists = [list(pg["params"]) for pg in ck.osd(t, 0)["optimizer_state_dict"]["param_groups"]]
    except (KeyError, TypeError):
        raise CheckpointError(f"{path}: optimizer_state_dict has no torch param_groups") from None
    if [i for lst in lists for i in lst] != list(range(n_sub)) or any(not lst for lst in lists):
        raise CheckpointError(f"{path}: param_groups number the sub-groups {lists}, expected "
                              f"0..{n_sub - 1} in order, each group non-empty: an unknown layout")
    return lists


def optim_groups(ck: Recorded) -> list[list[str]]:
    """The optimizer's parameter groups (names, in flat order): TP rank 0's recorded sub-groups
    joined as ``param_groups`` numbers them (:func:`sub_group_lists`)."""
    shapes = ck.groups(0)
    return [[n for k in lst for n in shapes[k]] for lst in sub_group_lists(ck, 0, len(shapes))]


def ds_ids(ck: Recorded) -> tuple[dict[str, int], bool]:
    """Each parameter's ``ds_id``, where the source's ``"<first>_<last>"`` names tell it: a
    sub-group of n parameters numbered ``first .. first + n - 1`` (DeepSpeed numbers them in
    model order; every TP rank alike). Where they do not (param groups out of model order), the
    numbering is a guess; DeepSpeed's loader does not read ``ds_id``."""
    out, exact = {}, True
    flats = ck.osd(0, 0)["fp32_flat_groups"]
    base = 0
    for sg, t in zip(ck.groups(0), flats):
        names = list(sg)
        rng = _ds_id_range(t)
        if rng is None or rng[1] - rng[0] + 1 != len(names):
            exact = False
        first = rng[0] if rng is not None else base
        for i, n in enumerate(names):
            out[n] = first + i
        base = first + len(names)
    return out, exact


def autoep(ck: Recorded) -> AutoEP:
    """The source's AutoEP experts (refused where it has none)."""
    if ck.experts is None:
        raise CheckpointError(f"{ck.tag_dir}: not an AutoEP checkpoint")
    return ck.experts


def autoep_groups(ck: Recorded) -> tuple[list[list[str]], set[int], int]:
    """An AutoEP ZeRO-3 source's optimizer parameter groups (:func:`optim_groups`), which of them
    hold experts (a group is all expert or all dense sub-groups: ``layout.check_sub``), and
    ``sub_group_size``."""
    ax, group_names = autoep(ck), optim_groups(ck)
    size = sub_group_size(ck.model_state(0).get("ds_config"), str(ck.model_files[0]))
    return group_names, {g for g, names in enumerate(group_names) if names[0] in ax.params}, size


def autoep_ds_ids(ck: Recorded, names: list[str]) -> tuple[dict[str, int], bool]:
    """Each parameter's ``ds_id`` in the order ``experts.module_ds_ids`` derives (experts after
    their router), checked against the ``"<first>_<last>"`` ids of an AutoEP source's flat groups."""
    ids, exact = module_ds_ids(list(ck.model_state(0).get("module") or {}), autoep(ck), names)
    flats = ck.osd(0, 0)["fp32_flat_groups"]
    for k, sg in enumerate(ck.groups(0)):
        got = str(getattr(flats[k], "ds_id", ""))
        if got != f"{ids[next(iter(sg))]}_{ids[list(sg)[-1]]}":
            exact = False
    return ids, exact


def _zero_config(cfg: Any) -> dict:
    zo = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    return zo if isinstance(zo, dict) else {}


def sub_group_size(cfg: Any, where: str) -> int:
    """``zero_optimization.sub_group_size`` of a ds_config (DeepSpeed's default when unset)."""
    value = _zero_config(cfg).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where}: ds_config zero_optimization.sub_group_size {value!r} is not a "
                              "non-negative integer")
    return value


def _ds_id_range(t: torch.Tensor) -> tuple[int, int] | None:
    raw = getattr(t, "ds_id", None)
    try:
        a, b = str(raw).split("_")
        return int(a), int(b)
    except ValueError:
        return None


def check(ck: Recorded,
          check_sub: Callable[[Recorded], Mapping[tuple[int, int], Sequence[SubGroup]]]) -> bool:
    """A ZeRO-3 checkpoint (TP=1, or AutoTP at any TP degree; no pipeline) as ``reshard reshard``
    reads it: per TP rank its recorded sub-groups (of TP shards), the same in every DP rank's file,
    checked against DeepSpeed 0.19.8's layout rule (``check_sub``: the one ZeRO-3 sub-group check,
    ``layout.check_sub``, passed in because layout builds on this module) and every file's sizes
    against the sub-groups it returns, before anything is written. Every TP rank holds the same
    parameters in the same groups; only their shard shapes differ. Returns whether Adam moments
    are present."""
    if ck.zero_stage != 3:
        raise CheckpointError(f"{ck.tag_dir}: ZeRO stage {ck.zero_stage}, not 3")
    if ck.pp != 1:
        raise CheckpointError(f"{ck.tag_dir}: ZeRO-3 with PP={ck.pp} is not supported (no pipeline)")
    template = ck.model_state(0)
    where0 = ck.model_files[0]
    for key in ("num_experts", "ds_autoep_layers"):
        if template.get(key):
            raise CheckpointError(f"{where0}: mixture-of-experts checkpoints are not supported")
    cfg = template.get("ds_config")
    zo = _zero_config(cfg)
    if zo.get("mics_shard_size", -1) not in (-1, 0, None) or zo.get("elastic_checkpoint"):
        raise CheckpointError(f"{where0}: MiCS or elastic ZeRO-3 checkpoints are not supported")
    sub_group_size(cfg, str(where0))
    for t in range(ck.tp):
        _recorded_sub_groups(ck, t)
    has_moments = check_partitions(ck, check_sub(ck))
    _check_module(ck, [n for sg in ck.groups(0) for n in sg] + list(ck.frozen.shapes))
    ck.check_steps()
    return has_moments


def _recorded_sub_groups(ck: Recorded, t: int) -> list[OrderedDict]:
    """TP rank ``t``'s ``param_shapes``: one ``OrderedDict`` of shard shapes per sub-group,
    the same in every DP rank's file."""
    out = None
    for d in range(ck.dp):
        path = ck.z3_model_files[(t, d)]
        ms = ck.model_state(t) if d == 0 else _as_dict(load(path), path)
        shapes = ms.get("param_shapes")
        shapes = shapes if isinstance(shapes, list) else [shapes]
        if not all(isinstance(sg, dict) for sg in shapes):
            raise CheckpointError(f"{path}: param_shapes is not a list of name -> shape dicts")
        groups = [OrderedDict((n, tuple(int(x) for x in s)) for n, s in sg.items()) for sg in shapes]
        if out is None:
            out = groups
        elif groups != out:
            raise CheckpointError(f"{path}: param_shapes differ from DP rank 0's")
    if out is None:  # a check, not an assert: it must hold under python -O too
        raise CheckpointError(f"{ck.model_files[t]}: no DP rank's model states at TP rank {t}")
    seen: set[str] = set()
    for sg in out:
        dup = next((n for n in sg if n in seen), None)
        if dup is not None:
            raise CheckpointError(f"{ck.model_files[t]}: {dup!r} is in two sub-groups of param_shapes")
        seen.update(sg)
    return out


def check_partitions(ck: Recorded, units: Mapping[tuple[int, int], Sequence[SubGroup]]) -> bool:
    """Every rank's file: known keys, ``partition_count``, sub-group count, state keys, and each
    flat tensor exactly as long as its sub-groups (``units[(t, d)]``, ``layout.check_sub``) say (a
    truncated one is named by file, rank and the first parameter it cuts off). Returns whether
    Adam moments are present."""
    # AutoEP records each sub-group's partition group besides (checked by experts.read)
    known = OSD_KEYS + (("ds_zero_partition_groups",) if ck.experts is not None else ())
    moments: set[bool] = set()
    for t, d in ((t, d) for t in range(ck.tp) for d in range(ck.dp)):
        subs = units[(t, d)]
        path = ck.optim_files[(t, d)]
        top = ck.optim_state(t, d)
        osd = ck.osd(t, d)
        folded = ck.experts is not None and ck.experts.folded  # its "folding" record: folding.check
        unknown = [k for k in top if k not in OPTIM_FILE_KEYS and not (folded and k == "folding")] + \
            [k for k in osd if k not in known]
        if unknown:
            raise CheckpointError(f"{path}: unknown entries {unknown[:3]} (AutoEP or another layout); "
                                  "not supported")
        if osd.get("partition_count") != ck.dp:
            raise CheckpointError(f"{path}: partition_count {osd.get('partition_count')!r}, the files "
                                  f"say DP={ck.dp}")
        flats = osd.get("fp32_flat_groups")
        inner = osd.get("optimizer_state_dict")
        state = inner.get("state") if isinstance(inner, dict) else None
        if not isinstance(flats, list) or len(flats) != len(subs) or not isinstance(state, dict):
            raise CheckpointError(f"{path}: expected {len(subs)} fp32_flat_groups and a torch "
                                  "optimizer state, one per sub-group")
        rank = f"dp rank {d}" if ck.tp == 1 else f"tp rank {t}, dp rank {d}"
        for k, sg in enumerate(subs):
            entry = state.get(k, {})
            extra = [key for key in entry if key not in ("step", *MOMENTS)]
            if extra:
                raise CheckpointError(f"{path}: optimizer state {extra[0]!r} of sub-group {k} is not "
                                      "known to move with its parameters (only step, exp_avg, "
                                      "exp_avg_sq)")
            moments.add(all(m in entry for m in MOMENTS))
            _check_length(path, rank, sg, k, "fp32", flats[k])
            for m in MOMENTS:
                if m in entry:
                    _check_length(path, rank, sg, k, m, entry[m])
    if len(moments) > 1:
        raise CheckpointError(f"{ck.tag_dir}: some sub-groups have Adam moments and others not")
    return moments == {True}


def _check_length(path: Any, rank: str, sg: SubGroup, k: int, state: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
        raise CheckpointError(f"{path}: {rank}: {state} of sub-group {k} is not a 1-D float32 tensor")
    n = x.numel()
    if n == sg.numel:
        return
    if n > sg.numel:
        raise CheckpointError(f"{path}: {rank}: the {state} partition of sub-group {k} has {n} "
                              f"elements, DeepSpeed's layout of its {len(sg.names)} parameters "
                              f"{sg.numel}: not the recorded parameters")
    i = next(i for i, (o, p) in enumerate(zip(sg.offsets, sg.partitions)) if o + p > n)
    lo = sg.offsets[i]
    raise CheckpointError(f"{path}: {rank}: parameter {sg.names[i]!r} ({state}, elements "
                          f"[{lo}, {lo + sg.partitions[i]}) of sub-group {k}) lies past the end of the "
                          f"partition, which has {n} of {sg.numel} elements: truncated or corrupt")


def _check_module(ck: Recorded, names: Sequence[str]) -> None:
    for t in range(ck.tp):
        check_module_entries(ck.model_files[t], ck.model_state(t), names, rank0=ck.model_state(0))


def _as_dict(x: Any, path: Any) -> dict:
    if not isinstance(x, dict):
        raise CheckpointError(f"{path}: expected a dict at the top level, got {type(x).__name__}")
    return x


# -- dictionaries ----------------------------------------------------------------------------------


def model_states(template: Mapping[str, Any], *, subs: Sequence[SubGroup], d: int, dp: int,
                 ds_config: dict | None, t: int = 0, tp: int = 1, uc_info: dict | None = None) -> dict:
    """(TP rank ``t``, DP rank ``d``)'s ``zero_pp_rank_D_mp_rank_TT_model_states.pt`` dict: the
    source's keys in the source's order (placeholder ``module``, buffers, client state), the
    topology-dependent ones replaced, and under AutoTP (``uc_info``) the
    ``universal_checkpoint_info`` last, as DeepSpeed saves it (the same on every rank)."""
    out: dict[str, Any] = {k: v for k, v in template.items() if k != "universal_checkpoint_info"}
    out["param_shapes"] = [OrderedDict((n, torch.Size(s)) for n, s in zip(sg.names, sg.shapes))
                           for sg in subs]
    # DeepSpeed fills shared_params on global rank 0 only
    out["shared_params"] = dict(template.get("shared_params") or {}) if d == 0 and t == 0 else {}
    out["dp_world_size"] = dp
    out["mp_world_size"] = tp
    if "checkpoint_parallel_dimensions" in out:
        out["checkpoint_parallel_dimensions"] = {**(out["checkpoint_parallel_dimensions"] or {}),
                                                 "pp_degree": 1, "tp_degree": tp}
    return with_config(out, ds_config, uc_info)


def optim_states(source: Mapping[str, Any], *, subs: Sequence[SubGroup], dp: int,
                 fp32: Sequence[torch.Tensor | Storage],
                 moments: Sequence[Mapping[str, torch.Tensor | TensorRef]] | None,
                 ds_ids: Mapping[str, int], ds_config: dict | None) -> dict:
    """One ``zero_pp_rank_D_mp_rank_00_optim_states.pt`` dict built on a source optimizer file's
    dict (its key order, loss scaler, hyper-parameters and ``step``). ``fp32[k]`` and
    ``moments[k]`` are sub-group ``k``'s whole flat partitions (padding zero): tensors, or for
    ``torch_zip.save`` a :class:`~reshard.storage.torch_zip.Storage` and views of one."""
    src = source["optimizer_state_dict"]
    inner = src["optimizer_state_dict"]
    step_state = inner["state"].get(0, {})
    state = {}
    for k in range(len(subs)):
        if moments is None:
            continue
        entry = {}
        for key, value in step_state.items():
            entry[key] = (value.clone() if isinstance(value, torch.Tensor) else value) if key == "step" \
                else moments[k][key]
        state[k] = entry
    param_groups = []
    for g, pg in enumerate(inner["param_groups"]):
        pg = copy.deepcopy({k: v for k, v in pg.items() if k != "params"})
        pg["params"] = [k for k, sg in enumerate(subs) if sg.group == g]
        param_groups.append(pg)
    flats = []
    for sg, t in zip(subs, fp32):
        ds_id = f"{ds_ids[sg.names[0]]}_{ds_ids[sg.names[-1]]}"
        if isinstance(t, Storage):  # a placeholder the streamed writer fills
            flats.append(AttrTensorRef(t, (t.numel,), attrs={"ds_id": ds_id}, requires_grad=True))
            continue
        t = t.detach().requires_grad_(True)  # as DeepSpeed's master partitions (the file records it)
        t.ds_id = ds_id  # type: ignore[attr-defined]  # DeepSpeed's own attribute
        flats.append(t)
    osd: dict[str, Any] = {}
    for key, value in src.items():
        osd[key] = value
    osd["zero_stage"] = ZeroStageEnum(3)
    osd["partition_count"] = dp
    osd["optimizer_state_dict"] = {"state": state, "param_groups": param_groups}
    osd["fp32_flat_groups"] = flats
    out: dict[str, Any] = dict(source)
    out["optimizer_state_dict"] = osd
    if "ds_config" in out:
        out["ds_config"] = ds_config
    return out


# -- another ZeRO stage's dictionaries, recast ---------------------------------------------------------


def _replace(source: Mapping[str, Any], key: str, value: Any) -> dict:
    return {k: (value if k == key else v) for k, v in source.items()}


def optim_source_from_zero12(source: Mapping[str, Any]) -> dict:
    """A ZeRO-1/2 optimizer file's dict recast as the ZeRO-3 one :func:`optim_states` builds on:
    the same loss scaler, flags, torch hyper-parameters and ``step`` (the layout-dependent entries
    are filled in there)."""
    src = source["optimizer_state_dict"]
    base = src["base_optimizer_state"]
    osd = {"zero_stage": ZeroStageEnum(3), "loss_scaler": src.get("loss_scaler"),
           "dynamic_loss_scale": src.get("dynamic_loss_scale"), "overflow": src.get("overflow"),
           "partition_count": None,
           "optimizer_state_dict": {"state": {0: dict(base["state"].get(0, {}))},
                                    "param_groups": base["param_groups"]},
           "fp32_flat_groups": []}
    return _replace(source, "optimizer_state_dict", osd)


def optim_source_from_zero3(source: Mapping[str, Any], *, clip_grad: Any) -> dict:
    """A ZeRO-3 optimizer file's dict recast as the ZeRO-1/2 one ``deepspeed_writer.optim_states``
    builds on (``deepspeed_writer.OSD_KEYS`` order): one torch parameter per parameter group, each
    with sub-group 0's ``step``; ``clip_grad`` is the engine's ``gradient_clipping``, which only a
    ZeRO-1/2 file records."""
    src = source["optimizer_state_dict"]
    inner = src["optimizer_state_dict"]
    groups = inner["param_groups"]
    state0 = dict(inner["state"].get(0, {}))
    base = {"state": {g: state0 for g in range(len(groups))} if state0 else {},
            "param_groups": [{**{k: v for k, v in pg.items() if k != "params"}, "params": [g]}
                             for g, pg in enumerate(groups)]}
    osd = {"loss_scaler": src.get("loss_scaler"), "dynamic_loss_scale": src.get("dynamic_loss_scale"),
           "overflow": src.get("overflow"), "clip_grad": clip_grad, "base_optimizer_state": base,
           "single_partition_of_fp32_groups": [], "zero_stage": None, "group_paddings": [],
           "param_alignment_paddings": [], "partition_count": [], "ds_version": source.get("ds_version"),
           "param_slice_mappings": []}
    return _replace(source, "optimizer_state_dict", osd)


def model_template_from_zero12(ms: Mapping[str, Any], *, params: Sequence[str], shared: Mapping[str, str],
                               dtype: torch.dtype) -> dict:
    """A ZeRO-1/2 ``mp_rank_00_model_states.pt`` dict recast as the ZeRO-3 template
    :func:`model_states` builds on: every parameter a 0-element placeholder of the training dtype
    (a tied alias the same one as its parameter), buffers whole (AutoTP leaves them whole on every
    TP rank), the frozen-parameter records empty ``OrderedDict`` s; the topology and AutoTP
    metadata are set there."""
    wanted = set(params)
    module: OrderedDict = OrderedDict()
    for key, value in (ms.get("module") or {}).items():
        module[key] = torch.empty(0, dtype=dtype) if key in wanted else value
    for alias, canonical in shared.items():
        if alias in module and canonical in module:
            module[alias] = module[canonical]
    out = {k: v for k, v in ms.items() if k != "universal_checkpoint_info"}
    out["module"] = module
    out["frozen_param_shapes"] = OrderedDict()
    out["frozen_param_fragments"] = OrderedDict()
    return out
