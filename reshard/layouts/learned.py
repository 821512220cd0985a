"""Maps learned from an inference engine's own loader, by markers (no naming table, no layout code).

1. :func:`markers` -- one float32 tensor per source parameter whose elements are unique across all of
   them: element ``k`` of the ``i``-th parameter holds ``base_i + k + 1`` (exact in float32 while
   the parameters hold fewer than 2**24 elements in all); 0 is left for elements no parameter fills.
2. The engine loads them with its own loader at its TP degree (vLLM: each parameter's
   ``weight_loader``), in float32, outside reshard -- reshard imports no engine.
3. :func:`learn_placed` -- from each rank's loaded tensors, every source parameter's target as a
   :class:`~reshard.layouts.inference.Placed`: the engine tensor it lands in, the offset of its part
   there on each rank, and its map, :func:`~reshard.layouts.derive.derive`\\ d from a partition
   function that selects what the markers revealed (holders, replication of key/value heads and
   the canonical form are derive's). Zeros after a tensor's only part are padding (a padded
   vocabulary): F is then padded on dim 0 to hold them, and ``valid_shape`` is the parameter's.

A marker is read back only from tensors of at least one dim (an engine's scalar scales are 1.0, a
marker's value). Every check raises :class:`MapError` naming the parameter, tensor and rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import MapError
from ..ir.param_map import ParamMap
from ..ir.piece import prod
from .derive import derive
from .inference import Placed, check_placed

__all__ = ["MAX_MARKED", "learn_placed", "markers"]

MAX_MARKED = 2**24  # float32 holds every integer up to this exactly


def _bases(shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    out, base = {}, 0
    for name, shape in shapes.items():
        out[name] = base
        base += prod(tuple(shape))
    if base >= MAX_MARKED:
        raise MapError(f"{base} elements in all: markers are exact in float32 up to {MAX_MARKED}; learn the maps "
                       "on a smaller model of the same architecture")
    return out


def markers(shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """A unique float32 marker per element of every parameter (module doc), by name, in order."""
    bases = _bases(shapes)
    return {n: torch.arange(bases[n] + 1, bases[n] + prod(tuple(s)) + 1, dtype=torch.float32).reshape(tuple(s))
            for n, s in shapes.items()}


def _parts(name: str, rank: int, t: torch.Tensor, names: list[str], starts: torch.Tensor,
           sizes: Mapping[str, int]) -> dict[str, tuple[int, torch.Tensor]]:
    """The sources whose markers engine tensor ``t`` holds: name -> (offset, flat source indices)."""
    if t.dtype != torch.float32:
        raise MapError(f"engine tensor {name!r} on rank {rank} is {t.dtype}: markers are read back from float32")
    ids = t.detach().reshape(-1).to(torch.int64) - 1
    filled = ids >= 0
    which = torch.searchsorted(starts, ids, right=True) - 1
    runs, counts = torch.unique_consecutive(torch.where(filled, which, -1), return_counts=True)
    out: dict[str, tuple[int, torch.Tensor]] = {}
    lo = 0
    for k, n in zip(runs.tolist(), counts.tolist()):
        if k >= 0:
            src = names[k]
            if src in out:
                raise MapError(f"{src!r} on rank {rank}: its elements are not one contiguous run of {name!r}")
            idx = ids[lo:lo + n] - int(starts[k])
            if int(idx.max()) >= sizes[src]:
                raise MapError(f"engine tensor {name!r} on rank {rank}: a value past {src!r}'s elements (not a "
                               "marker)")
            out[src] = (lo, idx)
        lo += n
    if len(out) == 1 and not bool(filled.all()):  # a padded table: zeros after its only part
        (src, (lo, idx)), = out.items()
        if lo != 0 or bool(filled[lo + idx.numel():].any()):
            raise MapError(f"engine tensor {name!r} on rank {rank}: elements outside {src!r}'s part")
    return out


def learn_placed(shapes: Mapping[str, Sequence[int]], engine: Mapping[int, Mapping[str, torch.Tensor]]
                 ) -> dict[str, Placed]:
    """Every parameter of ``shapes`` (the order :func:`markers` was called with) as the engine placed
    it: ``engine[rank]`` is that rank's loaded tensors by the engine's names (module doc)."""
    bases = _bases(shapes)
    names = list(shapes)
    sizes = {n: prod(tuple(s)) for n, s in shapes.items()}
    starts = torch.tensor([bases[n] for n in names], dtype=torch.int64)
    ranks = sorted(engine)
    if ranks != list(range(len(ranks))):
        raise MapError(f"engine ranks {ranks} are not 0..{len(ranks) - 1}")
    # per source and rank: (engine tensor, offset, source indices, engine shape, padding after)
    found: dict[str, dict[int, tuple[str, int, torch.Tensor, tuple[int, ...], int]]] = {n: {} for n in names}
    blank: dict[str, list[tuple[int, tuple[int, ...]]]] = {}  # tensors a rank holds only padding of
    for r in ranks:
        for into, t in engine[r].items():
            if t.dim() == 0:
                continue
            parts = _parts(into, r, t, names, starts, sizes)
            if not parts and t.numel() and not bool(t.any()):
                blank.setdefault(into, []).append((r, tuple(t.shape)))
            for src, (lo, idx) in parts.items():
                if r in found[src]:
                    raise MapError(f"{src!r} on rank {r}: in both {found[src][r][0]!r} and {into!r}")
                pad = t.numel() - lo - idx.numel() if len(parts) == 1 else 0  # trailing zeros
                found[src][r] = (into, lo, idx, tuple(t.shape), pad)
    for src in names:
        _pad(src, found[src], blank, ranks)
    out = {}
    for src in names:
        missing = [r for r in ranks if r not in found[src]]
        if missing:
            raise MapError(f"{src!r}: the engine loaded none of it on rank(s) {missing}")
        intos = {found[src][r][0] for r in ranks}
        if len(intos) > 1:
            raise MapError(f"{src!r}: in different engine tensors on different ranks {sorted(intos)}")
        out[src] = _placed(src, tuple(shapes[src]), found[src], ranks)
    check_placed(out)
    return out


def _pad(src: str, found: dict[int, tuple], blank: Mapping[str, list], ranks: list[int]) -> None:
    """A padded table's padding, as F's rows past the parameter's, in rank order (vLLM's
    ``VocabParallelEmbedding``: each rank an even run of the padded rows): the zeros after a rank's
    part, and the ranks whose tensor holds padding only."""
    intos = {f[0] for f in found.values()}
    if len(intos) != 1:
        return
    (into,) = intos
    extra = {r: shape for r, shape in blank.get(into, []) if r not in found}
    cursor = 0
    for r in ranks:
        if r in found:
            name, lo, idx, shape, pad = found[r]
            cursor = max(cursor, int(idx.max()) + 1)
            if pad:
                found[r] = (name, lo, torch.cat([idx, torch.arange(cursor, cursor + pad)]), shape, 0)
                cursor += pad
        elif r in extra:
            found[r] = (into, 0, torch.arange(cursor, cursor + prod(extra[r])), extra[r], 0)
            cursor += prod(extra[r])


def _placed(src: str, shape: tuple[int, ...], parts: Mapping[int, tuple], ranks: list[int]) -> Placed:
    row = prod(shape[1:]) if shape else 1
    top = max(int(p[2].max()) for p in parts.values()) + 1
    logical = shape if top <= prod(shape) else (-(-top // row),) + shape[1:]
    shards = {}
    for r in ranks:
        into, _, idx, eshape, _ = parts[r]
        tail = prod(eshape[1:])
        shards[r] = (idx.numel() // tail,) + eshape[1:] if eshape and idx.numel() % tail == 0 else (idx.numel(),)

    def fn(x: torch.Tensor, r: int) -> torch.Tensor:
        return x.reshape(-1)[parts[r][2]].reshape(shards[r])

    m = derive(fn, logical, len(ranks))
    if logical != shape:
        m = ParamMap(m.logical_shape, m.shards, valid_shape=shape)
    into = parts[ranks[0]][0]
    return Placed(m, into, {r: parts[r][3] for r in ranks}, {r: parts[r][1] for r in ranks})
