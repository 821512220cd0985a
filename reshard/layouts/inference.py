"""Inference-engine layouts (vLLM / SGLang tensor and expert parallelism) as maps, and fused targets.

Every builder takes sizes, a parallel degree and optional global ``ranks`` (local rank ``i`` is
``ranks[i]``), never parameter names; the names are data (:mod:`reshard.layouts.arch`).

* :func:`column_parallel`, :func:`row_parallel` -- ``ColumnParallelLinear`` (rows split evenly),
  ``RowParallelLinear`` (columns split evenly; its bias is whole on every rank).
* :func:`qkv_parts` -- ``QKVParallelLinear``: per rank ``[q_r; k_r; v_r]``; when TP exceeds the
  key/value head count each key/value head is held by ``tp / num_kv_heads`` consecutive ranks.
* :func:`merged_column_parts` -- ``MergedColumnParallelLinear`` (``gate_up_proj``: ``[gate_r; up_r]``).
* :func:`vocab_parallel_padded` -- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary
  padded (vLLM: to a multiple of ``pad_to`` = 64, then split evenly over TP; ``per_rank=True``:
  to a multiple of ``pad_to × tp``, Megatron's rule), padding rows zero.
* :func:`moe_experts` -- ``FusedMoE``'s ``w13`` (``[E_local, 2·I/tp, H]``, per expert
  ``[gate; up]``) and ``w2`` (``[E_local, H, I/tp]``) from the stacked expert tensors of
  transformers 5 (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``),
  over an expert-parallel × tensor-parallel grid (global rank index ``ep_rank · tp + tp_rank``).

**Fused targets.** An engine keeps some tensors made of several source parameters (``qkv_proj``
from ``q_proj``, ``k_proj``, ``v_proj``). Such a target is a :class:`Placed`: the *compact* map of
one source parameter, whose shard on rank ``r`` is exactly that parameter's part of the engine
tensor (an ordinary valid map: P0-P3 and tiling hold, so the planner plans it unchanged), plus
the engine tensor's name, its shape on every rank and the element offset at which the part
starts in it. A part is a contiguous run of the engine tensor: vLLM and SGLang build every fused
tensor by concatenation along dim 0 (per expert for ``w13``), so a block of rows is contiguous in
a row-major tensor. A plan segment's destination view into the compact shard therefore becomes a
view of the engine tensor by adding the offset (exact: the part is contiguous), and the executor
writes straight into the engine's tensor. Read the other way, a Placed is the map whose shard
is the whole engine tensor with every piece's dest offset shifted: the convention of ZeRO's
``shard="partition"`` maps, where one flat partition is shared by many parameters. Such a map
is not valid alone (one parameter does not tile the shared shard), which is why the compact map
is what is stored and planned, and :func:`check_placed` checks that the parts of each engine
tensor tile it exactly on every rank. A target that is not fused is a Placed with offset 0 and
the map's own shard shapes (:func:`placed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import MapError
from ..ir.blocks import block_grid, coarsen
from ..ir.param_map import ParamMap
from ..ir.piece import Piece, prod
from ._core import Shape, as_shape, box_piece, dim_blocks, finish, global_ranks, positive
from .tp import even_sizes, replicated, split

__all__ = [
    "Placed",
    "check_placed",
    "column_parallel",
    "engine_shapes",
    "merged_column_parts",
    "moe_experts",
    "placed",
    "qkv_parts",
    "row_parallel",
    "scale_placed",
    "vocab_padded_rows",
    "vocab_parallel_padded",
]


@dataclass(frozen=True, slots=True, eq=False)
class Placed:
    """A target map whose shard on each rank is a contiguous part of an engine tensor: on rank
    ``r``, ``map``'s shard is elements ``[offsets[r], offsets[r] + numel)`` of the engine tensor
    ``into``, which has shape ``shapes[r]`` (module docstring)."""

    map: ParamMap
    into: str
    shapes: Mapping[int, tuple[int, ...]]
    offsets: Mapping[int, int]

    def __post_init__(self) -> None:
        if set(self.shapes) != set(self.map.ranks) or set(self.offsets) != set(self.map.ranks):
            raise MapError(f"{self.into!r}: placement names ranks {sorted(self.shapes)}, the map "
                           f"{list(self.map.ranks)}")
        for r, s in self.map.shards.items():
            off, total = self.offsets[r], prod(tuple(self.shapes[r]))
            if not isinstance(off, int) or off < 0 or off + s.numel > total:
                raise MapError(f"{self.into!r}: rank {r}: part at offset {off} of {s.numel} elements does not fit "
                               f"the engine tensor {list(self.shapes[r])}")

    def with_ranks(self, relabel: Mapping[int, int]) -> Placed:
        """The same placement with ranks renamed (``relabel[old] = new``)."""
        return Placed(self.map.with_ranks(relabel), self.into, {relabel[r]: s for r, s in self.shapes.items()},
                      {relabel[r]: o for r, o in self.offsets.items()})

    def named(self, into: str) -> Placed:
        return Placed(self.map, into, self.shapes, self.offsets)


def placed(m: ParamMap, into: str) -> Placed:
    """A target that is a whole engine tensor (not fused): offset 0, the map's shard shapes."""
    return Placed(m, into, {r: s.shape for r, s in m.shards.items()}, dict.fromkeys(m.ranks, 0))


