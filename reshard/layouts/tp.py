"""Tensor-parallel layouts: replication, contiguous splits and the split sizes DeepSpeed uses.

Every builder takes sizes and a rank count (``ranks`` relabels local rank ``i`` to ``ranks[i]``);
none looks at parameter names. Where DeepSpeed decides something from a name (AutoTP skips the
kv-head rule for MLP, MoE and output-head layers), the builder takes that decision as a flag.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import MapError
from ..ir.param_map import ParamMap
from ..ir.piece import prod
from ._core import as_shape, check_dim, dim_blocks, finish, flat_piece, global_ranks, positive

__all__ = [
    "autotp_shard_sizes",
    "autotp_split",
    "even_sizes",
    "near_even_sizes",
    "padded_vocab",
    "padded_vocab_rows",
    "prescaled_bias",
    "replicated",
    "split",
    "sub_params",
    "vocab_parallel",
]


# -- split sizes -------------------------------------------------------------------------------


def even_sizes(total: int, parts: int) -> list[int]:
    """``parts`` equal sizes; refuses a ``total`` they do not divide (legacy TP's requirement)."""
    positive(parts, "parts")
    if total % parts:
        raise MapError(f"{total} does not split evenly into {parts} parts")
    return [total // parts] * parts


def near_even_sizes(total: int, parts: int) -> list[int]:
    """Sizes differing by at most one, the larger ones first (``torch.chunk``-like in spirit,
    the rule of DeepSpeed's ZeRO partitions and of AutoTP's plain split)."""
    positive(parts, "parts")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def autotp_shard_sizes(
    total: int,
    tp: int,
    *,
    num_kv_heads: int | None = None,
    grain: int = 1,
    head_aware: bool = True,
) -> list[int]:
    """Per-rank extents AutoTP cuts a dimension of ``total`` into (DeepSpeed's
    ``tp_shard.get_shard_size_list``), reproduced from its rules:

    * head-aware split, when ``num_kv_heads`` is known, divides ``total`` and ``head_aware`` is
      set: whole kv heads are dealt out, the first ``num_kv_heads % tp`` ranks taking one extra;
    * otherwise a grain split: ``total // grain`` grains dealt the same way, and the tail
      ``total % grain`` (which no grain holds) goes to the last rank so nothing is dropped;
    * a ``total`` smaller than one grain is dealt element by element.

    DeepSpeed turns the head rule off by layer name (MLP, MoE expert and output-head layers);
    here the caller says so with ``head_aware=False``.
    """
    positive(tp, "tp")
    positive(grain, "grain")
    if total < 0:
        raise MapError(f"total must be non-negative, got {total}")
    if num_kv_heads is not None:
        positive(num_kv_heads, "num_kv_heads")
    if num_kv_heads is not None and head_aware and total % num_kv_heads == 0:
        per_head = total // num_kv_heads
        return [per_head * n for n in near_even_sizes(num_kv_heads, tp)]
    if total >= grain:
        grains, tail = divmod(total, grain)
        sizes = [n * grain for n in near_even_sizes(grains, tp)]
        sizes[-1] += tail
        return sizes
    return near_even_sizes(total, tp)


# -- builders -----------------------------------------------------------------------------------


def replicated(shape: Sequence[int], ranks: int | Sequence[int], *, scale: float = 1.0) -> ParamMap:
    """Every rank holds all of F, multiplied by ``scale`` (``1/N`` for a bias pre-divided by the
    world size). ``ranks`` is a count or the global ranks."""
    shape = as_shape(shape)
    labels = global_ranks(ranks, None) if isinstance(ranks, int) else global_ranks(len(ranks), ranks)
    n = prod(shape)
    return finish(shape, {r: (shape, [flat_piece(0, 0, n, labels, scale)]) for r in labels})


def prescaled_bias(shape: Sequence[int], tp: int, *, ranks: Sequence[int] | None = None) -> ParamMap:
    """A bias every rank holds divided by the world size, so that the sum all-reduce of a
    row-parallel output adds it once (DeepSpeed's ``TensorParallelConv2d`` input-channel split,
    Yuan's o_proj)."""
    positive(tp, "tp")
    return replicated(shape, global_ranks(tp, ranks), scale=1.0 / tp)


def split(shape: Sequence[int], dim: int, sizes: Sequence[int], *, ranks: Sequence[int] | None = None) -> ParamMap:
    """Contiguous split along ``dim``: local rank ``i`` holds ``sizes[i]`` consecutive slices,
    in rank order (``tensor.split(sizes, dim)[i]``). Sizes may be uneven or zero."""
    shape = as_shape(shape)
    dim = check_dim(shape, dim)
    sizes = list(sizes)
    if any(s < 0 for s in sizes) or sum(sizes) != shape[dim]:
        raise MapError(f"split sizes {sizes} must be non-negative and sum to dim {dim} of {list(shape)}")
    labels = global_ranks(len(sizes), ranks)
    blocks, start = {}, 0
    for r, n in zip(labels, sizes):
        blocks[r] = [(start, n)]
        start += n
    return dim_blocks(shape, dim, blocks)


def vocab_parallel(
    shape: Sequence[int], partition_sizes: Sequence[int], *, dim: int = 0, ranks: Sequence[int] | None = None
) -> ParamMap:
    """``VocabParallelEmbedding``/``VocabParallelLinear``: rank ``i`` holds rows
    ``[sum(partition_sizes[:i]), + partition_sizes[i])``, no padding."""
    return split(shape, dim, partition_sizes, ranks=ranks)


def autotp_split(
    shape: Sequence[int],
    dim: int,
    tp: int,
    *,
    num_kv_heads: int | None = None,
    grain: int = 1,
    head_aware: bool = True,
    ranks: Sequence[int] | None = None,
) -> ParamMap:
    """AutoTP's column (``dim=0``) or row (``dim=1``) parallel split with its own sizes."""
    shape = as_shape(shape)
    d = check_dim(shape, dim)
    sizes = autotp_shard_sizes(shape[d], tp, num_kv_heads=num_kv_heads, grain=grain, head_aware=head_aware)
    return split(shape, d, sizes, ranks=ranks)


def sub_params(
    shape: Sequence[int],
    sub_sizes: Sequence[int],
    widths: Sequence[Sequence[int]],
    *,
    dim: int = 0,
    ranks: Sequence[int] | None = None,
) -> ParamMap:
    """F is sub-parameters concatenated along ``dim`` (fused q/k/v, gate/up); each is split over
    the ranks with its own per-rank ``widths[k]``, and a rank's shard is its slice of every
    sub-parameter in order."""
    shape = as_shape(shape)
    dim = check_dim(shape, dim)
    sub_sizes = list(sub_sizes)
    if sum(sub_sizes) != shape[dim] or any(s < 0 for s in sub_sizes):
        raise MapError(f"sub-parameter sizes {sub_sizes} must sum to dim {dim} of {list(shape)}")
    if len(widths) != len(sub_sizes) or not widths:
        raise MapError(f"need one width list per sub-parameter ({len(sub_sizes)}), got {len(widths)}")
    tp = len(widths[0])
    for k, (size, w) in enumerate(zip(sub_sizes, widths)):
        if len(w) != tp or sum(w) != size or any(x < 0 for x in w):
            raise MapError(f"sub-parameter {k}: widths {list(w)} must be {tp} non-negative ints summing to {size}")
    labels = global_ranks(tp, ranks)
    blocks: dict[int, list[tuple[int, int]]] = {r: [] for r in labels}
    base = 0
    for size, w in zip(sub_sizes, widths):
        start = base
        for r, n in zip(labels, w):
            blocks[r].append((start, n))
            start += n
        base += size
    return dim_blocks(shape, dim, blocks)


def padded_vocab_rows(vocab: int, tp: int, *, divisible_by: int = 1) -> int:
    """Rows of a legacy-TP (Megatron) vocabulary padded up to a multiple of ``divisible_by * tp``."""
    positive(tp, "tp")
    positive(divisible_by, "divisible_by")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def padded_vocab(
    shape: Sequence[int], tp: int, *, divisible_by: int = 1, ranks: Sequence[int] | None = None
) -> ParamMap:
    """Legacy TP vocabulary: F is the table padded with rows up to a multiple of
    ``divisible_by * tp`` and split evenly on rows; ``valid_shape`` is the real vocabulary
    (``shape``). The padding rows are part of F, so every piece stays a view (docs/spec.md §1, valid region)."""
    shape = as_shape(shape)
    if not shape:
        raise MapError("a vocabulary needs at least one dim")
    rows = padded_vocab_rows(shape[0], tp, divisible_by=divisible_by)
    logical = (rows,) + shape[1:]
    labels = global_ranks(tp, ranks)
    per = rows // tp
    return dim_blocks(logical, 0, {r: [(i * per, per)] for i, r in enumerate(labels)}, valid=shape)

