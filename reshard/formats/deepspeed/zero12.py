"""DeepSpeed 0.19.8 ZeRO-1/2 checkpoint files: read and checked (:func:`check`), and the
dictionaries of the files a target writes (no tensor data moves here; the engine fills them).

A ZeRO-1/2 source, as every route reads it: its parameter groups per model-parallel rank, checked
against DeepSpeed 0.19.8's flat-buffer rule before anything is written, and each parameter's
model-parallel map (a TP map, or for a ``deepspeed.pipe`` checkpoint a stage map: its TP map on its
stage's model-parallel ranks ``stage * tp + t``, nothing on the other stages').

What DeepSpeed 0.19.8 writes, read from ``deepspeed/runtime/zero/stage_1_and_2.py`` and
``runtime/engine.py`` and checked against checkpoints it saved at TP=1/2 x DP=1..4
(docs/deepspeed-checkpoints.md):


* **Flat buffer, per parameter group and TP rank.** The group's trainable parameters, in
  ``param_shapes`` order (model order, or the ``round_robin_gradients`` order, which this module
  does not produce), are laid end to end. With ``zero_optimization.parameter_alignment`` each
  parameter but the last is followed by zeros up to a multiple of ``16 // element_size`` elements
  of the training dtype (``param_alignment_paddings``); without it (the default) there is no gap.
  The whole is zero-padded to a multiple of ``nccl_start_alignment_factor * dp = 2 * dp`` and cut
  into ``dp`` equal partitions (``get_data_parallel_partitions``; the alignment makes them equal).
* **``group_paddings[g]``** is the padding inside *this* rank's partition: the partition size if
  the partition starts at or past the end of the data, the overhang if the end falls inside it,
  else 0.
* **``single_partition_of_fp32_groups[g]``** is the fp32 partition without that padding
  (``_get_groups_without_padding``); **``base_optimizer_state``** is ``torch.optim``'s own
  ``state_dict()`` over the flat partition (rigid checkpoint), moments padding included.
* **``param_slice_mappings[g]``**: for each parameter intersecting the partition, in flat order,
  ``fragment_address(numel, start)`` with ``start`` counted from the start of the partition.
* **Model states** (one file per TP rank, written by DP rank 0): ``module`` holds the training
  dtype weights as views into one flat buffer per group in the layout above (so the file stores
  that buffer once); ``param_shapes`` one ``OrderedDict`` of ``torch.Size`` per group;
  ``shared_params`` is filled on global rank 0 only; ZeRO-2 writes ``frozen_param_shapes`` and
  ``frozen_param_fragments`` as empty ``OrderedDict``s where ZeRO-1 writes ``None``; AutoTP at TP=1
  attaches no ``universal_checkpoint_info``.
"""

from __future__ import annotations

import copy
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap, map_to_dict
from ...layouts.zero import FlatGroup, zero12_group_layout
from ...storage.safe_load import FragmentAddress, ZeroStageEnum
from ...storage.torch_zip import Storage, TensorRef
from .module_entries import check_module_entries
from .recorded import Recorded

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: "4-byte alignment/sizeof(fp16) = 2"

# Keys of a ZeRO-1/2 optimizer_state_dict, in the order DeepSpeed 0.19.8 writes them.
OSD_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
            "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "param_alignment_paddings",
            "partition_count", "ds_version", "param_slice_mappings")
MOMENTS = ("exp_avg", "exp_avg_sq")


