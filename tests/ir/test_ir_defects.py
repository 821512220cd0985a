"""A catalogue of planted defects: each is refused with the right error class and a message that
names where the defect is (JSON path, rank, piece)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from reshard import ParamMap
from reshard.errors import MapError, MapFormatError, ReplicaMismatchError, ShardError
from tests.support.irgen import grid_map, segmented_map

# A valid 2-rank column split of an 4x6 F, as JSON.
GOOD = {
    "logical_shape": [4, 6],
    "ranks": {
        "0": {"shard_shape": [4, 3], "pieces": [
            {"shape": [4, 3], "source": [0, [6, 1]], "dest": [0, [3, 1]], "locations": [0]}]},
        "1": {"shard_shape": [4, 3], "pieces": [
            {"shape": [4, 3], "source": [3, [6, 1]], "dest": [0, [3, 1]], "locations": [1]}]},
    },
}


def _edit(fn):
    d = copy.deepcopy(GOOD)
    fn(d)
    return d


P0 = lambda d: d["ranks"]["0"]["pieces"][0]  # noqa: E731
P1 = lambda d: d["ranks"]["1"]["pieces"][0]  # noqa: E731

FORMAT_DEFECTS = [
    ("missing logical_shape", lambda d: d.pop("logical_shape"), "logical_shape"),
    ("missing ranks", lambda d: d.pop("ranks"), "ranks"),
    ("ranks not an object", lambda d: d.__setitem__("ranks", [1, 2]), "ranks"),
    ("rank key not an integer", lambda d: d["ranks"].__setitem__("x", d["ranks"].pop("1")), "ranks.x"),
    ("rank key with leading zero", lambda d: d["ranks"].__setitem__("01", d["ranks"].pop("1")), "ranks.01"),
    ("missing shard_shape", lambda d: d["ranks"]["1"].pop("shard_shape"), "ranks.1.shard_shape"),
    ("pieces not a list", lambda d: d["ranks"]["0"].__setitem__("pieces", {}), "ranks.0.pieces"),
    ("piece missing dest", lambda d: P0(d).pop("dest"), "ranks.0.pieces.0.dest"),
    ("fractional source offset", lambda d: P1(d)["source"].__setitem__(0, 3.5), "ranks.1.pieces.0.source[0]"),
    ("integral float offset is still not an int", lambda d: P1(d)["source"].__setitem__(0, 3.0),
     "ranks.1.pieces.0.source[0]"),
    ("string stride", lambda d: P0(d)["source"][1].__setitem__(0, "6"), "ranks.0.pieces.0.source[1][0]"),
    ("bool offset", lambda d: P0(d)["dest"].__setitem__(0, True), "ranks.0.pieces.0.dest[0]"),
    ("stride count differs from shape", lambda d: P0(d)["dest"].__setitem__(1, [1]), "ranks.0.pieces.0.dest[1]"),
    ("negative extent", lambda d: P0(d)["shape"].__setitem__(0, -4), "ranks.0.pieces.0.shape[0]"),
    ("negative stride", lambda d: P0(d)["source"][1].__setitem__(1, -1), "ranks.0.pieces.0.source[1][1]"),
    ("zero scale", lambda d: P0(d).__setitem__("scale", 0.0), "ranks.0.pieces.0.scale"),
    ("infinite scale", lambda d: P0(d).__setitem__("scale", math.inf), "ranks.0.pieces.0.scale"),
    ("nan scale", lambda d: P0(d).__setitem__("scale", math.nan), "ranks.0.pieces.0.scale"),
    ("string scale", lambda d: P0(d).__setitem__("scale", "0.5"), "ranks.0.pieces.0.scale"),
    ("unknown version", lambda d: d.__setitem__("version", 2), "version"),
    ("empty locations", lambda d: P0(d).__setitem__("locations", []), "ranks.0.pieces.0.locations"),
    ("repeated location", lambda d: P0(d).__setitem__("locations", [0, 0]), "ranks.0.pieces.0.locations"),
    ("source is not a pair", lambda d: P0(d).__setitem__("source", [0]), "ranks.0.pieces.0.source"),
    ("valid_shape larger than F", lambda d: d.__setitem__("valid_shape", [5, 6]), "valid_shape"),
    ("shape not a list", lambda d: P0(d).__setitem__("shape", 12), "ranks.0.pieces.0.shape"),
    ("rank repeated as int and string", lambda d: d["ranks"].__setitem__(1, d["ranks"]["1"]), "ranks.1"),
]


@pytest.mark.parametrize("name,edit,path", FORMAT_DEFECTS, ids=[f[0] for f in FORMAT_DEFECTS])
def test_format_defect(name, edit, path):
    with pytest.raises(MapFormatError) as e:
        ParamMap.from_dict(_edit(edit))
    assert e.value.path == path, str(e.value)
    assert str(e.value).startswith(path)


def test_good_map_is_good():
    ParamMap.from_dict(GOOD).check()


GEOMETRY_DEFECTS = [
    ("source view outside F", lambda d: P1(d)["source"].__setitem__(0, 4), "rank 1 piece 0", "outside F"),
    ("dest view outside shard", lambda d: P0(d)["dest"].__setitem__(0, 1), "rank 0 piece 0", "outside the shard"),
    ("shard gap", lambda d: d["ranks"]["0"].__setitem__("shard_shape", [5, 3]), "rank 0", "written by no piece"),
    ("shard written twice",
     lambda d: d["ranks"]["0"]["pieces"].append(
         {"shape": [3], "source": [12, [1]], "dest": [0, [1]], "locations": [0]}),
     "rank 0 piece", "overlapping piece"),
    ("uncovered element",
     lambda d: P1(d).__setitem__("shape", [3, 3]) or d["ranks"]["1"].__setitem__("shard_shape", [3, 3]),
     "F [4, 6]", "covered by no piece"),
    ("locations omit a holder",
     lambda d: (P1(d).__setitem__("source", [0, [6, 1]])), "rank", "different locations"),
    ("locations name a non-holder", lambda d: P0(d).__setitem__("locations", [0, 1]), "rank 0 piece 0",
     "locations must be exact"),
    ("locations omit the own rank", lambda d: P1(d).__setitem__("locations", [0]), "rank 1 piece 0",
     "must include the rank"),
    ("locations name an unknown rank", lambda d: P0(d).__setitem__("locations", [0, 7]), "rank 0 piece 0",
     "not in the map"),
    ("non-injective source view",
     lambda d: P0(d)["source"][1].__setitem__(0, 0), "rank 0 piece 0", "more than once"),
    ("non-injective dest view", lambda d: P0(d)["dest"][1].__setitem__(1, 0), "rank 0 piece 0", "more than once"),
]


@pytest.mark.parametrize("name,edit,where,reason", GEOMETRY_DEFECTS, ids=[g[0] for g in GEOMETRY_DEFECTS])
def test_geometry_defect(name, edit, where, reason):
    m = ParamMap.from_dict(_edit(edit))
    with pytest.raises(MapError) as e:
        m.check()
    assert where in str(e.value) and reason in str(e.value), str(e.value)


def _replicated_pair(scale0: float, scale1: float) -> dict:
    piece = {"shape": [4], "source": [0, [1]], "dest": [0, [1]]}
    return {"logical_shape": [4], "ranks": {
        "0": {"shard_shape": [4], "pieces": [dict(piece, locations=[0, 1], scale=scale0)]},
        "1": {"shard_shape": [4], "pieces": [dict(piece, locations=[0, 1], scale=scale1)]}}}


def test_overlapping_pieces_with_different_scales():
    with pytest.raises(MapError, match=r"rank 1 piece 0 .*different scale"):
        ParamMap.from_dict(_replicated_pair(0.5, 0.25)).check()


def test_rank_holding_an_element_twice():
    d = {"logical_shape": [4], "ranks": {"0": {"shard_shape": [8], "pieces": [
        {"shape": [4], "source": [0, [1]], "dest": [0, [1]], "locations": [0]},
        {"shape": [4], "source": [0, [1]], "dest": [4, [1]], "locations": [0]}]}}}
    with pytest.raises(MapError, match=r"rank 0 piece 1 .*already holds"):
        ParamMap.from_dict(d).check()


def test_inhomogeneous_piece_spanning_two_holder_sets():
    """GPTBigCode at TP=2 with the last rank's q rows fused to the replicated kv block: one
    piece whose first half is private and second half replicated (seed, 'Overlap and
    locations')."""
    good = segmented_map((12, 2), 0, [(8, False), (4, True)], 2)
    good.check()
    d = good.to_dict()
    pieces = d["ranks"]["1"]["pieces"]
    merged = {"shape": [16], "source": [8, [1]], "dest": [0, [1]], "locations": [0, 1]}
    d["ranks"]["1"]["pieces"] = [merged] if pieces[0]["source"][0] == 8 else pieces
    with pytest.raises(MapError, match=r"rank .* piece .*locations"):
        ParamMap.from_dict(d).check()


def test_uncovered_reports_boxes_not_elements():
    d = _edit(lambda d: d["ranks"].pop("1"))
    m = ParamMap.from_dict(d)
    assert m.uncovered() == [((0, 1, 4), (3, 1, 3))]


# -- apply-time defects ------------------------------------------------------------------------


def test_shard_of_wrong_size():
    m = grid_map((4, 6), {1: [3, 3]})
    with pytest.raises(ShardError, match="rank 1: shard has 10 elements"):
        m.rebuild({0: torch.zeros(4, 3), 1: torch.zeros(10)})


def test_missing_holder():
    m = grid_map((4, 6), {1: [3, 3]})
    with pytest.raises(ShardError, match=r"rank 1 piece 0 .*no supplied shard holds"):
        m.rebuild({0: torch.zeros(4, 3)})


def test_mixed_dtypes():
    m = grid_map((4, 6), {1: [3, 3]})
    with pytest.raises(ShardError, match="rank 1: shard dtype"):
        m.rebuild({0: torch.zeros(4, 3), 1: torch.zeros(4, 3, dtype=torch.float64)})


def test_unknown_rank_supplied():
    m = grid_map((4, 6), {1: [3, 3]})
    with pytest.raises(ShardError, match="rank 5"):
        m.rebuild({0: torch.zeros(4, 3), 1: torch.zeros(4, 3), 5: torch.zeros(1)})


def test_extract_wrong_full_shape():
    m = grid_map((4, 6), {1: [3, 3]})
    with pytest.raises(ShardError, match=r"full tensor has shape \[6, 4\]"):
        m.extract(torch.zeros(6, 4), 0)


def test_scaled_piece_on_integers():
    m = ParamMap.from_dict(_replicated_pair(0.5, 0.5))
    with pytest.raises(MapError, match="rank 0 piece 0: a scaled piece cannot apply to integer"):
        m.extract(torch.arange(4), 0)


def test_replica_drift():
    m = ParamMap.from_dict(_replicated_pair(1.0, 1.0))
    with pytest.raises(ReplicaMismatchError, match=r"ranks 0 and 1 .*largest difference 3"):
        m.rebuild({0: torch.tensor([1.0, 2, 3, 4]), 1: torch.tensor([1.0, 2, 6, 4])})


def test_unknown_rank_lookup():
    m = grid_map((4, 6), {1: [3, 3]})
    with pytest.raises(MapError, match="rank 9 is not in this map"):
        m.extract(torch.zeros(4, 6), 9)
