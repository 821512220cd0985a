"""Lowering: a parameter's TP layout as a map, from what the checkpoint records.

The checkpoint's own ``affine_map`` entry wins when present. Otherwise each legacy
``universal_checkpoint_info`` key lowers to a map through one small function (docs/spec.md §7). Each
lowering also returns the extra keys DeepSpeed's converter writes beside ``param`` for that
category, so universal output has the same dict keys as ``ds_to_universal``'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError, MapError, MapFormatError
from ...ir.param_map import ParamMap, map_from_dict
from ...layouts import replicated, split, sub_params

Shapes = list[tuple[int, ...]]


@dataclass
class Lowered:
    """A parameter's TP map, the family it was lowered from (docs/spec.md §7), and DeepSpeed's extra output keys."""

    map: ParamMap
    family: str
    extra: dict[str, Any] = field(default_factory=dict)


def _full(shapes: Shapes, dim: int) -> tuple[int, ...]:
    full = list(shapes[0])
    full[dim] = sum(s[dim] for s in shapes)
    return tuple(full)


INFO = "universal_checkpoint_info"  # JSON paths of what it records start so (in model-state file 0)
AFFINE = f"{INFO}.affine_map"


def lower_affine_map(entry: Any, shapes: Shapes, path: str = f"{AFFINE}.params.?") -> ParamMap:
    """The checkpoint's own map (JSON format v1), held to everything a map must satisfy before
    anything composes or plans with it: the format, its ranks exactly the TP ranks, each shard the
    shape of the tensor the model state holds, and the IR's checks (docs/spec.md §2). A failure is
    a :class:`CheckpointError` starting with the JSON path of the field at fault (``path`` is the
    entry's)."""
    try:
        m = map_from_dict(entry, path)
    except MapFormatError as e:
        raise CheckpointError(f"{e.path}: malformed affine_map entry: {e.reason}") from None
    extra = [r for r in m.ranks if r >= len(shapes)]
    if extra:
        raise CheckpointError(f"{path}.ranks.{extra[0]}: rank {extra[0]} is not a TP rank of this checkpoint "
                              f"(TP={len(shapes)})")
    for t, s in enumerate(shapes):
        if s is None and t in m.shards and m.shards[t].numel == 0:
            continue  # DeepSpeed lists no shape for a rank that holds none of the parameter
        if t not in m.shards or s is None or m.shards[t].shape != tuple(s):
            got = list(m.shards[t].shape) if t in m.shards else "none"
            at = f"{path}.ranks.{t}.shard_shape" if t in m.shards else f"{path}.ranks"
            have = "no shape" if s is None else f"{list(s)}"
            raise CheckpointError(f"{at}: affine_map gives TP rank {t} shard shape {got}, the model state has {have}")
    try:
        m.check(path)
    except MapError as e:
        raise CheckpointError(f"{e.path}: {e.reason}") from None
    return m


def lower_replicated(shapes: Shapes) -> ParamMap:
    """``tp_replicated_parameter_patterns``: every rank holds all of F."""
    _same_shapes(shapes, "replicated")
    return replicated(shapes[0], len(shapes))


def lower_average(shapes: Shapes) -> ParamMap:
    """``parameter_to_average_patterns``: an average is no view (P3). Lowered to replicated, so
    the copies must agree bitwise; drift is reported, never averaged silently."""
    return lower_replicated(shapes)


def lower_two_sub_params(shapes: Shapes) -> ParamMap:
    """``parameter_with_2_sub_params_cat_dim_0``: each shard is its half of sub-param 0, then of 1."""
    widths = []
    for s in shapes:
        if s[0] % 2:
            raise CheckpointError(f"a shard of {s[0]} rows cannot hold two equal sub-parameters")
        widths.append(s[0] // 2)
    full = _full(shapes, 0)
    return sub_params(full, [full[0] // 2] * 2, [widths, widths], dim=0)


def lower_sub_params(shapes: Shapes, spec: Any, widths: Any) -> ParamMap:
    """``parameter_with_sub_params`` + ``sub_param_shard_widths`` (UCP 0.4): per-rank widths."""
    dim = int(spec.partition_dim)
    sizes = spec.shape[dim]
    if not isinstance(sizes, (tuple, list)):
        if widths is None:
            n = int(sizes)
            total = sum(s[dim] for s in shapes)
            if n <= 0 or total % n or (total // n) % len(shapes):
                raise CheckpointError(f"{n} equal sub-parameters cannot be split evenly over {len(shapes)} ranks")
            sizes = [total // n] * n
            widths = [[size // len(shapes)] * len(shapes) for size in sizes]
        else:
            raise CheckpointError("sub-parameter widths given without sub-parameter sizes")
    if widths is None:
        raise CheckpointError("sub-parameter sizes without recorded shard widths (UCP < 0.4, uneven)")
    return sub_params(_full(shapes, dim), list(sizes), [list(w) for w in widths], dim=dim)


def lower_split(shapes: Shapes, dim: int) -> ParamMap:
    """Default: a contiguous split on ``dim`` (1 for row-parallel patterns, else 0), uneven allowed."""
    if len(shapes[0]) <= dim:
        raise CheckpointError(f"cannot split a {len(shapes[0])}-d shard on dim {dim}")
    return split(_full(shapes, dim), dim, [s[dim] for s in shapes])


def lower_vocabulary(m: ParamMap, vocab: Any) -> ParamMap:
    """``vocabulary_parameter_patterns`` + ``original_vocab_size``: F keeps its padding rows and
    the valid region is the real vocabulary (docs/spec.md §1, valid region)."""
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise CheckpointError(f"original_vocab_size must be a positive int, got {vocab!r}")
    if vocab > m.logical_shape[0]:
        raise CheckpointError(f"original_vocab_size {vocab} exceeds the {m.logical_shape[0]} rows of F")
    return ParamMap(m.logical_shape, dict(m.shards), (vocab,) + m.logical_shape[1:])


def _same_shapes(shapes: Shapes, what: str) -> None:
    if any(tuple(s) != tuple(shapes[0]) for s in shapes):
        raise CheckpointError(f"{what} parameter has different shard shapes on TP ranks: {shapes}")


def _cat(info: dict, key: str, name: str) -> str | None:
    """The pattern of category ``key`` of the info that matches ``name``, if any."""
    return _match(info.get(key), name, f"{INFO}.{key}")


def _match(patterns: Any, name: str, what: str = INFO) -> str | None:
    found = [p for p in (patterns or []) if _matches(p, name, what)]
    if len(found) > 1:
        raise CheckpointError(f"{what}: matches several patterns {found}")
    return found[0] if found else None


def _matches(pattern: Any, name: str, what: str) -> bool:
    """Whether a recorded pattern matches ``name``; one that is no regular expression is refused."""
    if not isinstance(pattern, str):
        raise CheckpointError(f"{what}: pattern {pattern!r} is not a string")
    try:
        return re.match(pattern, name) is not None
    except re.error as e:
        raise CheckpointError(f"{what}: pattern {pattern!r} is not a regular expression ({e})") from None


def recorded_maps(info: dict) -> dict:
    """``universal_checkpoint_info['affine_map']['params']``: pattern -> map entry (``{}`` without)."""
    doc = info.get("affine_map")
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise CheckpointError(f"{AFFINE}: expected a map document, got {type(doc).__name__}")
    version = doc.get("version", 1)
    if isinstance(version, bool) or version != 1:
        raise CheckpointError(f"{AFFINE}.version: unknown format version {version!r} (know 1)")
    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise CheckpointError(f"{AFFINE}.params: expected an object, got {type(params).__name__}")
    return params


def lower(name: str, shapes: Shapes, info: dict) -> Lowered:
    """The TP map of ``name`` given each TP rank's shard shape and the checkpoint's info."""
    shapes = [tuple(s) if s is not None else None for s in shapes]
    tp = len(shapes)
    vocab_pat = _cat(info, "vocabulary_parameter_patterns", name)
    affine = recorded_maps(info)
    key = _match(list(affine), name, f"{AFFINE}.params")
    if key is not None:
        lowered = Lowered(lower_affine_map(affine[key], shapes, f"{AFFINE}.params.{key}"), "affine_map")
    elif any(s is None for s in shapes):
        missing = [t for t, s in enumerate(shapes) if s is None]
        raise CheckpointError(f"TP ranks {missing} record no shape for it and there is no affine_map entry")
    elif _cat(info, "tp_replicated_parameter_patterns", name):
        lowered = Lowered(lower_replicated(shapes), "replicated")
    elif _cat(info, "parameter_to_average_patterns", name):
        lowered = Lowered(lower_average(shapes), "average (as replicated)")
    elif _cat(info, "parameter_with_2_sub_params_cat_dim_0", name):
        lowered = Lowered(lower_two_sub_params(shapes), "2 sub-params", {"cat_dim": 0, "param_n_sub_params": 2})
    elif (spec := _sub_param_spec(info, name)) is not None:
        widths = (info.get("sub_param_shard_widths") or {}).get(_match(spec.patterns, name))
        lowered = Lowered(lower_sub_params(shapes, spec, widths), "sub-params", {"sub_param_shape": spec})
    else:
        dim = 1 if _cat(info, "parameter_with_row_parallelism_patterns", name) else 0
        lowered = Lowered(lower_split(shapes, dim), f"split dim {dim}", {"cat_dim": dim})
    if vocab_pat is not None and tp > 1 or vocab_pat is not None and "original_vocab_size" in info:
        lowered.map = lower_vocabulary(lowered.map, info.get("original_vocab_size"))
        lowered.extra["vocab_tensor"] = True
    return lowered


def _sub_param_spec(info: dict, name: str) -> Any:
    for spec in info.get("parameter_with_sub_params") or []:
        if _match(getattr(spec, "patterns", None), name):
            return spec
    return None


def even_shapes(name: str, full: tuple[int, ...], tp: int, info: dict) -> Shapes:
    """Each TP rank's shard shape of ``name`` (F of shape ``full``) at TP=``tp`` in Megatron's
    layouts: the category's split, even on every rank (``lower`` of these shapes is then the map).
    The legacy categories fix those layouts at any degree; an ``affine_map`` or sub-parameter widths
    (AutoTP, head-aligned) and a padded vocabulary (its padding depends on the TP degree) do not."""
    recorded = _match(list(recorded_maps(info)), name, f"{AFFINE}.params") is not None
    if recorded or _sub_param_spec(info, name) is not None:
        raise CheckpointError("its TP layout is an affine map or sub-parameter widths (AutoTP, head-aligned), "
                              "which say nothing of another TP degree")
    if _cat(info, "vocabulary_parameter_patterns", name) and info.get("original_vocab_size", full[0]) != full[0]:
        raise CheckpointError(f"a vocabulary padded from {info.get('original_vocab_size')} to {full[0]} rows: the "
                              "padding at another TP degree depends on the training script")
    if _cat(info, "tp_replicated_parameter_patterns", name) or _match(
            info.get("parameter_to_average_patterns"), name):
        return [tuple(full)] * tp
    two = _cat(info, "parameter_with_2_sub_params_cat_dim_0", name) is not None
    dim = 1 if _cat(info, "parameter_with_row_parallelism_patterns", name) else 0
    if len(full) <= dim:
        raise CheckpointError(f"cannot split a {len(full)}-d parameter on dim {dim}")
    parts = 2 * tp if two else tp
    if full[dim] % parts:
        what = "each of two sub-parameters" if two else f"dim {dim}"
        raise CheckpointError(f"{what} of shape {list(full)} does not split evenly over {tp} TP ranks")
    shard = list(full)
    shard[dim] = full[dim] // tp
    return [tuple(shard)] * tp
