"""``check`` names the JSON path of the field at fault (``MapError.path``), under the path the
caller gives; a view outside its tensor is blamed on the one field whose repair makes the map
valid (issue 37)."""

from __future__ import annotations

import copy

import pytest

from reshard import ParamMap
from reshard.errors import MapError
from reshard.ir.geometry import is_injective
from reshard.layouts import replicated, split

COL = split((32, 88), 1, [44, 44]).to_dict()  # a row-parallel weight at TP=2 (columns split)
REP = replicated((32,), 2).to_dict()  # a norm weight, replicated


def _edited(d: dict, rank: int, fn) -> ParamMap:
    d = copy.deepcopy(d)
    fn(d["ranks"][str(rank)]["pieces"][0])
    return ParamMap.from_dict(d)


def _set(field: str, index: int, value):
    return lambda p: p[field].__setitem__(index, value)


def _add(field: str, index: int, by: int):
    return lambda p: p[field].__setitem__(index, p[field][index] + by)


CASES = [  # (map, rank, edit, field blamed)
    (REP, 0, _set("source", 0, 10**12), "ranks.0.pieces.0.source[0]"),
    (REP, 0, _add("source", 0, 1), "ranks.0.pieces.0.source[0]"),  # shape 31 would fit too, but leave a hole
    (REP, 1, _set("shape", 0, 2**31), "ranks.1.pieces.0.shape[0]"),
    (COL, 0, _add("shape", 1, 1), "ranks.0.pieces.0.shape[1]"),  # only the dest view leaves its tensor
    (COL, 1, _add("shape", 1, 1), "ranks.1.pieces.0.shape[1]"),  # both views do
    (COL, 1, _add("source", 0, 1), "ranks.1.pieces.0.source[0]"),
    (COL, 1, _add("dest", 0, 3), "ranks.1.pieces.0.dest[0]"),
    (COL, 1, lambda p: p["source"][1].__setitem__(0, 89), "ranks.1.pieces.0.source[1][0]"),
]


@pytest.mark.parametrize("d,rank,edit,field", CASES)
def test_a_view_outside_its_tensor_names_the_field_to_repair(d, rank, edit, field):
    m = _edited(d, rank, edit)
    with pytest.raises(MapError) as e:
        m.check()
    assert e.value.path == field, str(e.value)
    assert str(e.value).startswith(f"{field}: rank {rank} piece 0 "), str(e.value)


def test_the_path_goes_under_the_callers():
    m = _edited(COL, 0, _set("locations", 0, 1))
    with pytest.raises(MapError) as e:
        m.check("params.w")
    assert e.value.path == "params.w.ranks.0.pieces.0.locations", str(e.value)
    assert "must include the rank" in e.value.reason


def test_every_check_names_a_path():
    edits = [(lambda p: p.__setitem__("locations", [0, 1]), "locations"),
             (lambda p: p["dest"][1].__setitem__(0, 1), "dest[1]")]
    for edit, leaf in edits:
        m = _edited(COL, 0, edit)
        with pytest.raises(MapError) as e:
            m.check()
        assert e.value.path == f"ranks.0.pieces.0.{leaf}", str(e.value)
    shrunk = _edited(COL, 0, _add("shape", 1, -1))
    with pytest.raises(MapError) as e:
        shrunk.check()
    assert e.value.path == "ranks.0.pieces", str(e.value)


def test_injectivity_enumerates_elements_not_addresses():
    """A stretched stride that breaks nesting is decided from the view's 9 elements, not by
    allocating its span of 2**41 addresses."""
    assert not is_injective((3, 3), (2**40, 2**40))
    assert is_injective((3, 3), (2**40 + 5, 2**40))


def test_in_context_keeps_an_errors_type_and_path():
    """``in_context`` of a format error (whose ``__init__`` takes a path and a reason) once ended
    in a TypeError; it keeps the type and the fields of every error."""
    from reshard.errors import MapFormatError, in_context

    for e in (MapFormatError("ranks.0", "missing"), MapError("outside", path="ranks.0.pieces.0.shape[1]")):
        got = in_context(e, "file.pt")
        assert type(got) is type(e) and got.path == e.path and str(got) == f"file.pt: {e}"
