"""Sources of a weight sync as trainers hold them: maps and local shards from FSDP2's DTensors,
DeepSpeed ZeRO-3 partitions and checkpoint readers.

Each helper returns ``(maps, shards)``: source maps by parameter name over global ranks (the same
on every rank) and this rank's shards by name, ready for :class:`reshard.execute.sync.WeightSync`.
Shards are views of what the trainer holds, never copies, so they stay current as the optimizer
updates them in place.

Here, as in :class:`~reshard.execute.sync.WeightSync`, *source* is the side a weight sync reads (the
trainer), the live counterpart of a job's source checkpoint (``docs/spec.md``). The ``*_sources`` names
are API that callers use as ``docs/spec.md`` documents them, so they keep their spelling.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch

from ..errors import MapError
from ..ir.param_map import ParamMap
from ..ir.piece import Piece, View, prod
from ..layouts._core import box_piece, finish, global_ranks
from ..layouts.tp import replicated
from ..layouts.zero import zero3, zero3_partition_numel
from .lazy import LazyShards, read_labels

__all__ = ["dtensor_map", "fsdp2_sources", "reader_sources", "zero3_shard", "zero3_sources"]


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``[lo, hi)`` of chunk ``i`` of ``n`` in ``torch.chunk``'s sizes (DTensor's ``Shard``): chunks
    of ``ceil(n / parts)``, the last ones short or empty."""
    c = -(-n // parts)
    lo = min(n, i * c)
    return lo, min(n, lo + c)


def dtensor_map(shape: Sequence[int], mesh_ranks: Sequence, placements: Sequence, *, name: str = "") -> ParamMap:
    """The map of a DTensor of global ``shape`` on a device mesh whose global ranks are the nested
    list ``mesh_ranks`` (``mesh.mesh.tolist()``), with one placement per mesh dim: ``Shard(d)``
    cuts the current extent of dim ``d`` as ``torch.chunk`` does (mesh dims in order, so two
    shards of one dim nest), ``Replicate`` copies it. ``Partial`` (a pending reduction, P3) and
    ``_StridedShard`` (FSDP over TP's shards, whose order differs) are refused."""
    shape = tuple(shape)
    dims = []
    level = mesh_ranks
    while isinstance(level, list):
        dims.append(len(level))
        level = level[0] if level else None
    if len(dims) != len(placements):
        raise MapError(f"{name}: {len(placements)} placements for a {len(dims)}-d mesh")
    boxes = {}
    for coord in itertools.product(*(range(n) for n in dims)):
        rank = mesh_ranks
        for c in coord:
            rank = rank[c]
        starts, ext = [0] * len(shape), list(shape)
        for k, pl in enumerate(placements):
            kind = type(pl).__name__
            if kind == "Shard":
                d = pl.dim % len(shape)
                lo, hi = _chunk(ext[d], dims[k], coord[k])
                starts[d] += lo
                ext[d] = hi - lo
            elif kind != "Replicate":
                raise MapError(f"{name}: placement {kind} ({pl}) on mesh dim {k} has no map (only Shard and Replicate do)")
        boxes[int(rank)] = (tuple(starts), tuple(ext))
    holders: dict[tuple, set[int]] = {}
    for r, box in boxes.items():
        holders.setdefault(box, set()).add(r)
    shards = {r: (ext, [box_piece(shape, starts, ext, ext, [0] * len(shape), holders[(starts, ext)])]
                  if prod(ext) else [])
              for r, (starts, ext) in boxes.items()}
    return finish(shape, shards)


def fsdp2_sources(model: torch.nn.Module, *, ranks: Sequence[int] | None = None
                  ) -> tuple[dict[str, ParamMap], dict[str, torch.Tensor]]:
    """The maps of every parameter of a model under ``fully_shard`` (its DTensors' placements) and
    this rank's local shards (``to_local()``, the tensors the optimizer updates in place).
    Parameters that are plain tensors are replicated over ``ranks`` (default: the ranks of the
    first DTensor's mesh, else the world). Tied parameters appear once, under their first name."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = list(model.named_parameters())
    mesh_ranks = None
    for _, p in params:
        if isinstance(p, DTensor):
            mesh_ranks = sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist())
            break
    plain = list(ranks) if ranks is not None else mesh_ranks or list(range(dist.get_world_size()))
    me = dist.get_rank()
    maps, shards = {}, {}
    for name, p in params:
        if isinstance(p, DTensor):
            maps[name] = dtensor_map(p.shape, p.device_mesh.mesh.tolist(), p.placements, name=name)
            local = p.to_local()
        else:
            maps[name] = replicated(tuple(p.shape), global_ranks(len(plain), plain))
            local = p
        if me in maps[name].shards:
            shards[name] = local.detach()
    return maps, shards


def zero3_sources(shapes: Mapping[str, Sequence[int]], dp: int, *, ranks: Sequence[int] | None = None
                  ) -> dict[str, ParamMap]:
    """Maps of DeepSpeed ZeRO-3 parameters (``layouts.zero3``, ``shard="fragment"``) over ``dp`` DP
    ranks (global ``ranks``): each rank's shard is its partition without the tail padding
    (:func:`zero3_shard` cuts it from ``param.ds_tensor``)."""
    return {n: zero3(tuple(s), dp, ranks=ranks, shard="fragment") for n, s in shapes.items()}


def zero3_shard(partition: torch.Tensor, shape: Sequence[int], dp: int, dp_rank: int) -> torch.Tensor:
    """DP rank ``dp_rank``'s ZeRO-3 partition of a parameter of ``shape`` (DeepSpeed's ``ds_tensor``:
    ``ceil(numel / dp)`` elements, the last ranks' tails padding) as the shard :func:`zero3_sources`
    maps: a view without the padding."""
    numel = prod(tuple(shape))
    part = zero3_partition_numel(numel, dp)
    flat = partition.reshape(-1)
    if flat.numel() != part:
        raise MapError(f"ZeRO-3 partition of {flat.numel()} elements; a {list(shape)} parameter over {dp} ranks "
                       f"has {part}")
    return flat.narrow(0, 0, max(0, min(part, numel - dp_rank * part)))


def reader_sources(reader, rank: int, *, states: Iterable[str] = ("fp32", "weight"),
                   ranks: Sequence[int] | None = None, names: Iterable[str] | None = None, lazy: bool = True
                   ) -> tuple[dict[str, ParamMap], Mapping[str, torch.Tensor]]:
    """Source maps and shards from a checkpoint on disk (any reader of ``reshard.open``): storage rank
    ``k`` of the checkpoint is read by live rank ``ranks[k]`` (default ``k``), which gets its
    fragments -- only from the files storage rank ``k`` saved. Where a map's keys are not saving
    ranks (``Reader.labels``: a Megatron checkpoint's runs under HF names), ``Reader.saver`` says
    whose files hold each, and a live rank's several keys of one parameter become one shard, their
    fragments back to back. Each parameter takes the first of ``states`` the checkpoint holds (the
    fp32 master, else the module weights). The one place that knows the reader interface
    (``names``, ``states``, ``map``, ``saver``, ``fragment``).

    ``lazy`` (default): the shards are a :class:`~reshard.execute.lazy.LazyShards`, nothing read
    until a push reads it, a band at a time (a quantized weight decoded band by band), so a push
    holds a band, not the checkpoint's decoded shards; ``lazy=False``: a dict of every fragment read
    now (memory-mapped where the reader stores them; a quantized weight decoded whole)."""
    maps, shards, entries = {}, {}, {}
    wanted = tuple(states)
    for name in (reader.names if names is None else names):
        held = reader.states(name)
        state = next((s for s in wanted if s in held), None)
        if state is None:
            raise MapError(f"{name!r}: the checkpoint holds states {list(held)}, none of {list(wanted)}")
        m = reader.map(name, state)
        store = {k: _storage(reader, name, state, k) for k in m.ranks}
        if ranks is not None and any(s >= len(ranks) for s in store.values()):
            raise MapError(f"{name!r}: the checkpoint has storage ranks {sorted(set(store.values()))}, but only "
                           f"{len(ranks)} live ranks read it")
        maps[name], held = _on_live_ranks(m, {k: (s if ranks is None else ranks[s]) for k, s in store.items()})
        mine = held.get(rank)
        if mine:
            labels = mine[0] if len(mine) == 1 else tuple(mine)
            shape = tuple(maps[name].shard(rank).shape)
            entries[name] = (state, labels, shape)
            if not lazy:
                shards[name] = read_labels(reader, name, state, labels).view(shape)
    return maps, (LazyShards(reader, entries) if lazy else shards)


def _storage(reader, name: str, state: str, label: int) -> int:
    """The storage rank whose files hold map key ``label``: the key itself where keys are saving ranks."""
    saver = reader.saver(name, state, label)
    return label if saver is None else saver


def _on_live_ranks(m: ParamMap, live: Mapping[int, int]) -> tuple[ParamMap, dict[int, list[int]]]:
    """``m`` over live ranks (``live[key]``) and each live rank's keys: a key per rank relabeled;
    several keys of one rank (runs of its files) joined into one flat shard, their fragments back
    to back in key order, each piece's holders relabeled."""
    held: dict[int, list[int]] = {}
    for k in sorted(m.ranks):
        held.setdefault(live[k], []).append(k)
    if all(len(ks) == 1 for ks in held.values()):
        return m.with_ranks(live), held
    shards = {}
    for q, keys in held.items():
        pieces, at = [], 0
        for k in keys:
            s = m.shard(k)
            pieces += [Piece(p.shape, p.source, View(p.dest.offset + at, p.dest.strides),
                             frozenset(live[x] for x in p.locations), p.scale) for p in s.pieces]
            at += s.numel
        shards[q] = ((at,), pieces)
    return finish(m.logical_shape, shards, m.valid_shape), held
