"""DeepSpeed AutoEP experts in a ZeRO-1/2 checkpoint: their maps and their optimizer fragments.

AutoEP (``"expert_parallel": {"enabled": true, "autoep_size": N}``) replaces each MoE block's
experts by fused ``<prefix>.w1/w2/w3`` parameters of shape ``[local experts, ...]``. The model
state records per MoE layer (``ds_autoep_layers``) an ``expert_placement`` descriptor: which global
experts each EP rank holds, in order. The experts form their own optimizer parameter group,
partitioned over the *expert-data-parallel* (EDP) group of each EP rank rather than over all DP
ranks: by default the DP ranks are cut into runs of ``ep`` consecutive ranks, EP rank ``e`` is
``d % ep`` and its EDP group is ``e, e + ep, ...`` (``use_data_before_expert_parallelism``:
``e = d // edp`` and the group is consecutive). docs/deepspeed-checkpoints.md §11 shows the files.

The lowering (docs/spec.md §7.1): an expert parameter's F is ``[num_experts, ...]`` and its map
has one piece per run of experts an EP rank holds (``layouts.autoep_placement``), located on that
EP rank: the outer map of ``layout.source``, which composes it with each EP rank's ZeRO split over
its EDP group, whose ranks are the global (DP) ranks whose flat partitions hold the fragments.

Under ZeRO-3 (DeepSpeed's ``checkpoint_format: "zero3_partitioned"``, version 1) every DP rank
writes its own ``zero_pp_rank_D_mp_rank_00_model_states.pt`` (``ds_autoep_layers`` as that rank
sees it) and no per-expert files; each fused expert parameter of EP rank ``e`` is a ZeRO-3
parameter partitioned on its own over ``e``'s EDP group (``zero3(local shape, edp)``), in an
optimizer sub-group of its own whose ``ds_zero_partition_groups`` entry records the partition
count, rank and the global ranks of the group (docs/deepspeed-checkpoints.md §11.1).

With AutoTP (DeepSpeed's "folding", any ZeRO stage, PP = 1) the EP groups span the TP lanes: the same
EDP groups over global ranks ``dp_rank * tp + tp_rank`` (``AutoEP.tp`` > 1), every TP rank's model
state records the experts of its own EP rank, and every file a ``folding`` record
(``folding.py``; docs/deepspeed-checkpoints.md §11.2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.canonical import canonicalize
from ...ir.param_map import ParamMap, map_from_dict
from ...layouts import autoep_placement
from ...storage.safe_load import load
from . import folding
from .checks import first_difference, param_groups
from .lowering import Lowered

# a ``formats.deepspeed.DeepSpeedCheckpoint``, which imports this module (its hooks call these)
DeepSpeedCheckpoint = Any

LAYERS_KEY = "ds_autoep_layers"
WEIGHTS = ("w1", "w2", "w3")  # the fused expert parameters AutoEP creates per layer
# the keys ds_to_universal writes beside ``param`` for an expert parameter
UCP_EXTRA = ("cat_dim", "is_expert_param", "ep_num_experts")
Z3_FORMAT = ("zero3_partitioned", 1)  # checkpoint_format, checkpoint_format_version of a ZeRO-3 entry


@dataclass(frozen=True, slots=True)
class ExpertParam:
    """One fused expert parameter: its F, where its experts are, and its optimizer group."""

    name: str
    layer: int  # moe_layer_id
    full_shape: tuple[int, ...]  # [num_experts, ...]
    experts_by_rank: tuple[tuple[int, ...], ...]  # EP rank -> global experts, in shard order
    descriptor: Mapping[str, Any]  # DeepSpeed's expert_placement, as written
    group: int  # optimizer parameter group index

    @property
    def ep(self) -> int:
        return len(self.experts_by_rank)

    def shard_shape(self, e: int) -> tuple[int, ...]:
        return (len(self.experts_by_rank[e]),) + self.full_shape[1:]


@dataclass(frozen=True, slots=True)
class AutoEP:
    """The AutoEP experts of a checkpoint (``ck.experts``)."""

    params: Mapping[str, ExpertParam]
    groups: frozenset[int]  # optimizer groups holding experts (partitioned over EDP groups)
    ep: int
    edp: int
    data_before_expert: bool
    aliases: tuple[str, ...]  # module entries the optimizer does not own (router aliases)
    tp: int = 1  # > 1: DeepSpeed's folding, the EP groups laid over the TP lanes (global ranks)
    pp: int = 1  # > 1: pipeline stages (TP 1), each with its own experts over its own EP groups
    stages: Mapping[str, int] = field(default_factory=dict)  # PP > 1: the stage of each expert and alias

    @property
    def folded(self) -> bool:
        return self.tp > 1

    def members(self, e: int) -> list[int]:
        """EP rank ``e``'s EDP group: its global ranks (``dp_rank * tp + tp_rank``; TP = 1: its DP
        ranks) in EDP rank order. Folded, DeepSpeed's EP groups are runs of ``ep`` consecutive
        global ranks (``auto_ep_folding.expected_folding_group_tables``): the default order."""
        if self.data_before_expert:
            return [e * self.edp + k for k in range(self.edp)]
        return [e + k * self.ep for k in range(self.edp)]

    def global_rank(self, e: int, k: int) -> int:
        return self.members(e)[k]

    def holder_ranks(self, h: int) -> list[int]:
        """Expert holder ``h``'s partition group, as global ranks ``dp_rank * pp + stage``: holder
        ``stage * ep + e`` is stage ``stage``'s EP rank ``e`` (PP 1: holder ``e``, :meth:`members`)."""
        s, e = divmod(h, self.ep)
        return [g * self.pp + s for g in self.members(e)]

    def stage(self, name: str) -> int:
        return self.stages.get(name, 0)


