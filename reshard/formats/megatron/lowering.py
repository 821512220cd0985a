"""How Megatron's layouts lower to maps (docs/spec.md, "Megatron-Core"). Every shard is something
that lies contiguous in a file, named by a *rank label* of its own:

* a DCP chunk of a key (``torch_dist``: model weights, plain Adam's and ``fully_reshardable``'s
  states): one box piece of the stacked F (:func:`chunk_map`);
* a local parameter (a legacy file's module tensor, a legacy ``distrib_optim.pt`` range): its
  boxes of F stacked along its dim 0, replicated norms located on every TP rank's label
  (:func:`local_map`);
* a range of a distributed-optimizer bucket: the local map composed with the flat ranges each
  bucket chunk holds of each local parameter (:func:`composite`), the buckets being flat groups.

A :class:`Lowered` is one (key, state): its map and where each label's shard lies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ...errors import CheckpointError, ReshardError
from ...ir.param_map import ParamMap
from ...ir.piece import Piece, View, prod, row_major_strides
from ...layouts import ZeroComposer
from ...layouts._core import box_piece, finish
from ..dcp.checkpoint import tiling
from .model import Arch, KeySpec, LocalParam

__all__ = ["Lowered", "chunk_map", "composite", "local_map", "part_pieces"]


@dataclass(frozen=True, slots=True)
class Lowered:
    """One key's state: its map over rank labels, each label's shard (flat, as it lies in the
    file), the TP rank a label's copy belongs to (``None`` where nothing is replicated) and the
    storage rank whose file holds it (``None`` where the files do not say)."""

    map: ParamMap
    fragment: Callable[[int], torch.Tensor]
    tp: Callable[[int], int | None]
    saver: Callable[[int], int | None] = lambda label: None


def part_pieces(full: tuple[int, ...], lp: LocalParam, locations: frozenset[int]) -> list[Piece]:
    """A local parameter's boxes of F as pieces of its (unstacked, row-major) local tensor."""
    fs, ls = row_major_strides(full), row_major_strides(lp.shape)
    k = lp.spec.stacked
    pieces, row = [], 0
    for offsets, sizes in lp.parts:
        shape = sizes[k:]
        pieces.append(Piece(shape, View(sum(a * s for a, s in zip(offsets, fs)), fs[k:]), View(row * ls[0], ls),
                            locations))
        row += shape[0]
    return pieces


def local_map(arch: Arch, spec: KeySpec, cache: dict | None = None) -> tuple[ParamMap, dict[int, LocalParam]]:
    """``spec``'s F over its local parameters (labels ``LocalParam.label``); a replicated key's
    copies are located on every TP rank's label of the same index."""
    if cache is not None and spec.key in cache:
        return cache[spec.key]
    full = arch.full_shape(spec)
    locals_ = arch.locals_of(spec)
    by_index: dict[tuple[int, ...], list[int]] = {}
    for lp in locals_:
        by_index.setdefault(lp.index, []).append(lp.label)
    shards = {}
    for lp in locals_:
        where = frozenset(by_index[lp.index]) if spec.split == "rep" else frozenset((lp.label,))
        shards[lp.label] = (lp.shape, part_pieces(full, lp, where))
    out = (finish(full, shards), {lp.label: lp for lp in locals_})
    if cache is not None:
        cache[spec.key] = out
    return out


def chunk_map(shape: tuple[int, ...], chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], where: str) -> ParamMap:
    """One box piece per DCP chunk, chunk ``i`` on label ``i``; the chunks must tile F."""
    shards = {}
    for i, (offsets, sizes) in enumerate(chunks):
        if len(offsets) != len(shape) or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CheckpointError(f"{where}: chunk at {list(offsets)} of size {list(sizes)} lies outside {list(shape)}")
        pieces = [box_piece(shape, offsets, sizes, sizes, (0,) * len(sizes), (i,))] if prod(sizes) else []
        shards[i] = (tuple(sizes), pieces)
    return tiling(shape, shards, sum(prod(s) for _, s in chunks), where)


_COMPOSER = ZeroComposer()


def composite(outer: ParamMap, fragments: Mapping[int, Sequence[tuple[int, int, int]]], where: str) -> ParamMap:
    """``outer`` (a local map) composed with ``fragments[local label] = [(label, lo, hi)]``: flat
    ranges of each local parameter held by each label (bucket ranges)."""
    missing = [t for t in outer.ranks if not fragments.get(t)]
    if missing:
        raise CheckpointError(f"{where}: no bucket holds local parameter {missing[0]} (of {len(missing)})")
    try:
        return _COMPOSER.compose(outer, {t: tuple(fragments[t]) for t in outer.ranks})
    except ReshardError as e:
        raise CheckpointError(f"{where}: bucket ranges do not tile the parameters ({e})") from None
