"""Apply a map to tensors: ``extract`` (F -> one rank's shard) and ``rebuild`` (shards -> F).

Both are one loop of strided copies, the same views read in opposite directions. Offsets in a
piece are relative to the first element of a flat tensor; a tensor that is itself a view into a
larger storage is handled by adding its own storage offset, never by reading from the wrong place.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import MapError, ReplicaMismatchError, ShardError
from .piece import Piece, View, prod
from .shard import MapLike


def flatten(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor over ``t``'s elements (a view when ``t`` is contiguous)."""
    t = t.detach()
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def view_of(flat: torch.Tensor, shape: tuple[int, ...], view: View) -> torch.Tensor:
    """``view`` of a flat tensor, counted from the tensor's own first element (not its storage's)."""
    return torch.as_strided(flat, shape, view.strides, flat.storage_offset() + view.offset)


def strided_copy(dst: torch.Tensor, dst_view: View, src: torch.Tensor, src_view: View, shape: tuple[int, ...],
                 factor: float = 1.0) -> None:
    """``dst[dst_view] = src[src_view] * factor`` on flat tensors: the one copy every executor and
    the map operations perform (a piece applied, a plan segment run)."""
    view_of(dst, shape, dst_view).copy_(scaled(view_of(src, shape, src_view), factor))


def factor_of(p: Piece, scale_power: int) -> float:
    return p.scale**scale_power


def scaled(block: torch.Tensor, factor: float) -> torch.Tensor:
    """``block * factor``, computed as a division when ``factor`` is ``1/k`` for an integer k, so
    the result is bit-identical to what frameworks write (``bias / world_size``)."""
    if factor == 1.0:
        return block
    inv = round(1.0 / factor)
    if inv != 0 and 1.0 / inv == factor:
        return block / inv
    return block * factor


def _require_scalable(dtype: torch.dtype, factor: float, where: str) -> None:
    if factor != 1.0 and not (dtype.is_floating_point or dtype.is_complex):
        raise MapError(f"{where}: a scaled piece cannot apply to integer dtype {dtype}")