def _under_pipeline(ck: DeepSpeedCheckpoint, where: str) -> str:
    """Why this AutoEP checkpoint under pipeline parallelism is not read, in DeepSpeed 0.19.8's terms
    (docs/deepspeed-checkpoints.md §11.4, fixture ``mixtral_autoep_ep2_pp2``)."""
    topo = f"ZeRO-{ck.zero_stage}, TP={ck.tp}, PP={ck.pp}, DP={ck.dp}"
    if ck.tp > 1:  # DeepSpeed refuses to train it: no DeepSpeed 0.19.8 job wrote these files
        return (f"{where}: AutoEP folded over TP under pipeline parallelism ({topo}) is not a DeepSpeed 0.19.8 "
                "checkpoint: deepspeed.initialize refuses that job in validate_folding_global "
                "(deepspeed/module_inject/auto_ep_folding.py:207: \"AutoEP+AutoTP folding currently supports "
                f"pp_size=1 only; got pp_size={ck.pp}. Pipeline-parallel validation is planned separately.\")")
    return (f"{where}: AutoEP under pipeline parallelism ({topo}) is read at ZeRO-1 only: DeepSpeed 0.19.8's "
            "pipeline engine refuses ZeRO-2 and ZeRO-3 (PipelineEngine: \"ZeRO-2 and ZeRO-3 are incompatible with "
            "pipeline parallelism\"), so no DeepSpeed job wrote these files")


