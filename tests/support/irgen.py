"""Small, independent layout builders and hypothesis strategies for IR tests.

Deliberately separate from ``reshard.layouts``: the IR is tested against layouts built here from
first principles (boxes and flat ranges written out by hand), not against itself.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from reshard import ParamMap, Piece, Shard, View
from reshard.ir import prod, row_major_strides


def _box_piece(full: tuple[int, ...], lo: tuple[int, ...], ext: tuple[int, ...], shard: tuple[int, ...],
               shard_lo: tuple[int, ...], locs, scale: float = 1.0) -> Piece:
    fs, ss = row_major_strides(full), row_major_strides(shard)
    return Piece(ext, View(sum(a * s for a, s in zip(lo, fs)), fs),
                 View(sum(a * s for a, s in zip(shard_lo, ss)), ss), frozenset(locs), scale)


def split_sizes(n: int, parts: int, uneven: bool = False) -> list[int]:
    base, rem = divmod(n, parts)
    sizes = [base + (1 if i < rem else 0) for i in range(parts)]
    if uneven and parts > 1 and sizes[0] > 0:
        sizes[0] -= 1
        sizes[-1] += 1
    return sizes


def grid_map(shape: tuple[int, ...], splits: dict[int, list[int]]) -> ParamMap:
    """Nested contiguous splits: dim d cut into ``splits[d]`` sizes; ranks in row-major order
    over the cut dims."""
    dims = sorted(splits)
    counts = [len(splits[d]) for d in dims]
    shards = {}
    for rank in range(prod(tuple(counts))):
        idx, rem = [], rank
        for c in reversed(counts):
            rem, i = divmod(rem, c)
            idx.append(i)
        idx.reverse()
        lo, ext = list([0] * len(shape)), list(shape)
        for d, i in zip(dims, idx):
            lo[d] = sum(splits[d][:i])
            ext[d] = splits[d][i]
        shards[rank] = Shard(tuple(ext), (_box_piece(shape, tuple(lo), tuple(ext), tuple(ext), (0,) * len(shape), {rank}),))
    return ParamMap(shape, shards)


def segmented_map(shape: tuple[int, ...], dim: int, segments: list[tuple[int, bool]], ranks: int,
                  scale_replicated: float = 1.0) -> ParamMap:
    """Along ``dim``: segments either split evenly-ish over ranks or replicated on all of them."""
    per_rank: dict[int, list[tuple[int, int, bool]]] = {r: [] for r in range(ranks)}  # (F start, size, repl)
    start = 0
    for size, repl in segments:
        if repl:
            for r in range(ranks):
                per_rank[r].append((start, size, True))
        else:
            off = start
            for r, w in enumerate(split_sizes(size, ranks)):
                per_rank[r].append((off, w, False))
                off += w
        start += size
    assert start == shape[dim]
    shards = {}
    for r, parts in per_rank.items():
        sshape = list(shape)
        sshape[dim] = sum(w for _, w, _ in parts)
        pieces, cursor = [], 0
        for f0, w, repl in parts:
            lo = [0] * len(shape)
            lo[dim] = f0
            ext = list(shape)
            ext[dim] = w
            slo = [0] * len(shape)
            slo[dim] = cursor
            locs = set(range(ranks)) if repl else {r}
            pieces.append(_box_piece(shape, tuple(lo), tuple(ext), tuple(sshape), tuple(slo), locs,
                                     scale_replicated if repl else 1.0))
            cursor += w
        shards[r] = Shard(tuple(sshape), tuple(pieces))
    return ParamMap(shape, shards)


def flat_map(shape: tuple[int, ...], bounds: list[int]) -> ParamMap:
    """ZeRO-style: F flattened and cut into contiguous ranges, one per rank."""
    shards = {}
    for r in range(len(bounds) - 1):
        n = bounds[r + 1] - bounds[r]
        shards[r] = Shard((n,), (Piece((n,), View(bounds[r], (1,)), View(0, (1,)), frozenset({r})),))
    return ParamMap(shape, shards)


def replicated_map(shape: tuple[int, ...], ranks: int, scale: float = 1.0) -> ParamMap:
    fs = row_major_strides(shape)
    p = Piece(shape, View(0, fs), View(0, fs), frozenset(range(ranks)), scale)
    return ParamMap(shape, {r: Shard(shape, (p,)) for r in range(ranks)})


def fragment(m: ParamMap, cuts: list[int]) -> ParamMap:
    """The same layout described with more pieces: piece i of every shard is cut in two along
    its first non-trivial dim at ``cuts[i % len(cuts)]`` (mod the extent)."""
    shards = {}
    for r, s in m.shards.items():
        out = []
        for i, p in enumerate(s.pieces):
            dims = [k for k, n in enumerate(p.shape) if n > 1]
            if not dims:
                out.append(p)
                continue
            k = dims[cuts[i % len(cuts)] % len(dims)]
            at = 1 + cuts[i % len(cuts)] % (p.shape[k] - 1)
            a = list(p.shape)
            b = list(p.shape)
            a[k], b[k] = at, p.shape[k] - at
            out.append(Piece(tuple(a), p.source, p.dest, p.locations, p.scale))
            out.append(Piece(tuple(b), View(p.source.offset + at * p.source.strides[k], p.source.strides),
                             View(p.dest.offset + at * p.dest.strides[k], p.dest.strides), p.locations, p.scale))
        shards[r] = Shard(s.shape, tuple(reversed(out)))
    return ParamMap(m.logical_shape, shards, m.valid_shape)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


@st.composite
def shapes(draw, max_ndim: int = 4, max_extent: int = 7) -> tuple[int, ...]:
    ndim = draw(st.integers(1, max_ndim))
    return tuple(draw(st.lists(st.integers(1, max_extent), min_size=ndim, max_size=ndim)))


@st.composite
def layouts(draw, shape: tuple[int, ...] | None = None, scaled: bool = True) -> ParamMap:
    """Random valid maps: even/uneven/nested splits on any dim, replicated and scaled segments,
    flat ZeRO ranges; shapes up to 4-d."""
    if shape is None:
        shape = draw(shapes())
    ndim = len(shape)
    kind = draw(st.sampled_from(["grid", "segmented", "flat", "replicated"]))
    if kind == "grid":
        dims = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=2, unique=True))
        splits = {}
        for d in dims:
            parts = draw(st.integers(1, min(4, shape[d])))
            splits[d] = split_sizes(shape[d], parts, uneven=draw(st.booleans()))
        return grid_map(shape, splits)
    if kind == "segmented":
        d = draw(st.integers(0, ndim - 1))
        ranks = draw(st.integers(1, 4))
        cut = draw(st.integers(0, shape[d]))
        segs = [(s, r) for s, r in ((cut, False), (shape[d] - cut, True)) if s]
        if draw(st.booleans()):
            segs.reverse()
        scale = draw(st.sampled_from([1.0, 0.5, 0.25, 2.0] if scaled else [1.0]))
        return segmented_map(shape, d, segs, ranks, scale)
    if kind == "flat":
        n = prod(shape)
        ranks = draw(st.integers(1, 4))
        inner = sorted(draw(st.lists(st.integers(0, n), min_size=ranks - 1, max_size=ranks - 1)))
        return flat_map(shape, [0, *inner, n])
    return replicated_map(shape, draw(st.integers(1, 3)),
                          draw(st.sampled_from([1.0, 0.5, 0.125] if scaled else [1.0])))


def padded_vocab_map(vocab: int, hidden: int, tp: int) -> ParamMap:
    """Legacy TP: rows padded up to a multiple of ``tp``, split evenly; valid region the vocab."""
    rows = -(-vocab // tp) * tp
    g = grid_map((rows, hidden), {0: [rows // tp] * tp})
    return ParamMap((rows, hidden), dict(g.shards), valid_shape=(vocab, hidden))
