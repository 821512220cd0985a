"""``derive``: recover the map of a partition function by running it.

Two readings of the function, the cheaper first:

1. *Index markers* (``_derive_by_index``). Run ``partition_fn(index, rank)`` on F's own element
   indices (int32, or int64 from 2**31 elements). A shard that is a view of the index tensor (what
   ``chunk``, ``split`` and slicing return) names its source view in ``storage_offset()`` and
   ``stride()``: no element is read. Any other shard is read once: as a view guessed from its
   first elements and confirmed by one comparison, else element by element. Holders come from the
   boxes of F the views cover when those are equal or disjoint, else from counts per element.
2. *Float markers* (``_derive_by_markers``), whenever the first does not apply: the function
   scales, computes in floating point, refuses an integer input, or the reading fails the check
   below. One or two float markers in ``dtype`` (a unique value per element, exact while F is
   small enough for that dtype) give index and scale per shard element.

Either way the result is compressed into the canonical form, then the function runs once more on
random data of ``dtype`` and must be reproduced bit-exactly (a shard read as a view is compared
with that view of the data in place, or not at all when the function returns that very view). A
function that computes rather than selects fails one of these steps and raises NotAffineError,
always from the float markers, so the messages do not depend on which reading was tried first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import torch

from ..errors import NotAffineError
from ..ir.apply import bits
from ..ir.canonical import canonical_pieces
from ..ir.geometry import Box, box_intersect, is_injective, merge_dims, one_box, view_boxes
from ..ir.param_map import ParamMap
from ..ir.piece import Piece, View, prod, row_major_strides
from ..ir.shard import Shard

PartitionFn = Callable[[torch.Tensor, int], torch.Tensor]


def derive(
    partition_fn: PartitionFn,
    logical_shape: tuple[int, ...],
    world_size: int,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> ParamMap:
    """The canonical map of ``partition_fn`` over ``world_size`` ranks (see module doc)."""
    shape = tuple(logical_shape)
    m = _derive_by_index(partition_fn, shape, world_size, dtype, seed)
    return m if m is not None else _derive_by_markers(partition_fn, shape, world_size, dtype, seed)


# -- reading 1: index markers -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ViewRead:
    """A shard that is F seen through ``view``, its elements in row-major order of ``shape``, and
    that the canonical form turns into one piece (see ``_one_piece``)."""

    shape: tuple[int, ...]
    view: View


@dataclass(frozen=True, slots=True)
class _ElementRead:
    """A shard read element by element: ``src[k]`` is the flat index into F of its k-th element."""

    shape: tuple[int, ...]
    src: np.ndarray


_Read = _ViewRead | _ElementRead


def _derive_by_index(fn: PartitionFn, shape: tuple[int, ...], world_size: int, dtype: torch.dtype,
                     seed: int) -> ParamMap | None:
    """The map read from index markers, or ``None`` where that reading does not apply."""
    n = prod(shape)
    if not shape or n == 0:
        return None
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    # One buffer serves the index and then the random data: first touches of fresh memory cost
    # more than the passes themselves at this size.
    raw = torch.empty(n * max(index_dtype.itemsize, dtype.itemsize), dtype=torch.uint8)
    index = raw[: n * index_dtype.itemsize].view(index_dtype)
    torch.arange(n, dtype=index_dtype, out=index)
    index = index.view(shape)
    reads = _read_shards(fn, index, world_size)
    if reads is None:
        return None
    try:
        m = _index_map(reads, index, shape)
        del index  # every read holds geometry or its own copy: the buffer is free for the data
        _reproduce_reads(m, fn, raw[: n * dtype.itemsize].view(dtype).view(shape), reads, seed)
    except NotAffineError:
        return None
    return m


def _read_shards(fn: PartitionFn, index: torch.Tensor, world_size: int) -> dict[int, _Read] | None:
    version = _version(index)
    reads: dict[int, _Read] = {}
    for rank in range(world_size):
        try:
            out = fn(index, rank)
        except Exception:  # it needs a floating-point input, say: the float markers will tell
            return None
        if not isinstance(out, torch.Tensor) or out.dtype != index.dtype or out.device != index.device:
            return None  # it computes in another dtype (a scale, say)
        read = _read(out.detach(), index)
        if read is None:
            return None
        reads[rank] = read
    # every reading above trusts index[i] == i: a function that wrote into its input voids them
    return reads if version is not None and _version(index) == version else None


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), ``None`` where torch keeps none."""
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor
        return None


