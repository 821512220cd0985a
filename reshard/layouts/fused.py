"""Fused and irregular tensor-parallel layouts: fused QKV in every arrangement DeepSpeed's AutoTP
produces, GLM gate/up packing, GPTBigCode MQA, CodeGen's permuted blocks, Yuan shared-QK and the
convolution splits of ``TensorParallelConv2d``.

Each builder is derived from what the partition does to the rows, not from the code that does it;
the tests hold every one against DeepSpeed 0.19.8's real partition functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import MapError
from ..ir.param_map import ParamMap
from ._core import as_shape, dim_blocks, global_ranks, positive
from .tp import autotp_shard_sizes, near_even_sizes, prescaled_bias, split, sub_params

__all__ = [
    "FUSED_QKV_KINDS",
    "bigcode_mqa",
    "codegen_qkv",
    "conv2d_bias",
    "conv2d_split_sizes",
    "conv2d_weight",
    "fused_qkv",
    "fused_qkv_sub_sizes",
    "gate_up",
    "shared_qk_head_ids",
    "shared_qk_o_proj",
    "shared_qk_o_proj_bias",
    "shared_qk_value",
]

# Arrangements of a fused q/k/v weight (DeepSpeed's names in ``fusedqkv_utils``; a module whose
# class is not recognised falls back to "bloom"). "glm" covers MPT/Baichuan/generic DecoderLayer.
FUSED_QKV_KINDS = ("bloom", "glm", "qwen", "phi3", "bigcode", "codegen")


def fused_qkv_sub_sizes(
    kind: str,
    shape: Sequence[int],
    *,
    num_kv_heads: int | None = None,
    num_attention_heads: int | None = None,
    n_embd: int | None = None,
) -> list[int]:
    """Rows of each sub-parameter of a fused weight whose rows are q, k, v in turn (or a single
    block for "bloom", which interleaves heads so the whole dim is split as one)."""
    shape = as_shape(shape)
    if not shape:
        raise MapError("a fused weight needs at least one dim")
    rows = shape[0]
    if kind == "bloom":
        return [rows]
    if kind in ("glm", "qwen"):
        if num_kv_heads == 2:
            # ChatGLM2/3: q is the hidden size, k and v share the rest; v takes any odd row.
            if n_embd is None or not 0 <= n_embd <= rows:
                raise MapError(f"{kind} with 2 kv heads needs n_embd within the {rows} rows, got {n_embd}")
            kv = (rows - n_embd) // 2
            return [n_embd, kv, rows - n_embd - kv]
        if rows % 3:
            raise MapError(f"{kind}: {rows} rows do not split into equal q, k, v thirds")
        return [rows // 3] * 3
    if kind == "phi3":
        if len(shape) < 2 or not num_attention_heads or num_kv_heads is None:
            raise MapError("phi3 needs a 2-d weight, num_attention_heads and num_kv_heads")
        kv = num_kv_heads * (shape[1] // num_attention_heads)
        if 2 * kv > rows:
            raise MapError(f"phi3: k and v ({kv} rows each) do not fit in {rows} rows")
        return [rows - 2 * kv, kv, kv]
    raise MapError(f"{kind!r} is not a sub-parameter layout (kinds: bloom, glm, qwen, phi3)")


def fused_qkv(
    kind: str,
    shape: Sequence[int],
    tp: int,
    *,
    num_kv_heads: int | None = None,
    num_attention_heads: int | None = None,
    n_embd: int | None = None,
    grain: int = 1,
    ranks: Sequence[int] | None = None,
) -> ParamMap:
    """The layout ``prepare_tp_fused_qkvw`` gives a fused q/k/v weight (or bias) of ``kind``.

    bloom/glm/qwen/phi3 split each sub-parameter with AutoTP's head-aware sizes; bigcode and
    codegen have their own builders, dispatched to here for convenience."""
    positive(tp, "tp")
    if kind == "bigcode":
        if n_embd is None:
            raise MapError("bigcode needs n_embd (the query rows)")
        return bigcode_mqa(shape, tp, n_embd=n_embd, num_kv_heads=num_kv_heads, grain=grain, ranks=ranks)
    if kind == "codegen":
        if num_kv_heads is None:
            raise MapError("codegen needs num_kv_heads")
        return codegen_qkv(shape, tp, num_kv_heads=num_kv_heads, grain=grain, ranks=ranks)
    sizes = fused_qkv_sub_sizes(
        kind, shape, num_kv_heads=num_kv_heads, num_attention_heads=num_attention_heads, n_embd=n_embd
    )
    widths = [autotp_shard_sizes(s, tp, num_kv_heads=num_kv_heads, grain=grain) for s in sizes]
    return sub_params(shape, sizes, widths, dim=0, ranks=ranks)


def gate_up(
    shape: Sequence[int],
    tp: int,
    *,
    num_kv_heads: int | None = None,
    grain: int = 1,
    ranks: Sequence[int] | None = None,
) -> ParamMap:
    """GLM's packed gate/up projection: two equal halves of the rows, each split on its own with
    AutoTP's MLP sizes (the head rule never applies to an MLP)."""
    shape = as_shape(shape)
    if not shape or shape[0] % 2:
        raise MapError(f"gate/up packing needs an even number of rows, got shape {list(shape)}")
    half = shape[0] // 2
    w = autotp_shard_sizes(half, tp, num_kv_heads=num_kv_heads, grain=grain, head_aware=False)
    return sub_params(shape, [half, half], [w, w], dim=0, ranks=ranks)


