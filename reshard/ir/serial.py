"""JSON format v1 of a map: a strict decoder and its encoder.

Interoperable with DeepSpeed 0.19.8's ``ParamAffineMap.to_dict``/``from_dict``: the same keys,
``scale`` omitted when 1, rank keys ints in memory and strings after JSON. reshard adds two
optional keys that older readers ignore: ``valid_shape`` and ``version``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import MapFormatError
from .piece import Piece, View, scale_problem
from .shard import MapLike, Shard

FORMAT_VERSION = 1


def _piece_to_dict(p: Piece) -> dict[str, Any]:
    d: dict[str, Any] = {
        "shape": list(p.shape),
        "source": [p.source.offset, list(p.source.strides)],
        "dest": [p.dest.offset, list(p.dest.strides)],
        "locations": sorted(p.locations),
    }
    if p.scale != 1.0:
        d["scale"] = p.scale
    return d


def encode_map(m: MapLike) -> dict[str, Any]:
    d: dict[str, Any] = {
        "logical_shape": list(m.logical_shape),
        "ranks": {
            str(rank): {"shard_shape": list(s.shape), "pieces": [_piece_to_dict(p) for p in s.pieces]}
            for rank, s in m.shards.items()
        },
    }
    if m.is_padded:
        d["valid_shape"] = list(m.valid_shape)
    return d


# -- strict decoding ------------------------------------------------------------------------


# The strict JSON decoders below are shared with the plan format (``reshard.plan.values``): each
# raises MapFormatError whose path names the offending value.


def json_int(x: Any, path: str, *, minimum: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise MapFormatError(path, f"expected an integer, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise MapFormatError(path, f"expected an integer >= {minimum}, got {x}")
    return x


def json_list(x: Any, path: str) -> list:
    if not isinstance(x, (list, tuple)):
        raise MapFormatError(path, f"expected a list, got {type(x).__name__}")
    return list(x)


def json_dict(x: Any, path: str) -> dict:
    if not isinstance(x, dict):
        raise MapFormatError(path, f"expected an object, got {type(x).__name__}")
    return x


def json_key(d: dict, key: str, path: str) -> Any:
    if key not in d:
        raise MapFormatError(f"{path}.{key}" if path else key, "missing required key")
    return d[key]


def json_shape(x: Any, path: str) -> tuple[int, ...]:
    return tuple(json_int(n, f"{path}[{i}]") for i, n in enumerate(json_list(x, path)))


def _view(x: Any, path: str, ndim: int) -> View:
    pair = json_list(x, path)
    if len(pair) != 2:
        raise MapFormatError(path, f"expected [offset, [strides]], got {len(pair)} items")
    offset = json_int(pair[0], f"{path}[0]")
    strides = tuple(json_int(s, f"{path}[1][{i}]") for i, s in enumerate(json_list(pair[1], f"{path}[1]")))
    if len(strides) != ndim:
        raise MapFormatError(f"{path}[1]", f"{len(strides)} strides for a {ndim}-d shape")
    return View(offset, strides)


def _piece(x: Any, path: str) -> Piece:
    d = json_dict(x, path)
    shape = json_shape(json_key(d, "shape", path), f"{path}.shape")
    source = _view(json_key(d, "source", path), f"{path}.source", len(shape))
    dest = _view(json_key(d, "dest", path), f"{path}.dest", len(shape))
    locs_raw = json_list(json_key(d, "locations", path), f"{path}.locations")
    locs = [json_int(r, f"{path}.locations[{i}]") for i, r in enumerate(locs_raw)]
    if not locs:
        raise MapFormatError(f"{path}.locations", "must name at least one rank")
    if len(set(locs)) != len(locs):
        raise MapFormatError(f"{path}.locations", f"repeats a rank: {locs}")
    scale = d.get("scale", 1.0)
    problem = scale_problem(scale)
    if problem:
        raise MapFormatError(f"{path}.scale", problem)
    return Piece(shape, source, dest, frozenset(locs), float(scale))


def json_rank(k: Any, path: str) -> int:
    if isinstance(k, str):
        if not k.isdigit() or (len(k) > 1 and k[0] == "0"):
            raise MapFormatError(path, f"rank key {k!r} is not a non-negative integer")
        return int(k)
    return json_int(k, path)


MapFields = tuple[tuple[int, ...], dict[int, Shard], "tuple[int, ...] | None"]


def decode_map(d: Any, path: str = "") -> MapFields:
    """``(logical_shape, shards, valid_shape)`` of one map entry, the *format* validated (not the
    geometry: ``ParamMap.check()`` does that). ``ParamMap.from_dict`` builds the map."""
    d = json_dict(d, path)
    version = d.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise MapFormatError(_join(path, "version"), f"unknown format version {version!r} (know {FORMAT_VERSION})")
    logical = json_shape(json_key(d, "logical_shape", path), _join(path, "logical_shape"))
    valid = None
    if "valid_shape" in d:
        valid = json_shape(d["valid_shape"], _join(path, "valid_shape"))
        if len(valid) != len(logical) or any(v > n for v, n in zip(valid, logical)):
            raise MapFormatError(_join(path, "valid_shape"), f"{list(valid)} does not fit in {list(logical)}")
    ranks_path = _join(path, "ranks")
    ranks = json_dict(json_key(d, "ranks", path), ranks_path)
    shards: dict[int, Shard] = {}
    for key, entry in ranks.items():
        rpath = f"{ranks_path}.{key}"
        rank = json_rank(key, rpath)
        if rank in shards:
            raise MapFormatError(rpath, f"rank {rank} appears twice")
        entry = json_dict(entry, rpath)
        shape = json_shape(json_key(entry, "shard_shape", rpath), f"{rpath}.shard_shape")
        plist = json_list(json_key(entry, "pieces", rpath), f"{rpath}.pieces")
        pieces = tuple(_piece(p, f"{rpath}.pieces.{i}") for i, p in enumerate(plist))
        shards[rank] = Shard(shape, pieces)
    return logical, shards, valid


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# -- documents holding many maps (the checkpoint's ``affine_map`` entry) ----------------------


def encode_document(maps: Mapping[str, MapLike]) -> dict[str, Any]:
    """``{"version": 1, "params": {name: map}}``."""
    return {"version": FORMAT_VERSION, "params": {name: encode_map(m) for name, m in maps.items()}}


def decode_document(doc: Any) -> dict[str, MapFields]:
    doc = json_dict(doc, "")
    version = json_key(doc, "version", "")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise MapFormatError("version", f"unknown format version {version!r} (know {FORMAT_VERSION})")
    params = json_dict(json_key(doc, "params", ""), "params")
    out = {}
    for name, entry in params.items():
        if not isinstance(name, str):
            raise MapFormatError("params", f"parameter key {name!r} is not a string")
        out[name] = decode_map(entry, f"params.{name}")
    return out
