"""A Hugging Face folder's tensor-parallel layout, from transformers' own plan for its architecture.

transformers ships each architecture's TP plan: ``base_model_tp_plan`` on the config class (module
patterns such as ``layers.*.self_attn.q_proj`` -> ``colwise``), the model class's ``_tp_plan``
(``lm_head``) and, for a base model with an ``nn.Embedding`` ``embed_tokens``, a vocabulary split
(``embedding_rowwise``). The merged plan is read from the model itself, built from ``config.json`` on
the meta device (no weights, no remote code); transformers is imported only here, when a plan is
needed (it is not a dependency of reshard).

Each parameter takes the placement its style's ``shard_param`` gives it, lowered to a map over TP
ranks ``0..tp-1``:

* ``Shard(d)`` (``colwise``: dim ``ndim-2`` of a weight, dim 0 of a bias; ``rowwise``: the last dim
  of a weight, bias whole; ``embedding_rowwise`` / ``embedding_colwise``: dim 0 / 1): contiguous
  blocks in ``torch.chunk`` sizes (``ceil(n/tp)`` each, the last ranks shorter or empty);
* ``_StridedShard(d, split_factor)`` (``packed_colwise``, ``packed_rowwise`` on weights of 2 or more
  dims): ``d`` cut into ``split_factor`` groups of ``ceil(n/sf)``, each chunked over the ranks, as
  transformers' loader (``DtensorShardOperation``) reads them;
* styles whose ``shard_param`` keeps the parameter (``replicate``, ``sequence_parallel``,
  ``replicated_with_grad_allreduce``, ``moe_tp_experts``, ...) and parameters no rule names: whole on
  every rank.

A style whose class shards in another way is refused by name, as is a tensor of the folder that is
not a parameter of the model under its own name and shape (transformers converts it on load, so
its place in the plan is not known).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ReshardError
from ...ir.param_map import ParamMap
from ...layouts import replicated, split, sub_params

__all__ = ["PlanParam", "TPPlan", "chunk_sizes", "lower", "tp_plan", "tp_plan_of_config"]


@dataclass(frozen=True, slots=True)
class PlanParam:
    """One parameter under the plan: the style that names it (None: no rule), and its placement:
    ``("replicate",)``, ``("shard", dim)`` or ``("strided", dim, split_factor)``."""

    style: str | None
    placement: tuple


@dataclass(frozen=True, slots=True)
class TPPlan:
    arch: str
    plan: Mapping[str, str]  # the model's merged plan: pattern -> style
    params: Mapping[str, PlanParam]
    tied: Mapping[str, str]  # model parameters tied to another ({alias: weight}), from the model itself

    def maps(self, shapes: Mapping[str, tuple[int, ...]], tp: int) -> dict[str, ParamMap]:
        """Each parameter's map over TP ranks ``0..tp-1``, transformers' placement lowered."""
        return {n: lower(self.params[n].placement, tuple(shapes[n]), tp) for n in shapes}


def chunk_sizes(total: int, tp: int) -> list[int]:
    """``Shard``'s per-rank extents (``torch.chunk``): ``ceil(total/tp)`` each, the last ranks
    shorter or empty."""
    c = -(-total // tp) if total else 0
    return [max(0, min(total, (r + 1) * c) - min(total, r * c)) for r in range(tp)]


def lower(placement: tuple, shape: tuple[int, ...], tp: int) -> ParamMap:
    """A :class:`PlanParam` placement of a ``shape`` parameter as a map over TP ranks ``0..tp-1``."""
    kind = placement[0]
    if kind == "replicate" or not shape:
        return replicated(shape, tp)
    dim = placement[1] % len(shape)
    if kind == "shard":
        return split(shape, dim, chunk_sizes(shape[dim], tp))
    n, sf = shape[dim], placement[2]
    width = math.ceil(n / sf)
    groups = [max(0, min(n, (g + 1) * width) - min(n, g * width)) for g in range(sf)]
    return sub_params(shape, groups, [chunk_sizes(g, tp) for g in groups], dim=dim)


def _transformers(where: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ReshardError(f"{where}: the TP layout of a Hugging Face folder comes from transformers' tensor-parallel "
                           "plan for its architecture, and transformers is not installed: install it, or pass "
                           "--layout") from None
    return transformers


def _styles(where: str) -> tuple[Any, Any]:
    """transformers' style registry and the ``shard_param`` functions reshard knows."""
    try:
        from transformers.distributed import tensor_parallel as tpmod
        from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
    except ImportError as e:
        raise ReshardError(f"{where}: this transformers has no transformers.distributed tensor-parallel API ({e}); "
                           "reshard reads the plan of transformers 5.x: upgrade it, or pass --layout") from None
    base = tpmod.TensorParallelLayer.shard_param
    known = {
        base: lambda s, leaf, nd: ("replicate",),
        tpmod.ColwiseParallel.shard_param: lambda s, leaf, nd: ("shard", nd - 2),
        tpmod.RowwiseParallel.shard_param: lambda s, leaf, nd: ("replicate",) if leaf == "bias" else ("shard", -1),
        tpmod.EmbeddingParallel.shard_param: lambda s, leaf, nd: ("shard", s.shard_dim),
        tpmod.PackedColwiseParallel.shard_param:
            lambda s, leaf, nd: ("shard", -1) if nd == 1 else ("strided", nd - 2, s.split_factor),
        tpmod.PackedRowwiseParallel.shard_param:
            lambda s, leaf, nd: ("replicate",) if nd == 1 else ("strided", -1, s.split_factor),
    }
    return (tpmod.ALL_PARALLEL_STYLES, known, base), replace_layer_number_by_wildcard


