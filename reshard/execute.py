"""In-memory executor: run a plan's segments as strided copies."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import ShardError
from .ir.apply import flatten, strided_copy
from .ir.piece import prod
from .plan import ModelPlan, TransferPlan


def apply_plan(
    plan: TransferPlan,
    source_shards: Mapping[int, torch.Tensor],
    *,
    scale_power: int = 1,
    out: Mapping[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """Target shards from source shards. Target padding (``plan.unfilled``) is zero unless
    ``out`` is given, in which case segments are written into ``out`` and nothing else is."""
    flats = {}
    dtype = device = None
    for rank, t in source_shards.items():
        want = plan.source_shards.get(rank)
        if want is None:
            raise ShardError(f"rank {rank}: supplied a source shard, but the plan has no source rank {rank}")
        if t.numel() != prod(want):
            raise ShardError(f"rank {rank}: source shard has {t.numel()} elements, the plan says {prod(want)}")
        flats[rank] = flatten(t)
        dtype, device = t.dtype, t.device
    if out is None:
        targets = {r: torch.zeros(prod(s), dtype=dtype, device=device) for r, s in plan.target_shards.items()}
    else:
        targets = {r: flatten(t) for r, t in out.items()}
    for seg in plan.segments:
        src = flats.get(seg.src_rank)
        if src is None:
            raise ShardError(f"rank {seg.src_rank}: the plan reads this source shard, but it was not supplied")
        dst = targets[seg.dst_rank]
        strided_copy(dst, seg.dst, src, seg.src, seg.shape, seg.factor**scale_power)
    if out is not None:
        return dict(out)
    return {r: t.view(plan.target_shards[r]) for r, t in targets.items()}


def apply_model_plan(plan: ModelPlan, source_shards: Mapping[str, Mapping[int, torch.Tensor]], *,
                     scale_power: int = 1) -> dict[str, dict[int, torch.Tensor]]:
    """Every parameter's target shards, by name (see :func:`apply_plan`)."""
    missing = sorted(set(plan.params) - set(source_shards))
    if missing:
        raise ShardError(f"no source shards for parameter(s) {missing[:5]}")
    return {n: apply_plan(p, source_shards[n], scale_power=scale_power) for n, p in plan.params.items()}