def _read(out: torch.Tensor, index: torch.Tensor) -> _Read | None:
    """What ``out``, computed from the index tensor, holds; ``None`` when it holds a value that is
    no index of F (it computes)."""
    shape, n = tuple(out.shape), index.numel()
    if out.numel() == 0:
        return _ViewRead(shape, View(0, (0,) * len(shape)))
    shared = _shares(out, index)
    if shared:  # a view: its geometry says everything, no element is read
        view = View.trusted(out.storage_offset() - index.storage_offset(), tuple(out.stride()))
        if not _fits(shape, view, n):
            return None  # it reaches past F (the index shares its buffer with the random data)
        if _one_piece(shape, view, tuple(index.shape)):
            return _ViewRead(shape, view)
    values = out.contiguous()
    view = None if shared else _guess_view(values, index)  # a view's guess is that same view
    if view is not None and _one_piece(shape, view, tuple(index.shape)):
        return _ViewRead(shape, view)
    src = np.array(values.reshape(-1).numpy(), dtype=np.int64)  # a copy: the buffer is reused
    if src.min() < 0 or src.max() >= n:
        return None
    return _ElementRead(shape, src)


def _fits(shape: tuple[int, ...], view: View, n: int) -> bool:
    """Whether ``view`` (of ``shape``) stays inside F's ``n`` elements."""
    lo, hi = view.span(shape)
    return lo >= 0 and all(s >= 0 for s in view.strides) and hi <= n


def _guess_view(values: torch.Tensor, index: torch.Tensor) -> View | None:
    """The view of F that ``values`` (contiguous, from the index tensor) is a copy of, if any:
    guessed from the first element and one step along each dim, then confirmed in one pass."""
    shape = tuple(values.shape)
    flat = values.reshape(-1)
    base = int(flat[0])
    strides = tuple(int(flat[r]) - base if k > 1 else 0 for k, r in zip(shape, row_major_strides(shape)))
    view = View.trusted(base, strides)
    if base < 0 or not _fits(shape, view, index.numel()):
        return None
    return view if torch.equal(values, index.as_strided(shape, strides, base)) else None


def _one_piece(shape: tuple[int, ...], view: View, space: tuple[int, ...]) -> bool:
    """Whether the canonical form of a shard that is F seen through ``view`` is that view as one
    piece, exactly as the element-by-element reading finds it. True when the view is injective,
    one box of F, keeps F's element order, and no carry between its dims continues a progression
    of an inner dim (the element reading, which sees only addresses, would join across it)."""
    if not is_injective(shape, view.strides) or not one_box(view, shape, space):
        return False
    dims = merge_dims(shape, view.strides, row_major_strides(shape))
    if any(a[1][1] <= b[1][1] for a, b in zip(dims, dims[1:])):
        return False  # the shard reorders F (a transpose): its runs break up differently
    ext = [(n, st[0]) for n, st in dims] + [(1, 1)]  # a unit step after the innermost dim
    for j in range(len(ext) - 1):
        reach = 0  # how far dims j+1 .. k-1 advance
        for k in range(j + 1, len(ext)):
            n_k, s_k = ext[k]
            if k > j + 1 and ext[j][1] == reach + n_k * s_k:
                return False
            reach += (n_k - 1) * s_k
    return True


def _index_map(reads: dict[int, _Read], index: torch.Tensor, space: tuple[int, ...]) -> ParamMap:
    views = {rank: r for rank, r in reads.items() if isinstance(r, _ViewRead)}
    locs = _box_holders(views, space) if len(views) == len(reads) else None
    if locs is not None:
        shards = {rank: Shard(r.shape, canonical_pieces(_view_pieces(r, locs.get(rank)), space))
                  for rank, r in views.items()}
        return ParamMap(space, shards)
    per_rank = {}
    for rank, r in reads.items():
        src = r.src if isinstance(r, _ElementRead) else _elements(r, index)
        per_rank[rank] = (r.shape, src, np.broadcast_to(np.float64(1.0), src.shape))
    masks = _holder_masks(per_rank, index.numel())
    return ParamMap(space, {
        rank: Shard(sshape, canonical_pieces(_pieces(src, scale, masks[rank], space), space))
        for rank, (sshape, src, scale) in per_rank.items()
    })