def scale_placed(p: Placed, block: tuple[int, int]) -> Placed:
    """The placement of a block-scaled 2-d payload's scales (docs/spec.md §7.5): the map
    ``ir.blocks.coarsen`` derives from the payload's, in each rank's scale tensor (the block grid
    of the payload's engine tensor) from the block row where the part starts, ``⌈row / bm⌉``
    (vLLM's and SGLang's ``BlockQuantScaleParameter`` loaders). Raises :class:`MapError` where a
    part is not whole rows of its engine tensor or starts inside a block row."""
    scales = coarsen(p.map, block)
    shapes, offsets = {}, {}
    for r, s in p.map.shards.items():
        shape = tuple(p.shapes[r])
        if len(shape) != 2 or len(s.shape) != 2 or s.shape[1] != shape[1] or p.offsets[r] % shape[1]:
            raise MapError(f"{p.into!r} on rank {r}: a part {list(s.shape)} at element {p.offsets[r]} is not whole "
                           f"rows of the 2-d engine tensor {list(shape)}: its block scales have no place")
        row = p.offsets[r] // shape[1]
        if row % block[0]:
            raise MapError(f"{p.into!r} on rank {r}: a part starts at row {row}, inside a block of {block[0]} rows "
                           "(the scale row would hold two parts' blocks)")
        grid = block_grid(shape, block)
        shapes[r], offsets[r] = grid, row // block[0] * grid[1]
    return Placed(scales, p.into, shapes, offsets)


def check_placed(targets: Mapping[str, Placed]) -> None:
    """Raise :class:`MapError` unless, on every rank, the parts placed into each engine tensor
    agree on its shape and tile it exactly (no element written twice, none left unwritten)."""
    by_tensor: dict[tuple[str, int], list[tuple[int, int, str, tuple[int, ...]]]] = {}
    for name, t in targets.items():
        for r, s in t.map.shards.items():
            by_tensor.setdefault((t.into, r), []).append((t.offsets[r], s.numel, name, tuple(t.shapes[r])))
    for (into, r), parts in sorted(by_tensor.items()):
        shapes = {p[3] for p in parts}
        if len(shapes) > 1:
            raise MapError(f"engine tensor {into!r} on rank {r}: its parts disagree on its shape {sorted(shapes)}")
        (shape,) = shapes
        cursor, prev = 0, None
        for off, n, name, _ in sorted(parts):
            if off < cursor:
                raise MapError(f"engine tensor {into!r} on rank {r}: {name!r} at element {off} overlaps {prev!r}")
            if off > cursor:
                raise MapError(f"engine tensor {into!r} on rank {r}: elements [{cursor}, {off}) are written by no "
                               f"parameter")
            cursor, prev = off + n, name
        if cursor != prod(shape):
            raise MapError(f"engine tensor {into!r} on rank {r}: elements [{cursor}, {prod(shape)}) are written "
                           f"by no parameter")


def engine_shapes(targets: Mapping[str, Placed], rank: int) -> dict[str, tuple[int, ...]]:
    """The engine tensors rank ``rank`` holds, by name, with their shapes."""
    return {t.into: tuple(t.shapes[rank]) for t in targets.values() if rank in t.shapes}


# -- plain tensor parallelism ---------------------------------------------------------------------


def column_parallel(shape: Sequence[int], tp: int, *, ranks: Sequence[int] | None = None) -> ParamMap:
    """``ColumnParallelLinear`` weight or bias: dim 0 split evenly (vLLM refuses an uneven one)."""
    shape = as_shape(shape)
    return split(shape, 0, even_sizes(shape[0] if shape else 0, positive(tp, "tp")), ranks=ranks)


def row_parallel(shape: Sequence[int], tp: int, *, ranks: Sequence[int] | None = None) -> ParamMap:
    """``RowParallelLinear``: a 2-d weight's columns split evenly; a 1-d bias whole on every rank
    (the engine adds it once, after the all-reduce)."""
    shape = as_shape(shape)
    labels = global_ranks(positive(tp, "tp"), ranks)
    if len(shape) == 1:
        return replicated(shape, labels)
    if len(shape) != 2:
        raise MapError(f"a row-parallel weight is 2-d, got shape {list(shape)}")
    return split(shape, 1, even_sizes(shape[1], tp), ranks=labels)