def extract(m: MapLike, full: torch.Tensor, rank: int, scale_power: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``. ``full`` has ``m.logical_shape``, or ``m.valid_shape``
    for a padded map, in which case the padding the shard holds is zero."""
    shard_spec = m.shard(rank)
    full = _as_logical(m, full)
    src = flatten(full)
    out = torch.empty(shard_spec.numel, dtype=full.dtype, device=full.device)
    for i, p in enumerate(shard_spec.pieces):
        if p.is_empty:
            continue
        factor = factor_of(p, scale_power)
        _require_scalable(full.dtype, factor, f"rank {rank} piece {i}")
        strided_copy(out, p.dest, src, p.source, p.shape, factor)
    return out.view(shard_spec.shape)


def _as_logical(m: MapLike, full: torch.Tensor) -> torch.Tensor:
    shape = tuple(full.shape)
    if shape == m.logical_shape:
        return full
    if shape == m.valid_shape and prod(shape) == full.numel():
        padded = full.new_zeros(m.logical_shape)
        padded[tuple(slice(0, n) for n in m.valid_shape)] = full
        return padded
    raise ShardError(
        f"full tensor has shape {list(shape)}; the map expects {list(m.logical_shape)}"
        + (f" or valid shape {list(m.valid_shape)}" if m.is_padded else "")
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so equality is bitwise (NaN == NaN, -0 != +0)."""
    if t.dtype.is_floating_point:
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[t.element_size()]
        return t.contiguous().view(width)
    return t


def _check_shards(m: MapLike, shards: Mapping[int, torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    if not shards:
        raise ShardError("no shards supplied")
    dtype = device = None
    for rank, t in shards.items():
        if rank not in m.shards:
            raise ShardError(f"rank {rank}: supplied a shard, but the map has no rank {rank}")
        want = m.shards[rank].numel
        if t.numel() != want:
            raise ShardError(
                f"rank {rank}: shard has {t.numel()} elements {list(t.shape)}, the map says "
                f"{want} {list(m.shards[rank].shape)}"
            )
        if dtype is None:
            dtype, device = t.dtype, t.device
        elif t.dtype != dtype:
            raise ShardError(f"rank {rank}: shard dtype {t.dtype} differs from {dtype} of the other shards")
    return dtype, device


def rebuild(
    m: MapLike,
    shards: Mapping[int, torch.Tensor],
    scale_power: int = 1,
    *,
    verify: bool = True,
    valid_only: bool = False,
    prefer: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """F from shards. Every block is written from its lowest supplied holder (or ``prefer`` where
    that rank holds it); with ``verify``, every other supplied holder is compared bitwise (P2) and
    a difference raises :class:`ReplicaMismatchError` naming the ranks, the block and the largest
    difference. ``shards`` may omit ranks as long as every block keeps a holder. ``out``, a
    contiguous tensor of F's element count, dtype and device, receives F instead of a fresh
    allocation (a caller can hand in memory it prepared, e.g. huge-page backed)."""
    dtype, device = _check_shards(m, shards)
    have = set(shards)

    def writer(holders: frozenset[int]) -> int:
        return prefer if prefer in holders else min(holders)

    full = _output(out, m.numel, dtype, device)
    flats = {r: flatten(t) for r, t in shards.items()}
    pending: list[tuple[int, int, Piece]] = []
    for rank, i, p in m.pieces():
        if p.is_empty:
            continue
        holders = p.locations & have
        if not holders:
            raise ShardError(
                f"rank {rank} piece {i} ({p.describe()}): no supplied shard holds this block "
                f"(holders {sorted(p.locations)}, supplied {sorted(have)})"
            )
        if rank != writer(holders):
            if verify and rank in have:
                pending.append((rank, i, p))
            continue
        factor = factor_of(p, scale_power)
        _require_scalable(dtype, factor, f"rank {rank} piece {i}")
        strided_copy(full, p.source, flats[rank], p.dest, p.shape, 1.0 / factor)
    for rank, i, p in pending:
        _verify_replica(full, flats[rank], rank, i, p, scale_power, writer(p.locations & have))
    out = full.view(m.logical_shape)
    if valid_only and m.is_padded:
        out = out[tuple(slice(0, n) for n in m.valid_shape)].contiguous()
    return out


def _output(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.numel() != numel or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ShardError(f"out must be a contiguous {dtype} tensor of {numel} elements on {device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    return out.view(-1)


def _verify_replica(
    full: torch.Tensor, flat: torch.Tensor, rank: int, i: int, p: Piece, scale_power: int, writer: int
) -> None:
    factor = factor_of(p, scale_power)
    block = view_of(flat, p.shape, p.dest)
    mine = scaled(block, 1.0 / factor)
    written = view_of(full, p.shape, p.source)
    if torch.equal(bits(mine), bits(written)):
        return
    diff = (mine.double() - written.double()).abs() if mine.dtype.is_floating_point else None
    worst = float(diff.nan_to_num(nan=float("inf")).max()) if diff is not None else float("nan")
    raise ReplicaMismatchError(
        f"ranks {writer} and {rank} hold different data for the block {p.describe()} "
        f"(rank {rank} piece {i}); largest difference {worst:g}",
        ranks=(writer, rank),
        max_abs_diff=worst,
    )


def rebuild_mean(m: MapLike, shards: Mapping[int, torch.Tensor], scale_power: int = 1) -> torch.Tensor:
    """F with every element the mean of all supplied copies of it (float64 accumulation). An
    explicit policy for replicas that drifted apart; identical copies give their common value."""
    dtype, device = _check_shards(m, shards)
    total = torch.zeros(m.numel, dtype=torch.float64, device=device)
    count = torch.zeros(m.numel, dtype=torch.float64, device=device)
    flats = {r: flatten(t) for r, t in shards.items()}
    for rank, _, p in m.pieces():
        if p.is_empty or rank not in flats:
            continue
        block = scaled(view_of(flats[rank], p.shape, p.dest).double(), 1.0 / factor_of(p, scale_power))
        view_of(total, p.shape, p.source).add_(block)
        view_of(count, p.shape, p.source).add_(1.0)
    if bool((count == 0).any()):
        raise ShardError("the supplied shards leave part of F without any holder")
    return (total / count).to(dtype).view(m.logical_shape)