def _model(transformers: Any, config: Any, where: str) -> tuple[str, Any]:
    arch = (getattr(config, "architectures", None) or [None])[0]
    try:
        cls = getattr(transformers, arch) if arch else transformers.AutoModelForCausalLM
        with torch.device("meta"):
            model = cls(config) if arch else cls.from_config(config)
    except Exception as e:  # noqa: BLE001 -- any failure means the architecture cannot be built here
        raise ReshardError(f"{where}: transformers cannot build {arch or config.model_type!r} to read its "
                           f"tensor-parallel plan ({type(e).__name__}: {e}); pass --layout") from None
    return arch or type(model).__name__, model


def tp_plan(folder: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> TPPlan:
    """The plan transformers applies to the folder's model (``config.json``), for each of ``shapes``
    (the folder's tensors)."""
    where = str(folder)
    transformers = _transformers(where)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- an unreadable or unknown config
        raise ReshardError(f"{where}: transformers cannot read config.json ({type(e).__name__}: {e}), so the "
                           "architecture's tensor-parallel plan is unknown; pass --layout") from None
    return _plan(transformers, config, shapes, where)


def tp_plan_of_config(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str) -> TPPlan:
    """As :func:`tp_plan`, for a ``config.json`` already read (``model_type`` names the class)."""
    transformers = _transformers(where)
    try:
        cfg = dict(config)
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except Exception as e:  # noqa: BLE001
        raise ReshardError(f"{where}: transformers cannot read the config ({type(e).__name__}: {e})") from None
    return _plan(transformers, config, shapes, where)


def _plan(transformers: Any, config: Any, shapes: Mapping[str, tuple[int, ...]], where: str) -> TPPlan:
    (registry, known, base), generic = _styles(where)
    arch, model = _model(transformers, config, where)
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ReshardError(f"{where}: transformers has no tensor-parallel plan for {arch} (no base_model_tp_plan): "
                           "how its parameters split over TP ranks is unknown; pass --layout")
    params = dict(model.named_parameters(remove_duplicate=False))
    first = {id(p): n for n, p in reversed(list(params.items()))}
    tied = {n: first[id(p)] for n, p in params.items() if first[id(p)] != n}
    out = {}
    for name, shape in shapes.items():
        p = params.get(name)
        if p is None or tuple(p.shape) != tuple(shape):
            got = "is not one of its parameters" if p is None else f"is {list(shape)}, the parameter {list(p.shape)}"
            raise ReshardError(f"{where}: tensor {name!r} {got} in transformers' {arch} (transformers converts it on "
                               "load), so its place in the tensor-parallel plan is not known; pass --layout")
        # transformers' own rule (parallel_utils._get_parameter_plan): the parameter's pattern, else its module's
        pattern = generic(name)
        style = plan.get(pattern)
        if style is None and "." in pattern:
            style = plan.get(pattern.rsplit(".", 1)[0])
        out[name] = PlanParam(style, _placement(style, name, p.ndim, registry, known, base, arch, where))
    return TPPlan(arch, plan, out, tied)


def _placement(style: str | None, name: str, ndim: int, registry: Any, known: dict, base: Any, arch: str,
               where: str) -> tuple:
    if style is None:
        return ("replicate",)
    try:
        obj = registry[style]
    except KeyError:
        raise ReshardError(f"{where}: {arch}'s tensor-parallel plan gives {name!r} the style {style!r}, which this "
                           "transformers does not register") from None
    fn = getattr(type(obj), "shard_param", base)
    rule = known.get(fn)
    if rule is None:
        raise ReshardError(f"{where}: {arch}'s tensor-parallel plan gives {name!r} the style {style!r} "
                           f"({type(obj).__name__}), which shards in a way reshard does not lower (it lowers colwise, "
                           "rowwise, embedding, packed and replicated styles); pass --layout")
    return rule(obj, name.rsplit(".", 1)[-1], ndim)
