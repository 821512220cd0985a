"""What every route checks of a DeepSpeed checkpoint's tensors before any output exists
(``DeepSpeedReader.check``), beside the layout rules of ``zero12``, ``zero3``, ``experts`` and
``moe``: a flat partition or a moment of another dtype, rank or length is refused, never cast or
reshaped on the way.

* **ZeRO-1/2 partitions**, every group of every optimizer file (dense, pipeline stages, AutoEP and
  classic MoE expert groups alike): ``single_partition_of_fp32_groups[g]`` is a 1-D float32 tensor;
  each Adam moment of the group a 1-D float32 tensor of that length plus ``group_paddings[g]``
  (torch's optimizer keeps the partition's padding); every fragment of ``param_slice_mappings[g]``
  lies inside the partition; the DP ranks that share a partitioning hold partitions of one size.
* **Module weights**: every optimized parameter's tensor in its model-parallel rank's file (or its
  pipeline layer file) has exactly the shape ``param_shapes`` records, in the training dtype.
* **Recorded maps**: every model-state file records the TP maps of model-parallel rank 0's, the
  file they are read from (and checked as they are lowered: ``lowering.lower_affine_map``).
* **Per-expert files** (AutoEP at ZeRO-1/2, classic MoE): each holds exactly its expert's
  parameters under their global names, each of the recorded shape, in the training dtype; they
  are copied as they are by ``reshard``, so they are checked even where a route reads none of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import CheckpointError
from ...storage.safe_load import load
from .folding import KEY, check_expert_file, expert_writers
from .recorded import first_difference

__all__ = ["check_expert_files", "check_keys", "check_module_weights", "check_partitions", "check_recorded_maps",
           "check_step", "first_difference"]

MOMENTS = ("exp_avg", "exp_avg_sq")
# what DeepSpeed 0.19.8's save_checkpoint writes into every model-state file (client state comes beside)
# (but ``global_samples``, which its loader derives from global_steps x the train batch size when absent, and
# which reshard's fresh DeepSpeed targets leave out: the source records no batch size)
MODEL_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
              "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
              "dp_world_size", "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions")
OPTIM_FILE_KEYS = ("optimizer_state_dict", "ds_config", "ds_version")
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def _get(d: Any, key: Any, where: Any, what: str) -> Any:
    try:
        return d[key]
    except (KeyError, IndexError, TypeError):
        raise CheckpointError(f"{where}: missing {what} (not a DeepSpeed 0.19.8 file, or an unknown layout)") from None


def _flat(x: Any, n: int | None, where: Any, what: str) -> int:
    """``x`` must be a 1-D float32 tensor (of ``n`` elements, where given); returns its length."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
        got = f"a {x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise CheckpointError(f"{where}: {what} is {got}, not a 1-D float32 tensor: not DeepSpeed's layout "
                              "(refused, not cast)")
    if n is not None and x.numel() != n:
        raise CheckpointError(f"{where}: {what} has {x.numel()} elements, the partition {n}: truncated or not the "
                              "recorded layout")
    return x.numel()


def param_groups(state: Mapping, path: Any) -> list[dict[str, tuple[int, ...]]]:
    """A model-state file's ``param_shapes``: per parameter group (ZeRO-3: per sub-group)
    ``{name: shape}`` in the recorded order, every shape checked. The one reading of the entry
    (``DeepSpeedCheckpoint.groups`` keeps each model-parallel rank's)."""
    groups = state.get("param_shapes") if isinstance(state, Mapping) else None
    groups = groups if isinstance(groups, list) else [groups]
    if not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointError(f"{path}: param_shapes is not a list of {{name: shape}} groups")
    return [{n: shape_of(s, n, path) for n, s in g.items()} for g in groups]


def shape_of(value: Any, name: Any, where: Any) -> tuple[int, ...]:
    """A ``param_shapes`` entry as a shape: a sequence of non-negative Python ints (``torch.Size``)."""
    ok = isinstance(name, str) and isinstance(value, (tuple, list)) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    if not ok:
        raise CheckpointError(f"{where}: param_shapes entry {name!r} is {value!r:.80}, not a parameter name and shape")
    return tuple(value)