def read(ck: DeepSpeedCheckpoint) -> AutoEP | None:
    """The experts ``ck`` records in ``ds_autoep_layers``, checked against the optimizer files;
    ``None`` without AutoEP. Under pipeline parallelism (TP 1) every stage's model state records its
    own layers (``moe_layer_id`` from 0 on each stage, ``module_path`` the pipeline's global layer
    index): they are merged, each parameter with its stage."""
    state, path = ck.model_state(0), ck.model_files[0]
    layers = state.get(LAYERS_KEY)
    if layers is None:
        return None
    where = f"{path}: {LAYERS_KEY}"
    if ck.pp != 1 and ck.tp != 1:
        raise CheckpointError(_under_pipeline(ck, where))
    if ck.tp != 1 and folding.KEY not in state:
        raise CheckpointError(f"{where}: AutoEP experts at TP > 1 are read only from DeepSpeed's folded "
                              f"checkpoints (PP = 1, a '{folding.KEY}' record; this one: ZeRO-{ck.zero_stage}, "
                              f"TP={ck.tp}, PP={ck.pp})")
    if ck.pp != 1 and ck.zero_stage >= 2:  # DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3
        raise CheckpointError(_under_pipeline(ck, where))
    params: dict[str, ExpertParam] = {}
    stages: dict[str, int] = {}
    aliases: list[str] = []
    expert_groups: set[int] = set()
    all_layers: list = []
    for s in range(ck.pp):  # the stage's model-parallel rank (TP 1 under PP): its own record
        state, path = ck.model_state(s * ck.tp), ck.model_files[s * ck.tp]
        layers, where = state.get(LAYERS_KEY), f"{path}: {LAYERS_KEY}"
        if not isinstance(layers, list) or not layers:
            raise CheckpointError(f"{where}: expected a non-empty list of layer entries, got {type(layers).__name__}"
                                  + (f" (stage {s} of {ck.pp}: every stage records its own MoE layers)" if s else ""))
        if ck.zero_stage == 3:
            _check_z3_format(layers, where)
        groups = ck.groups(s * ck.tp)
        stage_params: dict[str, ExpertParam] = {}
        for i, layer in enumerate(layers):
            for p in _layer_params(layer, groups, f"{where}[{i}]"):
                if p.name in params or p.name in stage_params:
                    raise CheckpointError(f"{where}: expert parameter {p.name!r} is described twice")
                stage_params[p.name] = p
                stages[p.name] = s
        _same_copies(state, path)
        stage_groups = frozenset(p.group for p in stage_params.values())
        for g in stage_groups:
            strays = [n for n in groups[g] if n not in stage_params]
            if strays:
                raise CheckpointError(f"{path}: optimizer group {g} holds experts and also {strays[:3]}, which "
                                      f"{LAYERS_KEY} does not describe")
        if s and stage_groups != frozenset(expert_groups):
            raise CheckpointError(f"{path}: stage {s}'s experts are in optimizer group(s) {sorted(stage_groups)}, "
                                  f"stage 0's in {sorted(expert_groups)}: DeepSpeed puts them in the same group")
        expert_groups |= stage_groups
        params.update(stage_params)
        all_layers += [(layer, f"{where}[{i}]") for i, layer in enumerate(layers)]
        owned = {n for g in groups for n in g}
        # under ZeRO-3 the router alias is a 0-element placeholder: nothing to convert (ds_to_universal
        # writes nothing for it either); the module placeholders are carried as they are
        stage_aliases = () if ck.zero_stage == 3 else _unowned(state, owned, str(path))
        aliases += stage_aliases
        stages.update(dict.fromkeys(stage_aliases, s))
    eps = {p.ep for p in params.values()}
    world = ck.tp * ck.dp  # folded (TP > 1): the EP groups span the TP lanes of all ranks; PP: of one stage
    where = f"{ck.model_files[0]}: {LAYERS_KEY}"
    if len(eps) != 1 or world % next(iter(eps)):
        raise CheckpointError(f"{where}: EP sizes {sorted(eps)} do not divide the world size {world} (TP={ck.tp}, "
                              f"DP={ck.dp}{f', per stage of PP={ck.pp}' if ck.pp > 1 else ''}) as one EP group")
    ep = eps.pop()
    edp = world // ep
    for layer, at in all_layers:  # what DeepSpeed records of the writing rank's EDP group
        size = layer.get("expert_data_parallel_world_size")
        if size is not None and size != edp:
            raise CheckpointError(f"{at}: expert_data_parallel_world_size is {size}, but world size {world} "
                                  f"over EP={ep} leaves EDP={edp}")
    cfg = ck.model_state(0).get("ds_config")
    cfg = cfg if isinstance(cfg, dict) else {}
    ax = AutoEP(params, frozenset(expert_groups), ep, edp, bool(cfg.get("use_data_before_expert_parallelism", False)),
                tuple(aliases), ck.tp, ck.pp, stages if ck.pp > 1 else {})
    if ax.folded:
        folding.check_layers(ck, ax)
    if ck.zero_stage == 3:
        _check_z3_partitions(ck, ax, len(ck.groups(0)))
    return ax


