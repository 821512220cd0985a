"""A DeepSpeed 0.19.8 checkpoint as the engine reads it (``formats.contract.Reader``): every kind
(ZeRO-1/2/3, AutoTP, ``deepspeed.pipe`` stages, TP x PP, AutoEP, classic MoE) is one map per
parameter state and the fragments of the files that hold it.

* ``weight``, the module's training-dtype weights: a parameter's TP map on its pipeline stage's
  model-parallel ranks ``m = stage * tp + t`` (its *stage map*), whose shard on ``m`` is the
  module tensor of ``mp_rank_MM`` (or of the stage's layer file). ZeRO-3 files hold placeholders,
  and expert weights live in per-expert files: there the state is not offered, and whoever needs
  it casts the master (``formats.contract.MODULE``).
* ``fp32``, ``exp_avg``, ``exp_avg_sq``: the stage map composed with the ZeRO split of each shard
  (``DeepSpeedCheckpoint.composite_map``), over global ranks ``dp_rank * mp + m``, whose shard on a
  rank is the parameter's fragment of that rank's flat partition, as it lies in the mapped file.

Everything is checked before the engine opens an output folder (:meth:`DeepSpeedReader.check`):
the flat layout of every ZeRO-1/2 and ZeRO-3 partition against DeepSpeed's rule and the files'
own ``param_slice_mappings``, every partition's length and dtype, the layer files of a pipeline,
the experts' placement and partitions, the optimizer steps.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...ir.param_map import ParamMap
from ...storage import verified
from ..contract import Held, Reader
from ..hf.trainer_files import trainer_held
from . import checks, folding, zero3, zero12
from .checkpoint import DeepSpeedCheckpoint
from .files import LAYER_RE, MODEL_RE, OPTIM_RE, Z3_MODEL_RE
from .frozen import fragment as frozen_fragment
from .layout import check_flat, check_sub
from .zero3 import OSD_KEYS as Z3_OSD_KEYS
from .zero12 import OSD_KEYS as Z12_OSD_KEYS
from .zero12 import layout_alignment

__all__ = ["DeepSpeedNative", "DeepSpeedReader", "model_state_held", "optimizer_state"]

OPTIMIZER = ("fp32", "exp_avg", "exp_avg_sq")
# model-state entries the reader reads or DeepSpeed writes as bookkeeping of what the files hold
BOOKKEEPING = frozenset((*checks.MODEL_KEYS, "global_samples", "ds_autoep_layers", "num_experts",
                         "universal_checkpoint_info", folding.KEY)) - {"lr_scheduler", "data_sampler", "random_ltd"}


class DeepSpeedNative:
    """A DeepSpeed source's own objects (``Reader.native("deepspeed")``): its files (``ck``) and,
    built once on first use, its ZeRO-1/2 or ZeRO-3 layout, checked against DeepSpeed's rule."""

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.ck = ck

    @cached_property
    def kind(self) -> str:
        ck = self.ck
        if ck.experts is not None:
            return "autoep"
        if ck.moe is not None:
            return "moe"
        return "zero3" if ck.zero_stage == 3 else "zero12"

    @cached_property
    def zero12_checked(self) -> bool:
        """A dense ZeRO-1/2 source checked against DeepSpeed's layout rule (:func:`zero12.check`), once."""
        zero12.check(self.ck, check_flat)
        return True

    @cached_property
    def zero3_moments(self) -> bool:
        """A ZeRO-3 source checked against DeepSpeed's layout rule and every file's sizes, once
        (a dense one by :func:`zero3.check`; an AutoEP one's sub-groups and partitions by the same
        :func:`layout.check_sub` and :func:`zero3.check_partitions`): whether its optimizer files
        hold Adam's moments."""
        if self.kind == "zero3":
            return zero3.check(self.ck, check_sub)
        return zero3.check_partitions(self.ck, check_sub(self.ck))


