"""Learned maps cached per (model class, config, parallel sizes, vLLM version, parameter shapes).

Learning a model's maps (``layouts.learned``) builds a float32 copy of the model on every vLLM
worker and loads a marker per element: seconds for a tiny model, far more for a large one, and the
answer depends only on what vLLM's loaders do with those shapes. So each worker keeps what was
learned, in this process and on disk, under a :class:`MapsKey`:

* the model class vLLM builds (``Qwen2ForCausalLM``), a SHA-256 of its HF config (the keys that
  name the folder or the writing library's version left out: the same config in two folders is
  the same model), vLLM's quantization method;
* TP, PP, DP and EP sizes (EP: 1 unless vLLM runs experts in parallel);
* the vLLM version (a loader change re-learns);
* a SHA-256 of the parameters' names and full shapes (the trainer's set, in order).

An entry is one worker's: ``<root>/vllm-maps/<digest>.w<rank>.json`` holds the key, the maps of
every parameter on every worker (``Placed``, workers ``0..W-1``, as ``wire.encode_targets``
writes them: ``ParamMap.to_dict``), and this worker's engine tensors and placed element count,
so a worker that reads it skips the marker model and still checks what it checks after learning.
The root is ``$RESHARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/reshard``, else ``~/.cache/reshard``;
``RESHARD_CACHE_DIR=off`` keeps entries in the process only. Files are written whole (a temporary
file renamed into place) and read strictly: an entry that does not decode, names another key or
does not cover exactly the parameters asked for is ignored (and relearned over), never used.

No vLLM import: the engine computes the key from its config (``engine.maps_key``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...errors import ReshardError
from ...layouts.inference import Placed
from . import wire

__all__ = ["CachedMaps", "MapsKey", "cache_root", "clear_memory", "config_digest", "decode", "encode", "get", "maps_digest",
           "put", "shapes_digest"]

_log = logging.getLogger(__name__)

FORMAT = 1
_DROP = ("transformers_version",)  # what differs between two copies of one config


def _sha(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def config_digest(config: Mapping[str, Any]) -> str:
    """SHA-256 of an HF config as a dict, without the keys that name where it was read from
    (``_name_or_path`` and the other ``_``-keys) or which transformers wrote it."""
    return _sha({k: v for k, v in config.items() if not k.startswith("_") and k not in _DROP})


def maps_digest(maps: Mapping[str, Placed]) -> str:
    """SHA-256 of maps as ``wire.encode_targets`` writes them (to compare two engines' maps)."""
    return hashlib.sha256(wire.encode_targets(maps)).hexdigest()


def shapes_digest(shapes: Mapping[str, Sequence[int]]) -> str:
    return _sha([[n, list(s)] for n, s in shapes.items()])


@dataclass(frozen=True, slots=True)
class MapsKey:
    """What the learned maps of a model depend on (module doc)."""

    model_class: str
    config: str
    quantization: str
    tp: int
    pp: int
    dp: int
    ep: int
    vllm: str
    shapes: str

    @property
    def digest(self) -> str:
        return _sha(asdict(self))


@dataclass(frozen=True, slots=True)
class CachedMaps:
    """One worker's entry: the maps of every parameter (workers ``0..W-1``), this worker's engine
    tensors, the elements the markers placed on it, and where it came from (``"memory"``,
    ``"disk"``)."""

    maps: dict[str, Placed]
    engine_tensors: tuple[str, ...]
    placed_elements: int
    source: str = "memory"


_MEMORY: dict[tuple[str, int], CachedMaps] = {}


def cache_root() -> Path | None:
    """Where entries are kept on disk (module doc); ``None``: in the process only."""
    env = os.environ.get("RESHARD_CACHE_DIR")
    if env:
        return None if env == "off" else Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "reshard"


def _path(root: Path, key: MapsKey, rank: int) -> Path:
    return root / "vllm-maps" / f"{key.digest}.w{rank}.json"


def _covers(maps: Mapping[str, Placed], shapes: Mapping[str, Sequence[int]]) -> bool:
    return list(maps) == list(shapes) and all(tuple(maps[n].map.valid_shape) == tuple(s) for n, s in shapes.items())


def get(key: MapsKey, rank: int, shapes: Mapping[str, Sequence[int]]) -> CachedMaps | None:
    """Worker ``rank``'s entry for ``key`` (this process first, then disk), or ``None``."""
    hit = _MEMORY.get((key.digest, rank))
    if hit is not None and _covers(hit.maps, shapes):
        return CachedMaps(hit.maps, hit.engine_tensors, hit.placed_elements, "memory")
    root = cache_root()
    if root is None:
        return None
    path = _path(root, key, rank)
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _log.warning("reshard: ignoring the cached maps %s: %s", path, e)
        return None
    try:
        entry = decode(doc, key, rank)
    except (ReshardError, KeyError, TypeError, ValueError) as e:
        _log.warning("reshard: ignoring the cached maps %s: %s", path, e)
        return None
    if not _covers(entry.maps, shapes):
        _log.warning("reshard: ignoring the cached maps %s: they cover other parameters", path)
        return None
    _MEMORY[(key.digest, rank)] = entry
    return CachedMaps(entry.maps, entry.engine_tensors, entry.placed_elements, "disk")


def put(key: MapsKey, rank: int, entry: CachedMaps) -> Path | None:
    """Keep worker ``rank``'s entry for ``key`` in this process and on disk (the path, or ``None``
    where there is no disk cache or it cannot be written: a cache never fails the transfer)."""
    _MEMORY[(key.digest, rank)] = CachedMaps(entry.maps, entry.engine_tensors, entry.placed_elements, "memory")
    root = cache_root()
    if root is None:
        return None
    path = _path(root, key, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(encode(key, rank, entry)).encode())
            os.replace(tmp, path)  # whole or not at all, also when several workers write at once
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        _log.warning("reshard: could not keep the learned maps in %s: %s", path, e)
        return None
    return path


def encode(key: MapsKey, rank: int, entry: CachedMaps) -> dict[str, Any]:
    return {"format": FORMAT, "key": asdict(key), "rank": rank, "maps": json.loads(wire.encode_targets(entry.maps)),
            "engine_tensors": list(entry.engine_tensors), "placed_elements": entry.placed_elements}


def decode(doc: Any, key: MapsKey, rank: int) -> CachedMaps:
    """A document :func:`encode` wrote for ``key`` and ``rank``; raises where it is anything else."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a format {FORMAT} maps document")
    if doc.get("key") != asdict(key) or doc.get("rank") != rank:
        raise ValueError("written for another key or worker")
    maps = wire.decode_targets(json.dumps(doc["maps"]).encode())  # Placed checks each part fits its tensor
    for p in maps.values():
        p.map.check()
    names, placed = doc["engine_tensors"], doc["placed_elements"]
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and isinstance(placed, int)):
        raise ValueError("engine_tensors / placed_elements malformed")
    return CachedMaps(maps, tuple(names), placed, "disk")


def clear_memory() -> None:
    """Forget the entries kept in this process (tests)."""
    _MEMORY.clear()