def router_aliases(template: Mapping[str, Any], params: Sequence[str], where: str, *,
                   why: str = "its value is not in a ZeRO-3 checkpoint, so it cannot be written at ZeRO-1/2"
                   ) -> dict[str, str]:
    """The module entries of an AutoEP template that are no parameter: each the router's
    alias (DeepSpeed's AutoEP layer sets its router a second time under the name transformers'
    OutputRecorder captures, ``<module_path>.<alias>.<rest>`` for ``<module_path>.router.<rest>``),
    mapped to that router parameter. A buffer (``buffer_names``, held whole) is kept as it is;
    anything else is refused (``why``: what the target cannot tell of it)."""
    owned, out = set(params) | set(template.get("buffer_names") or []), {}
    paths = [str(e.get("module_path", "")) for e in template.get(LAYERS_KEY) or []]
    for key in template.get("module") or {}:
        if key in owned:
            continue
        path = next((p for p in paths if key.startswith(p + ".")), None)
        rest = key[len(path) + 1:].split(".", 1) if path is not None else []
        router = f"{path}.router.{rest[1]}" if len(rest) == 2 else None
        if router is None or router not in owned:
            raise CheckpointError(f"{where}: module entry {key!r} is neither a parameter nor an AutoEP router alias; "
                                  f"{why}")
        out[key] = router
    return out



def _unowned(state: Mapping[str, Any], owned: set[str], where: str) -> tuple[str, ...]:
    """The module entries no optimizer group owns: module buffers (``buffer_names``) and the
    router's aliases (:func:`router_aliases`); any other entry is refused, naming it (it would be
    carried into every output as if it were a weight)."""
    module = state.get("module") or {}
    buffers = [n for n in module if n not in owned and n in set(state.get("buffer_names") or ())]
    aliases = router_aliases(state, sorted(owned), where, why="no optimizer group owns it and DeepSpeed's "
                             "AutoEP writes no other module entry")
    for alias, router in aliases.items():  # one tensor under two names: they cannot differ
        a, r = module.get(alias), module.get(router)
        if isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor) and not (
                a.shape == r.shape and a.dtype == r.dtype and torch.equal(a, r)):
            raise CheckpointError(f"{where}: {alias} (weight) differs from {router}, the router it aliases "
                                  f"(DeepSpeed's AutoEP saves one tensor under both names): {a.dtype} "
                                  f"{list(a.shape)} against {r.dtype} {list(r.shape)}")
    return tuple(n for n in module if n in set(buffers) or n in aliases)


def _check_z3_format(layers: list, where: str) -> None:
    """Every layer entry must be DeepSpeed's partition-native ZeRO-3 format, version 1."""
    for i, layer in enumerate(layers):
        got = (layer.get("checkpoint_format"), layer.get("checkpoint_format_version")) \
            if isinstance(layer, Mapping) else None
        if got != Z3_FORMAT:
            raise CheckpointError(f"{where}[{i}]: a ZeRO-3 AutoEP layer entry has checkpoint_format "
                                  f"{got!r}; only DeepSpeed 0.19.8's {Z3_FORMAT!r} is known")


