"""``derive``: recover the map of a partition function by running it.

Run ``partition_fn(full, rank)`` on two marker tensors (a unique value per element of F) to learn,
for every shard element, which element of F it holds and by what scale; compress those into the
canonical form; then run it once more on random data and require a bit-exact reproduction. A
function that computes rather than selects fails one of these steps and raises NotAffineError.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .errors import NotAffineError
from .ir.apply import bits
from .ir.canonical import canonical_pieces
from .ir.geometry import one_box
from .ir.param_map import ParamMap
from .ir.piece import Piece, View, prod
from .ir.shard import Shard

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
    while k < nruns:
        j = k + 1
        if j < nruns and _same(k, j, lengths, run_mask, run_scale):
            ds, dd = run_src[j] - run_src[k], starts[j] - starts[k]
            while (j + 1 < nruns and _same(k, j + 1, lengths, run_mask, run_scale)
                   and run_src[j + 1] - run_src[j] == ds and starts[j + 1] - starts[j] == dd):
                j += 1
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