def model_file(tp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def layer_file(layer: int, tp_rank: int) -> str:
    """A pipeline module's weights of one layer and TP rank, as ``PipelineModule.ckpt_layer_path``
    names them over a topology with a model axis (``PipeModelDataParallelTopology``)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def optim_file(tp_rank: int, dp_rank: int, *, bf16: bool = False) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_optim_states.pt"


def param_alignment(dtype: torch.dtype, enabled: bool) -> int:
    """Per-parameter alignment in elements: ``16 // gcd(16, element_size)`` when
    ``zero_optimization.parameter_alignment`` is on, else 1."""
    size = torch.empty((), dtype=dtype).element_size()
    return 16 // math.gcd(16, size) if enabled else 1


def flat_group(names: Sequence[str], shapes: Sequence[Sequence[int]], dp: int, *,
                 param_align: int = 1) -> FlatGroup:
    """DeepSpeed 0.19.8's flat layout of one ZeRO-1/2 parameter group over ``dp`` ranks."""
    if dp < 1:
        raise CheckpointError(f"dp must be positive, got {dp}")
    return zero12_group_layout(shapes, dp, alignment=NCCL_START_ALIGNMENT_FACTOR * dp, param_alignment=param_align,
                               names=names)


def slice_mappings(group: FlatGroup, d: int) -> OrderedDict:
    """``param_slice_mappings`` of partition ``d``: each parameter's fragment address in it."""
    base = d * group.partition
    return OrderedDict((group.names[i], FragmentAddress(numel=hi - lo, start=lo - base))
                       for i, lo, hi in group.fragments(d))


def check_partition(group: FlatGroup, q: int, osd: Mapping, g: int, where: str, path: Any) -> None:
    """Refuse a rank whose recorded ZeRO layout of group ``g`` (its partition ``q`` of ``group``)
    is not the one :func:`flat_group` computes (round-robin gradients, another DeepSpeed version,
    two ranks' files swapped, a truncated partition): every later step relies on it. ``where``
    names the rank, ``path`` its file."""
    got = [(n, int(f.numel), int(f.start)) for n, f in osd["param_slice_mappings"][g].items()]
    want = [(n, int(f.numel), int(f.start)) for n, f in slice_mappings(group, q).items()]
    if got != want:
        diff = next(((a, b) for a, b in zip(got, want) if a != b), (got[len(want):][:1], want[len(got):][:1]))
        raise CheckpointError(
            f"{where} group {g}: param_slice_mappings differ from DeepSpeed 0.19.8's ZeRO-1/2 flat layout "
            f"(recorded {diff[0]}, expected {diff[1]}); round_robin_gradients or an unknown layout is not supported")
    if int(osd["group_paddings"][g]) != group.tail_padding(q):
        raise CheckpointError(f"{where} group {g}: group_paddings {osd['group_paddings'][g]}, expected "
                              f"{group.tail_padding(q)}")
    recorded = osd.get("param_alignment_paddings")
    if recorded is not None and [int(x) for x in recorded[g]] != group.param_paddings():
        raise CheckpointError(f"{where} group {g}: param_alignment_paddings differ from the layout "
                              "parameter_alignment implies")
    lean, expected = osd["single_partition_of_fp32_groups"][g].numel(), group.partition - group.tail_padding(q)
    if lean != expected:
        raise CheckpointError(f"{path}: group {g} fp32 partition has {lean} elements, the layout implies {expected}: "
                              "truncated or not a DeepSpeed 0.19.8 file")


def layout_alignment(ck: Any, dtype: torch.dtype) -> int:
    """The per-parameter alignment ``ck``'s ds_config and training dtype give."""
    zo = (ck.model_state(0).get("ds_config") or {}).get("zero_optimization") or {}
    return param_alignment(dtype, bool(zo.get("parameter_alignment", False)))


# -- dictionaries --------------------------------------------------------------------------------


def target_ds_config(cfg: Mapping | None, *, tp: int, dp: int, zero_stage: int) -> dict | None:
    """The source's ds_config as it would read at the target topology: ZeRO stage, AutoTP size
    (set when the source had a ``tensor_parallel`` section or the target uses TP), and a
    ``train_batch_size`` recomputed for the new DP size when one is given."""
    if cfg is None:
        return None
    out = copy.deepcopy(dict(cfg))
    zo = out.get("zero_optimization")
    if isinstance(zo, dict):
        zo["stage"] = zero_stage
    else:
        out["zero_optimization"] = {"stage": zero_stage}
    if "tensor_parallel" in out or tp > 1:
        out["tensor_parallel"] = {**(out.get("tensor_parallel") or {}), "autotp_size": tp}
    if "train_batch_size" in out:
        micro = out.get("train_micro_batch_size_per_gpu")
        gas = out.get("gradient_accumulation_steps", 1)
        if isinstance(micro, int) and isinstance(gas, int):
            out["train_batch_size"] = micro * gas * dp
        else:
            out.pop("train_batch_size")
    return out


def affine_map_entry(maps: Mapping[str, ParamMap]) -> dict:
    """``universal_checkpoint_info['affine_map']`` for TP maps: JSON format v1 with int rank keys
    in memory, keyed ``^escaped\\.name$``, as DeepSpeed's AutoTP publishes it."""
    params = {}
    for name, m in maps.items():
        d = map_to_dict(m)
        d["ranks"] = {int(k): v for k, v in d["ranks"].items()}
        params[rf"^{re.escape(name)}$"] = d
    return {"version": 1, "params": params}


def model_states(source: Mapping[str, Any], *, module: Mapping[str, torch.Tensor],
                 param_shapes: list[OrderedDict], tp: int, dp: int, tp_rank: int, zero_stage: int,
                 shared_params: Mapping[str, str], uc_info: dict | None, ds_config: dict | None,
                 empty_params: Mapping[str, torch.Tensor] | None = None, pp: int = 1) -> dict:
    """One ``mp_rank_XX_model_states.pt`` dict: the source's keys in the source's order, the
    topology-dependent ones replaced. With ``pp`` stages (a ``deepspeed.pipe`` checkpoint) there
    is one such file per stage and TP rank (``mp_rank = stage * tp + tp_rank``), and ``module`` is
    ``None``: the weights are in the layer files."""
    out: dict[str, Any] = {}
    for key, value in source.items():
        if key == "universal_checkpoint_info":
            continue
        out[key] = value
    out["module"] = module
    out["param_shapes"] = param_shapes
    out["shared_params"] = dict(shared_params) if tp_rank == 0 else {}
    # ZeRO-2 records parameters outside the optimizer -- here only zero-element TP shards -- as
    # frozen ones; ZeRO-1 records nothing
    empty = empty_params or {}
    out["frozen_param_shapes"] = OrderedDict((n, t.shape) for n, t in empty.items()) if zero_stage == 2 else None
    out["frozen_param_fragments"] = OrderedDict(empty.items()) if zero_stage == 2 else None
    out["dp_world_size"] = dp
    out["mp_world_size"] = tp * pp
    dims = dict(source.get("checkpoint_parallel_dimensions") or {})
    dims.update(pp_degree=pp, tp_degree=tp)
    out["checkpoint_parallel_dimensions"] = dims
    return with_config(out, ds_config, uc_info)


def with_config(out: dict, ds_config: dict | None, uc_info: dict | None) -> dict:
    """A model-states dict with the target's ``ds_config`` (where the source records one) and
    ``universal_checkpoint_info`` (last, as DeepSpeed saves it)."""
    if "ds_config" in out:
        out["ds_config"] = ds_config
    if uc_info is not None:
        out["universal_checkpoint_info"] = uc_info
    return out


def optim_states(source: Mapping[str, Any], *, groups: Sequence[FlatGroup], d: int | Sequence[int],
                 fp32: Sequence[torch.Tensor | Storage], moments: Sequence[Mapping[str, torch.Tensor | TensorRef]],
                 zero_stage: int, ds_config: dict | None, uc_info: dict | None) -> dict:
    """One ``zero_pp_rank_D_mp_rank_XX_optim_states.pt`` dict, built on a source optimizer file's
    dict (its keys and order, loss scaler, hyper-parameters and ``step``). ``fp32[g]`` and
    ``moments[g]`` are whole partitions (``groups[g].partition`` elements, padding zero): tensors,
    or for ``torch_zip.save`` a :class:`~reshard.storage.torch_zip.Storage` and views of one. ``d``: the
    partition of every group, or of each (an expert group's is its EDP rank's)."""
    qs = [d] * len(groups) if isinstance(d, int) else list(d)
    src = source["optimizer_state_dict"]
    base = src["base_optimizer_state"]
    state = {}
    for g in range(len(groups)):
        entry = {}
        for key, value in base["state"].get(g, {}).items():
            if key == "step":
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            elif key in MOMENTS:
                entry[key] = moments[g][key]
            else:
                raise CheckpointError(f"optimizer state {key!r} of group {g} is not known to move with its "
                                      "parameters (only step, exp_avg, exp_avg_sq)")
        if entry:
            state[g] = entry
    lean = []  # a view of the padded partition, as DeepSpeed saves it (the file keeps the padding)
    for g, group in enumerate(groups):
        n = group.partition - group.tail_padding(qs[g])
        if isinstance(fp32[g], Storage):  # a placeholder the streamed writer fills: the same tensor
            lean.append(fp32[g].view((n,), requires_grad=True))
        else:
            lean.append(fp32[g].detach().requires_grad_(True)[:n])
    osd: dict[str, Any] = {}
    for key, value in src.items():
        osd[key] = value
    osd["base_optimizer_state"] = {"state": state, "param_groups": copy.deepcopy(base["param_groups"])}
    osd["single_partition_of_fp32_groups"] = lean
    osd["zero_stage"] = ZeroStageEnum(zero_stage)
    osd["group_paddings"] = [group.tail_padding(q) for group, q in zip(groups, qs)]
    osd["param_alignment_paddings"] = [group.param_paddings() for group in groups]
    osd["partition_count"] = [group.dp for group in groups]
    osd["param_slice_mappings"] = [slice_mappings(group, q) for group, q in zip(groups, qs)]
    if "universal_checkpoint_info" in osd:
        if uc_info is None:
            del osd["universal_checkpoint_info"]
        else:
            osd["universal_checkpoint_info"] = uc_info
    out: dict[str, Any] = {}
    for key, value in source.items():
        out[key] = value
    out["optimizer_state_dict"] = osd
    if "ds_config" in out:
        out["ds_config"] = ds_config
    return out


def check(ck: Recorded, check_flat: Callable[[Recorded, int], None]) -> None:
    """A dense ZeRO-1/2 source's files against DeepSpeed's layout rule and what a target can
    write: one parameter group per name, no round-robin or elastic layout, the layer files of a
    pipeline, every partition (``check_flat``: the one ZeRO-1/2 layout check, ``layout.check_flat``,
    passed in because layout builds on this module), no frozen parameters, every module entry
    placed, the optimizer steps."""
    ms0 = ck.model_state(0)
    for key in ("num_experts", "ds_autoep_layers"):
        if ms0.get(key):
            raise CheckpointError(f"{ck.model_files[0]}: mixture-of-experts checkpoints are not supported")
    groups = [ck.groups(t) for t in range(ck.mp)]
    if len({len(g) for g in groups}) != 1:
        raise CheckpointError(f"{ck.tag_dir}: model-parallel ranks record different numbers of parameter groups")
    n_groups = len(groups[0])
    group_of: dict[str, int] = {}
    for g in range(n_groups):
        for n in dict.fromkeys(n for t in range(ck.mp) for n in groups[t][g]):
            if n in group_of:
                raise CheckpointError(f"{ck.tag_dir}: {n!r} is in parameter groups {group_of[n]} and {g}")
            group_of[n] = g
    cfg = ms0.get("ds_config") or {}
    zo = cfg.get("zero_optimization") or {}
    if zo.get("round_robin_gradients"):
        raise CheckpointError(f"{ck.tag_dir}: ZeRO round_robin_gradients reorders the flat buffer by DP size; "
                              "not supported")
    if zo.get("elastic_checkpoint"):
        raise CheckpointError(f"{ck.tag_dir}: elastic ZeRO checkpoints are not supported")
    if ck.pipe:  # layer files against param_shapes, before anything reads a weight
        ck.check_layer_files()
    first = next((w for n in group_of if (w := ck.module_tensor(n, 0)) is not None), None)
    if first is None:
        raise CheckpointError(f"{ck.model_files[0]}: the module state holds none of the optimized parameters")
    _check_groups(ck, n_groups, check_flat, param_alignment(first.dtype, bool(zo.get("parameter_alignment", False))))
    _check_rest(ck, ms0, group_of)
    for n in group_of:  # every stage map lowers, before the reader's later checks
        ck.stage_map(n)


def _check_groups(ck: Recorded, n_groups: int, check_flat: Callable[[Recorded, int], None],
                  align: int) -> None:
    for t in range(ck.mp):
        for d in range(ck.dp):
            osd = ck.osd(t, d)
            base = osd.get("base_optimizer_state")
            if not isinstance(base, dict) or "state" not in base:
                raise CheckpointError(f"{ck.optim_files[(t, d)]}: base_optimizer_state is not a torch optimizer "
                                      "state_dict (elastic checkpoint?); not supported")
            if len(osd["param_slice_mappings"]) != n_groups:
                raise CheckpointError(f"{ck.optim_files[(t, d)]}: {len(osd['param_slice_mappings'])} groups, "
                                      f"the model states record {n_groups}")
    check_flat(ck, align)


def _check_rest(ck: Recorded, ms0: dict, group_of: Mapping[str, int]) -> None:
    frozen = ck.frozen.shapes  # read and checked by frozen.read (refused where it cannot be read)
    if ck.pipe and any(ck.model_state(t).get(k) for t in range(ck.mp) for k in ("buffer_names", "shared_params")):
        raise CheckpointError(f"{ck.tag_dir}: pipeline checkpoints with buffers or tied weights are not supported")
    for t in range(ck.mp):
        check_module_entries(ck.model_files[t], ck.model_state(t), {**group_of, **frozen}, rank0=ms0)
    ck.check_steps()
