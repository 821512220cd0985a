"""Read a DeepSpeed 0.19.8 checkpoint tag folder: which files exist, the topology they imply,
and per parameter the maps (TP, then ZeRO) and the tensors they describe. Files are opened
memory-mapped, so a parameter's bytes are read only when it is converted.

Files are numbered by *model-parallel rank* ``m``: ``mp_rank_MM_model_states.pt`` and
``zero_pp_rank_D_mp_rank_MM_optim_states.pt``. Without pipeline parallelism ``m`` is the TP
rank. A pipeline-parallel checkpoint (``deepspeed.pipe``) names parameters ``"<layer>.<name>"``
and keeps module weights in layer files, one per layer and TP rank: ``layer_LL-model_states.pt``
without a model axis, ``layer_LL-model_TT-model_states.pt`` over
``PipeModelDataParallelTopology`` (Megatron-DeepSpeed), ``TT`` the TP (slice) rank. Each
parameter lives in one stage, and TP rank ``t`` of stage ``s`` is ``m = s * tp + t`` (the grid's
model-parallel rank: its index among the ranks of one DP index, pipe-major; checked on
``tests/fixtures/deepspeed/tp_pipe_tp2_pp2``). ``checkpoint_parallel_dimensions`` tells stages
from TP ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError, UnplacedError, in_context
from ...ir.param_map import ParamMap
from ...storage.safe_load import load
from . import experts as deepspeed_experts
from . import frozen as deepspeed_frozen
from . import layout as ds_layout
from . import lowering
from . import moe as deepspeed_moe
from .checks import MOMENTS, check_step, param_groups
from .files import LAYER_RE, MODEL_RE, OPTIM_RE, Z3_MODEL_RE, resolve_tag_dir
from .zero12 import layout_alignment

STATES = ("fp32", "exp_avg", "exp_avg_sq")
SCALE_POWER = {"fp32": 1, "exp_avg": -1, "exp_avg_sq": -2}


def _grid(files: dict[tuple[int, int], Path], what: str, folder: Path) -> tuple[int, int]:
    tps = sorted({t for t, _ in files})
    dps = sorted({d for _, d in files})
    tp, dp = len(tps), len(dps)
    missing = [(t, d) for t in range(tp) for d in range(dp) if (t, d) not in files]
    if tps != list(range(tp)) or dps != list(range(dp)) or missing:
        want = [f"tp {t} dp {d}" for t, d in missing] or ["ranks numbered 0.. without gaps"]
        raise CheckpointError(f"{folder}: {what} files are missing for {', '.join(want[:4])}")
    return tp, dp


@dataclass
class DeepSpeedCheckpoint:
    tag_dir: Path
    zero_stage: int
    tp: int
    dp: int
    model_files: dict[int, Path]
    optim_files: dict[tuple[int, int], Path]
    z3_model_files: dict[tuple[int, int], Path] = field(default_factory=dict)
    pp: int = 1
    layer_files: dict[tuple[int, int], Path] = field(default_factory=dict)  # (layer, TP rank) -> file
    opened_from: Path | None = None  # the path the user gave: the tag folder, or its parent with 'latest'
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def sources(self) -> tuple[Path, ...]:
        """The paths this checkpoint is read from, which no output may touch."""
        return (self.tag_dir,) if self.opened_from is None else (self.opened_from, self.tag_dir)

    @property
    def mp(self) -> int:
        """Model-parallel ranks (files per DP rank): pipeline stages x TP ranks."""
        return self.pp * self.tp

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> DeepSpeedCheckpoint:
        tag = resolve_tag_dir(path)
        names = sorted(f.name for f in tag.iterdir())
        layer_matches = [(m, n) for n in names if (m := LAYER_RE.match(n))]
        layers = {(int(m.group(1)), int(m.group(2) or 0)): tag / n for m, n in layer_matches}
        tp_named = any(m.group(2) is not None for m, _ in layer_matches)
        if tp_named and any(m.group(2) is None for m, _ in layer_matches):
            raise CheckpointError(f"{tag}: layer files both with and without a TP rank (layer_LL-model_TT) in their "
                                  "names: not one pipeline x tensor parallel checkpoint")
        model = {int(m.group(1)): tag / n for n in names if (m := MODEL_RE.match(n))}
        optim = {(int(m.group(3)), int(m.group(2))): tag / n for n in names if (m := OPTIM_RE.match(n))}
        z3 = {(int(m.group(2)), int(m.group(1))): tag / n for n in names if (m := Z3_MODEL_RE.match(n))}
        if not optim:
            raise CheckpointError(f"{tag}: no zero_pp_rank_*_optim_states.pt files (optimizer states missing)")
        mp, dp = _grid(optim, "optimizer state", tag)
        first = load(optim[(0, 0)])
        osd = _get(first, "optimizer_state_dict", optim[(0, 0)])
        stage = int(_get(osd, "zero_stage", optim[(0, 0)]))
        if stage == 3:
            if _grid(z3, "ZeRO-3 model state", tag) != (mp, dp):
                raise CheckpointError(f"{tag}: ZeRO-3 model and optimizer files disagree on the topology")
            model = {t: z3[(t, 0)] for t in range(mp)}
        elif sorted(model) != list(range(mp)):
            raise CheckpointError(
                f"{tag}: expected mp_rank_00..{mp - 1:02d}_model_states.pt for {mp} model-parallel ranks, "
                f"found ranks {sorted(model)}"
            )
        ck = cls(tag, stage, mp, dp, model, optim, z3, layer_files=layers, opened_from=Path(path))
        ck._cache[("optim", 0, 0)] = first
        pp = ck._pipeline_stages(mp)
        ck.pp, ck.tp = pp, mp // pp
        ck._check_layer_grid()
        if ck.tp > 1 and ck.layer_files and not ck.uc_info:
            # Megatron-style TP records its layouts only there (client_state of save_checkpoint);
            # DeepSpeed's converter would concatenate everything on dim 0 without a word
            raise CheckpointError(f"{ck.model_files[0]}: a pipeline checkpoint at TP={ck.tp} without "
                                  "universal_checkpoint_info does not record how its parameters split over TP ranks")
        return ck

    def _check_layer_grid(self) -> None:
        """Every layer has one file per TP rank, numbered 0..TP-1 (file names only; contents:
        :meth:`check_layer_files`)."""
        by_layer: dict[int, list[int]] = {}
        for layer, t in sorted(self.layer_files):
            by_layer.setdefault(layer, []).append(t)
        for layer, ranks in by_layer.items():
            if ranks != list(range(self.tp)):
                path = self.layer_files[(layer, ranks[-1])]
                raise CheckpointError(
                    f"{path}: layer {layer} has files for TP ranks {ranks}, but the model-state files describe a "
                    f"pipeline x tensor parallel topology of PP={self.pp}, TP={self.tp}: one file per TP rank expected")

    def _pipeline_stages(self, mp: int) -> int:
        """Pipeline stages, from ``checkpoint_parallel_dimensions`` (what DeepSpeed records)."""
        dims = self.model_state(0).get("checkpoint_parallel_dimensions")
        if not isinstance(dims, dict) or "pp_degree" not in dims:
            return 1
        pp, tp = dims.get("pp_degree"), dims.get("tp_degree", 1)
        if not all(isinstance(x, int) and x >= 1 for x in (pp, tp)) or pp * tp != mp:
            raise CheckpointError(f"{self.model_files[0]}: checkpoint_parallel_dimensions {dims} disagree with "
                                  f"the {mp} model-parallel rank files")
        return pp

    # -- raw files ----------------------------------------------------------------------------
    def model_state(self, tp: int) -> dict:
        key = ("model", tp)
        if key not in self._cache:
            self._cache[key] = _as_dict(load(self.model_files[tp]), self.model_files[tp])
        return self._cache[key]

    def model_state_at(self, path: Path) -> dict:
        """The model-state file ``path`` of this tag (any rank's), loaded once."""
        for t, p in self.model_files.items():
            if p == path:
                return self.model_state(t)
        key = ("model_at", path)
        if key not in self._cache:
            self._cache[key] = _as_dict(load(path), path)
        return self._cache[key]

    def optim_state(self, tp: int, dp: int) -> dict:
        key = ("optim", tp, dp)
        if key not in self._cache:
            self._cache[key] = _as_dict(load(self.optim_files[(tp, dp)]), self.optim_files[(tp, dp)])
        return self._cache[key]

    def osd(self, tp: int, dp: int) -> dict:
        return _get(self.optim_state(tp, dp), "optimizer_state_dict", self.optim_files[(tp, dp)])

    @cached_property
    def uc_info(self) -> dict:
        info = self.model_state(0).get("universal_checkpoint_info")
        return info if isinstance(info, dict) else {}

    @cached_property
    def pipe(self) -> bool:
        """Whether this is a ``deepspeed.pipe`` checkpoint (layer files, or PP > 1): each
        parameter's TP map sits on its stage's model-parallel ranks (``stage_map``)."""
        return bool(self.layer_files) or self.pp > 1

    @cached_property
    def bf16(self) -> bool:
        """Whether the optimizer files are named ``bf16_...`` (DeepSpeed's bf16 optimizer); a
        target names its own alike."""
        return any(p.name.startswith("bf16_") for p in self.optim_files.values())

    @cached_property
    def param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per model-parallel rank: ``{name: shard shape}`` over all groups, in model order."""
        return [{n: s for g in self.groups(t) for n, s in g.items()} for t in range(self.mp)]

    def groups(self, t: int) -> list[dict[str, tuple[int, ...]]]:
        """Model-parallel rank ``t``'s ``param_shapes``: per parameter group (ZeRO-3: per
        sub-group) ``{name: shard shape}``, read once."""
        key = ("groups", t)
        if key not in self._cache:
            self._cache[key] = param_groups(self.model_state(t), self.model_files[t])
        return self._cache[key]

    @cached_property
    def _stage(self) -> dict[str, int]:
        """Pipeline stage of every parameter (all 0 without pipeline parallelism)."""
        out: dict[str, int] = {}
        for m, shapes in enumerate(self.param_shapes):
            for n in shapes:
                out.setdefault(n, m // self.tp)
        if self.experts is not None:  # AutoEP's router aliases: their stage's model state
            out.update({n: s for n, s in self.experts.stages.items() if n not in out})
        return out

    def stage_of(self, name: str) -> int:
        """The pipeline stage holding ``name`` (0 without pipeline parallelism)."""
        return self._stage.get(name, 0)

    def mp_rank(self, name: str, t: int) -> int:
        """The model-parallel rank (file index) of TP rank ``t`` of ``name``'s stage."""
        return self.stage_of(name) * self.tp + t

    @cached_property
    def names(self) -> list[str]:
        """Every parameter, in model-parallel rank 0's order, then any only other ranks hold
        (later pipeline stages; a TP rank holding none of an unevenly split parameter lists no
        shape for it)."""
        seen = dict.fromkeys(self.param_shapes[0])
        for shapes in self.param_shapes[1:]:
            seen.update(dict.fromkeys(shapes))
        if self.experts is not None:  # AutoEP's router aliases: module weights only
            seen.update(dict.fromkeys(self.experts.aliases))
        if self.moe is not None:  # classic MoE: global expert names replace the local ones
            return [n for n in seen if n not in self.moe.local_names] + list(self.moe.params)
        return list(seen)

    # -- AutoEP experts (hooks into formats/deepspeed/experts.py) -------------------------------
    @cached_property
    def experts(self) -> deepspeed_experts.AutoEP | None:
        """The AutoEP expert parameters, or ``None`` without ``ds_autoep_layers``."""
        return deepspeed_experts.read(self)

    def expert(self, name: str) -> deepspeed_experts.ExpertParam | None:
        return None if self.experts is None else self.experts.params.get(name)

    # -- classic MoE experts (hooks into formats/deepspeed/moe.py) ---------------------------------
    @cached_property
    def moe(self) -> deepspeed_moe.ClassicMoE | None:
        """The classic ``deepspeed.moe.layer.MoE`` experts, or ``None`` without ``num_experts``."""
        return deepspeed_moe.read(self)

    def moe_param(self, name: str) -> deepspeed_moe.MoEParam | None:
        return None if self.moe is None else self.moe.params.get(name)

    @cached_property
    def frozen(self) -> deepspeed_frozen.Frozen:
        """The frozen parameters (module weights no optimizer group owns), checked against every
        record of them (``frozen.read``); refused where they cannot be read."""
        return deepspeed_frozen.read(self, dense=self.experts is None and self.moe is None)

    def module_held(self, name: str) -> bool:
        """Whether the model-state (or layer) files hold ``name``'s module weight: not under ZeRO-3
        (placeholders), nor for an expert (per-expert files)."""
        return self.zero_stage != 3 and self.expert(name) is None and self.moe_param(name) is None

    def _alias(self, name: str) -> bool:
        return self.experts is not None and name in self.experts.aliases

    # -- maps ---------------------------------------------------------------------------------
    def tp_map(self, name: str) -> lowering.Lowered:
        """``name``'s model-parallel map: over TP ranks, or for an AutoEP expert over EP ranks."""
        if (p := self.expert(name)) is not None:
            return deepspeed_experts.lowered(p)
        if (q := self.moe_param(name)) is not None:
            return deepspeed_moe.lowered(q, self.moe.etp)
        if self._alias(name):  # a module weight the optimizer does not own: as ds_to_universal, no extra keys
            shape = tuple(self.model_state(self.mp_rank(name, 0))["module"][name].shape)
            return lowering.Lowered(lowering.lower_replicated([shape]), "module only")
        key = ("tp_map", name)  # lowered (and a recorded map checked) once per parameter
        if key in self._cache:
            return self._cache[key]
        shapes = [self.param_shapes[self.mp_rank(name, t)].get(name) for t in range(self.tp)]
        try:
            got = self._cache[key] = lowering.lower(name, shapes, self.uc_info)
            return got
        except ReshardError as e:  # what the info records is named in the file it is read from
            where = self.model_files[0] if str(e).startswith(lowering.INFO) else self.tag_dir
            raise in_context(e, f"{where}: parameter {name!r}") from None

    def stage_map(self, name: str) -> ParamMap:
        """``name``'s outer map: its TP map (an AutoEP expert's placement over EP ranks, a classic
        MoE expert's EP rank) on its stage's model-parallel ranks ``stage * tp + t``."""
        m = self.tp_map(name).map
        # a stage's holders: its TP ranks, or for an AutoEP expert its EP ranks (holder stage * ep + e)
        base = self.stage_of(name) * (self.experts.ep if self.expert(name) is not None else self.tp)
        return m if base == 0 else m.with_ranks({t: base + t for t in m.ranks})

    @cached_property
    def module_dtype(self) -> torch.dtype:
        """The training dtype: the module weights' (ZeRO-3: its placeholders')."""
        for n in self.names:  # ZeRO-3: no pipeline, every placeholder in the model-state file
            w = self.module_tensor(n, 0)
            if isinstance(w, torch.Tensor):
                return w.dtype
        return torch.float32

    @cached_property
    def layout(self) -> ds_layout.Layout:
        """The one layout (``layout.source``) ``param_shapes`` imply, outer maps its stage maps: every
        optimizer map and fragment of every kind comes from it. Built once the files are checked
        (``DeepSpeedReader.check``: what it computes is what the files record)."""
        return ds_layout.source(self, layout_alignment(self, self.module_dtype), self.stage_map)

    def zero_map(self, name: str, tp: int) -> tuple[int, ParamMap] | None:
        """``(unit, map)`` of TP rank ``tp``'s shard of ``name`` over its DP fragments (ranks: DP
        ranks; a unit is a parameter group, under ZeRO-3 a sub-group), ``None`` where that rank
        holds none of it. A classic MoE expert is TP rank 0's whole, over its EP rank's DP ranks;
        an AutoEP expert, held by every EP rank, has none."""
        lay = self.layout
        k = lay.unit_of.get(name)
        if k is None or (self.experts is not None and k in self.experts.groups):
            return None
        moe = self.moe is not None and k in self.moe.groups
        if moe and tp >= self.moe.etp:  # unsplit: one holder, its EP rank (read as TP rank 0's)
            return None
        h = lay.holders[name][tp] if moe else self.mp_rank(name, tp)
        split = lay.inner(name, h)
        if split is None:
            return None
        members = lay.units[k].group.members[h]
        relabel = {q: members[q] // self.mp for q in split.ranks}
        return k, split if all(q == d for q, d in relabel.items()) else split.with_ranks(relabel)

    def composite_map(self, name: str, model_map: ParamMap, *, stages: bool = False) -> ParamMap:
        """``name``'s optimizer map: its outer map composed with the split of each holder's share
        over its partition group (``layout.Layout.composite``), over global ranks ``dp_rank * R +
        r`` (DeepSpeed's order; R model-parallel ranks, or without ``stages`` the TP ranks: a
        pipeline parameter's stage dropped). ``model_map`` is ``name``'s outer map (over TP ranks,
        or with ``stages`` over model-parallel ranks), itself the map of a module weight no
        optimizer partition holds (an AutoEP router alias, only in rank 0's model-state file)."""
        if name not in self.layout.unit_of:
            return model_map
        try:
            m = self.layout.composite(name)
        except ReshardError as e:
            raise in_context(e, f"{self.tag_dir}: parameter {name!r}: composing its model-parallel map with the "
                                "ZeRO split") from None
        if stages or self.pp == 1:
            return m
        return m.with_ranks({g: g // self.mp * self.tp + g % self.mp % self.tp for g in m.ranks})

    def check_steps(self) -> None:
        """Every rank's optimizer must be at the same step (DeepSpeed asserts the same), and every
        state with Adam moments has its step (torch's Adam keeps them together)."""
        steps = set()
        for (t, d), path in self.optim_files.items():
            osd = self.osd(t, d)
            try:
                outer = osd["optimizer_state_dict"] if self.zero_stage == 3 else osd["base_optimizer_state"]
                states = list(outer["state"].items())
            except (KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{path}: optimizer state has an unknown layout (no per-group 'state')") \
                    from None
            for k, s in states:
                if not isinstance(s, dict):
                    raise CheckpointError(f"{path}: the optimizer state of group {k} is {type(s).__name__}, not a dict")
                if "step" in s:
                    check_step(s["step"], path)
                    steps.add(float(s["step"]))
                elif any(m in s for m in MOMENTS):
                    raise CheckpointError(f"{path}: the optimizer state of group {k} has Adam moments but no step")
        if len(steps) > 1:
            raise CheckpointError(f"{self.tag_dir}: optimizer ranks are at different steps {sorted(steps)}")

    def has_optimizer_state(self, name: str) -> bool:
        return name in self.layout.unit_of

    # -- tensors ------------------------------------------------------------------------------
    def flat_state(self, t: int, d: int, group: int, state: str) -> torch.Tensor:
        """Rank (model-parallel ``t``, dp ``d``)'s flat partition of one state of one parameter
        group (memory-mapped)."""
        osd = self.osd(t, d)
        path = self.optim_files[(t, d)]
        if self.zero_stage == 3:
            if state == "fp32":
                return _get(osd, "fp32_flat_groups", path)[group]
            return _get(_get(osd, "optimizer_state_dict", path), "state", path)[group][state]
        if state == "fp32":
            return _get(osd, "single_partition_of_fp32_groups", path)[group]
        base = _get(osd, "base_optimizer_state", path)
        try:
            return base["state"][group][state]
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f"{path}: optimizer state has no {state!r} for group {group} "
                                  "(an unknown optimizer state layout)") from None

    def step(self, name: str) -> Any:
        """``name``'s ``step``: its unit's, in the file of its first holder's first partition."""
        lay = self.layout
        k = lay.unit_of[name]
        r = lay.units[k].group.members[lay.holders[name][0]][0]
        m, d = r % self.mp, r // self.mp
        osd, path = self.osd(m, d), self.optim_files[(m, d)]
        state = _get(osd, "optimizer_state_dict" if self.zero_stage == 3 else "base_optimizer_state", path)["state"]
        return state[k].get("step") if k in state else None

    def module_tensor(self, name: str, t: int) -> torch.Tensor | None:
        """TP rank ``t``'s module weight of ``name``: from the model-state file, or for a
        pipeline module (``"<layer>.<name>"``) from that layer's file of TP rank ``t``."""
        module = self.model_state(self.mp_rank(name, t)).get("module") or {}
        if name in module or not self.layer_files:
            return module.get(name)
        layer, _, key = name.partition(".")
        path = self.layer_files.get((int(layer), t)) if layer.isdigit() else None
        return None if path is None else self.layer_state(path).get(key)

    def layer_state(self, path: Path) -> dict:
        """One layer file's state dict (memory-mapped, read once)."""
        cache = ("layer", path)
        if cache not in self._cache:
            self._cache[cache] = _as_dict(load(path), path)
        return self._cache[cache]

    def check_layer_files(self) -> None:
        """A pipeline checkpoint's layer files hold exactly the parameters its model-state files
        record for their layer and TP rank, with the same shapes: a file disagreeing with the
        metadata is refused naming it, the parameter and the rank."""
        want: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
        for name in self.names:
            layer, _, key = name.partition(".")
            if not layer.isdigit():
                raise CheckpointError(f"{self.model_files[self.mp_rank(name, 0)]}: parameter {name!r} of a pipeline "
                                      "checkpoint is not named '<layer>.<name>'")
            for t in range(self.tp):
                shape = self.param_shapes[self.mp_rank(name, t)].get(name)
                want.setdefault((int(layer), t), {})[key] = shape
        for (layer, t), keys in want.items():
            m = self.stage_of(f"{layer}.{next(iter(keys))}") * self.tp + t
            path = self.layer_files.get((layer, t))
            if path is None:
                raise CheckpointError(f"{self.tag_dir}: no layer file for layer {layer}, TP rank {t} (parameters "
                                      f"{sorted(keys)[:3]} of {self.model_files[m].name})")
            state = self.layer_state(path)
            for key, shape in keys.items():
                got = state.get(key)
                if not isinstance(got, torch.Tensor):
                    raise CheckpointError(f"{path}: no tensor for parameter '{layer}.{key}' (TP rank {t}, "
                                          f"model-parallel rank {m}), which {self.model_files[m].name} records")
                if shape is not None and tuple(got.shape) != tuple(shape):
                    raise CheckpointError(f"{path}: parameter '{layer}.{key}' (TP rank {t}, model-parallel rank {m}) "
                                          f"has shape {list(got.shape)}, {self.model_files[m].name} records "
                                          f"{list(shape)}")
            extra = [k for k in state if k not in keys]
            if extra:
                raise UnplacedError(f"{path}: holds {extra[:3]} (TP rank {t}), which {self.model_files[m].name} "
                                    "does not record as optimized parameters (frozen parameters or buffers are not "
                                    "supported)", entries=tuple(extra))
        for (layer, t), path in sorted(self.layer_files.items()):  # a layer without parameters holds nothing
            if (layer, t) not in want and self.layer_state(path):
                raise CheckpointError(f"{path}: holds {list(self.layer_state(path))[:3]} (TP rank {t}), but no "
                                      f"model-state file records a parameter of layer {layer}")


def _as_dict(x: Any, path: Path) -> dict:
    if not isinstance(x, dict):
        raise CheckpointError(f"{path}: expected a dict at the top level, got {type(x).__name__}")
    return x


def _get(d: Any, key: str, path: Path) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"{path}: missing {key!r} (not a DeepSpeed 0.19.8 checkpoint, or an unknown layout)")
    return d[key]
