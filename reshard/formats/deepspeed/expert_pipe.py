"""AutoEP under pipeline parallelism (TP 1, ZeRO-1) as a DeepSpeed *target*: the same
``deepspeed.pipe.PipelineModule`` job at ``pp`` stages, EP ``ep`` and DP ``dp``
(docs/deepspeed-checkpoints.md §11.4).

A PipelineModule names its layers by their global index (``1.mlp``) whatever the stage count, so
its stages can be merged into one (``--pp 1``) or kept (``--pp`` the source's) with nothing
renamed. What a stage count changes is what each stage's files hold, as DeepSpeed 0.19.8 writes them:

* ``mp_rank_0S_model_states.pt`` per stage ``S``: the module of its layers, in layer order;
  ``param_shapes`` per optimizer group; its ``ds_autoep_layers`` (also in
  ``universal_checkpoint_info``) with ``moe_layer_id`` counted from 0 on each stage, as the job
  counts its AutoEP layers, each entry at the target's placement; ``num_experts`` per layer;
* ``layer_<moe_layer_id>_expert_<x>_mp_rank_0S_model_states.pt``: expert ``x`` of a layer, named
  by the stage-local id (the file's content, keyed by the global parameter names, is the same);
* ``zero_pp_rank_<d>_mp_rank_0S_optim_states.pt``: per stage a dense group flat over its DP ranks
  (global ranks ``d * pp + S``) and the expert group flat over each EP rank's EDP group.

The dense group's order is the one DeepSpeed records: the stage's parameters in layer order,
those of the AutoEP layers (their routers) last, since AutoEP registers them again when it replaces
the block. Merged stages keep that rule: every stage's other parameters, then every stage's
AutoEP-layer parameters (what ``mixtral_autoep_ep2_pipe1``, DeepSpeed's own one-stage save, shows).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...layouts import replicated
from ...storage.torch_zip import save
from ..contract import OPTIMIZER
from . import experts as dse
from . import zero12 as dsw
from .checkpoint import DeepSpeedCheckpoint
from .layout import Group, Layout, Part, Unit
from .placement import AutoEPPlacement, uniform_placement
from .target import DeepSpeedTarget

__all__ = ["autoep_pipe_target", "check_autoep_pipe", "is_pipeline_module", "stage_split"]

EXPERT_FILE = "layer_{layer}_expert_{expert}_mp_rank_{stage:02d}_model_states.pt"


@dataclasses.dataclass(frozen=True, slots=True)
class _Layer:
    """One AutoEP layer of the pipeline: its entry, source stage and id there, and its global id
    (its rank among every stage's layers, in layer order)."""

    entry: Mapping[str, Any]
    stage: int
    local: int
    glob: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Stage:
    """What one target stage holds: the source stages it merges (in order), its module, its
    optimizer groups' names and its AutoEP layers."""

    sources: tuple[int, ...]
    module: Mapping[str, Any]
    groups: tuple[tuple[str, ...], ...]
    layers: tuple[_Layer, ...]


def check_autoep_pipe(ck: DeepSpeedCheckpoint, ep: int, dp: int, tp: int, pp: int, stage: int) -> None:
    """What an AutoEP-under-PP target refuses, before anything is written."""
    where = ck.tag_dir
    if tp != 1:
        raise ReshardError(f"{where}: AutoEP under pipeline parallelism is written at TP 1 only (asked tp={tp}): "
                           "DeepSpeed 0.19.8 refuses AutoEP folded over TP under a pipeline (validate_folding_global, "
                           "auto_ep_folding.py:207)")
    if stage != 1:
        raise ReshardError(f"{where}: AutoEP under pipeline parallelism is written at ZeRO stage 1 only (asked "
                           f"{stage}): DeepSpeed 0.19.8's PipelineEngine refuses ZeRO-2 and ZeRO-3")
    if not is_pipeline_module(ck):
        raise CheckpointError(f"{where}: not a PipelineModule's AutoEP checkpoint: some parameter is not named by a "
                              "layer index (N.mlp...)")
    if dp % ep:
        raise ReshardError(f"ep={ep} must divide the target DP size dp={dp} (EDP = dp / ep, per stage)")
    for name, p in ck.experts.params.items():
        if p.full_shape[0] % ep:
            raise ReshardError(f"{ck.model_files[ck.experts.stage(name)]}: {name}: {p.full_shape[0]} experts do not "
                               f"split evenly over ep={ep} (AutoEP's uniform placement)")
        if [list(x) for x in p.experts_by_rank] != [r["experts"] for r in uniform_placement(p.full_shape[0], p.ep)["ranks"]]:
            raise CheckpointError(f"{ck.model_files[ck.experts.stage(name)]}: {name}: a non-uniform source placement "
                                  f"{[list(x) for x in p.experts_by_rank]} is not supported yet")
    ck.check_steps()


def _layers(ck: DeepSpeedCheckpoint) -> list[_Layer]:
    out: list[_Layer] = []
    for s in range(ck.pp):
        entries = sorted(ck.model_state(s).get(dse.LAYERS_KEY) or [], key=lambda e: int(e["moe_layer_id"]))
        out += [_Layer(e, s, int(e["moe_layer_id"]), len(out) + i) for i, e in enumerate(entries)]
    return out


def _dense_order(names: Sequence[str], prefixes: Sequence[str], where: Path) -> tuple[list[str], list[str]]:
    """A stage's dense group split into its other parameters and its AutoEP layers' (the last ones)."""
    owned = [n for n in names if any(n.startswith(p + ".") for p in prefixes)]
    if list(names[len(names) - len(owned):]) != owned:
        raise CheckpointError(f"{where}: param_shapes lists the AutoEP layers' parameters {owned} among the others, "
                              "not last as DeepSpeed's AutoEP registers them; the merged order cannot be told")
    return list(names[:len(names) - len(owned)]), owned


def _index(name: str) -> int | None:
    """The PipelineModule layer index a name starts with (``1.mlp.router.gate.weight``: 1)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def is_pipeline_module(ck: DeepSpeedCheckpoint) -> bool:
    """Whether an AutoEP checkpoint is a PipelineModule's (every parameter named by its layer index),
    whatever its stage count."""
    return ck.experts is not None and all(_index(n) is not None for s in range(ck.pp) for grp in ck.groups(s)
                                          for n in grp)


def stage_split(ck: DeepSpeedCheckpoint, pp: int, layout: Any) -> list[frozenset[int]] | None:
    """Which layer indices form each of ``pp`` target stages: ``None`` where the source's stages are
    kept or merged into one; else taken from ``layout``, a DeepSpeed checkpoint of this PipelineModule
    saved at ``pp`` stages (the split depends on the job's ``partition_method``, which no checkpoint
    records)."""
    if pp == 1 or pp == ck.pp:
        return None
    why = (f"which layers form each of {pp} stages depends on the training script's partition_method (DeepSpeed's "
           "default 'parameters' balances parameter counts), which the checkpoint does not record")
    if not (isinstance(layout, (str, Path)) and Path(layout).is_dir()):
        raise ReshardError(f"{ck.tag_dir}: PP={ck.pp} -> {pp}: {why}; pass --layout, a DeepSpeed checkpoint of this "
                           f"PipelineModule saved at PP={pp} (its stages' layer indices are taken)")
    lck = DeepSpeedCheckpoint.open(layout)
    if lck.pp != pp or lck.tp != 1:
        raise ReshardError(f"layout checkpoint {lck.tag_dir} is at PP={lck.pp}, TP={lck.tp}; the target is PP={pp}, "
                           "TP=1")
    split = []
    for s in range(pp):
        names = [n for grp in lck.groups(s) for n in grp]
        idx = {_index(n) for n in names}
        if None in idx:
            raise ReshardError(f"layout checkpoint {lck.model_files[s]}: {next(n for n in names if _index(n) is None)!r} "
                               "is not named by a PipelineModule layer index")
        split.append(frozenset(i for i in idx if i is not None))
    if any(max(split[s]) >= min(split[s + 1]) for s in range(pp - 1) if split[s] and split[s + 1]):
        raise ReshardError(f"layout checkpoint {lck.tag_dir}: its stages' layer indices {[sorted(x) for x in split]} "
                           "are not consecutive ranges")
    held = {_index(n) for s in range(ck.pp) for grp in ck.groups(s) for n in grp}
    if held != set().union(*split):
        raise ReshardError(f"layout checkpoint {lck.tag_dir}: its stages hold layers {sorted(set().union(*split))}, "
                           f"the source {sorted(i for i in held if i is not None)}: not the same PipelineModule")
    return split


def _stages(ck: DeepSpeedCheckpoint, pp: int, layers: Sequence[_Layer],
            split: Sequence[frozenset[int]] | None) -> list[_Stage]:
    """The target's stages: the source's kept (``pp == ck.pp``), all merged into one, or every source
    stage cut into ``split``'s layer indices."""
    ax = ck.experts
    counts = {len(ck.groups(s)) for s in range(ck.pp)}
    if len(counts) != 1:
        raise CheckpointError(f"{ck.tag_dir}: the stages' model states record {sorted(counts)} optimizer groups; "
                              "every stage of a pipeline job has the same")
    n_groups = counts.pop()
    plan = ([tuple(range(ck.pp))] * len(split) if split is not None else
            [tuple(range(ck.pp))] if pp == 1 else [(s,) for s in range(ck.pp)])
    out = []
    for t, sources in enumerate(plan):
        def mine(name: str, t: int = t) -> bool:
            return split is None or _index(name) in split[t]

        module: OrderedDict[str, Any] = OrderedDict()
        for s in sources:
            for k, v in (ck.model_state(s).get("module") or {}).items():
                if split is not None and _index(k) is None:
                    raise CheckpointError(f"{ck.model_files[s]}: module entry {k!r} is not named by a PipelineModule "
                                          "layer index: its stage cannot be told")
                if mine(k):
                    module[k] = v
        groups: list[tuple[str, ...]] = []
        for g in range(n_groups):
            if g in ax.groups or (split is None and len(sources) == 1):  # a kept stage keeps its order
                groups.append(tuple(n for s in sources for n in ck.groups(s)[g] if mine(n)))
                continue
            rest: list[str] = []
            owned: list[str] = []
            for s in sources:
                prefixes = [str(lay.entry["module_path"]) for lay in layers if lay.stage == s]
                r, o = _dense_order(list(ck.groups(s)[g]), prefixes, ck.model_files[s])
                rest, owned = rest + [n for n in r if mine(n)], owned + [n for n in o if mine(n)]
            groups.append(tuple(rest + owned))
        held = tuple(lay for lay in layers if lay.stage in sources and mine(str(lay.entry["module_path"])))
        out.append(_Stage(sources, module, tuple(groups), held))
    return out


def autoep_pipe_target(ck: DeepSpeedCheckpoint, *, pp: int, ep: int, dp: int, split_from: Any = None, zero_stage: int = 1,
                       strays: Sequence[Path] = ()) -> DeepSpeedTarget:
    """The pipeline job of ``ck`` (a PipelineModule's AutoEP, ZeRO-1, TP 1) at ``pp`` stages (1, ``ck.pp``,
    or another count with the split the checkpoint ``split_from`` shows: :func:`stage_split`), EP ``ep`` and DP ``dp``: see
    the module's docstring. Without stages (``ck.pp == pp == 1``) this is every unfolded AutoEP ZeRO-1/2
    target (stage ``zero_stage``), a non-pipeline model's included; ``strays``: per-expert files no layer
    records, copied as they are (as the AutoEP target always has)."""
    ax = ck.experts
    layers = _layers(ck)
    glob = {p.name: next(lay.glob for lay in layers if p.name.startswith(str(lay.entry["expert_key_prefix"]) + "."))
            for p in ax.params.values()}
    # layer ids unique over the pipeline: the placement is keyed by them
    merged = dataclasses.replace(ax, params={n: dataclasses.replace(p, layer=glob[n]) for n, p in ax.params.items()},
                                 pp=1, stages={})
    placement = AutoEPPlacement(merged, ep, dp)
    stages = _stages(ck, pp, layers, stage_split(ck, pp, split_from))
    ms0 = ck.model_state(0)
    zo = (ms0.get("ds_config") or {}).get("zero_optimization") or {}
    dtype = next(iter((ms0.get("module") or {}).values())).dtype
    align = dsw.param_alignment(dtype, bool(zo.get("parameter_alignment", False)))
    shapes = {n: tuple(shape) for s in range(ck.pp) for grp in ck.groups(s) for n, shape in grp.items()}
    if ax.folded:  # AutoEP x AutoTP written at TP 1: a dense parameter whole (its TP map's shape)
        shapes.update((n, tuple(ck.tp_map(n).map.valid_shape)) for n in shapes if n not in ax.params)
    maps: dict[str, ParamMap] = {}
    units = []
    for g in range(len(stages[0].groups)):
        if g in ax.groups:  # holder t * ep + e: stage t's EP rank e, over its EDP ranks d * pp + t
            members = tuple(tuple(d * pp + t for d in placement.ax.members(e)) for t in range(pp) for e in range(ep))
            parts = {}
            for t, st in enumerate(stages):
                names = st.groups[g]
                fg = dsw.flat_group(names, [placement.maps[n].shards[0].shape for n in names], placement.edp,
                                    param_align=align)
                parts.update({t * ep + e: Part(fg, fg.names) for e in range(ep)})
                maps.update((n, placement.maps[n].with_ranks({e: t * ep + e for e in range(ep)})) for n in names)
            units.append(Unit(Group(members), parts))
        else:  # stage t's dense group over its DP ranks d * pp + t
            parts = {}
            for t, st in enumerate(stages):
                fg = dsw.flat_group(st.groups[g], [shapes[n] for n in st.groups[g]], dp, param_align=align)
                parts[t] = Part(fg, fg.names)
                maps.update((n, replicated(shapes[n], 1).with_ranks({0: t})) for n in st.groups[g])
            units.append(Unit(Group.dense(pp, dp), parts))
    layout = Layout("flat", maps, units, [d * pp + t for t in range(pp) for d in range(dp)])
    ds_config = placement.ds_config(dsw.target_ds_config(ms0.get("ds_config"), tp=1, dp=dp, zero_stage=zero_stage))
    models: Any = PipeModelFiles(ck, stages, placement, dp=dp, ds_config=ds_config, zero_stage=zero_stage,
                                 strays=strays)
    optim: Callable[[], dict] = lambda: ck.optim_state(0, 0)  # noqa: E731
    how = ("stages kept" if pp == ck.pp else f"its {ck.pp} stages merged into one" if pp == 1 else
           f"its layers split into {pp} stages as {split_from} holds them")
    note = f"AutoEP experts at EP {ep} (EDP {placement.edp}), uniform placement"
    if ck.pp > 1 or pp > 1:
        note = (f"AutoEP under pipeline parallelism: the PipelineModule job at PP {pp} ({how}), EP {ep} (EDP "
                f"{placement.edp}) per stage, uniform placement; moe_layer_id and the per-expert files counted per "
                "stage as DeepSpeed counts them")
    if ax.folded:  # unfolded: the module's and per-expert files' weights from the masters, no folding records
        if pp != 1 or ck.pp != 1:
            raise CheckpointError(f"internal: a folded AutoEP source under pipeline parallelism ({ck.tag_dir})")
        models, optim = _unfolded_files(ck, stages[0], placement, maps, dp=dp, zero_stage=zero_stage,
                                        ds_config=ds_config, dtype=dtype)
        note += (f"; unfolded from TP {ck.tp}: the module's weights gathered from their TP shards, the per-expert "
                 "files' from the experts' fp32 masters (the same bits at fp32), no folding records")
    return DeepSpeedTarget(layout, tp=1, pp=pp, dp=dp, stage=zero_stage, bf16=ck.bf16, states=OPTIMIZER,
                           optim_template=optim, ds_config=ds_config, uc_info=None,
                           models=models, group_names=dict.fromkeys(ax.groups, f"ep_size_{ep}"),
                           notes=[note])


def _unfolded_files(ck: DeepSpeedCheckpoint, st: _Stage, placement: AutoEPPlacement, maps: Mapping[str, ParamMap], *,
                    dp: int, zero_stage: int, ds_config: dict | None, dtype: Any) -> tuple[Any, Callable[[], dict]]:
    """A folded (AutoEP x AutoTP) source's model files at TP 1 (``expert_target.ExpertWeightFiles`` on its
    TP 1 view, ``target.unfolded``) and its optimizer template."""
    from .expert_target import ExpertWeightFiles
    from .target import unfolded

    template = unfolded(ck.model_state(0))
    names = [n for grp in st.groups for n in grp]
    models = ExpertWeightFiles(ck, template, dp=dp, stage=zero_stage, ds_config=ds_config, placement=placement,
                               dtype=dtype, names=names, outer=maps,
                               aliases=dse.router_aliases(template, names, str(ck.model_files[0])))
    return models, lambda: unfolded(ck.optim_state(0, 0))


class PipeModelFiles:
    """Every target stage's model state and per-expert files (see the module's docstring): the
    source's model-state keys, topology and placement replaced; the per-expert files copied under
    their target names."""

    def __init__(self, ck: DeepSpeedCheckpoint, stages: Sequence[_Stage], placement: AutoEPPlacement, *, dp: int,
                 ds_config: dict | None, zero_stage: int = 1, strays: Sequence[Path] = ()) -> None:
        self.ck, self.stages, self.placement, self.dp, self.ds_config = ck, list(stages), placement, dp, ds_config
        self.zero_stage, self.strays = zero_stage, list(strays)

    def before(self) -> list:
        return []

    def after(self) -> list:
        return []

    def _entries(self, st: _Stage, copies: bool = False) -> list[dict]:
        """The stage's ``ds_autoep_layers`` at the target's placement, ids counted from 0 (``copies``:
        from each source stage's ``universal_checkpoint_info`` copy of them, as DeepSpeed writes both)."""
        out = []
        for i, lay in enumerate(st.layers):
            entry = dict(lay.entry)
            if copies:
                uc = (self.ck.model_state(lay.stage).get("universal_checkpoint_info") or {}).get(dse.LAYERS_KEY) or []
                entry = dict(next((e for e in uc if int(e["moe_layer_id"]) == lay.local), lay.entry))
            entry["moe_layer_id"] = lay.glob  # the placement is keyed by the global id
            entry = self.placement.layer(entry, 0, copied=False)
            entry["moe_layer_id"] = i
            out.append(entry)
        return out

    def model(self, tgt: DeepSpeedTarget, t: int) -> dict:
        st = self.stages[t]
        ms0 = self.ck.model_state(st.sources[0])
        # plain tuples, as DeepSpeed's expert save path (clone_tensors_for_torch_save) leaves them
        shapes = [OrderedDict((n, tuple(s)) for n, s in zip(p.unit.names, p.unit.shapes))
                  for _, p, _ in tgt.layout.rank_units(t)]
        uc = None
        if isinstance(ms0.get("universal_checkpoint_info"), dict):
            uc = dict(ms0["universal_checkpoint_info"])
            if dse.LAYERS_KEY in uc:
                uc[dse.LAYERS_KEY] = self._entries(st, copies=True)
        shared: dict = {}
        for s in st.sources:
            shared.update(self.ck.model_state(s).get("shared_params") or {})
        obj = dsw.model_states(ms0, module=OrderedDict(st.module), param_shapes=shapes, tp=1, dp=self.dp, tp_rank=0,
                               zero_stage=self.zero_stage, shared_params=shared, uc_info=uc, ds_config=self.ds_config,
                               pp=len(self.stages))
        if "num_experts" in ms0:
            obj["num_experts"] = [int(lay.entry["num_experts"]) for lay in st.layers]
        obj[dse.LAYERS_KEY] = self._entries(st)
        return obj

    def _write_model(self, tgt: DeepSpeedTarget, staging: Any, t: int) -> None:
        obj = self.model(tgt, t)
        with staging.open(dsw.model_file(t)) as f:
            save(obj, f)

    def expert_files(self) -> list[tuple[Path, str]]:
        """(source file, target name) of every per-expert file."""
        out = []
        for t, st in enumerate(self.stages):
            for i, lay in enumerate(st.layers):
                for x in range(int(lay.entry["num_experts"])):
                    src = self.ck.tag_dir / EXPERT_FILE.format(layer=lay.local, expert=x, stage=lay.stage)
                    out.append((src, EXPERT_FILE.format(layer=i, expert=x, stage=t)))
        return sorted(out + [(p, p.name) for p in self.strays], key=lambda f: f[0].name)

    def jobs(self, tgt: DeepSpeedTarget, engine: Any, staging: Any, archive: Callable[..., Any]) -> tuple[list, list]:
        before = [(sum(self.ck.model_files[s].stat().st_size for s in st.sources),
                   lambda t=t: self._write_model(tgt, staging, t)) for t, st in enumerate(self.stages)]
        after = [(src.stat().st_size, lambda src=src, name=name: staging.copy(src, name))
                 for src, name in self.expert_files()]
        return before, after
