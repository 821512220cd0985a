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

from ...errors import CheckpointError, MapFormatError
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


def lower_affine_map(entry: Any, shapes: Shapes) -> ParamMap:
    """The checkpoint's own map (JSON format v1)."""
    try:
        m = map_from_dict(entry, "affine_map")
    except MapFormatError as e:
        raise CheckpointError(f"malformed affine_map entry: {e}") from None
    for t, s in enumerate(shapes):
        if s is None and t in m.shards and m.shards[t].numel == 0:
            continue  # DeepSpeed lists no shape for a rank that holds none of the parameter
        if t not in m.shards or s is None or m.shards[t].shape != tuple(s):
            got = list(m.shards[t].shape) if t in m.shards else "none"
            raise CheckpointError(f"affine_map gives TP rank {t} shard shape {got}, the model state has {list(s)}")
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


def _match(patterns: Any, name: str) -> str | None:
    found = [p for p in (patterns or []) if re.match(p, name)]
    if len(found) > 1:
        raise CheckpointError(f"matches several patterns {found}")
    return found[0] if found else None


def lower(name: str, shapes: Shapes, info: dict) -> Lowered:
    """The TP map of ``name`` given each TP rank's shard shape and the checkpoint's info."""
    shapes = [tuple(s) if s is not None else None for s in shapes]
    tp = len(shapes)
    vocab_pat = _match(info.get("vocabulary_parameter_patterns"), name)
    affine = (info.get("affine_map") or {}).get("params", {}) if isinstance(info.get("affine_map"), dict) else {}
    key = _match(list(affine), name)
    if key is not None:
        lowered = Lowered(lower_affine_map(affine[key], shapes), "affine_map")
    elif any(s is None for s in shapes):
        missing = [t for t, s in enumerate(shapes) if s is None]
        raise CheckpointError(f"TP ranks {missing} record no shape for it and there is no affine_map entry")
    elif _match(info.get("tp_replicated_parameter_patterns"), name):
        lowered = Lowered(lower_replicated(shapes), "replicated")
    elif _match(info.get("parameter_to_average_patterns"), name):
        lowered = Lowered(lower_average(shapes), "average (as replicated)")
    elif _match(info.get("parameter_with_2_sub_params_cat_dim_0"), name):
        lowered = Lowered(lower_two_sub_params(shapes), "2 sub-params", {"cat_dim": 0, "param_n_sub_params": 2})
    elif (spec := _sub_param_spec(info, name)) is not None:
        widths = (info.get("sub_param_shard_widths") or {}).get(_match(spec.patterns, name))
        lowered = Lowered(lower_sub_params(shapes, spec, widths), "sub-params", {"sub_param_shape": spec})
    else:
        dim = 1 if _match(info.get("parameter_with_row_parallelism_patterns"), name) else 0
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
    affine = info.get("affine_map") if isinstance(info.get("affine_map"), dict) else {}
    if _match(list((affine or {}).get("params", {})), name) is not None or _sub_param_spec(info, name) is not None:
        raise CheckpointError("its TP layout is an affine map or sub-parameter widths (AutoTP, head-aligned), "
                              "which say nothing of another TP degree")
    if _match(info.get("vocabulary_parameter_patterns"), name) and info.get("original_vocab_size", full[0]) != full[0]:
        raise CheckpointError(f"a vocabulary padded from {info.get('original_vocab_size')} to {full[0]} rows: the "
                              "padding at another TP degree depends on the training script")
    if _match(info.get("tp_replicated_parameter_patterns"), name) or _match(
            info.get("parameter_to_average_patterns"), name):
        return [tuple(full)] * tp
    two = _match(info.get("parameter_with_2_sub_params_cat_dim_0"), name) is not None
    dim = 1 if _match(info.get("parameter_with_row_parallelism_patterns"), name) else 0
    if len(full) <= dim:
        raise CheckpointError(f"cannot split a {len(full)}-d parameter on dim {dim}")
    parts = 2 * tp if two else tp
    if full[dim] % parts:
        what = "each of two sub-parameters" if two else f"dim {dim}"
        raise CheckpointError(f"{what} of shape {list(full)} does not split evenly over {tp} TP ranks")
    shard = list(full)
    shard[dim] = full[dim] // tp
    return [tuple(shard)] * tp