def _check_z3_partitions(ck: DeepSpeedCheckpoint, ax: AutoEP, n_sub: int) -> None:
    """Each rank's ``ds_zero_partition_groups`` (one entry per sub-group) must say what the layout
    says: dense sub-groups cut over the DP ranks of its TP rank, expert sub-groups over the rank's
    EDP group, in the EDP order ``ax.members`` gives, as global ranks (``dp_rank * tp + tp_rank``;
    TP = 1: DP ranks); and the model-state files must agree."""
    for t, d in ((t, d) for t in range(ck.mp) for d in range(ck.dp)):
        path, g = ck.optim_files[(t, d)], d * ck.mp + t
        recorded = ck.osd(t, d).get("ds_zero_partition_groups")
        if not isinstance(recorded, list) or len(recorded) != n_sub:
            raise CheckpointError(f"{path}: ds_zero_partition_groups should list the {n_sub} sub-groups of "
                                  f"param_shapes (DeepSpeed's AutoEP ZeRO-3 metadata), got {recorded!r:.200}")
        e = next(e for e in range(ax.ep) if g in ax.members(e))
        for k, entry in enumerate(recorded):
            if k in ax.groups:
                members = ax.members(e)
                want = {"sub_group": k, "partition_count": ax.edp, "partition_rank": members.index(g),
                        "partition_ranks": members, "families": ["autoep_expert"]}
            else:
                want = {"sub_group": k, "partition_count": ck.dp, "partition_rank": d,
                        "partition_ranks": [x * ck.mp + t for x in range(ck.dp)], "families": ["replicated"]}
            got = {key: entry.get(key) for key in want} if isinstance(entry, Mapping) else entry
            if got != want:
                order = "use_data_before_expert_parallelism" if ax.data_before_expert else "expert before data"
                rank = f"DP rank {d}" if ck.mp == 1 else f"global rank {g} (TP rank {t}, DP rank {d})"
                raise CheckpointError(f"{path}: ds_zero_partition_groups[{k}] is {got!r}, but {rank} (EP rank "
                                      f"{e}, EDP groups in DeepSpeed's {order} order) should have {want!r}")
        if g:  # every rank's model states: the same parameters and shapes as its TP rank's, its own EP rank
            mpath = ck.z3_model_files[(t, d)]
            ms = ck.model_state(t) if d == 0 else load(mpath)
            if d and [list(x.items()) for x in param_groups(ms, mpath)] != [list(x.items()) for x in ck.groups(t)]:
                raise CheckpointError(f"{mpath}: param_shapes differ from DP rank 0's")
            _same_copies(ms, mpath)
            for i, (x, y) in enumerate(zip(ck.model_state(0)[LAYERS_KEY], ms.get(LAYERS_KEY) or [])):
                at = first_difference(x.get("affine_maps"), y.get("affine_maps") if isinstance(y, Mapping) else None,
                                      f"{LAYERS_KEY}[{i}].affine_maps")
                if at is not None:
                    raise CheckpointError(f"{mpath}: {at} disagrees with global rank 0's")
            ranks = {entry.get("ep_rank") for entry in ms.get(LAYERS_KEY) or []}
            if ranks != {e}:
                raise CheckpointError(f"{mpath}: {LAYERS_KEY} records EP rank(s) {sorted(ranks)}, the partition "
                                      f"groups say global rank {g} is EP rank {e}")