def _cat_parts(maps: Sequence[ParamMap]) -> list[Placed]:
    """Parts concatenated along dim 0 on every rank, in the order given: the engine tensor's rows
    are each part's shard rows in turn (trailing dims must agree)."""
    ranks = maps[0].ranks
    out = []
    for k, m in enumerate(maps):
        if m.ranks != ranks:
            raise MapError(f"fused part {k} is on ranks {list(m.ranks)}, part 0 on {list(ranks)}")
    shapes, offsets = {}, [dict.fromkeys(ranks, 0) for _ in maps]
    for r in ranks:
        parts = [m.shard(r).shape for m in maps]
        if len({p[1:] for p in parts}) != 1:
            raise MapError(f"rank {r}: fused parts {[list(p) for p in parts]} differ past dim 0")
        shapes[r] = (sum(p[0] for p in parts),) + parts[0][1:]
        at = 0
        for k, p in enumerate(parts):
            offsets[k][r] = at
            at += prod(p)
    for k, m in enumerate(maps):
        out.append(Placed(m, "", dict(shapes), offsets[k]))
    return out


def _heads(rows: int, heads: int, what: str) -> int:
    positive(heads, what)
    if rows % heads:
        raise MapError(f"{rows} rows are not a whole number of {heads} {what}")
    return rows // heads