def bigcode_mqa(
    shape: Sequence[int],
    tp: int,
    *,
    n_embd: int,
    num_kv_heads: int | None = None,
    grain: int = 1,
    ranks: Sequence[int] | None = None,
) -> ParamMap:
    """GPTBigCode multi-query attention: the ``n_embd`` query rows are split with AutoTP's sizes
    and the key/value rows after them are held whole by every rank. Each rank has two pieces,
    the kv piece naming all ranks; they never merge, not even on the last rank where the two are
    adjacent, because their holders differ."""
    shape = as_shape(shape)
    if not shape or not 0 <= n_embd <= shape[0]:
        raise MapError(f"bigcode: n_embd {n_embd} must lie within the {shape[0] if shape else 0} rows")
    labels = global_ranks(positive(tp, "tp"), ranks)
    widths = autotp_shard_sizes(n_embd, tp, num_kv_heads=num_kv_heads, grain=grain)
    blocks, start = {}, 0
    for r, w in zip(labels, widths):
        blocks[r] = [(start, w), (n_embd, shape[0] - n_embd)]
        start += w
    return dim_blocks(shape, 0, blocks)


def codegen_qkv(
    shape: Sequence[int],
    tp: int,
    *,
    num_kv_heads: int,
    grain: int = 1,
    mp_num: int = 4,
    ranks: Sequence[int] | None = None,
) -> ParamMap:
    """CodeGen's fused qkv. The weight is ``mp_num`` groups of rows, each q|k|v; every third of
    every group is cut into ``tp`` blocks of ``b`` rows. The partition reorders the blocks so
    that, for block index ``beta = group * tp + j`` in turn, the q, k and v block ``j`` of that
    group follow each other, then hands rank ``r`` the ``r``-th contiguous slice of that order.

    A rank's blocks merge only where a group's last v block meets the next group's first q
    block, so the piece count depends on ``tp`` and ``mp_num``, not on the hidden size
    (11 per rank at ``tp=2``). Refused, with the reason: a head count the partition asserts
    against, rows that do not make whole blocks (the partition would then reshape across
    columns), and grain sizes that give ranks different slice lengths (the partition slices
    every rank at ``rank * its own length``, which drops and duplicates rows)."""
    shape = as_shape(shape)
    positive(tp, "tp")
    positive(mp_num, "mp_num")
    positive(num_kv_heads, "num_kv_heads")
    if num_kv_heads % (tp * mp_num):
        raise MapError(f"codegen needs num_kv_heads ({num_kv_heads}) divisible by tp * mp_num ({tp * mp_num})")
    if len(shape) != 2:
        raise MapError(f"codegen's partition reshapes a 2-d weight, got shape {list(shape)}")
    rows = shape[0]
    if rows == 0 or rows % (3 * mp_num * tp):
        raise MapError(f"codegen: {rows} rows do not form whole blocks of 3 * mp_num * tp = {3 * mp_num * tp}")
    lengths = autotp_shard_sizes(rows, tp, num_kv_heads=num_kv_heads, grain=grain)
    if len(set(lengths)) != 1:
        raise MapError(
            f"codegen: rank slice lengths {lengths} differ; the partition would slice rank r at r * its own "
            f"length, dropping and duplicating rows, which no map can describe as a cover of F"
        )
    b = rows // (3 * mp_num * tp)
    group_rows, third_rows = rows // mp_num, rows // (3 * mp_num)
    order = []  # F start row of each block, in the partition's reordered sequence
    for beta in range(mp_num * tp):
        group, j = divmod(beta, tp)
        for third in range(3):
            order.append(group * group_rows + third * third_rows + j * b)
    per_rank = len(order) // tp
    labels = global_ranks(tp, ranks)
    blocks = {r: [(s, b) for s in order[i * per_rank : (i + 1) * per_rank]] for i, r in enumerate(labels)}
    return dim_blocks(shape, 0, blocks)


