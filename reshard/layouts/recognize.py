"""Recognise a TP map's layout family from its geometry alone, and rebuild it at another TP degree.

``recognize(m)`` tries each family's builder in turn; the first that rebuilds ``m`` exactly is the
family (``Family.build(T)`` is the same family at TP=T). Families:

* ``replicated`` -- every rank holds all of F; scale 1 stays 1, a scale of ``1/tp`` (a bias
  pre-divided by the TP size) becomes ``1/T``; other scales are refused;
* ``split`` -- contiguous blocks along one dim in rank order, possibly uneven; at TP=T the dim is
  cut into near-even sizes (equal when T divides it, else the first ranks take one more);
* ``sub-params`` -- several sub-parameters concatenated along one dim (fused q/k/v, gate/up),
  each split over the ranks; at TP=T each keeps its size and is cut near-evenly;
* ``split+replicated`` -- bands along one dim, each split or held by every rank (GPT-BigCode
  multi-query attention: query rows split, key/value rows on every rank);
* ``padded-vocab`` -- a split of F whose rows past ``valid_shape`` are padding; F keeps its rows
  when T divides them, else it is re-padded to a multiple of ``N * T`` rows (``vocab_divisible_by``);
* ``shared-qk`` -- Yuan's shared-QK value / o_proj heads; the number of heads is recognised and kept.

Anything else (ZeRO flat ranges, CodeGen's permuted blocks, mixed scales, a 1-rank map) is refused
with :class:`reshard.PlanError`: its geometry does not say what it would be at another degree.
A *band* here is an interval of one dim of F that is either split over the ranks or held by all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import MapError, PlanError
from ..ir.canonical import canonicalize
from ..ir.geometry import view_boxes
from ..ir.param_map import ParamMap
from ..ir.piece import Piece, View, row_major_strides
from ..ir.shard import Shard

__all__ = ["Family", "recognize"]


def _dims(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(n) for n in s) + "]"


@dataclass(frozen=True)
class Family:
    """A recognised layout family: ``build(T)`` is the same family at TP degree ``T``."""

    name: str
    text: str
    build: Callable[[int], ParamMap]


def _target_scale(scale: float, tp: int, target: int) -> float:
    if scale == 1.0:
        return 1.0
    if abs(scale * tp - 1.0) < 1e-12:
        return 1.0 / target
    raise PlanError(f"pieces scaled by {scale:g} on {tp} ranks: only 1 and 1/TP (a pre-divided bias) "
                    "have a known meaning at another TP degree")


def _same(a: ParamMap, b: ParamMap) -> bool:
    return canonicalize(a) == canonicalize(b)


def _as_replicated(m: ParamMap, n: int, vocab_divisible_by: int | None) -> Family | None:
    from .tp import replicated

    scales = {p.scale for _, _, p in m.pieces() if not p.is_empty}
    if len(scales) != 1:
        return None
    scale = scales.pop()
    ref = replicated(m.logical_shape, n, scale=scale)
    if not _same(ParamMap(ref.logical_shape, ref.shards, m.valid_shape), m):
        return None

    def build(t: int) -> ParamMap:
        out = replicated(m.logical_shape, t, scale=_target_scale(scale, n, t))
        return ParamMap(out.logical_shape, out.shards, m.valid_shape)

    text = "replicated" if scale == 1.0 else f"replicated, pre-divided by TP (scale {scale:g})"
    return Family("replicated", text, build)


def _slab_blocks(m: ParamMap, d: int) -> dict[int, list[tuple[int, int]]] | None:
    """Each rank's pieces as ``(start, length)`` blocks along dim ``d`` (in shard order), when
    every piece is one box spanning all of every other dim."""
    shape = m.logical_shape
    out: dict[int, list[tuple[int, int]]] = {}
    for r, s in m.shards.items():
        out[r] = []
        for p in sorted((p for p in s.pieces if not p.is_empty), key=lambda p: p.dest.offset):
            boxes = view_boxes(p.source, p.shape, shape)
            if len(boxes) != 1:
                return None
            box = boxes[0]
            if any(box[k] != (0, 1, shape[k]) for k in range(len(shape)) if k != d):
                return None
            start, step, count = box[d]
            if step != 1 and count != 1:
                return None
            out[r].append((start, count))
    return out


@dataclass(frozen=True)
class _Band:
    start: int
    size: int
    widths: tuple[int, ...] | None  # per rank for a split band; None: held by every rank


def _bands(blocks: dict[int, list[tuple[int, int]]], n: int, length: int) -> list[_Band] | None:
    """Cut dim ``d`` into bands, each split over the ranks in rank order or held by all."""
    cuts = sorted({0, length} | {x for bl in blocks.values() for a, k in bl if k for x in (a, a + k)})
    bands: list[list] = []  # [start, size, widths dict | None, last rank]
    everyone = frozenset(range(n))
    for a, b in zip(cuts, cuts[1:]):
        holders = frozenset(r for r, bl in blocks.items() if any(s <= a and b <= s + k for s, k in bl))
        if holders == everyone and n > 1:
            if bands and bands[-1][2] is None:
                bands[-1][1] += b - a
            else:
                bands.append([a, b - a, None, None])
        elif len(holders) == 1:
            (r,) = holders
            last = bands[-1] if bands else None
            if last is not None and last[2] is not None and r >= last[3]:
                last[1] += b - a
                last[2][r] = last[2].get(r, 0) + b - a
                last[3] = r
            else:
                bands.append([a, b - a, {r: b - a}, r])
        else:
            return None  # partial replication or a hole
    return [_Band(a, k, None if w is None else tuple(w.get(r, 0) for r in range(n))) for a, k, w, _ in bands]


def _bands_map(shape: tuple[int, ...], d: int, bands: Sequence[_Band], n: int, scale: float = 1.0,
                  valid: tuple[int, ...] | None = None) -> ParamMap:
    """The map whose rank ``r`` holds, concatenated along dim ``d`` in band order, its part of
    every split band and all of every replicated band."""
    fs = row_major_strides(shape)
    everyone = frozenset(range(n))
    shards = {}
    for r in range(n):
        parts, cursor = [], 0
        for band in bands:
            if band.widths is None:
                start, length, locs = band.start, band.size, everyone
            else:
                start, length, locs = band.start + sum(band.widths[:r]), band.widths[r], frozenset({r})
            parts.append((start, length, locs, cursor))
            cursor += length
        sshape = shape[:d] + (cursor,) + shape[d + 1 :]
        ss = row_major_strides(sshape)
        pieces = tuple(Piece(shape[:d] + (length,) + shape[d + 1 :], View(start * fs[d], fs), View(at * ss[d], ss),
                             locs, scale) for start, length, locs, at in parts if length)
        shards[r] = Shard(sshape, pieces)
    return canonicalize(ParamMap(shape, shards, valid))


def _bands_text(bands: Sequence[_Band], d: int) -> tuple[str, str]:
    split = [s for s in bands if s.widths is not None]
    if len(split) == len(bands) == 1:
        return "split", f"split dim {d}"
    if len(split) == len(bands):
        return "sub-params", f"sub-params {[s.size for s in bands]} dim {d}"
    parts = " + ".join(f"{'split' if s.widths is not None else 'replicated'} {s.size}" for s in bands)
    return "split+replicated", f"bands dim {d}: {parts}"


def _as_bands(m: ParamMap, n: int, vocab_divisible_by: int | None, *, proper: bool = False) -> Family | None:
    """Bands along one dim. With ``proper``, every split band must be split over at least two
    ranks (a "split" held by one rank is also how shared-QK's own heads look, so shared-QK is tried
    between the proper and the general pass)."""
    from .tp import near_even_sizes

    scales = {p.scale for _, _, p in m.pieces() if not p.is_empty}
    if len(scales) != 1:
        return None
    scale = scales.pop()
    shape = m.logical_shape
    for d in range(len(shape)):
        blocks = _slab_blocks(m, d)
        bands = None if blocks is None else _bands(blocks, n, shape[d])
        if not bands or proper and any(s.widths is not None and sum(map(bool, s.widths)) < 2 for s in bands):
            continue
        ref = _bands_map(shape, d, bands, n, scale, m.valid_shape)
        if not _same(ref, m):
            continue
        family, text = _bands_text(bands, d)
        if m.is_padded:
            return _padded(m, d, family, scale, vocab_divisible_by)

        def build(t: int, bands=bands, d=d) -> ParamMap:
            new = [_Band(s.start, s.size, None if s.widths is None else tuple(near_even_sizes(s.size, t)))
                   for s in bands]
            return _bands_map(shape, d, new, t, _target_scale(scale, n, t))

        return Family(family, text, build)
    return None


def _padded(m: ParamMap, d: int, family: str, scale: float,
            divisible_by: int | None) -> Family:
    from .tp import padded_vocab_rows

    shape, valid = m.logical_shape, m.valid_shape
    if family != "split" or scale != 1.0 or any(v != s for k, (v, s) in enumerate(zip(valid, shape)) if k != d):
        raise PlanError(f"F {_dims(shape)} is padded (valid {_dims(valid)}) but is not a split of the padded "
                        f"dim ({family} dim {d}): only padded vocabularies are supported")
    rows = shape[d]

    def build(t: int) -> ParamMap:
        if divisible_by is not None:
            new_rows = padded_vocab_rows(valid[d], t, divisible_by=divisible_by)
        elif rows % t == 0:
            new_rows = rows
        else:
            raise PlanError(f"padded vocabulary of {rows} rows ({valid[d]} valid) does not split evenly over "
                            f"TP={t}; pass --vocab-divisible-by N to re-pad it to a multiple of N*{t} rows")
        logical = shape[:d] + (new_rows,) + shape[d + 1 :]
        return _bands_map(logical, d, [_Band(0, new_rows, (new_rows // t,) * t)], t, 1.0, valid)

    how = f"re-padded with --vocab-divisible-by {divisible_by}" if divisible_by else "rows kept"
    return Family("padded-vocab", f"padded vocabulary split dim {d} ({rows} rows, {valid[d]} valid; {how})", build)


def _divisors(k: int) -> list[int]:
    small = [i for i in range(1, int(k**0.5) + 1) if k % i == 0]
    return sorted(set(small) | {k // i for i in small})


def _as_shared_qk(m: ParamMap, n: int, vocab_divisible_by: int | None) -> Family | None:
    from .fused import shared_qk_o_proj, shared_qk_value

    if n < 2 or m.is_padded or any(p.scale != 1.0 for _, _, p in m.pieces()):
        return None
    found = []
    for d, builder in ((0, shared_qk_value), (1, shared_qk_o_proj)):
        if len(m.logical_shape) <= d:
            continue
        for h in _divisors(m.logical_shape[d]):
            if h % 2 or h % n or n > h // 2:
                continue
            if _same(builder(m.logical_shape, n, num_heads=h), m):
                found.append((d, h, builder))
    if not found:
        return None
    if len(found) > 1:
        raise PlanError(f"ambiguous shared-QK layout: {len(found)} head counts fit "
                        f"({', '.join(f'{h} heads on dim {d}' for d, h, _ in found)})")
    d, h, builder = found[0]

    def build(t: int) -> ParamMap:
        try:
            return builder(m.logical_shape, t, num_heads=h)
        except MapError as e:
            raise PlanError(f"shared-QK with {h} heads has no layout at TP={t}: {e}") from None

    return Family("shared-qk", f"shared-QK {h} heads on dim {d}", build)


def _as_proper_bands(m: ParamMap, n: int, vocab_divisible_by: int | None) -> Family | None:
    return _as_bands(m, n, vocab_divisible_by, proper=True)


# Tried in order; the first that rebuilds the map exactly wins. Shared-QK with an even number of
# heads per rank *is* a two-sub-parameter split, and is planned as one.
FAMILIES = (_as_replicated, _as_proper_bands, _as_shared_qk, _as_bands)


def recognize(m: ParamMap, *, vocab_divisible_by: int | None = None) -> Family:
    """Recognise the family of a TP map (ranks ``0..n-1``) from its geometry: each family's
    builder must rebuild exactly this map. Raises :class:`PlanError` when none does."""
    n = len(m.ranks)
    if tuple(m.ranks) != tuple(range(n)):
        raise PlanError(f"expected a TP map over ranks 0..{n - 1}, got ranks {list(m.ranks)}")
    if n == 1:
        raise PlanError("a map on one rank does not say how F splits over more (split, replicated or fused); "
                        "give a target map document instead (reshard plan SRC.json --to TGT.json)")
    c = canonicalize(m)
    for finder in FAMILIES:
        fam = finder(c, n, vocab_divisible_by)
        if fam is not None:
            return fam
    raise PlanError("layout not recognised (supported at another TP degree: replicated, split, sub-params, "
                    "split+replicated bands, padded vocabulary, shared-QK; see reshard.layouts.recognize)")