class DeepSpeedReader(Reader):
    format = "deepspeed"

    def __init__(self, ck: DeepSpeedCheckpoint) -> None:
        self.ck = ck
        self.tag = ck.tag_dir.name
        self.sources = ck.sources
        pp = f" PP={ck.pp}" if ck.pp > 1 else ""
        ep = (ck.experts or ck.moe)
        self.description = f"DeepSpeed TP={ck.tp} DP={ck.dp}{pp} ZeRO-{ck.zero_stage}" + (f" EP={ep.ep}" if ep else "")
        self.topology = {"tp": ck.tp, "dp": ck.dp, "pp": ck.pp, "zero_stage": ck.zero_stage,
                         **({"ep": ep.ep} if ep else {})}
        self.tp = ck.tp
        self.own = DeepSpeedNative(ck)
        self._maps: dict[tuple[str, str], ParamMap] = {}

    @classmethod
    def open(cls, path: str | Path) -> DeepSpeedReader:
        return cls(DeepSpeedCheckpoint.open(path))

    # -- what the engine reads -------------------------------------------------------------------
    @cached_property  # the contract's attribute, computed once
    def names(self) -> list[str]:  # type: ignore[override]
        """Every parameter; frozen ones (module weights no optimizer group owns) at their place in
        the module's order."""
        frozen = self.ck.frozen.shapes
        if not frozen:
            return self.ck.names
        held = set(self.ck.names) | set(frozen)
        module = self.ck.model_state(0).get("module") or {}
        return [n for n in module if n in held] + [n for n in self.ck.names if n not in module]

    def frozen(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n in self.ck.frozen.shapes)

    @property
    def _kind(self) -> str:
        return self.own.kind

    def world(self) -> int | None:
        return self.ck.mp * self.ck.dp  # one optimizer file per (DP rank, model-parallel rank)

    def native(self, fmt: str) -> DeepSpeedNative | None:
        return self.own if fmt == "deepspeed" else None

    def check(self) -> None:
        """Every check that can refuse this checkpoint, for every route alike (``inspect``,
        ``convert``, ``reshard``): the files' tensors (``checks``), then each kind's layout rule."""
        ck = self.ck
        checks.check_keys(ck, Z3_OSD_KEYS if ck.zero_stage == 3 else Z12_OSD_KEYS)
        _ = ck.frozen  # frozen parameters: every record of them agrees, or a refusal by name
        if ck.zero_stage != 3:  # first: the layout rules below take the partitions' types on trust
            checks.check_partitions(ck, sizes=False)
        if self._kind == "zero12":
            _ = self.own.zero12_checked
        elif self._kind == "zero3":
            _ = self.own.zero3_moments
        else:
            if ck.zero_stage == 3:  # AutoEP: the sub-group rule and partitions, from the one layout
                _ = self.own.zero3_moments
            ck.check_steps()
        if ck.zero_stage == 3:
            checks.check_z3_model_files(ck)
        else:
            checks.check_partitions(ck)
            checks.check_module_weights(ck, self.names, self.module_dtype)
            checks.check_expert_files(ck, self.module_dtype)
            if self._kind in ("autoep", "moe"):  # a dense checkpoint's layout: zero12.check
                check_flat(ck, layout_alignment(ck, self.module_dtype))
        if ck.experts is not None and ck.experts.folded:  # every file's record, as DeepSpeed's folded load checks it
            folding.check(ck, ck.experts)
        checks.check_recorded_maps(ck, ck.names)
        for name in self.names:  # every map lowers and composes
            for state in self.states(name):
                self.map(name, state)

    def buffers(self) -> tuple[str, ...]:
        """The module buffers the model-state files name (``buffer_names``, every model-parallel
        rank's, in module order): held, not lowered (a DeepSpeed target copies them from the files)."""
        out: dict[str, None] = {}
        for m in range(self.ck.mp):
            state = self.ck.model_state(m)
            names = set(state.get("buffer_names") or ())
            out.update((k, None) for k in state.get("module") or {} if k in names)
        return tuple(out)

    def unlowered(self) -> list[Held]:
        """What the model-state files hold beside the parameters (:func:`model_state_held`, each
        model-parallel rank's), files of the tag folder no DeepSpeed file pattern names, and with
        a Trainer checkpoint-N, Trainer's own files beside it."""
        ck, out, seen = self.ck, [], set(self.names)
        for m in range(ck.mp):
            out += model_state_held(ck.model_files[m], ck.model_state(m), seen)
        known = (MODEL_RE, OPTIM_RE, Z3_MODEL_RE, LAYER_RE, checks.EXPERT_FILE)
        out += [Held(f.name, str(f), "state", "a file of the tag folder reshard does not read")
                for f in sorted(ck.tag_dir.iterdir()) if not f.is_dir() and not any(r.match(f.name) for r in known)]
        for src in self.sources:
            out += trainer_held(Path(src))
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.ck.frozen.shapes:
            return self.ck.frozen.shapes[name]
        return tuple(self.ck.tp_map(name).map.valid_shape)

    def states(self, name: str) -> tuple[str, ...]:
        ck = self.ck
        if name in ck.frozen.shapes:  # a module weight alone: no master, no moments
            return ("weight",)
        optim = OPTIMIZER if ck.has_optimizer_state(name) else ()
        if self._kind == "zero3" and not self.own.zero3_moments:
            optim = ("fp32",)
        return (("weight",) if ck.module_held(name) else ()) + optim

    def dtype(self, name: str, state: str) -> torch.dtype:
        if state == "weight":
            return self.module_dtype
        return torch.float32

    @property
    def module_dtype(self) -> torch.dtype:
        """The training dtype: the module weights' (ZeRO-3: its placeholders')."""
        return self.ck.module_dtype

    def map(self, name: str, state: str) -> ParamMap:
        kind = "weight" if state == "weight" else "optimizer"
        key = (name, kind)
        m = self._maps.get(key)
        if m is None and name in self.ck.frozen.shapes:
            m = self._maps[key] = self.ck.frozen.map(name)
        if m is None:
            stage = self.ck.stage_map(name)
            m = stage if kind == "weight" else self.ck.composite_map(name, stage, stages=True)
            self._maps[key] = m
        return m

    def fragment(self, name: str, state: str, rank: int) -> torch.Tensor:
        if state == "weight" and name in self.ck.frozen.shapes:
            return frozen_fragment(self.ck, self.ck.frozen, name, rank)
        if state == "weight":
            return self._module(name, rank)
        return self._partition(name, state, rank)

    def tp_index(self, name: str, state: str, rank: int) -> int:
        """The TP rank a (model-parallel or global) rank's copy belongs to: ``rank % mp % tp``."""
        return rank % self.ck.mp % self.ck.tp

    def step(self, name: str) -> Any:
        step = self.ck.step(name) if self.ck.has_optimizer_state(name) else None
        if isinstance(step, torch.Tensor):  # read outside the engine's fills: its record is checked now
            verified.ensure(step, f"{name} (step)")
        return step

    def extras(self, name: str) -> dict[str, Any]:
        if name in self.ck.frozen.shapes:
            return {}
        return dict(self.ck.tp_map(name).extra)

    def param_groups(self) -> list[dict[str, Any]]:
        """DeepSpeed's optimizer groups (rank 0's hyper-parameters), each listing the parameters
        of its units in the layout (ZeRO-3: its sub-groups, as ``param_groups`` numbers them), as
        DeepSpeed's files record them: an AutoEP or classic MoE expert in its ``moe`` group; a
        module weight no group owns (an AutoEP router alias, a tied copy of the router) in none."""
        ck = self.ck
        groups = [dict(g) for g in optimizer_state(ck)["param_groups"]]
        n_units = len(ck.groups(0))
        group_of = [g for g, lst in enumerate(zero3.sub_group_lists(ck, 0, n_units)) for _ in lst] \
            if ck.zero_stage == 3 else list(range(n_units))
        members: dict[int, list[str]] = {}
        for n in self.names:
            k = ck.layout.unit_of.get(n)
            if k is not None:
                members.setdefault(group_of[k], []).append(n)
        for i, g in enumerate(groups):
            g["params"] = members.get(i, [])
        return groups

    # -- where the bytes lie -------------------------------------------------------------------
    def _module(self, name: str, m: int) -> torch.Tensor:
        """Model-parallel rank ``m``'s module weight of ``name``, flat (memory-mapped): from its
        model-state file, or a pipeline checkpoint's layer file of that TP rank."""
        ck = self.ck
        t = m % ck.tp
        shard = ck.module_tensor(name, t)
        where = ck.model_files[m]
        if ck.layer_files:
            where = ck.layer_files.get((int(name.partition(".")[0]), t), where)
        if shard is None:
            raise CheckpointError(f"{where}: module has no {name!r} (model-parallel rank {m})")
        if shard.dtype != self.module_dtype:
            raise CheckpointError(f"{where}: {name} (model-parallel rank {m}) is {shard.dtype}, other weights "
                                  f"{self.module_dtype}: mixed training dtypes are not supported")
        want = self.map(name, "weight").shard(m).numel
        if shard.numel() != want:
            raise CheckpointError(f"{where}: {name} (model-parallel rank {m}) has {shard.numel()} elements, its "
                                  f"recorded shape {list(self.map(name, 'weight').shard(m).shape)} {want}")
        return shard.detach().reshape(-1)

    def _partition(self, name: str, state: str, g: int) -> torch.Tensor:
        """Global rank ``g``'s fragment of ``name`` in its flat ``state`` partition, as mapped."""
        ck = self.ck
        d, m = divmod(g, ck.mp)
        group, start = self._where(name, m, d)
        flat = ck.flat_state(m, d, group, state)
        n = self.map(name, state).shard(g).numel
        path = ck.optim_files[(m, d)]
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
            got = list(flat.shape) if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise CheckpointError(f"{path}: the flat {state} partition of group {group} is {got}, not 1-D: not a "
                                  "DeepSpeed 0.19.8 file")
        if flat.numel() < start + n:
            raise CheckpointError(f"{path}: {self._label(name, state, m, d)}: fragment [{start}, {start + n}) lies past "
                                  f"the flat {state} partition of {flat.numel()} elements: truncated or corrupt")
        return flat.narrow(0, start, n)

    def _label(self, name: str, state: str, m: int, d: int) -> str:
        """``name`` on the rank whose fragment it is, as messages name it."""
        ck = self.ck
        if ck.expert(name) is not None:
            e = next(e for e in range(ck.experts.ep) if d in ck.experts.members(e))
            return f"{name} (EP rank {e}, {state})"
        if (q := ck.moe_param(name)) is not None:
            return f"{q.local} ({name}, {state})"
        return f"{name} (tp rank {m % ck.tp}, {state})"

    def _where(self, name: str, m: int, d: int) -> tuple[int, int]:
        """(group or sub-group, first element) of ``name``'s fragment in rank (``m``, ``d``)'s files:
        where the layout puts it (the files' ``param_slice_mappings`` are checked to agree)."""
        ck = self.ck
        at = ck.layout.locate(name, d * ck.mp + m)
        if at is None:
            raise CheckpointError(f"{ck.optim_files[(m, d)]}: no optimizer fragments for {name!r}")
        return at