def check_z3_model_files(ck: Any) -> None:
    """Under ZeRO-3 every DP rank writes its own model-state file; each must hold the module
    placeholders and parameter records of DP rank 0's (some routes copy them as they are)."""
    for (t, d), path in sorted(ck.z3_model_files.items()):
        if not d:
            continue
        ref, got = ck.model_state(t), ck.model_state_at(path)
        for key in ("module", "buffer_names", "frozen_param_shapes"):
            a, b = ref.get(key), got.get(key)
            if key == "module" and isinstance(a, Mapping) and isinstance(b, Mapping):
                a = {k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v) for k, v in a.items()}
                b = {k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v) for k, v in b.items()}
            if a != b:
                raise CheckpointError(f"{path}: its {key} differs from DP rank 0's ({ck.model_files[t].name}): every "
                                      "DP rank's model-state file records the same")


def check_recorded_maps(ck: Any, names: list[str]) -> None:
    """Every model-state file records the TP maps (``universal_checkpoint_info.affine_map``) of
    the file they are read from (model-parallel rank 0's): each rank writes the whole group's
    description, and some routes copy the files as they are. The maps read are checked first, as
    they are lowered (``lowering.lower_affine_map``), so a damaged one is named where it is."""
    ref_path = ck.model_files[0]
    ref = _affine_map(ck.model_state(0))
    if ref is not None:
        for name in names:
            ck.tp_map(name)
    for path in sorted({*ck.model_files.values(), *ck.z3_model_files.values()}):
        if path == ref_path:
            continue
        at = first_difference(ref, _affine_map(ck.model_state_at(path)), "universal_checkpoint_info.affine_map")
        if at is not None:
            raise CheckpointError(f"{path}: {at} disagrees with {ref_path.name}'s: every rank records the same "
                                  "maps")


def _affine_map(state: Mapping) -> Any:
    info = state.get("universal_checkpoint_info")
    return info.get("affine_map") if isinstance(info, Mapping) else None


def check_keys(ck: Any, osd_keys: tuple[str, ...]) -> None:
    """Every model-state file holds what DeepSpeed 0.19.8 always writes; every optimizer file
    exactly its entries (``osd_keys``: its stage's ``optimizer_state_dict``; a file missing one,
    or holding another, is not one DeepSpeed wrote, and some routes copy or rewrite it: refused by
    all)."""
    # with experts (classic MoE, AutoEP) DeepSpeed 0.19.8 also writes ds_autoep_layers (None for classic MoE)
    experts = ck.moe is not None or ck.experts is not None
    want = MODEL_KEYS + (("ds_autoep_layers", "num_experts") if experts else ())
    base: tuple[Any, Any] | None = None  # (file, num_experts): one stage's files all hold the same
    for path in sorted({*ck.model_files.values(), *ck.z3_model_files.values()}):
        state = ck.model_state_at(path)
        missing = [k for k in want if k not in state]
        if missing:
            raise CheckpointError(f"{path}: missing {missing[:3]}, which DeepSpeed 0.19.8 writes into every "
                                  "model-state file: not a DeepSpeed 0.19.8 file, or damaged")
        if experts and ck.pp == 1:  # under PP each stage counts its own layers (experts.read checks those)
            base = base or (path, state["num_experts"])
            if state["num_experts"] != base[1]:
                raise CheckpointError(f"{path}: num_experts is {state['num_experts']!r}, {base[0].name} records "
                                      f"{base[1]!r}: every model-state file of a one-stage job holds the same")
    for (m, d), path in sorted(ck.optim_files.items()):
        top, osd = ck.optim_state(m, d), ck.osd(m, d)
        want = osd_keys
        missing = [k for k in (*OPTIM_FILE_KEYS, *want) if k not in (top if k in OPTIM_FILE_KEYS else osd)]
        folded = ck.experts is not None and ck.experts.folded  # its "folding" record: folding.check
        extra = [k for k in top if k not in OPTIM_FILE_KEYS and not (folded and k == "folding")]
        extra += [k for k in osd if k not in want and not (ck.zero_stage == 3 and k == "ds_zero_partition_groups")]
        if missing or extra:
            what = f"missing {missing[:3]}" if missing else f"unknown entries {extra[:3]}"
            raise CheckpointError(f"{path}: {what}: not the optimizer file DeepSpeed 0.19.8 writes at ZeRO-"
                                  f"{ck.zero_stage}")


