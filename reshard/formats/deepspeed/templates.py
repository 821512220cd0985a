"""What a DeepSpeed target takes from its source beside the tensors: the dictionaries its files
are built on (rank 0's model and optimizer states, in the flavour of the target's ZeRO stage), the
optimizer's parameter groups, the training dtype, the configuration, the buffers and tied weights.

From a DeepSpeed checkpoint these are its own, recast between ZeRO-1/2 and ZeRO-3 where the stage
changes (``zero3.optim_source_from_zero12`` and back), so a target at the source's topology is the
source byte for byte. From any other source (a universal, DCP or safetensors checkpoint) they are
what DeepSpeed 0.19.8 saves for a fresh ZeRO job of the same parameters with ``torch.optim.AdamW``
(:func:`fresh`): the loss scaler of an fp32/bf16 job, the source's parameter groups (or AdamW's
defaults where it has none), an empty ``ds_config`` and no scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CheckpointError
from ...storage.safe_load import LossScaler, ZeroStageEnum
from ..contract import Reader
from . import zero3 as z3
from .checkpoint import DeepSpeedCheckpoint
from .experts import module_ds_ids
from .reader import DeepSpeedNative
from .zero12 import param_alignment

__all__ = ["Templates", "ds_id_notes", "fresh", "from_deepspeed", "placeholder_dtype"]

DS_VERSION = "0.19.8"
# torch.optim.AdamW's param_group keys and defaults (torch 2.13), in its order
ADAMW = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False,
         "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
         "decoupled_weight_decay": True}


@dataclass
class Templates:
    stage: int  # the ZeRO stage whose flavour ``model`` and ``optim`` have
    model: dict  # (TP 0, DP 0)'s model states
    optim: dict  # (TP 0, DP 0)'s optimizer file
    group_names: list[list[str]]  # the optimizer's parameter groups, by name, in flat-buffer order
    dtype: torch.dtype  # the training dtype
    cfg: dict | None
    shared: dict[str, str]  # tied aliases -> their parameter
    bf16: bool  # optimizer files named bf16_...
    ds_ids: dict[str, int]
    ds_ids_exact: bool
    native: bool = True  # from a DeepSpeed checkpoint (else fresh)
    buffers: Mapping[str, Any] = field(default_factory=dict)  # per source TP rank: buffer rule (native)
    source_tp: int = 1
    buffer_source: Any = None  # a DeepSpeedCheckpoint whose TP ranks' buffers a ZeRO-1/2 target copies
    # frozen parameters (module weights in no optimizer group) -> whole shape, in the module's order
    frozen: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [n for g in self.group_names for n in g]

    @property
    def has_moments(self) -> bool:
        return bool(self._z12_state() or self._z3_state())

    def _z12_state(self) -> dict:
        if self.stage == 3:
            return {}
        return self.optim["optimizer_state_dict"]["base_optimizer_state"]["state"].get(0, {})

    def _z3_state(self) -> dict:
        if self.stage != 3:
            return {}
        return self.optim["optimizer_state_dict"]["optimizer_state_dict"]["state"].get(0, {})

    @property
    def param_align(self) -> int:
        zo = (self.cfg or {}).get("zero_optimization") if isinstance(self.cfg, dict) else None
        return param_alignment(self.dtype, bool((zo or {}).get("parameter_alignment", False)))

    def model_z3(self) -> dict:
        """The model states a ZeRO-3 file is built on."""
        if self.stage == 3:
            return self.model
        return z3.model_template_from_zero12(self.model, params=[*self.names, *self.frozen], shared=self.shared,
                                             dtype=self.dtype)

    def optim_z3(self) -> dict:
        return self.optim if self.stage == 3 else z3.optim_source_from_zero12(self.optim)

    def optim_z12(self) -> dict:
        if self.stage != 3:
            return self.optim
        clip = self.cfg.get("gradient_clipping", 0.0) if isinstance(self.cfg, dict) else 0.0
        return z3.optim_source_from_zero3(self.optim, clip_grad=clip)

    def buffer(self, key: str, value: torch.Tensor, t: int, tp: int) -> torch.Tensor:
        """A non-parameter module entry of target TP rank ``t`` (of ``tp``): at an unchanged TP
        degree the same TP rank's, else (AutoTP leaves buffers whole on every TP rank) the one
        every source rank holds alike. ZeRO-3 and fresh sources hold buffers whole."""
        ck = self.buffer_source
        if ck is None:
            return value
        if ck.tp == tp:
            return (ck.model_state(t).get("module") or {})[key].clone()
        for r in range(1, ck.tp):
            other = (ck.model_state(r).get("module") or {}).get(key)
            if other is None or other.shape != value.shape or not torch.equal(other, value):
                raise CheckpointError(f"{ck.model_files[r]}: buffer {key!r} differs from TP rank 0's; cannot tell "
                                      "how it is split")
        return value.clone()


def from_deepspeed(own: DeepSpeedNative) -> Templates:
    """A DeepSpeed source's own dictionaries (ZeRO-1/2 or ZeRO-3, no experts), read from its
    files (checked by ``DeepSpeedReader.check`` before any writer reads them), and its frozen
    parameters (``frozen.read``)."""
    tpl = _from_deepspeed(own)
    tpl.frozen = dict(own.ck.frozen.shapes)
    return tpl


def _from_deepspeed(own: DeepSpeedNative) -> Templates:
    ck = own.ck
    ms0 = ck.model_state(0)
    shared = dict(ms0.get("shared_params") or {})
    if ck.zero_stage == 3:
        if own.kind != "zero3":
            raise CheckpointError(f"{ck.tag_dir}: not a dense ZeRO-3 checkpoint")
        group_names = z3.optim_groups(ck)
        ids, exact = z3.ds_ids(ck)
        return Templates(3, ms0, ck.optim_state(0, 0), group_names,
                         placeholder_dtype(ck, [n for g in group_names for n in g]), ms0.get("ds_config"), shared,
                         ck.bf16, ids, exact, source_tp=ck.tp)
    if own.kind != "zero12":
        raise CheckpointError(f"{ck.tag_dir}: not a dense ZeRO-1/2 checkpoint")
    groups = [ck.groups(t) for t in range(ck.mp)]  # every model-parallel rank's, in the same groups
    order = [list(dict.fromkeys(n for t in range(ck.mp) for n in groups[t][g])) for g in range(len(groups[0]))]
    names = [n for g in order for n in g]
    # ZeRO-3's ds_id: the index in model.parameters(), frozen parameters included
    ids, exact = module_ds_ids(list(ms0.get("module") or {}), None, [*names, *ck.frozen.shapes])
    return Templates(ck.zero_stage, ms0, ck.optim_state(0, 0), order, ck.module_dtype, ms0.get("ds_config"),
                     shared, ck.bf16, ids, exact, source_tp=ck.tp, buffer_source=ck)


def placeholder_dtype(ck: DeepSpeedCheckpoint, names: Sequence[str]) -> torch.dtype:
    """A ZeRO-3 source's training dtype: that of the module's parameter placeholders (all alike)."""
    module = ck.model_state(0).get("module") or {}
    dtypes = {module[n].dtype for n in names if isinstance(module.get(n), torch.Tensor)}
    if len(dtypes) != 1:
        raise CheckpointError(f"{ck.model_files[0]}: the module's parameter placeholders have dtypes "
                              f"{sorted(map(str, dtypes))}; expected one training dtype")
    return dtypes.pop()


def _groups(reader: Reader, names: Sequence[str]) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The source's parameter groups (names in the model's order, hyper-parameters), or one AdamW
    group of all."""
    groups = [dict(g) for g in reader.param_groups()]
    if not groups:
        return [list(names)], [dict(ADAMW)]
    rank = {n: i for i, n in enumerate(names)}
    listed = [sorted((n for n in g.get("params", []) if n in rank), key=rank.__getitem__) for g in groups]
    missing = [n for n in names if not any(n in lst for lst in listed)]
    if missing:
        listed[0] = listed[0] + missing
    hyper = [{**ADAMW, **{k: v for k, v in g.items() if k != "params"}} for g in groups]
    return listed, hyper


