"""Damaged copies of a checkpoint folder: each mutation family of the robustness issue, applied to
one file (or two, or the folder) of a fresh copy, deterministically from a seeded generator.

A mutation is ``(family, target, params)``; :func:`apply` performs it on a copy and returns a
line describing exactly what was done. ``CANNOT_SHOW`` lists what the files themselves cannot
reveal (safetensors carries no checksum; two same-sized rank files swapped where no rank is
recorded and no deep check is possible)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import random
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.storage import pickling
from reshard.storage.safe_load import load
from reshard.storage.zip_index import is_zip, read_index

ARCHIVE_FAMILIES = ("flip_tensor", "flip_pkl", "flip_local_header", "flip_central", "resave_shape", "resave_dtype",
                    "resave_keys", "planted_pickle")
FILE_FAMILIES = ("truncate", "empty", "delete", "flip_bytes", "symlink_same", "symlink_junk", "symlink_dir",
                 "symlink_dev")
FOLDER_FAMILIES = ("swap", "latest_garbage", "dcp_metadata", "safetensors_header", "safetensors_data")
MAP_FAMILIES = ("recorded_map",)  # a field of a map a file records (DeepSpeed's affine_map / affine_maps)
# a quantized folder's scales (FP8 weight_scale_inv, MXFP4 *_scales), its config's block, its payloads
QUANT_FAMILIES = ("quant_scale", "quant_swap", "quant_block", "quant_truncate")
FAMILIES = ARCHIVE_FAMILIES + FILE_FAMILIES + FOLDER_FAMILIES + MAP_FAMILIES + QUANT_FAMILIES
CANNOT_SHOW = ("safetensors_data",)  # no checksum in the format: a flipped tensor byte is a valid file
UNSEEN = "[files cannot show]"  # in a description: damage no file can reveal (what the family alone does not say)


@dataclass(frozen=True)
class Mutation:
    family: str
    file: str  # relative to the checkpoint folder ("" for a folder-wide one)
    seed: int
    other: str = ""  # a second file (swap)
    note: dict[str, Any] = field(default_factory=dict, compare=False)


class Planted:
    """A pickle that would run ``touch MARKER`` when loaded (the payload of planted pickles)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def files_of(root: Path) -> list[str]:
    """Every regular file of a checkpoint folder (relative, sorted)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def kind_of(path: Path) -> str:
    name = path.name
    if name == ".metadata":
        return "dcp_metadata"
    if name.endswith(".distcp"):
        return "distcp"
    if name.endswith(".safetensors"):
        return "safetensors"
    if name in ("latest", "latest_universal"):
        return "latest"
    if name.endswith(".json"):
        return "json"
    with open(path, "rb") as f:
        head = f.read(4)
    return "archive" if is_zip(head) else "other"


def candidates(root: Path, family: str) -> list[str]:
    """The files of ``root`` a family applies to."""
    files = files_of(root)
    kinds = {f: kind_of(root / f) for f in files}
    if family in ARCHIVE_FAMILIES:
        out = [f for f in files if kinds[f] == "archive"]
        if family.startswith("resave") or family == "planted_pickle":
            out = [f for f in out if _loads(root / f)]
        return out
    if family in FILE_FAMILIES:
        return files
    if family in MAP_FAMILIES:
        return [f for f in files if kinds[f] == "archive" and _records_maps(root / f)]
    if family == "swap":
        return [f for f in files if _twin(f, files)]
    if family == "latest_garbage":
        return [f for f in files if kinds[f] == "latest"]
    if family == "dcp_metadata":
        return [f for f in files if kinds[f] == "dcp_metadata"]
    if family.startswith("safetensors"):
        return [f for f in files if kinds[f] == "safetensors"]
    if family in QUANT_FAMILIES:
        if (root / ".metadata").is_file():  # a DCP holding FP8 / MXFP4 entries of their own (--quantize keep)
            return _dcp_quant_candidates(root, family)
        return _quant_candidates(root, family, [f for f in files if kinds[f] == "safetensors"])
    raise ValueError(family)


def _loads(path: Path) -> bool:
    try:
        load(path, mmap=False)
        return True
    except ValueError:
        return False


def _records_maps(path: Path) -> bool:
    try:
        return bool(_map_documents(load(path, mmap=False)))
    except ValueError:
        return False


def _twin(f: str, files: list[str]) -> str | None:
    """A file named as ``f`` with another rank number in it (the first such), or None."""
    import re

    digits = list(re.finditer(r"\d+", f))
    for m in digits:
        for g in files:
            if g != f and len(g) == len(f) and g[:m.start()] == f[:m.start()] and g[m.end():] == f[m.end():]:
                return g
    return None


def apply(root: Path, m: Mutation, pristine: Path, scratch: Path) -> str:
    """Perform ``m`` on the checkpoint copy at ``root``; ``pristine`` is the undamaged folder
    (outside the copy), ``scratch`` a folder for what symlinks point at and the marker."""
    rng = random.Random(m.seed)
    path = root / m.file
    fn = globals()[f"_{m.family}"]
    return fn(root, path, rng, m, pristine, scratch)


# -- whole files ------------------------------------------------------------------------------------


def _truncate(root, path, rng, m, pristine, scratch) -> str:
    size = path.stat().st_size
    at = rng.randrange(size) if size else 0
    with open(path, "r+b") as f:
        f.truncate(at)
    return f"{m.file} truncated to {at} of {size} bytes"


def _empty(root, path, rng, m, pristine, scratch) -> str:
    path.write_bytes(b"")
    return f"{m.file} emptied"


def _delete(root, path, rng, m, pristine, scratch) -> str:
    path.unlink()
    return f"{m.file} deleted"


def _flip(path: Path, lo: int, hi: int, rng: random.Random) -> tuple[int, int]:
    at = rng.randrange(lo, hi)
    bit = rng.randrange(8)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << bit)]))
    return at, bit


def _flip_bytes(root, path, rng, m, pristine, scratch) -> str:
    size = path.stat().st_size
    if not size:
        return _empty(root, path, rng, m, pristine, scratch)
    at, bit = _flip(path, 0, size, rng)
    unseen = ""
    if path.suffix == ".safetensors" and at >= 8 + struct.unpack("<Q", (pristine / m.file).read_bytes()[:8])[0]:
        unseen = f" {UNSEEN}: a tensor byte of safetensors, which has no checksum"
    elif path.suffix == ".json" and _parses(path):
        unseen = f" {UNSEEN}: a JSON file (no checksum) that still parses, a value in it changed"
    elif path.suffix == ".safetensors" and _renamed(pristine / m.file, path):
        unseen = f" {UNSEEN}: a tensor renamed in a safetensors header (no checksum), its entry otherwise the same"
    return f"{m.file}: bit {bit} of byte {at} flipped{unseen}"


def _renamed(before: Path, after: Path) -> bool:
    """Whether a safetensors header still parses with the same entries, one under another name: a
    valid file holding a tensor of another name (only a model's parameter names could show it)."""
    try:
        old, new = (_st_header(p)[0] for p in (before, after))
    except (ValueError, UnicodeDecodeError, struct.error):
        return False
    entries = sorted(json.dumps(v, sort_keys=True) for v in old.values())
    return set(old) != set(new) and entries == sorted(json.dumps(v, sort_keys=True) for v in new.values())


def _parses(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
        return True
    except ValueError:
        return False


def _symlink(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _symlink_same(root, path, rng, m, pristine, scratch) -> str:
    _symlink(path, (pristine / m.file).resolve())
    return f"{m.file} -> the undamaged file, outside the folder"


def _symlink_junk(root, path, rng, m, pristine, scratch) -> str:
    junk = scratch / f"junk-{m.seed}{path.suffix}"
    junk.write_bytes(rng.randbytes(rng.randrange(1, 4096)))
    _symlink(path, junk)
    return f"{m.file} -> a junk file outside the folder"


def _symlink_dir(root, path, rng, m, pristine, scratch) -> str:
    d = scratch / "a-folder"
    d.mkdir(exist_ok=True)
    _symlink(path, d)
    return f"{m.file} -> a folder"


def _symlink_dev(root, path, rng, m, pristine, scratch) -> str:
    _symlink(path, Path("/dev/zero"))
    return f"{m.file} -> /dev/zero"


# -- torch archives -----------------------------------------------------------------------------------


def _index(path: Path):
    data = path.read_bytes()
    return read_index(lambda at, n: data[at:at + n], len(data), str(path))


def _flip_tensor(root, path, rng, m, pristine, scratch) -> str:
    index = _index(path)
    recs = [r for n, r in index.records.items() if n.startswith("data/") and r.size]
    if not recs:
        return _flip_pkl(root, path, rng, m, pristine, scratch)
    rec = rng.choice(recs)
    at, bit = _flip(path, rec.start, rec.start + rec.size, rng)
    return f"{m.file}: bit {bit} of byte {at - rec.start} of record {rec.name} flipped"


def _flip_pkl(root, path, rng, m, pristine, scratch) -> str:
    rec = _index(path).records["data.pkl"]
    at, bit = _flip(path, rec.start, rec.start + rec.size, rng)
    return f"{m.file}: bit {bit} of byte {at - rec.start} of data.pkl flipped"


def _flip_local_header(root, path, rng, m, pristine, scratch) -> str:
    rec = rng.choice(list(_index(path).records.values()))
    at, bit = _flip(path, rec.header, rec.start, rng)
    return f"{m.file}: bit {bit} of byte {at - rec.header} of {rec.name}'s local header flipped"


def _flip_central(root, path, rng, m, pristine, scratch) -> str:
    index = _index(path)
    at, bit = _flip(path, index.directory, index.size, rng)
    return f"{m.file}: bit {bit} of byte {at - index.directory} of the central directory / end records flipped"


def _places(obj: Any, at: str = "") -> list[tuple[Any, Any, str]]:
    """(container, key, path) of every tensor and dict entry inside ``obj``."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k, f"{at}.{k}"))
            out += _places(v, f"{at}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i, f"{at}[{i}]"))
            out += _places(v, f"{at}[{i}]")
    return out


def _resave(path: Path, obj: Any) -> None:
    pickling.save(obj, path)


def _tensors(obj: Any) -> list[tuple[Any, Any, str]]:
    return [p for p in _places(obj) if isinstance(p[0][p[1]], torch.Tensor) and p[0][p[1]].numel()]


def _resave_shape(root, path, rng, m, pristine, scratch) -> str:
    obj = load(path, mmap=False)
    places = _tensors(obj)
    if not places:
        return _resave_keys(root, path, rng, m, pristine, scratch)
    box, key, at = rng.choice(places)
    t = box[key].detach().clone()
    how = rng.choice(["1xN", "Nx1", "shorter", "longer"])
    flat = t.reshape(-1)
    box[key] = {"1xN": lambda: flat.reshape(1, -1), "Nx1": lambda: flat.reshape(-1, 1),
                "shorter": lambda: flat[:-1].clone(), "longer": lambda: torch.cat([flat, flat[:1]])}[how]()
    _resave(path, obj)
    # a DeepSpeed module tensor no optimizer group lists (a frozen one) in a file without frozen_param_shapes
    # (ZeRO-1): its shape is recorded nowhere but in the tensor itself
    frozen = isinstance(obj, dict) and box is obj.get("module") and not obj.get("frozen_param_shapes") and \
        isinstance(obj.get("param_shapes"), list) and all(key not in g for g in obj["param_shapes"])
    unseen = f" {UNSEEN}: a frozen tensor, whose shape the file records nowhere else" if frozen else ""
    return f"{m.file}: {at} re-saved {how} ({list(t.shape)} -> {list(box[key].shape)}){unseen}"


def _resave_dtype(root, path, rng, m, pristine, scratch) -> str:
    obj = load(path, mmap=False)
    places = _tensors(obj)
    if not places:
        return _resave_keys(root, path, rng, m, pristine, scratch)
    box, key, at = rng.choice(places)
    old = box[key].dtype
    new = rng.choice([d for d in (torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.float32) if d != old])
    box[key] = box[key].detach().to(new)
    _resave(path, obj)
    return f"{m.file}: {at} re-saved as {new} (was {old})"


def _resave_keys(root, path, rng, m, pristine, scratch) -> str:
    obj = load(path, mmap=False)
    # a state dict's key set (a dict holding tensors), or the file's own entries
    # (a model-state file's global_samples is optional: DeepSpeed's loader derives it when absent, so a
    # file without it is a valid checkpoint, not damage; reshard's fresh DeepSpeed targets leave it out)
    dicts = [p for p in _places(obj) if isinstance(p[0], dict) and (p[0] is obj or any(
        isinstance(v, torch.Tensor) for v in p[0].values())) and not (p[0] is obj and p[1] == "global_samples")]
    if not dicts:
        return _flip_pkl(root, path, rng, m, pristine, scratch)
    box, key, at = rng.choice(dicts)
    # a file's own entries may include a job's client state: one more is no damage, one missing is
    how = rng.choice(["drop", "rename"] if box is obj else ["drop", "rename", "add"])
    if how == "drop":
        del box[key]
    elif how == "rename":
        box[f"{key}_renamed" if isinstance(key, str) else key + 1000] = box.pop(key)
    else:
        box["unexpected_key"] = torch.zeros(3)
    _resave(path, obj)
    # a tensor added to a dense ZeRO-1 model state's module: how DeepSpeed records a frozen parameter (a
    # module entry no group lists; ZeRO-1 writes no frozen_param_shapes), read as one
    frozen = how == "add" and isinstance(obj, dict) and box is obj.get("module") and \
        obj.get("frozen_param_shapes") is None and isinstance(obj.get("param_shapes"), list) and \
        not obj.get("num_experts") and not obj.get("ds_autoep_layers")
    unseen = f" {UNSEEN}: a frozen parameter, as ZeRO-1 records one" if frozen else ""
    return f"{m.file}: key {at} {how}{'ped' if how == 'drop' else 'd' if how == 'rename' else 'ed beside'}{unseen}"


def _planted_pickle(root, path, rng, m, pristine, scratch) -> str:
    marker = scratch / "PICKLE-RAN"
    obj = load(path, mmap=False)
    if isinstance(obj, dict) and rng.random() < 0.7:
        obj["payload"] = Planted(marker)
        how = "beside its content"
    else:
        obj = {"payload": Planted(marker), "content": obj}
        how = "wrapping its content"
    torch.save(obj, path, pickle_module=pickling.pickle_module)
    return f"{m.file}: an os.system pickle planted {how}"


# -- recorded maps --------------------------------------------------------------------------------------


def _map_documents(obj: Any, at: str = "") -> list[tuple[str, dict]]:
    """``(path, params)`` of every map document inside ``obj``: DeepSpeed's
    ``universal_checkpoint_info.affine_map`` and AutoEP's ``affine_maps``, ``{"params": {pattern: map}}``."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            here = f"{at}.{k}" if at else str(k)
            if k in ("affine_map", "affine_maps") and isinstance(v, dict) and isinstance(v.get("params"), dict) \
                    and v["params"]:
                out.append((f"{here}.params", v["params"]))
            else:
                out += _map_documents(v, here)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _map_documents(v, f"{at}[{i}]")
    return out


def _int_edit(rng: random.Random, old: int) -> int:
    return rng.choice([old + 1, old - 1, old * 2, 0, 10**12, 2**31, -old - 1])


def _map_edit(rng: random.Random, params: dict, at: str) -> str:
    """Edit one field of one recorded map in place; returns what was done (``UNSEEN`` where the
    edited map is as valid a statement as the original: a scale, or an entry that no longer names
    its parameter, whose layout then comes from the checkpoint's categories)."""
    what = rng.choice(["name", "rank key", "piece", "piece", "piece", "piece", "map"])
    key = rng.choice(list(params))
    entry, here = params[key], f"{at}.{key}"
    if what == "name":
        how = rng.choice(["unmatched", "invalid regex", "matches all", "not a string"])
        new = {"unmatched": f"{key}_renamed", "invalid regex": f"({key}", "matches all": ".*",
               "not a string": 7}[how]
        params[new] = params.pop(key)
        unseen = f" {UNSEEN}: the parameter's layout now comes from the categories" if how == "unmatched" else ""
        return f"{here} renamed {new!r} ({how}){unseen}"
    ranks = entry["ranks"]
    rank = rng.choice(list(ranks))
    if what == "rank key":
        how = rng.choice(["past TP", "swapped", "leading zero", "not a number", "dropped"])
        others = [r for r in ranks if r != rank]
        if how == "swapped" and others:
            other = rng.choice(others)
            ranks[rank], ranks[other] = ranks[other], ranks[rank]
        elif how == "dropped":
            del ranks[rank]
        else:
            new = {"past TP": int(rank) + len(ranks) if str(rank).isdigit() else 99, "leading zero": f"0{rank}",
                   "not a number": "x"}.get(how, 99)
            ranks[new] = ranks.pop(rank)
        return f"{here}.ranks.{rank}: rank key {how}"
    if what == "map":
        field = rng.choice(["logical_shape", "shard_shape", "valid_shape", "version"])
        box = ranks[rank] if field == "shard_shape" else entry
        path = f"{here}.ranks.{rank}.{field}" if field == "shard_shape" else f"{here}.{field}"
        if field == "version":
            entry["version"] = rng.choice([2, 0, "1", None])
            return f"{path} set to {entry['version']!r}"
        shape = list(box.get(field, entry["logical_shape"]))
        if not shape:
            box[field] = [1]
            return f"{path}: [] -> [1]"
        d = rng.randrange(len(shape))
        old, shape[d] = shape[d], _int_edit(rng, shape[d])
        box[field] = shape
        return f"{path}[{d}]: {old} -> {shape[d]}"
    pieces = ranks[rank]["pieces"]
    if not pieces:
        del ranks[rank]
        return f"{here}.ranks.{rank}: dropped (no pieces)"
    i = rng.randrange(len(pieces))
    p, path = pieces[i], f"{here}.ranks.{rank}.pieces.{i}"
    field = rng.choice(["shape", "source offset", "source stride", "dest offset", "dest stride", "locations",
                        "scale"])
    if field == "locations":
        how = rng.choice(["add a rank", "drop the own rank", "another rank", "empty", "repeat", "unknown rank"])
        locs, all_ranks = list(p["locations"]), [int(r) for r in ranks if str(r).isdigit()]
        own = int(rank) if str(rank).isdigit() else locs[0]
        new = {"add a rank": sorted(set(locs) | {max(all_ranks) + 1 if set(all_ranks) <= set(locs) else
                                                 min(set(all_ranks) - set(locs))}),
               "drop the own rank": [r for r in locs if r != own] or [own + 1],
               "another rank": [own + 1], "empty": [], "repeat": locs + locs[:1], "unknown rank": locs + [99]}[how]
        p["locations"] = new
        return f"{path}.locations: {locs} -> {new} ({how})"
    if field == "scale":
        old = p.get("scale", 1.0)
        new = rng.choice([2.0, 0.5, 3.0, -1.0, 0, float("nan"), "1"])
        p["scale"] = new
        valid = isinstance(new, float) and new == new and new != 0
        return f"{path}.scale: {old!r} -> {new!r}" + (f" {UNSEEN}: a valid scale, the file's own statement" if valid
                                                      else "")
    if field == "shape":
        if not p["shape"]:
            p["shape"] = [2]
            return f"{path}.shape: [] -> [2]"
        d = rng.randrange(len(p["shape"]))
        old = p["shape"][d]
        p["shape"][d] = _int_edit(rng, old)
        return f"{path}.shape[{d}]: {old} -> {p['shape'][d]}"
    side, part = field.split()
    view = p[side]
    if part == "offset" or not view[1]:
        old = view[0]
        view[0] = _int_edit(rng, old)
        return f"{path}.{side}[0]: {old} -> {view[0]}"
    d = rng.randrange(len(view[1]))
    old = view[1][d]
    view[1][d] = _int_edit(rng, old)
    return f"{path}.{side}[1][{d}]: {old} -> {view[1][d]}"


def _recorded_map(root, path, rng, m, pristine, scratch) -> str:
    obj = load(path, mmap=False)
    docs = _map_documents(obj)
    if not docs:
        return _resave_keys(root, path, rng, m, pristine, scratch)
    at, params = rng.choice(docs)
    what = _map_edit(rng, params, at)
    _resave(path, obj)
    return f"{m.file}: {what}"


# -- folder-wide ----------------------------------------------------------------------------------------


def _swap(root, path, rng, m, pristine, scratch) -> str:
    other = root / m.other
    tmp = path.with_name(path.name + ".swap")
    path.rename(tmp)
    other.rename(path)
    tmp.rename(other)
    return f"{m.file} and {m.other} swapped"


def _latest_garbage(root, path, rng, m, pristine, scratch) -> str:
    how = rng.choice(["not utf-8", "300 chars", "missing tag", "empty", "slash", "dotdot", "nul"])
    data = {"not utf-8": b"\xff\xfe\x80global\xc3", "300 chars": b"g" * 300, "missing tag": b"global_step999",
            "empty": b"", "slash": b"../../etc", "dotdot": b"..", "nul": b"global\x00step"}[how]
    path.write_bytes(data)
    return f"{m.file}: {how} ({data[:20]!r})"


def _dcp_metadata(root, path, rng, m, pristine, scratch) -> str:
    md = pickle.loads(path.read_bytes())  # our own undamaged fixture: trusted here
    keys = [k for k, e in md.state_dict_metadata.items() if hasattr(e, "chunks") and e.chunks]
    key = rng.choice(keys)
    entry = md.state_dict_metadata[key]
    how = rng.choice(["shift", "resize", "drop", "dtype", "size", "storage_offset", "storage_length", "duplicate",
                      "planted"])
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    c = entry.chunks[0]
    if not len(entry.size) and how in ("shift", "resize", "size"):  # a 0-d tensor (a step) has no dimension to edit
        how = "dtype"
    if how == "shift":
        entry.chunks[0] = ChunkStorageMetadata(torch.Size([c.offsets[0] + 1, *c.offsets[1:]]), c.sizes)
    elif how == "resize":
        entry.chunks[0] = ChunkStorageMetadata(c.offsets, torch.Size([max(0, c.sizes[0] - 1), *c.sizes[1:]]))
    elif how == "drop":
        entry.chunks.pop(0)
    elif how == "dtype":
        entry.properties.dtype = torch.float16 if entry.properties.dtype != torch.float16 else torch.float32
    elif how == "size":
        entry.size = torch.Size([entry.size[0] + 1, *entry.size[1:]])
    elif how == "duplicate":
        entry.chunks.append(entry.chunks[0])
    elif how == "planted":
        md.planner_data = {key: Planted(scratch / "PICKLE-RAN")}
    else:
        idx = next(k for k in md.storage_data if k.fqn == key)
        info = md.storage_data[idx]
        if how == "storage_offset":
            info.offset += rng.choice([-1, 1, 64])
        else:
            info.length += rng.choice([-1, 1])
    path.write_bytes(pickle.dumps(md))
    return f".metadata: {key} {how}"


def _safetensors_header(root, path, rng, m, pristine, scratch) -> str:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    how = rng.choice(["shape", "dtype", "offsets", "drop", "flip"])
    e = header[name]
    if how == "flip":
        at, bit = _flip(path, 8, 8 + n, rng)
        renamed = f" {UNSEEN}: a tensor renamed (no checksum), its entry otherwise the same" \
            if _renamed(pristine / m.file, path) else ""
        return f"{m.file}: bit {bit} of header byte {at} flipped{renamed}"
    if how == "shape":
        e["shape"] = [*e["shape"][:-1], e["shape"][-1] + 1] if e["shape"] else [2]
    elif how == "dtype":
        e["dtype"] = {"F32": "BF16", "BF16": "F32", "F16": "F32"}.get(e["dtype"], "F32")
    elif how == "offsets":
        e["data_offsets"] = [e["data_offsets"][0] + 4, e["data_offsets"][1] + 4]
    else:
        del header[name]
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    return f"{m.file}: header entry {name} {how}"


def _safetensors_data(root, path, rng, m, pristine, scratch) -> str:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    if len(raw) <= 8 + n:
        return _safetensors_header(root, path, rng, m, pristine, scratch)
    at, bit = _flip(path, 8 + n, len(raw), rng)
    return f"{m.file}: bit {bit} of tensor byte {at - 8 - n} flipped (safetensors has no checksum)"


# -- quantized folders ---------------------------------------------------------------------------------

SCALES = ("_scale_inv", "_scales")  # FP8 block scales, MXFP4 exponents
PAYLOADS = ("F8_E4M3", "F8_E5M2")  # FP8 payload dtypes (MXFP4's *_blocks are U8)


def _quant_config(root: Path) -> dict | None:
    try:
        q = json.loads((root / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return q if isinstance(q, dict) else None


def _st_header(path: Path) -> tuple[dict, int, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), n, raw


def _st_write(path: Path, header: dict, raw: bytes, n: int) -> None:
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


def _scales(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__" and k.endswith(SCALES))


def _payloads(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__" and (header[k]["dtype"] in PAYLOADS or k.endswith("_blocks")))


def _quant_candidates(root: Path, family: str, tensors: list[str]) -> list[str]:
    q = _quant_config(root)
    if q is None:
        return []
    if family == "quant_block":
        return ["config.json"] if q.get("quant_method") == "fp8" and "weight_block_size" in q else []
    pick = _payloads if family == "quant_truncate" else _scales
    return [f for f in tensors if len(pick(_st_header(root / f)[0])) >= (2 if family == "quant_swap" else 1)]


def _quant_scale(root, path, rng, m, pristine, scratch) -> str:
    """One scale entry made one a reader must refuse: NaN, inf, zero, negative (float scales); the
    E8M0 byte 255, which is NaN (E8M0 and MXFP4's uint8 exponents)."""
    if (root / ".metadata").is_file():
        return _dcp_quant_scale(root, rng, m)
    header, n, raw = _st_header(path)
    name = rng.choice(_scales(header))
    e = header[name]
    lo, hi = e["data_offsets"]
    size = {"F32": 4, "BF16": 2, "F16": 2}.get(e["dtype"], 1)
    at = 8 + n + lo + size * rng.randrange((hi - lo) // size)
    if size == 1:
        value, data = "255 (E8M0 NaN)", b"\xff"
    else:
        value = rng.choice(["nan", "inf", "-inf", "0", "-0", "-1", "-1e-30"])
        data = torch.tensor([float(value)]).to({"F32": torch.float32, "BF16": torch.bfloat16,
                                                 "F16": torch.float16}[e["dtype"]]).view(torch.uint8).numpy().tobytes()
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)
    return f"{m.file}: an entry of {name} set to {value}"


def _quant_swap(root, path, rng, m, pristine, scratch) -> str:
    """Two tensors' data exchanged under their names: two scale tensors, or a scale and a payload.
    Two scales of one shape and dtype swapped are a valid folder with other values (no checksum)."""
    if (root / ".metadata").is_file():
        return _dcp_quant_swap(root, rng, m)
    header, n, raw = _st_header(path)
    scales = _scales(header)
    a = rng.choice(scales)
    how = rng.choice(["scales", "scale and payload"])
    others = [k for k in (scales if how == "scales" else _payloads(header)) if k != a]
    b = rng.choice(others)
    ea, eb = header[a], header[b]
    header[a], header[b] = eb, ea
    _st_write(path, header, raw, n)
    same = ea["dtype"] == eb["dtype"] and ea["shape"] == eb["shape"]
    return f"{m.file}: {a} and {b} swapped" + (f" (same shape and dtype) {UNSEEN}" if same else "")


def _quant_block(root, path, rng, m, pristine, scratch) -> str:
    """config.json's weight_block_size edited. A block that gives every scale tensor the same grid
    is a valid config with other values (nothing in the files says which block was used)."""
    if (root / ".metadata").is_file():
        return _dcp_quant_block(root, rng, m)
    cfg = json.loads(path.read_text())
    q = cfg["quantization_config"]
    bm, bn = q["weight_block_size"]
    new = rng.choice([[bm * 2, bn], [bm, bn // 2], [bm + 1, bn], [0, bn], [-bm, bn], [bm], [bm, bn, 1], "16x32", None,
                      [bm + 0.5, bn], [2**62, bn], [bn, bm]])
    q["weight_block_size"] = new
    path.write_text(json.dumps(cfg, indent=2))
    return f"config.json: weight_block_size {[bm, bn]} -> {new!r}" + (f" {UNSEEN}" if _same_grid(root, new) else "")


def _same_grid(root: Path, block: Any) -> bool:
    """Whether ``block`` is a valid block giving every FP8 payload of the folder its scales' shape."""
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        return False
    for f in files_of(root):
        if not f.endswith(".safetensors"):
            continue
        header = _st_header(root / f)[0]
        for k in _payloads(header):
            *lead, rows, cols = header[k]["shape"]
            s = header.get(k + "_scale_inv")
            if s and s["shape"] != [*lead, -(-rows // block[0]), -(-cols // block[1])]:
                return False
    return True


def _quant_truncate(root, path, rng, m, pristine, scratch) -> str:
    """The file cut inside a quantized payload's bytes."""
    if (root / ".metadata").is_file():
        return _dcp_quant_truncate(root, rng, m)
    header, n, raw = _st_header(path)
    name = rng.choice(_payloads(header))
    lo, hi = header[name]["data_offsets"]
    at = 8 + n + rng.randrange(lo, hi)
    with open(path, "r+b") as f:
        f.truncate(at)
    return f"{m.file} truncated to {at} of {len(raw)} bytes, inside {name}"


# -- quantized DCP checkpoints (``--quantize keep``: payload and scale entries of their own) --------------
# Each damage is made with valid records (a tensor record re-saved as reshard's DCP writer saves one, in
# place where it keeps its length, else appended to its file with .metadata pointing at it), so what is
# tested is the quantized reader's checks, not the records' CRC-32 (``flip_bytes`` and ``truncate`` do that).


def _dcp_md(root: Path) -> Any:
    return pickle.loads((root / ".metadata").read_bytes())  # our own undamaged fixture: trusted here


def _dcp_quant_config(md: Any, root: Path) -> dict:
    """The ``quantization_config`` entries (flattened as ``dcp.save`` flattens a dict), by leaf."""
    out = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith("quantization_config.") and index.offset is None:
            raw = (root / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
            out[index.fqn.split(".", 1)[1]] = torch.load(io.BytesIO(raw), weights_only=True)
    return out


def _dcp_chunks(md: Any, suffixes: tuple[str, ...] | None = None, dtypes: tuple[str, ...] | None = None
                ) -> list[Any]:
    """Storage indexes of the tensor chunks whose key ends with ``suffixes`` or whose dtype is one of
    ``dtypes`` (the payloads), in a stable order."""
    out = []
    for index in md.storage_data:
        e = md.state_dict_metadata.get(index.fqn)
        if index.offset is None or not hasattr(e, "chunks"):
            continue
        if suffixes is not None and index.fqn.endswith(suffixes) or dtypes is not None and (
                str(e.properties.dtype) in dtypes or index.fqn.endswith("_blocks")):
            out.append(index)
    return sorted(out, key=lambda i: (i.fqn, tuple(i.offset)))


DCP_PAYLOADS = ("torch.float8_e4m3fn", "torch.float8_e5m2")


def _dcp_quant_candidates(root: Path, family: str) -> list[str]:
    md = _dcp_md(root)
    q = _dcp_quant_config(md, root)
    if not q:
        return []
    if family == "quant_block":
        return [".metadata"] if q.get("quant_method") == "fp8" and "weight_block_size" in q else []
    if family == "quant_swap":
        return [".metadata"] if len(_dcp_chunks(md, SCALES)) >= 2 else []
    found = _dcp_chunks(md, dtypes=DCP_PAYLOADS) if family == "quant_truncate" else _dcp_chunks(md, SCALES)
    return sorted({md.storage_data[i].relative_path for i in found})


def _dcp_tensor(root: Path, info: Any) -> torch.Tensor:
    raw = (root / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    return torch.load(io.BytesIO(raw), weights_only=True)


def _dcp_replace(root: Path, md: Any, index: Any, data: bytes) -> str:
    """Record ``index`` replaced by ``data``: in place where it has the old length, else appended to its file
    (``.metadata`` rewritten to point at it)."""
    info = md.storage_data[index]
    path = root / info.relative_path
    if len(data) == info.length:
        with open(path, "r+b") as f:
            f.seek(info.offset)
            f.write(data)
        return "in place"
    at = path.stat().st_size
    with open(path, "ab") as f:
        f.write(data)
    md.storage_data[index] = dataclasses.replace(info, offset=at, length=len(data))
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return "appended"


def _resaved(t: torch.Tensor) -> bytes:
    from reshard.storage import torch_zip

    buf = io.BytesIO()
    torch_zip.save(torch_zip.tensor(t.dtype, tuple(t.shape), t.contiguous()), buf)
    return buf.getvalue()


def _dcp_quant_scale(root: Path, rng: random.Random, m: Mutation) -> str:
    md = _dcp_md(root)
    index = rng.choice([i for i in _dcp_chunks(md, SCALES) if md.storage_data[i].relative_path == m.file])
    t = _dcp_tensor(root, md.storage_data[index]).clone()
    flat = t.reshape(-1)
    at = rng.randrange(flat.numel())
    if t.dtype in (torch.uint8, torch.float8_e8m0fnu):
        value = "255 (E8M0 NaN)"
        flat.view(torch.uint8)[at] = 255
    else:
        value = rng.choice(["nan", "inf", "-inf", "0", "-0", "-1", "-1e-30"])
        flat[at] = float(value)
    how = _dcp_replace(root, md, index, _resaved(t))
    return f"{m.file}: entry {index.fqn} chunk at {list(index.offset)}: element {at} set to {value} (re-saved {how})"


def _dcp_quant_swap(root: Path, rng: random.Random, m: Mutation) -> str:
    """Two chunks' records exchanged under their keys (.metadata's storage index): two scale entries', or a
    scale's and a payload's. Two of one shape and dtype: a valid checkpoint with other values."""
    md = _dcp_md(root)
    scales = _dcp_chunks(md, SCALES)
    a = rng.choice(scales)
    how = rng.choice(["scales", "scale and payload"])
    others = [i for i in (scales if how == "scales" else _dcp_chunks(md, dtypes=DCP_PAYLOADS)) if i != a]
    b = rng.choice(others)
    md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]
    (root / ".metadata").write_bytes(pickle.dumps(md))
    ea, eb = md.state_dict_metadata[a.fqn], md.state_dict_metadata[b.fqn]
    ca, cb = (next(c for c in e.chunks if tuple(c.offsets) == tuple(i.offset)) for e, i in ((ea, a), (eb, b)))
    same = ea.properties.dtype == eb.properties.dtype and tuple(ca.sizes) == tuple(cb.sizes)
    return f".metadata: the records of {a.fqn} at {list(a.offset)} and {b.fqn} at {list(b.offset)} swapped" + (
        f" (same shape and dtype) {UNSEEN}" if same else "")


def _dcp_quant_block(root: Path, rng: random.Random, m: Mutation) -> str:
    """The ``quantization_config.weight_block_size`` entry re-saved with another block."""
    md = _dcp_md(root)
    index = next(i for i in md.storage_data if i.fqn == "quantization_config.weight_block_size")
    bm, bn = _dcp_quant_config(md, root)["weight_block_size"]
    new = rng.choice([[bm * 2, bn], [bm, bn // 2], [bm + 1, bn], [0, bn], [-bm, bn], [bm], [bm, bn, 1], "16x32", None,
                      [bm + 0.5, bn], [2**62, bn], [bn, bm]])
    buf = io.BytesIO()
    torch.save(new, buf)
    how = _dcp_replace(root, md, index, buf.getvalue())
    return f"quantization_config.weight_block_size: {[bm, bn]} -> {new!r} (re-saved {how})" + (
        f" {UNSEEN}" if _dcp_same_grid(md, new) else "")


def _dcp_same_grid(md: Any, block: Any) -> bool:
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        return False
    sd = md.state_dict_metadata
    for key, e in sd.items():
        if not hasattr(e, "chunks") or str(e.properties.dtype) not in DCP_PAYLOADS:
            continue
        *lead, rows, cols = e.size
        s = sd.get(key + "_scale_inv")
        if s is not None and list(s.size) != [*lead, -(-rows // block[0]), -(-cols // block[1])]:
            return False
    return True


def _dcp_quant_truncate(root: Path, rng: random.Random, m: Mutation) -> str:
    """The file cut inside a payload chunk's record."""
    md = _dcp_md(root)
    index = rng.choice([i for i in _dcp_chunks(md, dtypes=DCP_PAYLOADS) if md.storage_data[i].relative_path == m.file])
    info = md.storage_data[index]
    at = info.offset + rng.randrange(info.length)
    size = (root / m.file).stat().st_size
    with open(root / m.file, "r+b") as f:
        f.truncate(at)
    return f"{m.file} truncated to {at} of {size} bytes, inside {index.fqn} chunk at {list(index.offset)}"


def copy_folder(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True)