def check_step(value: Any, where: Any) -> None:
    """Adam's ``step``: a Python number, or the 0-dim float32 tensor torch's Adam keeps (another
    dtype is refused, never cast: a target would carry it as it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise CheckpointError(f"{where}: step is {type(value).__name__}, not a number")
    if isinstance(value, torch.Tensor) and (value.dim() or value.dtype != torch.float32):
        raise CheckpointError(f"{where}: step is a {value.dtype} tensor of shape {list(value.shape)}; torch's Adam "
                              "keeps a 0-dim float32 tensor")


def check_partitions(ck: Any, *, sizes: bool = True) -> None:
    """Every ZeRO-1/2 optimizer file's flat partitions and moments (module doc). With ``sizes``
    off, only what they are (the layout rules, which take their types on trust, run next and
    name a wrong length in their own terms); with it, their lengths too."""
    lengths: dict[tuple[int, int], dict[int, int]] = {}
    held: dict[tuple[str, ...], str] = {}  # the moments a group holds -> where first seen
    for (m, d), path in sorted(ck.optim_files.items()):
        osd = ck.osd(m, d)
        fp32 = _get(osd, "single_partition_of_fp32_groups", path, "'single_partition_of_fp32_groups'")
        maps = _get(osd, "param_slice_mappings", path, "'param_slice_mappings'")
        pads = _get(osd, "group_paddings", path, "'group_paddings'")
        state = _get(_get(osd, "base_optimizer_state", path, "'base_optimizer_state'"), "state", path,
                     "the torch optimizer's 'state'")
        if not all(isinstance(x, (list, tuple)) for x in (fp32, maps, pads)) or not len(fp32) == len(maps) == len(pads):
            raise CheckpointError(f"{path}: single_partition_of_fp32_groups, param_slice_mappings and group_paddings "
                                  "do not list the same parameter groups")
        for g in range(len(fp32)):
            where = f"{path}: group {g}"
            lean = _flat(fp32[g], None, path, f"the fp32 partition of group {g}")
            pad = pads[g]
            if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
                raise CheckpointError(f"{where}: group_paddings {pad!r} is not a non-negative integer")
            moments = state.get(g, {}) if isinstance(state, Mapping) else {}
            unknown = [k for k in moments if k not in ("step", *MOMENTS)]
            if unknown:
                raise CheckpointError(f"{where}: optimizer state {unknown[0]!r} is not known to move with its "
                                      "parameters (only step, exp_avg, exp_avg_sq)")
            held.setdefault(tuple(k for k in ("step", *MOMENTS) if k in moments), where)
            if len(held) > 1:
                (a, wa), (b, wb) = held.items()
                raise CheckpointError(f"{wb}: holds the optimizer states {list(b)}, {wa} holds {list(a)}: a step or "
                                      "moment is missing (every group of every rank holds the same)")
            for name in MOMENTS:
                if name in moments:
                    _flat(moments[name], lean + pad if sizes else None, path, f"{name} of group {g}")
            _fragments(maps[g], lean if sizes else None, where)
            lengths.setdefault((m, g), {})[d] = lean + pad
    if not sizes:
        return
    for (m, g), by_rank in lengths.items():
        if len(set(by_rank.values())) > 1 and not _expert_group(ck, g):
            d = next(d for d, n in by_rank.items() if n != by_rank[min(by_rank)])
            raise CheckpointError(f"{ck.optim_files[(m, d)]}: group {g}'s partition has {by_rank[d]} elements, DP "
                                  f"rank {min(by_rank)}'s {by_rank[min(by_rank)]}: DeepSpeed's partitions are equal")


def _expert_group(ck: Any, g: int) -> bool:
    """Expert groups are partitioned over each EP rank's EDP group, whose sizes may differ."""
    return (ck.experts is not None and g in ck.experts.groups) or (ck.moe is not None and g in ck.moe.groups)


def _fragments(mapping: Any, lean: int | None, where: str) -> None:
    if not isinstance(mapping, Mapping):
        raise CheckpointError(f"{where}: param_slice_mappings is {type(mapping).__name__}, not a name -> fragment map")
    for name, frag in mapping.items():
        start, numel = getattr(frag, "start", None), getattr(frag, "numel", None)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (start, numel)):
            raise CheckpointError(f"{where}: the fragment of {name!r} is {frag!r:.80}, not a fragment_address")
        if lean is not None and start + numel > lean:
            raise CheckpointError(f"{where}: the fragment of {name!r} [{start}, {start + numel}) lies past the fp32 "
                                  f"partition of {lean} elements: truncated or corrupt")


