"""Interop with DeepSpeed 0.19.8's ``deepspeed.checkpoint.affine``: its builders' maps load here,
pass ``check()`` and rebuild the same F; reshard's JSON loads there and rebuilds the same F."""

from __future__ import annotations

import json

import pytest
import torch

from reshard import ParamMap
from reshard.ir import canonicalize
from tests.support.irgen import flat_map, grid_map, random_tensor, replicated_map, segmented_map

affine = pytest.importorskip("deepspeed.checkpoint.affine")


def _ds_builders():
    return [
        ("replicated", (6, 4), affine.replicated_map((6, 4), 3)),
        ("replicated scaled", (6, 4), affine.replicated_map((6, 4), 4, scale=0.25)),
        ("row split uneven", (10, 4), affine.contiguous_split_map((10, 4), [3, 3, 4], 0)),
        ("column split", (4, 12), affine.contiguous_split_map((4, 12), [6, 6], 1)),
        ("column split 3d", (2, 4, 12), affine.contiguous_split_map((2, 4, 12), [4, 4, 4], 2)),
        ("fused qkv sub-params", (24, 4),
         affine.sub_param_map((24, 4), [16, 4, 4], [[8, 8], [2, 2], [2, 2]], 0)),
        ("fused qkv uneven", (24, 6),
         affine.sub_param_map((24, 6), [12, 6, 6], [[6, 4, 2], [2, 2, 2], [3, 2, 1]], 0)),
        ("bigcode mqa", (48, 8), affine.segmented_map((48, 8), [(32, False), (16, True)], 0, 4, [[8, 8, 8, 8]])),
        ("yuan value", (32, 8), affine.block_gather_map((32, 8), {0: [0, 2], 1: [1, 3]}, 8, 0)),
        ("yuan o_proj", (8, 32), affine.block_gather_map((8, 32), {0: [0, 2], 1: [1, 3]}, 8, 1)),
    ]


@pytest.mark.parametrize("name,shape,ds_map", _ds_builders(), ids=[b[0] for b in _ds_builders()])
def test_deepspeed_maps_load_check_and_rebuild(name, shape, ds_map):
    entry = json.loads(json.dumps(ds_map.to_dict()))  # rank keys become strings, as on disk
    m = ParamMap.from_dict(entry)
    m.check()
    assert ParamMap.from_dict(ds_map.to_dict()) == m  # int rank keys, as in memory
    full = random_tensor(shape, torch.float32, 7)
    shards = {r: ds_map.extract(full, r) for r in ds_map.shard_shapes}
    for r, s in shards.items():
        assert torch.equal(m.extract(full, r), s)
    assert torch.equal(m.rebuild(shards), ds_map.rebuild(shards))
    assert torch.equal(canonicalize(m).rebuild(shards), full)


def _ours():
    return [
        ("grid", grid_map((6, 8), {0: [3, 3], 1: [4, 4]})),
        ("uneven rows", grid_map((7, 3), {0: [2, 2, 3]})),
        ("segmented mqa", segmented_map((12, 4), 0, [(8, False), (4, True)], 4)),
        ("flat zero ranges", flat_map((5, 7), [0, 9, 20, 35])),
        ("replicated", replicated_map((3, 5), 2)),
        ("scaled replicated", replicated_map((3, 5), 2, 0.5)),
        ("canonical folded column split", canonicalize(grid_map((8, 12), {1: [4, 4, 4]}))),
    ]


@pytest.mark.parametrize("name,m", _ours(), ids=[b[0] for b in _ours()])
def test_reshard_json_loads_in_deepspeed(name, m):
    m.check()
    ds_map = affine.ParamAffineMap.from_dict(json.loads(json.dumps(m.to_dict())))
    ds_map.validate_coverage()  # DeepSpeed's own element-wise check agrees
    full = random_tensor(m.logical_shape, torch.float32, 11)
    shards = {r: m.extract(full, r) for r in m.ranks}
    for r in m.ranks:
        assert torch.equal(ds_map.extract(full, r), shards[r])
    assert torch.equal(ds_map.rebuild(shards), full)


def test_empty_piece_as_deepspeed_writes_it():
    """DeepSpeed writes a zero-extent piece for a rank holding none of a block."""
    d = affine.segmented_map((8, 2), [(4, False), (4, True)], 0, 2, [[4, 0]]).to_dict()
    assert any(0 in p["shape"] for p in d["ranks"][1]["pieces"])
    m = ParamMap.from_dict(d)
    m.check()
    full = torch.randn(8, 2)
    assert torch.equal(m.rebuild({r: m.extract(full, r) for r in m.ranks}), full)
    assert all(not p.is_empty for _, _, p in canonicalize(m).pieces())