def _box_holders(views: dict[int, _ViewRead], space: tuple[int, ...]) -> dict[int, frozenset[int]] | None:
    """Holders of each rank's elements when the ranks' boxes of F are pairwise equal or disjoint
    (splits, replication, both); ``None`` when some partly overlap."""
    groups: dict[Box, list[int]] = defaultdict(list)
    for rank, r in views.items():
        if prod(r.shape):
            groups[view_boxes(r.view, r.shape, space)[0]].append(rank)
    if len(groups) > 256:  # pairs grow quadratically: counting per element is cheaper by then
        return None
    if any(box_intersect(a, b) is not None for a, b in combinations(groups, 2)):
        return None
    return {rank: frozenset(ranks) for ranks in groups.values() for rank in ranks}


def _view_pieces(r: _ViewRead, locs: frozenset[int] | None) -> list[Piece]:
    if locs is None:  # an empty shard
        return []
    return [Piece(r.shape, r.view, View(0, row_major_strides(r.shape)), locs, 1.0)]


def _elements(r: _ViewRead, index: torch.Tensor) -> np.ndarray:
    if not prod(r.shape):
        return np.zeros(0, dtype=np.int64)
    picked = index.as_strided(r.shape, r.view.strides, r.view.offset)
    return np.array(picked.reshape(-1).numpy(), dtype=np.int64)


def _reproduce_reads(m: ParamMap, fn: PartitionFn, full: torch.Tensor, reads: dict[int, _Read],
                     seed: int) -> None:
    """``_reproduce`` for the index reading. A shard whose map is its view is compared with that
    view of the data in place (no extracted copy), or not at all when the function returned that
    very view: the same addresses read twice cannot differ."""
    full.uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(seed))
    for rank in m.ranks:
        want, r = fn(full, rank), reads[rank]
        want = want.detach() if isinstance(want, torch.Tensor) else want
        if isinstance(r, _ViewRead) and _is_view(m.shards[rank], r):
            if _same_view(want, full, r):
                continue
            got = full.as_strided(r.shape, r.view.strides, r.view.offset)
        else:
            got = m.extract(full, rank)
        if not (isinstance(want, torch.Tensor) and want.dtype == got.dtype and want.shape == got.shape
                and torch.equal(_bits_view(want), _bits_view(got))):
            raise NotAffineError(f"rank {rank}: on random data the shard differs from what the map predicts")


def _normal(shape: tuple[int, ...], source: View, dest: View) -> tuple:
    """A block's element mapping in normal form: equal forms, equal mappings."""
    return source.offset, dest.offset, tuple(merge_dims(shape, source.strides, dest.strides))


def _is_view(shard: Shard, r: _ViewRead) -> bool:
    """Whether the map's shard is exactly ``r``'s view: one unscaled piece with its mapping."""
    if len(shard.pieces) != 1 or shard.shape != r.shape:
        return False
    p = shard.pieces[0]
    return p.scale == 1.0 and _normal(p.shape, p.source, p.dest) == _normal(
        r.shape, r.view, View(0, row_major_strides(r.shape)))


def _same_view(want: object, full: torch.Tensor, r: _ViewRead) -> bool:
    """Whether ``want`` is ``full`` seen through ``r``'s view (the same addresses)."""
    if not (isinstance(want, torch.Tensor) and want.dtype == full.dtype and _shares(want, full)
            and tuple(want.shape) == r.shape):
        return False
    dest = View.trusted(0, row_major_strides(r.shape))
    seen = View.trusted(want.storage_offset() - full.storage_offset(), tuple(want.stride()))
    return _normal(r.shape, seen, dest) == _normal(r.shape, r.view, dest)


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of its width, without a copy (equality becomes bitwise)."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[t.element_size()])


# -- reading 2: float markers -----------------------------------------------------------------