def check_module_weights(ck: Any, names: list[str], dtype: torch.dtype) -> None:
    """Every optimized parameter's module weight on every model-parallel rank: present, of the
    recorded shape, in the training dtype (module doc)."""
    for name in names:
        if not ck.module_held(name):
            continue  # in the per-expert files: check_expert_files
        for t in range(ck.tp):
            m = ck.mp_rank(name, t)
            shape = ck.param_shapes[m].get(name)
            if shape is None:
                continue  # this TP rank holds none of it
            w = ck.module_tensor(name, t)
            where = ck.model_files[m]
            if ck.layer_files:
                where = ck.layer_files.get((int(name.partition(".")[0]), t), where)
            if not isinstance(w, torch.Tensor):
                raise CheckpointError(f"{where}: module has no tensor {name!r} (model-parallel rank {m}), which "
                                      f"{ck.model_files[m].name} records in param_shapes")
            if tuple(w.shape) != tuple(shape) or w.dtype != dtype:
                raise CheckpointError(f"{where}: {name} (model-parallel rank {m}) is a {w.dtype} tensor of shape "
                                      f"{list(w.shape)}; param_shapes records {list(shape)} and the training dtype is "
                                      f"{dtype}")


def check_expert_files(ck: Any, dtype: torch.dtype) -> None:
    """Each per-expert file holds its expert's parameters, of the recorded shapes and dtype."""
    want: dict[str, dict[str, tuple[int, ...]]] = {}
    ep_of: dict[str, tuple[int, int]] = {}  # AutoEP: a file's EP rank and TP rank
    if ck.moe is not None and ck.moe.etp > 1:  # one file per expert and TP rank, each that rank's shard
        for p in ck.moe.params.values():
            for t in range(ck.moe.etp):
                shard = p.tp_map.shard(t).shape if p.tp_map is not None else p.shape
                want.setdefault(ck.moe.tp_files[(p.layer, p.expert, t)].name, {})[p.name] = tuple(shard)
    elif ck.moe is not None:
        for p in ck.moe.params.values():
            want.setdefault(ck.moe.files[(p.layer, p.expert)].name, {})[p.name] = tuple(p.shape)
    elif ck.experts is not None and ck.zero_stage != 3:
        ax = ck.experts
        tps = {e: sorted(t for (e2, t) in expert_writers(ck.tp, ax.ep, ck.tp * ck.dp) if e2 == e)
               for e in range(ax.ep)} if ax.folded else dict.fromkeys(range(ax.ep), [0])
        for p in ax.params.values():
            for e, xs in enumerate(p.experts_by_rank):  # folded: one file per TP rank of its writers
                for x in xs:
                    for t in (tps[e] if ax.folded else [ax.stage(p.name)]):  # PP: named by the stage (TP 1)
                        fname = f"layer_{p.layer}_expert_{x}_mp_rank_{t:02d}_model_states.pt"
                        want.setdefault(fname, {})[f"{p.name}.{x}"] = tuple(p.full_shape[1:])
                        ep_of[fname] = (e, t)
    missing = sorted(f for f in want if not (ck.tag_dir / f).is_file())
    if missing:  # (or not a regular file)
        raise CheckpointError(f"{ck.tag_dir}: {'AutoEP ' if ck.moe is None else ''}per-expert files missing: "
                              f"{missing[:3]}")
    for fname, keys in sorted(want.items()):
        path = ck.tag_dir / fname
        sd = load(path)
        if ck.experts is not None and ck.experts.folded and isinstance(sd, dict):
            check_expert_file(path, sd, ck, ck.experts, *ep_of[fname])
            sd = {k: v for k, v in sd.items() if k != KEY}
        if not isinstance(sd, dict) or set(sd) != set(keys):
            got = sorted(sd)[:4] if isinstance(sd, dict) else type(sd).__name__
            raise CheckpointError(f"{path}: holds {got}, expected exactly its expert's parameters {sorted(keys)[:4]}: "
                                  "another expert's file, or not a per-expert file")
        for k, shape in keys.items():
            t = sd[k]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = f"a {t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(f"{path}: {k} is {got}; expected {dtype} of shape {list(shape)}")
