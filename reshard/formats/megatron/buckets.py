"""Several DDP buckets per buffer (docs/megatron-checkpoints.md §2.5): where Megatron cuts a DDP
buffer into buckets, from the run's ``args``, and each bucket's layout.

Megatron-Core 0.19.2 (``megatron/training/training.py``: ``resolve_ddp_bucket_size`` and the
per-chunk bucket sizes; ``DistributedOptimizer._compute_per_buffer_param_layout``):

* a bucket size only with ``--overlap-grad-reduce``: ``ddp_num_buckets`` gives the rank's
  parameter count (every model chunk, experts included) over that many, else ``ddp_bucket_size``,
  else ``max(40M, 1M x DP)``; none (one bucket) on pipeline stages after the first, on model
  chunks after the first and with ``--overlap-param-gather-with-optimizer-step``;
* parameters in reverse registration order, each start rounded up to 64 elements; a bucket closes
  after the parameter that brings it to the bucket size (a parameter is never split), its end
  padded to a multiple of ``lcm(DP, 128)`` where the next bucket starts.

A ``dp_reshardable`` checkpoint keys each bucket apart (``bucket_idx_<b>``, positions from the
bucket's start, cut at its unpadded size); a legacy ``distrib_optim.pt`` puts the buckets'
unpadded parts back to back (:func:`flat_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointError
from .model import EMBED, OUTPUT, Arch, LocalParam, pad

__all__ = ["FULLY_RESHARDABLE_SHIFTED", "BucketLayout", "bucket_layouts", "bucket_size", "copy_first", "copy_name",
           "dense_buffer_params", "embedding_copy", "flat_layout", "is_copy", "several_buckets", "shared_embedding"]

_DEFAULT_MIN = 40_000_000


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """One bucket: its parameters' ``(param, start, end)`` from the bucket's start, its size before
    and after the end padding."""

    params: tuple[tuple[LocalParam, int, int], ...]
    unpadded: int
    numel: int


def bucket_layouts(params: list[LocalParam], dp: int, size: int | None,
                   apart: Callable[[LocalParam], bool] = lambda lp: False) -> list[BucketLayout]:
    """One DDP buffer's buckets (``size`` None: one bucket), as Megatron lays them out; a parameter
    ``apart`` says is a ``shared_embedding`` one gets a bucket of its own (the one before it closed
    at its 64-aligned start)."""
    out: list[BucketLayout] = []
    cur: list[tuple[LocalParam, int, int]] = []
    pos = 0
    for p in reversed(params):
        pos = pad(pos, 64)
        if apart(p) and cur:
            out.append(BucketLayout(tuple(cur), pos, pad(pos, math.lcm(dp, 128))))
            cur, pos = [], 0
        cur.append((p, pos, pos + p.numel))
        pos += p.numel
        if (size is not None and pos >= size) or apart(p):
            out.append(BucketLayout(tuple(cur), pos, pad(pos, math.lcm(dp, 128))))
            cur, pos = [], 0
    if cur:
        out.append(BucketLayout(tuple(cur), pos, pad(pos, math.lcm(dp, 128))))
    return out


def embedding_copy(arch: Arch, pp: int) -> bool:
    """Whether stage ``pp`` keeps a copy of the word embeddings: the last one, over several stages,
    for the MTP block or for tied embeddings (its gradient is all-reduced with the first stage's,
    so it stays equal to it)."""
    return (bool(arch.mtp) or arch.tied) and arch.pp > 1 and pp == arch.pp - 1


def copy_first(arch: Arch) -> bool:
    """Where the last stage registers its embedding copy: first with MTP (GPTModel builds the
    MTP block's embedding before the decoder), else last (tied: ``output_layer.weight``, after the
    final norm)."""
    return bool(arch.mtp)


def copy_name(arch: Arch) -> str:
    """The copy's name in the last stage's model: the MTP block's embedding (with MTP the output
    layer holds no weight of its own, tied or not), else the tied ``output_layer.weight``."""
    return EMBED if arch.mtp else OUTPUT


def dense_buffer_params(arch: Arch, pp: int, t: int, vp: int | None = None) -> list[LocalParam]:
    """Stage ``pp``'s dense DDP buffer's parameters (TP rank ``t``; model chunk ``vp``, or every
    chunk): :meth:`Arch.stage_params` with the embedding copy where the stage keeps one (in its
    last model chunk), first (MTP) or last (tied)."""
    params = arch.stage_params(pp, t, vp=vp)
    if not embedding_copy(arch, pp) or vp not in (None, arch.vpp - 1):
        return params
    copy = arch.local(arch.spec(EMBED), (), t)
    if not copy_first(arch):
        return params + [copy]
    at = len(params) - len(arch.stage_params(pp, t, vp=arch.vpp - 1)) if vp is None else 0
    return params[:at] + [copy] + params[at:]


def is_copy(arch: Arch, pp: int, lp: LocalParam) -> bool:
    """Whether ``lp`` of a stage ``pp`` dense buffer is the last stage's embedding copy."""
    return lp.spec.key == EMBED and embedding_copy(arch, pp)