def _derive_by_markers(partition_fn: PartitionFn, shape: tuple[int, ...], world_size: int,
                       dtype: torch.dtype, seed: int) -> ParamMap:
    """The map read from float markers: the general reading, scales included."""
    n = prod(shape)
    if n >= 2**52 // 4:
        raise NotAffineError(f"F of {n} elements is too large for float64 markers")
    # Markers a = i + n + 1 (the element's index, offset so that a scaled copy cannot look like a
    # valid marker). When every rank returns markers unchanged (the common, unscaled case) one
    # run suffices; otherwise a second marker b = i + 2n + 1 separates index and scale. The
    # function must not modify its input: the markers are shared by every rank's call.
    marker_a = torch.arange(n + 1, 2 * n + 1, dtype=torch.float64).reshape(shape).to(dtype)
    marker_b: list[torch.Tensor] = []

    def second() -> torch.Tensor:
        if not marker_b:
            marker_b.append(torch.arange(2 * n + 1, 3 * n + 1, dtype=torch.float64).reshape(shape).to(dtype))
        return marker_b[0]

    def decode(rank: int, a: torch.Tensor, fast: bool):
        quick = _decode_unscaled(a, n) if fast else None
        if quick is not None:
            return quick, True
        b = _run(partition_fn, second(), rank)
        if a.shape != b.shape:
            raise NotAffineError(f"rank {rank}: shard shape depends on the data ({list(a.shape)} vs {list(b.shape)})")
        return _decode(a, b, n, rank), False

    runs = {rank: _run(partition_fn, marker_a, rank) for rank in range(world_size)}
    for fast in (True, False):
        per_rank, guessed = {}, False
        for rank, a in runs.items():
            (src, scale), quick = decode(rank, a, fast)
            guessed |= quick
            per_rank[rank] = (tuple(a.shape), src, scale)
        try:
            masks = _holder_masks(per_rank, n)
            shards = {
                rank: Shard(sshape, canonical_pieces(_pieces(src, scale, masks[rank], shape), shape))
                for rank, (sshape, src, scale) in per_rank.items()
            }
            m = ParamMap(shape, shards)
            # the random data may reuse the marker's memory when no shard is a view of it
            spare = None if any(_shares(r, marker_a) for r in runs.values()) else marker_a
            _reproduce(m, partition_fn, dtype, seed, spare)
            return m
        except NotAffineError:
            if not guessed:  # a one-run reading could be a coincidence of scale: retry with two
                raise
    raise AssertionError("unreachable")