def fresh(reader: Reader, *, stage: int, dtype: torch.dtype, step: float, order: Sequence[str],
          clip_grad: float | None = None, buffers: Sequence[str] = ()) -> Templates:
    """The dictionaries DeepSpeed 0.19.8 saves for a fresh ZeRO job over ``reader``'s parameters
    (``order``: the model's), after ``step`` optimizer steps; ``buffers``: names of ``order`` that
    are module buffers (``buffer_names``: in the module, in no optimizer group); the source's
    frozen parameters (``Reader.frozen``) in the module, in no optimizer group, recorded as frozen
    from ZeRO-2 on (filled by the target)."""
    kept = set(buffers)
    frozen = {n: tuple(reader.shape(n)) for n in order if n in set(reader.frozen())}
    names = [n for n in order if n not in kept and n not in frozen]
    group_names, hyper = _groups(reader, names)
    tied = dict(reader.tied())  # aliases the module holds beside their weight
    step_t = torch.tensor(float(step))
    shapes = [OrderedDict((n, torch.Size(reader.shape(n))) for n in g) for g in group_names]
    module = OrderedDict((n, torch.empty(0, dtype=dtype)) for n in order)
    module.update((alias, module[weight]) for alias, weight in tied.items())
    # DeepSpeed records the frozen parameters from ZeRO-2 on (engine._save_checkpoint: save_frozen_param is
    # zero_optimization_partition_gradients()), else None; the target fills them in
    records = stage >= 2
    model = {"module": module, "buffer_names": [n for n in order if n in kept],
             "optimizer": None, "param_shapes": shapes, "frozen_param_shapes": OrderedDict() if records else None,
             "shared_params": tied, "frozen_param_fragments": OrderedDict() if records else None,
             "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
             "skipped_steps": 0, "global_steps": int(step), "dp_world_size": 1,
             "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
             "ds_config": {}, "ds_version": DS_VERSION}
    scaler = LossScaler.__new__(LossScaler)
    scaler.__setstate__({"cur_scale": 1.0, "dynamic": False})
    if stage == 3:
        state = {k: {"step": step_t.clone(), "exp_avg": None, "exp_avg_sq": None} for k in range(len(group_names))}
        osd = {"zero_stage": ZeroStageEnum(3), "loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False,
               "partition_count": None,
               "optimizer_state_dict": {"state": state, "param_groups": [{**h, "params": [g]} for g, h in
                                                                         enumerate(hyper)]},
               "fp32_flat_groups": []}
    else:
        state = {g: {"step": step_t.clone(), "exp_avg": None, "exp_avg_sq": None} for g in range(len(group_names))}
        # DeepSpeed's ZeRO-1/2 loader restores clip_grad from the file over the job's config: the
        # source's where it records one, else 0.0 (what a job without clipping saves)
        osd = {"loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False,
               "clip_grad": 0.0 if clip_grad is None else clip_grad,
               "base_optimizer_state": {"state": state, "param_groups": [{**h, "params": [g]}
                                                                         for g, h in enumerate(hyper)]},
               "single_partition_of_fp32_groups": [], "zero_stage": ZeroStageEnum(stage), "group_paddings": [],
               "param_alignment_paddings": [], "partition_count": [], "ds_version": DS_VERSION,
               "param_slice_mappings": []}
    optim = {"optimizer_state_dict": osd, "ds_config": {}, "ds_version": DS_VERSION}
    ids = {n: i for i, n in enumerate(n for n in order if n not in kept)}  # model.parameters(), frozen ones too
    return Templates(stage, model, optim, group_names, dtype, {}, tied, dtype == torch.bfloat16, ids, True,
                     native=False, frozen=frozen)


def ds_id_notes(exact: bool, why: str) -> list[str]:
    """The report's word on ZeRO-3's ``ds_id`` attributes, when the source's do not tell them."""
    if exact:
        return []
    return [f"the source's ds_id names {why}; the written ds_id attributes are a best guess (DeepSpeed's loader "
            "does not read them)"]