def _layer_params(layer: Any, groups: list[dict], where: str) -> list[ExpertParam]:
    """The fused parameters of one ``ds_autoep_layers`` entry."""
    if not isinstance(layer, Mapping):
        raise CheckpointError(f"{where}: expected a dict, got {type(layer).__name__}")
    prefix, desc = layer.get("expert_key_prefix"), layer.get("expert_placement")
    if not isinstance(prefix, str) or not prefix or not isinstance(desc, Mapping):
        raise CheckpointError(f"{where}: needs 'expert_key_prefix' and an 'expert_placement' descriptor "
                              "(AutoEP placement descriptor version 1)")
    affine = _affine_params(layer, prefix, where)
    out = []
    for w in WEIGHTS:
        name = f"{prefix}.{w}"
        g = next((i for i, grp in enumerate(groups) if name in grp), None)
        if g is None:
            raise CheckpointError(f"{where}: expert parameter {name!r} is in no param_shapes group")
        local = groups[g][name]
        full = (int(layer.get("num_experts", -1)),) + local[1:]
        try:
            m = autoep_placement(desc, full)
        except ReshardError as e:
            raise CheckpointError(f"{where}: {name}: {e}") from None
        by_rank = tuple(tuple(x["experts"]) for x in sorted(desc["ranks"], key=lambda x: x["rank"]))
        ep_rank = layer.get("ep_rank", 0)
        if m.shards[ep_rank].shape != local:
            raise CheckpointError(f"{where}: {name}: param_shapes gives EP rank {ep_rank} shape {list(local)}, the "
                                  f"placement {list(m.shards[ep_rank].shape)}")
        if name in affine:
            _same_as_deepspeed(m, affine[name], f"{where}.affine_maps.params.{name}")
        out.append(ExpertParam(name, int(layer.get("moe_layer_id", -1)), full, by_rank, desc, g))
    return out


def _same_copies(state: Mapping, path: Any) -> None:
    """DeepSpeed writes the layer entries twice, at the top and in ``universal_checkpoint_info``
    (which a target's entries are made from): the two must be the same."""
    info = state.get("universal_checkpoint_info")
    if isinstance(info, Mapping) and LAYERS_KEY in info:
        at = first_difference(state.get(LAYERS_KEY), info[LAYERS_KEY], f"universal_checkpoint_info.{LAYERS_KEY}")
        if at is not None:
            raise CheckpointError(f"{path}: {at} disagrees with {LAYERS_KEY}: DeepSpeed records the same in both")


def _affine_params(layer: Mapping, prefix: str, where: str) -> Mapping:
    """The layer's ``affine_maps`` entries (DeepSpeed's maps of its expert parameters), by name."""
    doc = layer.get("affine_maps")
    if doc is None:
        return {}
    if not isinstance(doc, Mapping) or not isinstance(doc.get("params"), Mapping):
        raise CheckpointError(f"{where}.affine_maps: expected {{'params': {{name: map}}}}, got {doc!r:.100}")
    names = [f"{prefix}.{w}" for w in WEIGHTS]
    stray = [k for k in doc["params"] if k not in names]
    if stray:
        raise CheckpointError(f"{where}.affine_maps.params: {stray[0]!r} is not an expert parameter of the layer "
                              f"({names})")
    return doc["params"]


def _same_as_deepspeed(ours: ParamMap, entry: Any, where: str) -> None:
    """DeepSpeed's own ``affine_maps`` entry (``where``: its file and JSON path) must be a valid
    map, and describe the layout the placement gives."""
    try:
        theirs = map_from_dict(entry)
        theirs.check()
    except ReshardError as e:
        path = getattr(e, "path", "")
        raise CheckpointError(f"{where}{'.' + path if path else ''}: {getattr(e, 'reason', e)}") from None
    if canonicalize(theirs) != canonicalize(ours):
        raise CheckpointError(f"{where}: affine_maps disagrees with the expert_placement descriptor")


# -- maps and tensors ----------------------------------------------------------------------------


def lowered(p: ExpertParam) -> Lowered:
    """The expert map over EP ranks, with the keys ``ds_to_universal`` writes beside ``param``."""
    m = autoep_placement(p.descriptor, p.full_shape)
    return Lowered(m, "experts", {"cat_dim": 0, "is_expert_param": True, "ep_num_experts": p.full_shape[0]})


# what ds_to_universal keeps of each layer entry in the universal model state (its
# ``AUTOEP_METADATA_FIELDS``): the placement descriptor and affine maps are dropped there
UCP_LAYER_FIELDS = ("moe_layer_id", "module_path", "expert_key_prefix", "num_experts", "num_local_experts", "ep_size")
UCP_EXPERT_PATTERNS = [r"\.experts\.w[123]$"]


