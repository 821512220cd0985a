"""Where ``reshard reshard`` takes the target's model-parallel maps from.

At the source's TP degree the source maps are kept; at TP=1 every parameter is whole on its one
rank. Any other TP degree needs the layout DeepSpeed's AutoTP uses there, which a checkpoint at
another degree does not record (it depends on head counts): ``layout=`` names it -- a DeepSpeed
checkpoint saved at the target TP (its ``universal_checkpoint_info.affine_map``), a map document
or ``{name: ParamMap}``, or ``"geometry"`` to rebuild each source layout at the new degree from its
geometry alone (``layouts.recognize``: near-even splits, which can differ from AutoTP's
head-aligned ones). A pipeline checkpoint's stages are kept or merged into one; its TP degree
changes where its ``universal_checkpoint_info`` categories (Megatron-DeepSpeed's, no AutoTP with
pipelines) fix the layout at the new degree. A Hugging Face folder, which records no TP layout,
takes the one transformers' tensor-parallel plan for its architecture gives, as DeepSpeed's AutoTP
reads that plan (:func:`hf_plan_maps`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ReshardError, in_context
from ...ir.param_map import ParamMap, maps_from_document
from ...layouts import autotp_shard_sizes, replicated
from ...layouts.recognize import recognize
from ..contract import Reader
from ..hf.tp_plan import TPPlan, chunk_sizes, tp_plan_of_config
from . import lowering
from . import zero12 as dsw
from .checkpoint import DeepSpeedCheckpoint

TargetLayout = str | Path | Mapping[str, Any] | None

__all__ = ["TargetLayout", "autotp_plan_maps", "hf_plan_maps", "layout_sources", "target_stage_maps", "target_tp_maps"]

# The styles DeepSpeed 0.19.8's AutoTP reads from a model's tp_plan (module_inject/tp_plan_converter.py);
# a plan with any other is rejected by DeepSpeed as a whole.
AUTOTP_STYLES = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "rowwise",
                           "replicated_with_grad_allreduce", "embedding_rowwise"})


def layout_sources(layout: TargetLayout) -> tuple[Path, ...]:
    """The paths a ``layout=`` reads (a checkpoint folder or a map document), which the output
    must not touch any more than the source."""
    return (Path(layout),) if isinstance(layout, (str, Path)) and layout != "geometry" and Path(layout).exists() else ()


def _match_map(maps: Mapping[str, ParamMap], name: str) -> ParamMap | None:
    if name in maps:
        return maps[name]
    key = rf"^{re.escape(name)}$"
    return maps.get(key)


def target_tp_maps(ck: DeepSpeedCheckpoint | None, names: list[str], tp: int, layout: TargetLayout, *,
                   source_maps: Mapping[str, ParamMap] | None = None) -> tuple[dict[str, ParamMap], dict | None, str]:
    """Target TP map of every parameter, the ``universal_checkpoint_info`` DeepSpeed would save
    with them, and where they came from. The source's TP maps are ``ck``'s, or ``source_maps``
    (a source without TP: F whole on one rank)."""
    if ck is not None:
        source = {n: ck.tp_map(n).map for n in names}
        src_tp, src_info = ck.tp, ck.model_state(0).get("universal_checkpoint_info")
        where = ck.tag_dir
    else:
        source, src_tp, src_info, where = dict(source_maps or {}), 1, None, "the source"
    if src_tp > 1 and tp != src_tp and not src_info:
        raise CheckpointError(f"{where}: TP={src_tp} checkpoint without universal_checkpoint_info: how its "
                              "parameters are split over TP ranks is not recorded, so TP cannot change")
    if layout is None:
        if tp == src_tp:
            return source, src_info, "kept (same TP degree)"
        if tp == 1:
            return {n: replicated(m.valid_shape, 1) for n, m in source.items()}, None, "whole (TP=1)"
        raise ReshardError(
            f"changing TP from {src_tp} to {tp} needs the layout DeepSpeed's AutoTP uses at TP={tp}, which the "
            f"source does not record: pass --layout (layout=): a DeepSpeed checkpoint of this model saved at "
            f"TP={tp}, a map document, or 'geometry' to rebuild the source layouts at the new degree from their "
            "geometry")
    info = None
    if isinstance(layout, str) and layout == "geometry":
        maps = {}
        for n, m in source.items():
            try:
                maps[n] = m if tp == src_tp else (replicated(m.valid_shape, 1) if tp == 1 else recognize(m).build(tp))
            except ReshardError as e:
                raise in_context(e, f"parameter {n!r}") from None
        origin = "rebuilt from the source geometry"
        maps = _checked_maps(source, maps, tp)
    elif isinstance(layout, (str, Path)) and Path(layout).is_dir():
        lck = DeepSpeedCheckpoint.open(layout)
        if lck.tp != tp:
            raise ReshardError(f"layout checkpoint {lck.tag_dir} is at TP={lck.tp}, the target is TP={tp}")
        missing = [n for n in names if n not in set(lck.names)]
        if missing:
            raise ReshardError(f"layout checkpoint {lck.tag_dir} has no parameter {missing[0]!r}")
        maps = {n: lck.tp_map(n).map for n in names}
        info = lck.model_state(0).get("universal_checkpoint_info")
        origin = f"from {lck.tag_dir}"
        return _checked_maps(source, maps, tp), info, origin
    else:
        doc = layout
        if isinstance(layout, (str, Path)):
            try:
                doc = json.loads(Path(layout).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ReshardError(f"{layout}: cannot read a layout (checkpoint folder or JSON map document): {e}") \
                    from None
        where = str(layout) if isinstance(layout, (str, Path)) else "layout"
        if isinstance(doc, Mapping) and "params" in doc and not isinstance(doc.get("params"), ParamMap):
            try:
                doc = maps_from_document(doc)
            except ReshardError as e:
                raise in_context(e, where) from None
        if not isinstance(doc, Mapping) or not all(isinstance(m, ParamMap) for m in doc.values()):
            raise ReshardError("layout must be a checkpoint folder, a map document or {name: ParamMap}")
        maps = {}
        for n in names:
            m = _match_map(doc, n)
            if m is None:
                raise ReshardError(f"layout has no map for parameter {n!r}")
            maps[n] = m
        origin = "from the given map document"
        maps = _checked_maps(source, maps, tp, where)
    if tp > 1:
        info = {k: v for k, v in (src_info or {"universal_checkpoint_version": 0.4}).items()
                if k not in ("sub_param_shard_widths", "affine_map")}
        info["affine_map"] = dsw.affine_map_entry(maps)
    return maps, info, origin


def hf_plan_maps(reader: Reader, tp: int) -> tuple[dict[str, ParamMap], str] | None:
    """The maps DeepSpeed's AutoTP gives a Hugging Face folder's parameters at TP=``tp``, from the
    tensor-parallel plan transformers has for the architecture in its ``config.json``
    (:func:`autotp_plan_maps`). ``None``: not a Hugging Face folder, or one without a config."""
    config = reader.hf_config() if reader.format == "safetensors" else None
    if not isinstance(config, Mapping) or "model_type" not in config:
        return None
    where = str(reader.sources[-1])
    shapes = {n: tuple(reader.shape(n)) for n in reader.names}
    plan = tp_plan_of_config(config, shapes, where)
    return autotp_plan_maps(plan, shapes, tp, config, where), \
        f"from transformers' tensor-parallel plan for {plan.arch}, as DeepSpeed's AutoTP reads it"


def autotp_plan_maps(plan: TPPlan, shapes: Mapping[str, tuple[int, ...]], tp: int, config: Mapping[str, Any],
                     where: str) -> dict[str, ParamMap]:
    """``plan`` (``formats.hf.tp_plan``) as DeepSpeed 0.19.8 reads it (``TPPlanConverter``): colwise
    and rowwise as transformers places them; ``embedding_rowwise`` kept whole, unless the embedding
    is tied to the output head (then both are vocabulary-parallel, as transformers splits them).
    DeepSpeed cuts with its own sizes (``tp_shard.get_shard_size_list``: whole kv heads, near-even
    otherwise); a parameter where those may differ from transformers' ``torch.chunk`` sizes is
    refused, as is a plan with a style DeepSpeed rejects."""
    rejected = sorted({s for s in plan.plan.values() if s not in AUTOTP_STYLES})
    if rejected:
        raise ReshardError(f"{where}: {plan.arch}'s tensor-parallel plan has the style(s) {rejected}, which DeepSpeed "
                           "0.19.8's AutoTP rejects (it reads only " + ", ".join(sorted(AUTOTP_STYLES)) + "); pass "
                           "--layout")
    maps = plan.maps(shapes, tp)
    vocab_head = set(plan.tied.values()) | set(plan.tied)  # embedding and head sharing one weight
    kv = config.get("num_key_value_heads") or config.get("num_attention_heads")
    kv = kv if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 else None
    for n in shapes:
        p = plan.params[n]
        if p.style == "embedding_rowwise" and n not in vocab_head:
            maps[n] = replicated(shapes[n], tp)
            continue
        if p.placement[0] != "shard":
            continue
        total = shapes[n][p.placement[1] % len(shapes[n])]
        theirs = {tuple(autotp_shard_sizes(total, tp, num_kv_heads=kv, head_aware=h)) for h in (True, False)}
        if theirs != {tuple(chunk_sizes(total, tp))}:
            raise ReshardError(f"{where}: parameter {n!r}: transformers' plan splits its {total} rows/columns "
                               f"{chunk_sizes(total, tp)} over TP={tp}, DeepSpeed's AutoTP cuts "
                               f"{' or '.join(str(list(t)) for t in sorted(theirs))}: pass --layout (a DeepSpeed "
                               f"checkpoint of this model saved at TP={tp})")
    return maps


def target_stage_maps(ck: DeepSpeedCheckpoint, names: Sequence[str], tp: int, pp: int, layout: TargetLayout,
                      zero_stage: int) -> tuple[dict[str, ParamMap], dict | None, str]:
    """Target maps of a pipeline checkpoint: every parameter's target TP map on its target
    stage's model-parallel ranks ``stage * tp + t``, and the ``universal_checkpoint_info`` the
    training script records (kept). Stages are kept, or merged into one; any other stage count
    depends on the training script's ``partition_method``, which the checkpoint does not record. TP
    is kept, or changed where Megatron's categories (``universal_checkpoint_info``) fix the layout."""
    if layout is not None:
        raise ReshardError(f"{ck.tag_dir}: a pipeline checkpoint's target TP layout follows from its "
                           "universal_checkpoint_info categories; layout= does not apply")
    if zero_stage != 1:
        raise ReshardError("DeepSpeed's pipeline engine supports ZeRO stage 1 only")
    if pp not in (1, ck.pp):
        raise ReshardError(f"{ck.tag_dir}: PP={ck.pp} can be kept or merged into PP=1; which layers form each of "
                           f"{pp} stages depends on the training script's partition_method, not recorded in the "
                           "checkpoint")
    info = ck.model_state(0).get("universal_checkpoint_info")
    if tp != ck.tp and not isinstance(info, dict):
        raise ReshardError(f"{ck.tag_dir}: a pipeline checkpoint at TP={ck.tp} without universal_checkpoint_info "
                           f"has TP={ck.tp} and keeps it (tp={ck.tp}): how its parameters split over TP ranks is "
                           "not recorded")
    maps = {}
    for n in names:
        stage = ck.stage_of(n) if pp == ck.pp else 0
        try:
            m = ck.tp_map(n).map if tp == ck.tp else _megatron_map(n, ck.tp_map(n).map, tp, info)
        except ReshardError as e:
            raise in_context(e, f"{ck.tag_dir}: parameter {n!r} at TP={tp}") from None
        maps[n] = m.with_ranks({t: stage * tp + t for t in range(tp)})
    origin = "pipeline stages kept" if pp == ck.pp else "pipeline stages merged into one"
    if tp != ck.tp:
        origin += f", TP {ck.tp} -> {tp} by the universal_checkpoint_info categories"
    return maps, info if isinstance(info, dict) else None, origin


def _megatron_map(name: str, source: ParamMap, tp: int, info: dict) -> ParamMap:
    """``name``'s map at TP=``tp`` in Megatron's layout for its category (even splits)."""
    m = lowering.lower(name, lowering.even_shapes(name, source.logical_shape, tp, info), info).map
    m.check()
    return m


def _checked_maps(source: Mapping[str, ParamMap], maps: Mapping[str, ParamMap], tp: int,
                  where: str = "") -> dict[str, ParamMap]:
    """``maps`` as the target's TP maps, each valid (``where``: the layout they were read from)."""
    out = {}
    for n, m in maps.items():
        if tuple(m.ranks) != tuple(range(tp)):
            raise ReshardError(f"target map of {n!r} is over ranks {list(m.ranks)}, expected TP ranks 0..{tp - 1}")
        if m.valid_shape != source[n].valid_shape:
            raise ReshardError(f"target map of {n!r} is for F {list(m.valid_shape)}, the source's is "
                               f"{list(source[n].valid_shape)}")
        try:
            m.check()
        except ReshardError as e:
            raise in_context(e, f"{where + ': ' if where else ''}target map of {n!r}") from None
        out[n] = m
    return out