def kv_head_of(rank: int, tp: int, num_kv_heads: int) -> list[int]:
    """The key/value heads TP rank ``rank`` holds under ``QKVParallelLinear``: ``num_kv_heads / tp``
    consecutive heads, or, when ``tp >= num_kv_heads``, head ``rank // (tp / num_kv_heads)``
    (each head replicated on that many consecutive ranks)."""
    if tp >= num_kv_heads:
        if tp % num_kv_heads:
            raise MapError(f"tp {tp} is not a multiple of the {num_kv_heads} key/value heads")
        return [rank // (tp // num_kv_heads)]
    if num_kv_heads % tp:
        raise MapError(f"{num_kv_heads} key/value heads do not split evenly over tp {tp}")
    per = num_kv_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def qkv_parts(q_shape: Sequence[int], kv_shape: Sequence[int], tp: int, *, num_heads: int, num_kv_heads: int,
              ranks: Sequence[int] | None = None) -> tuple[Placed, Placed, Placed]:
    """``QKVParallelLinear``: the q, k and v parts (weights ``[heads · head_dim, hidden]`` or biases
    ``[heads · head_dim]``) of the engine's ``qkv_proj``, ``[q_r; k_r; v_r]`` on TP rank ``r``.
    Query heads split evenly; key/value heads as :func:`kv_head_of` says, a replicated head
    naming every rank that holds it."""
    q_shape, kv_shape = as_shape(q_shape), as_shape(kv_shape)
    labels = global_ranks(positive(tp, "tp"), ranks)
    if not q_shape or not kv_shape or q_shape[1:] != kv_shape[1:]:
        raise MapError(f"q {list(q_shape)} and k/v {list(kv_shape)} must agree past dim 0")
    d = _heads(q_shape[0], num_heads, "query heads")
    if _heads(kv_shape[0], num_kv_heads, "key/value heads") != d:
        raise MapError(f"query head size {d} differs from key/value head size {kv_shape[0] // num_kv_heads}")
    if num_heads % tp:
        raise MapError(f"{num_heads} query heads do not split evenly over tp {tp}")
    q = split(q_shape, 0, even_sizes(q_shape[0], tp), ranks=labels)
    blocks = {r: [(h * d, d) for h in kv_head_of(i, tp, num_kv_heads)] for i, r in enumerate(labels)}
    kv = dim_blocks(kv_shape, 0, blocks)
    q_part, k_part, v_part = _cat_parts([q, kv, kv])
    return q_part, k_part, v_part


def merged_column_parts(shapes: Sequence[Sequence[int]], tp: int, *,
                        ranks: Sequence[int] | None = None) -> list[Placed]:
    """``MergedColumnParallelLinear`` (``gate_up_proj``): each source split evenly on dim 0, the
    engine tensor ``[part_0 r; part_1 r; ...]`` on TP rank ``r``."""
    labels = global_ranks(positive(tp, "tp"), ranks)
    return _cat_parts([column_parallel(s, tp, ranks=labels) for s in shapes])


# -- vocabulary -----------------------------------------------------------------------------------


def vocab_padded_rows(vocab: int, tp: int, *, pad_to: int = 64, per_rank: bool = False) -> int:
    """Rows of a vocabulary-parallel table: vLLM's ``pad_vocab_size`` (a multiple of ``pad_to``), which
    TP must then divide (vLLM asserts it); with ``per_rank``, a multiple of ``pad_to × tp``."""
    positive(tp, "tp")
    multiple = positive(pad_to, "pad_to") * (tp if per_rank else 1)
    rows = -(-vocab // multiple) * multiple
    if rows % tp:
        raise MapError(f"vocabulary of {vocab} padded to {rows} rows does not split evenly over tp {tp}")
    return rows


def vocab_parallel_padded(shape: Sequence[int], tp: int, *, pad_to: int = 64, per_rank: bool = False,
                          ranks: Sequence[int] | None = None) -> ParamMap:
    """``VocabParallelEmbedding`` / ``ParallelLMHead`` (weight, or a 1-d bias): F is the table padded
    to :func:`vocab_padded_rows` rows, split evenly; ``valid_shape`` is the real vocabulary, so the
    padding rows are planned as ``unfilled`` and zeroed."""
    shape = as_shape(shape)
    if not shape:
        raise MapError("a vocabulary table needs at least one dim")
    labels = global_ranks(positive(tp, "tp"), ranks)
    rows = vocab_padded_rows(shape[0], tp, pad_to=pad_to, per_rank=per_rank)
    per = rows // tp
    return dim_blocks((rows,) + shape[1:], 0, {r: [(i * per, per)] for i, r in enumerate(labels)}, valid=shape)


# -- experts --------------------------------------------------------------------------------------


def _experts_of(num_experts: int, ep: int, placement: str) -> list[list[int]]:
    positive(ep, "ep")
    if num_experts % ep:
        raise MapError(f"{num_experts} experts do not split evenly over ep {ep}")
    if placement == "linear":
        n = num_experts // ep
        return [list(range(e * n, (e + 1) * n)) for e in range(ep)]
    if placement == "round_robin":
        return [list(range(e, num_experts, ep)) for e in range(ep)]
    raise MapError(f'expert placement must be "linear" or "round_robin", got {placement!r}')


def moe_experts(shape: Sequence[int], kind: str, *, ep: int, tp: int = 1, placement: str = "linear",
                ranks: Sequence[int] | None = None) -> ParamMap:
    """``FusedMoE`` ``w13`` (``kind="w13"``, F ``[E, 2I, H]``: gate rows then up rows) or ``w2``
    (``kind="w2"``, F ``[E, H, I]``) over ``ep × tp`` ranks, global index ``ep_rank · tp + tp_rank``:
    EP rank ``e`` holds its experts (vLLM's ``linear`` or ``round_robin`` placement) stacked on
    dim 0, each cut on the intermediate dim over TP (``w13``: ``[gate_t; up_t]``)."""
    full = as_shape(shape)
    if len(full) != 3 or kind not in ("w13", "w2"):
        raise MapError(f'moe_experts needs a 3-d [E, ...] weight and kind "w13" or "w2", got {list(full)}, {kind!r}')
    labels = global_ranks(positive(ep, "ep") * positive(tp, "tp"), ranks)
    inter = full[1] // 2 if kind == "w13" else full[2]
    if kind == "w13" and full[1] % 2:
        raise MapError(f"w13 needs an even number of rows (gate then up), got {full[1]}")
    it = even_sizes(inter, tp)[0]
    boxes: dict[int, list[tuple[list[int], list[int], list[int]]]] = {}
    by_rank = _experts_of(full[0], ep, placement)
    for e_rank, experts in enumerate(by_rank):
        for t in range(tp):
            r = labels[e_rank * tp + t]
            mine = []
            for j, x in enumerate(experts):
                if kind == "w13":
                    mine += [([x, t * it, 0], [1, it, full[2]], [j, 0, 0]),
                             ([x, inter + t * it, 0], [1, it, full[2]], [j, it, 0])]
                else:
                    mine.append(([x, 0, t * it], [1, full[1], it], [j, 0, 0]))
            boxes[r] = mine
    shard = (len(by_rank[0]), 2 * it, full[2]) if kind == "w13" else (len(by_rank[0]), full[1], it)
    return _box_map(full, shard, boxes)


def _box_map(full: Shape, shard: Shape, boxes: Mapping[int, list[tuple[list[int], list[int], list[int]]]]
             ) -> ParamMap:
    """Each rank's shard (all of shape ``shard``) made of boxes ``(F starts, extents, shard starts)``;
    boxes of F are identical or disjoint across ranks, so a box's holders are the ranks listing it."""
    holders: dict[tuple, set[int]] = {}
    for r, bs in boxes.items():
        for starts, ext, _ in bs:
            holders.setdefault((tuple(starts), tuple(ext)), set()).add(r)
    shards: dict[int, tuple[Shape, list[Piece]]] = {}
    for r, bs in boxes.items():
        pieces = [box_piece(full, s, e, shard, d, holders[(tuple(s), tuple(e))]) for s, e, d in bs]
        shards[r] = (shard, pieces)
    return finish(full, shards)