UCP_Z3_EXPERT_PATTERNS = [r".*\.experts\.w[123]$"]  # what its ZeRO-3 path writes instead


def universal_model_state_z3(path: Any) -> dict:
    """A ZeRO-3 rank's model state as ``ds_to_universal`` rewrites it under AutoEP (folded: its
    ``folding`` record dropped):
    ``universal_checkpoint_info`` (created if missing) gets the expert pattern and, as the very
    same object, the file's own ``ds_autoep_layers``; the rest is the file's, as loaded."""
    state = load(path, mmap=False)
    state.pop(folding.KEY, None)  # as universal_model_state: a universal checkpoint has no topology
    info = state.setdefault("universal_checkpoint_info", {})
    info["expert_parameter_patterns"] = list(UCP_Z3_EXPERT_PATTERNS)
    info[LAYERS_KEY] = state.get(LAYERS_KEY)
    return state


def universal_model_state(ck: DeepSpeedCheckpoint, m: int) -> dict:
    """Model-parallel rank ``m``'s model state as ``ds_to_universal`` rewrites it under AutoEP:
    ``universal_checkpoint_info`` gains its expert pattern and a projection of every file's
    ``ds_autoep_layers`` (one entry per expert prefix); the rest is the file's, as loaded."""
    layers: dict[str, dict] = {}
    for r in range(ck.mp):
        for entry in ck.model_state(r).get(LAYERS_KEY) or []:
            layers.setdefault(entry["expert_key_prefix"], {k: entry[k] for k in UCP_LAYER_FIELDS if k in entry})
    state = load(ck.model_files[m], mmap=False)  # a fresh copy: the cached state stays as read
    # a universal checkpoint has no topology: a folding record would make DeepSpeed's unfolded load refuse it
    state.pop(folding.KEY, None)
    info = state.setdefault("universal_checkpoint_info", {})
    info["expert_parameter_patterns"] = list(UCP_EXPERT_PATTERNS)
    info[LAYERS_KEY] = list(layers.values())
    return state


def edp_elements(ck: DeepSpeedCheckpoint) -> dict[int, int]:
    """``{global rank: elements}``: how much of the expert parameters lies in each rank's flat
    partitions of the expert optimizer groups (EP rank ``e``'s shards, cut over its EDP group):
    the shards of their composites (``ck.layout``; TP = 1: a global rank is a DP rank; folded:
    ``dp_rank * tp + tp_rank``)."""
    out = dict.fromkeys(range(ck.mp * ck.dp), 0)
    for p in ck.experts.params.values():
        for d, s in ck.layout.composite(p.name).shards.items():
            out[d] += s.numel
    return out


def module_ds_ids(module: Sequence[str], ax: AutoEP | None, names: Sequence[str]) -> tuple[dict[str, int], bool]:
    """Each parameter's ZeRO-3 ``ds_id`` (its index in ``model.parameters()``): the module's owned
    parameters in order (``module``: its keys), with AutoEP (``ax``) each MoE layer's fused experts
    right after the last owned parameter under its ``module_path`` (the router; DeepSpeed's AutoEP
    layer registers its experts after it). ``False`` where that order does not hold every
    parameter (then ``names``' order, a best guess)."""
    owned = set(names)
    keys = [n for n in module if n in owned]
    layers: dict[str, list[str]] = {}
    for p in (ax.params.values() if ax is not None else ()):
        layers.setdefault(p.name.rsplit(".experts.", 1)[0], []).append(p.name)
    order: list[str] = []
    for i, n in enumerate(keys):
        order.append(n)
        nxt = keys[i + 1] if i + 1 < len(keys) else ""
        for path, experts in layers.items():
            if n.startswith(path + ".") and not nxt.startswith(path + "."):
                order.extend(experts)
    exact = sorted(order) == sorted(names)
    return {n: i for i, n in enumerate(order if exact else names)}, exact