def _decode_unscaled(a: torch.Tensor, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Indices when every value is a marker ``i + n + 1`` unchanged, else ``None``."""
    a = a.reshape(-1)
    if not a.numel():
        return np.zeros(0, dtype=np.int64), np.ones(0)
    lo, hi = torch.aminmax(a)
    if float(lo) < n + 1 or float(hi) > 2 * n:
        return None
    idx = a.to(torch.int64)
    if not torch.equal(idx.to(a.dtype), a):  # a fraction somewhere: not an unchanged marker
        return None
    return (idx - (n + 1)).numpy(), np.broadcast_to(np.float64(1.0), (a.numel(),))


def _run(fn: PartitionFn, full: torch.Tensor, rank: int) -> torch.Tensor:
    out = fn(full, rank)
    if not isinstance(out, torch.Tensor):
        raise NotAffineError(f"rank {rank}: partition function returned {type(out).__name__}, not a tensor")
    return out.detach().to(torch.float64).contiguous()


def _decode(a: torch.Tensor, b: torch.Tensor, n: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Per shard element: the flat index into F and the scale. a = s·(i+n+1), b = s·(i+2n+1)."""
    av, bv = a.reshape(-1).numpy(), b.reshape(-1).numpy()
    s = (bv - av) / n
    with np.errstate(divide="ignore", invalid="ignore"):
        idx = av / s - (n + 1)
    rounded = np.rint(idx)
    bad = ~np.isfinite(idx) | (np.abs(idx - rounded) > 1e-6) | (rounded < 0) | (rounded >= n) | (s == 0)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise NotAffineError(
            f"rank {rank}: shard position {_pos(pos, a.shape)} holds no element of F "
            f"(it computes rather than selects)"
        )
    return rounded.astype(np.int64), _snap(s)


def _snap(s: np.ndarray) -> np.ndarray:
    """Undo float noise in the recovered scale: 1/k and k for integers k are snapped exactly."""
    out = s.copy()
    odd = np.flatnonzero(s != 1.0)
    v = s[odd]
    inv = np.rint(1.0 / v)
    near_inv = np.abs(inv * v - 1.0) < 1e-9
    v[near_inv] = 1.0 / inv[near_inv]
    k = np.rint(v)
    near_k = (np.abs(k - v) < 1e-9 * np.abs(v)) & (k != 0)
    v[near_k] = k[near_k]
    out[odd] = v
    return out


def _pos(flat: int, shape: torch.Size) -> list[int]:
    return [int(x) for x in np.unravel_index(flat, tuple(shape))] if len(shape) else []


def _holder_masks(per_rank: dict, n: int) -> dict[int, np.ndarray | int]:
    """Per rank, the holder bitmask of each of its shard elements (an int when constant)."""
    total = sum(src.size for _, src, _ in per_rank.values())
    if total == n:
        # Sizes add up to F: the shards partition F exactly iff together they hold every element.
        seen = np.zeros(n, dtype=bool)
        for _, src, _ in per_rank.values():
            seen[src] = True
        if seen.all():
            return {rank: 1 << rank for rank in per_rank}
    count = np.zeros(n, dtype=np.int32)
    for _, src, _ in per_rank.values():
        count[src] += 1
    if int(count.sum()) != total:
        for rank, (sshape, src, _) in per_rank.items():
            uniq, first = np.unique(src, return_index=True)
            if uniq.size != src.size:
                dup = np.setdiff1d(np.arange(src.size), first)[0]
                raise NotAffineError(
                    f"rank {rank}: shard position {_pos(int(dup), sshape)} repeats element "
                    f"{int(src[dup])} of F, which another position of the same shard already holds"
                )
    if count.max(initial=0) <= 1:
        return {rank: 1 << rank for rank in per_rank}
    if max(per_rank) >= 63:
        raise NotAffineError("derive supports replicated blocks for up to 63 ranks")
    mask = np.zeros(n, dtype=np.int64)
    for rank, (_, src, _) in per_rank.items():
        mask[src] |= np.int64(1 << rank)
    return {rank: mask[src] for rank, (_, src, _) in per_rank.items()}


def _pieces(src: np.ndarray, scale: np.ndarray, mask, space: tuple[int, ...]) -> list[Piece]:
    """Runs of unit source step with one holder set and scale, then equal runs stacked."""
    m = src.size
    if m == 0:
        return []
    masks = np.broadcast_to(np.asarray(mask, dtype=np.int64), (m,))
    brk = np.ones(m, dtype=bool)
    brk[1:] = (np.diff(src) != 1) | (masks[1:] != masks[:-1]) | (scale[1:] != scale[:-1])
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, m))
    run_src = src[starts]
    run_mask = masks[starts]
    run_scale = scale[starts]
    # Stack runs: consecutive runs (in shard order) of one length, holder set and scale whose
    # source and dest starts advance by constants become one 2-d piece when that is one box of F.
    pieces: list[Piece] = []
    k = 0
    nruns = starts.size
    chain_end = -1  # where the last scanned chain of equal steps ended
    while k < nruns:
        j = k + 1
        if j < nruns and _same(k, j, lengths, run_mask, run_scale):
            ds, dd = run_src[j] - run_src[k], starts[j] - starts[k]
            if k < chain_end:
                # inside a chain that an earlier run could not stack (no box): every run of it has
                # that run's length, holders, scale and steps, so its chain ends at the same run.
                # Without this, a long chain that is no box is rescanned from each run: quadratic.
                j = chain_end
            while (j + 1 < nruns and _same(k, j + 1, lengths, run_mask, run_scale)
                   and run_src[j + 1] - run_src[j] == ds and starts[j + 1] - starts[j] == dd):
                j += 1
            chain_end = j
            if ds > 0 and j > k:
                cand = _piece((j - k + 1, int(lengths[k])), int(run_src[k]), (int(ds), 1),
                              int(starts[k]), (int(dd), 1), int(run_mask[k]), float(run_scale[k]))
                if one_box(cand.source, cand.shape, space):
                    pieces.append(cand)
                    k = j + 1
                    continue
        pieces.append(_piece((int(lengths[k]),), int(run_src[k]), (1,), int(starts[k]), (1,),
                             int(run_mask[k]), float(run_scale[k])))
        k += 1
    return pieces


def _same(k: int, j: int, lengths, masks, scales) -> bool:
    return lengths[k] == lengths[j] and masks[k] == masks[j] and scales[k] == scales[j]


def _piece(shape, src, sstr, dst, dstr, mask: int, scale: float) -> Piece:
    locs = frozenset(b for b in range(mask.bit_length()) if mask >> b & 1)
    return Piece(shape, View(src, sstr), View(dst, dstr), locs, scale)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _reproduce(m: ParamMap, fn: PartitionFn, dtype: torch.dtype, seed: int,
               spare: torch.Tensor | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    full = spare if spare is not None else torch.empty(m.logical_shape, dtype=dtype)
    full.uniform_(-1.0, 1.0, generator=g)
    for rank in m.ranks:
        want = fn(full, rank)
        got = m.extract(full, rank)
        w, o = bits(want.contiguous().reshape(-1)), bits(got.reshape(-1))
        if w.shape != o.shape or not torch.equal(w, o):
            diff = (w != o).nonzero()
            pos = int(diff[0]) if diff.numel() else 0
            raise NotAffineError(
                f"rank {rank}: on random data, shard position {_pos(pos, got.shape)} differs from what "
                f"the map predicts (the function computes, or chooses by the data, rather than selects)"
            )