def shared_embedding(arch: Arch) -> Callable[[LocalParam], bool]:
    """Which parameters Megatron marks ``shared_embedding`` (``setup_embeddings_and_output_layer``):
    with MTP or tied embeddings over several stages, the first stage's embedding and the last
    stage's copy. The distributed optimizer gives each a bucket of its own."""
    on = (bool(arch.mtp) or arch.tied) and arch.pp > 1
    return lambda lp: on and lp.spec.key == EMBED


def flat_layout(buckets: list[BucketLayout]) -> tuple[list[tuple[LocalParam, int, int]], int]:
    """A legacy ``distrib_optim.pt`` buffer: the buckets' unpadded parts back to back
    (``get_parameter_state_dp_zero``). Returns ``([(param, start, end)], numel)``."""
    out, at = [], 0
    for b in buckets:
        out += [(lp, at + s, at + e) for lp, s, e in b.params]
        at += b.unpadded
    return out, at


def _rank_numel(arch: Arch, pp: int) -> int:
    """What ``num_parameters`` counts on a rank of stage ``pp``: every model chunk's parameters,
    the rank's experts included (each TP / expert rank holds as many)."""
    n = sum(lp.numel for lp in arch.stage_params(pp, 0))
    if arch.expert_apart:
        n += sum(lp.numel for lp in arch.stage_params(pp, 0, expert_rank=0))
    return n


def bucket_size(args: Any, arch: Arch, pp: int, vp: int, where: str) -> int | None:
    """The bucket size of stage ``pp``'s model chunk ``vp`` (None: one bucket), as ``args`` (and the
    sizes of ``arch``, which may be a target's) make Megatron compute it."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    if pp > 0 or vp > 0 or getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    num = getattr(args, "ddp_num_buckets", None)
    size = getattr(args, "ddp_bucket_size", None)
    if num is not None:
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise CheckpointError(f"{where}: args.ddp_num_buckets = {num!r}: not a positive integer")
        return _rank_numel(arch, pp) // num
    if size is None:
        return max(_DEFAULT_MIN, 1_000_000 * arch.dp)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise CheckpointError(f"{where}: args.ddp_bucket_size = {size!r}: not a positive integer")
    return size


def several_buckets(args: Any, arch: Arch, where: str) -> bool:
    """Whether a DDP buffer of ``arch`` holds more than one bucket under ``args`` (only the first
    stage's first model chunk can)."""
    size = bucket_size(args, arch, 0, 0, where)
    if size is None:
        return False
    groups = [arch.stage_params(0, 0, vp=0)] + ([arch.stage_params(0, 0, expert_rank=0, vp=0)]
                                                 if arch.expert_apart else [])
    return any(len(bucket_layouts(g, arch.dp, size)) > 1 for g in groups if g)


# Megatron-Core 0.19.2's ``sharded_param_state_fully_reshardable`` (save and load) slices the
# buckets' unpadded parts laid back to back at the padded buffer's positions: with several buckets
# every bucket after the first one with end padding is read and written shifted, its tail zeros.
FULLY_RESHARDABLE_SHIFTED = ("the fully_reshardable optimizer with several DDP buckets (Megatron-Core 0.19.2 writes "
                             "and reads its states shifted past the first padded bucket)")