# -- Yuan shared-QK ----------------------------------------------------------------------------


def shared_qk_head_ids(num_heads: int, tp: int, rank: int) -> list[int]:
    """Value heads rank ``rank`` holds under Yuan's shared-QK attention, in shard order.

    With ``per = num_heads / tp`` query heads per rank, the rank takes the value heads
    ``floor(rank * per / 2)`` onward, ``ceil(per / 2)`` of them, then the same heads of the second
    half. When ``per`` is odd the runs of neighbouring ranks share a head, so that head is held by
    two ranks (partial replication)."""
    _check_shared_qk(num_heads, tp)
    per = num_heads // tp
    first, count = rank * per // 2, (per + 1) // 2
    ids = list(range(first, first + count))
    return ids + [h + num_heads // 2 for h in ids]


def _check_shared_qk(num_heads: int, tp: int) -> None:
    positive(num_heads, "num_heads")
    positive(tp, "tp")
    if num_heads % tp:
        raise MapError(f"shared-QK needs num_heads ({num_heads}) divisible by tp ({tp})")
    if num_heads % 2:
        raise MapError(f"shared-QK needs an even number of heads, got {num_heads} (a rank would hold a head twice)")
    if tp > num_heads // 2:
        raise MapError(f"shared-QK needs tp ({tp}) at most half the heads ({num_heads})")


def _shared_qk(shape, dim: int, tp: int, num_heads: int, ranks) -> ParamMap:
    shape = as_shape(shape)
    _check_shared_qk(num_heads, tp)
    if len(shape) <= dim or shape[dim] % num_heads:
        raise MapError(f"shared-QK: dim {dim} of {list(shape)} is not a whole number of {num_heads} heads")
    hd = shape[dim] // num_heads
    labels = global_ranks(tp, ranks)
    blocks = {r: [(h * hd, hd) for h in shared_qk_head_ids(num_heads, tp, i)] for i, r in enumerate(labels)}
    return dim_blocks(shape, dim, blocks)


def shared_qk_value(
    shape: Sequence[int], tp: int, *, num_heads: int, ranks: Sequence[int] | None = None
) -> ParamMap:
    """Yuan's value projection (weight or bias): rows are heads, a rank holds its shared-QK heads."""
    return _shared_qk(shape, 0, tp, num_heads, ranks)


def shared_qk_o_proj(
    shape: Sequence[int], tp: int, *, num_heads: int, ranks: Sequence[int] | None = None
) -> ParamMap:
    """Yuan's o_proj weight: the same head selection on columns, so pieces are column blocks
    (source strides ``(cols, 1)``)."""
    return _shared_qk(shape, 1, tp, num_heads, ranks)


def shared_qk_o_proj_bias(shape: Sequence[int], tp: int, *, ranks: Sequence[int] | None = None) -> ParamMap:
    """Yuan's o_proj bias: replicated, divided by ``tp`` (what ``shard_value_with_share_qk``
    computes before it fails to return it, see the tests)."""
    return prescaled_bias(shape, tp, ranks=ranks)


# -- TensorParallelConv2d --------------------------------------------------------------------


def conv2d_split_sizes(total: int, tp: int) -> list[int]:
    """Channel counts ``TensorParallelConv2d`` gives each rank: near-even, with the remainder on
    the *last* ranks (it builds the offsets walking ranks downward)."""
    return near_even_sizes(total, tp)[::-1]


def conv2d_weight(
    shape: Sequence[int], tp: int, *, shard_by_oc: bool, ranks: Sequence[int] | None = None
) -> ParamMap:
    """Conv weight ``(out, in, kh, kw)`` split on output channels (inner layers) or input
    channels (the last layer, whose outputs are all-reduced)."""
    shape = as_shape(shape)
    dim = 0 if shard_by_oc else 1
    if len(shape) <= dim:
        raise MapError(f"conv weight needs dim {dim}, got shape {list(shape)}")
    return split(shape, dim, conv2d_split_sizes(shape[dim], tp), ranks=ranks)


def conv2d_bias(
    shape: Sequence[int], tp: int, *, shard_by_oc: bool, ranks: Sequence[int] | None = None
) -> ParamMap:
    """Conv bias: split with the weight's output channels, or, under an input-channel split,
    replicated and divided by ``tp`` (scale ``1/tp``)."""
    shape = as_shape(shape)
    if shard_by_oc:
        return split(shape, 0, conv2d_split_sizes(shape[0], tp), ranks=ranks)
    return prescaled_bias(shape, tp, ranks=ranks)