def model_state_held(path: Path, state: dict, seen: set[str]) -> list[Held]:
    """What a model-state file holds beside the parameters: module buffers (``buffer_names``), the
    scheduler's, data sampler's and random-LTD states where saved, and the client state
    ``save_checkpoint`` kept. ``seen``: keys already accounted for (the parameters, other files'
    entries), updated."""
    out = []
    buffers = set(state.get("buffer_names") or ())
    for key in state.get("module") or {}:
        if key in buffers and key not in seen:
            seen.add(key)
            out.append(Held(key, str(path), "weights", "a module buffer (buffer_names), not an optimized parameter"))
    for key, value in state.items():
        if key in BOOKKEEPING or value is None or f"/{key}" in seen:
            continue
        seen.add(f"/{key}")
        why = {"lr_scheduler": "the learning-rate scheduler's state", "data_sampler": "the data sampler's state",
               "random_ltd": "random-LTD's state"}.get(key, "client state save_checkpoint kept")
        out.append(Held(key, str(path), "state", why))
    return out


def optimizer_state(ck: DeepSpeedCheckpoint) -> dict:
    """What ``ds_to_universal`` keeps of rank 0's optimizer file: the unsharded entries and the
    parameter groups."""
    osd = ck.osd(0, 0)
    try:
        if ck.zero_stage == 3:
            out = dict(osd)
            out["param_groups"] = osd["optimizer_state_dict"]["param_groups"]
            return out
        sharded = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
        out = {k: v for k, v in osd.items() if k not in sharded}
        out["param_groups"] = osd["base_optimizer_state"]["param_groups"]
        if ck.experts is not None:  # DeepSpeed's ZeROCheckpoint sets every group's count to DP (experts' is EDP)
            out["partition_count"] = [ck.dp] * len(out["partition_count"])
        return out
    except (KeyError, TypeError):
        raise CheckpointError(f"{ck.optim_files[(0, 0)]}: optimizer state has no 'param_groups'") from None
