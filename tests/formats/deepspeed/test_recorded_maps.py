"""A map a DeepSpeed checkpoint records (``universal_checkpoint_info.affine_map``) is input like any
other byte of it: an edited one is refused by every command before anything composes or plans
with it, with one line naming the file, the parameter and the JSON path of the field at fault,
and nothing is left behind (issue 37)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from reshard.cli import main as cli
from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.damage import copy_fixture
from tests.support.paths import DEEPSPEED

AFFINE = "universal_checkpoint_info.affine_map.params"
NORM, EMBED, DOWN = r"^model\.norm\.weight$", r"^model\.embed_tokens\.weight$", r"^model\.layers\.0\.mlp\.down_proj\.weight$"


def edit_recorded(ck: Path, how: Callable[[dict], object], file: str = "mp_rank_00_model_states.pt") -> Path:
    """Apply ``how`` to the recorded map document of ``ck``'s model-state file ``file`` (by default
    the first, which reshard reads them from) and re-save it with valid CRCs; returns the file."""
    victim = next(ck.glob(f"global_step*/{file}"))
    obj = load(victim, mmap=False)
    how(obj["universal_checkpoint_info"]["affine_map"]["params"])
    save(obj, victim)
    return victim


def _piece(params: dict, key: str, rank: int) -> dict:
    return params[key]["ranks"][rank]["pieces"][0]


def _set(key: str, rank: int, field: str, index: int, value: int) -> Callable[[dict], None]:
    def how(params: dict) -> None:
        _piece(params, key, rank)[field][index] = value
    return how


def _grow(key: str, rank: int, dim: int) -> Callable[[dict], None]:
    def how(params: dict) -> None:
        _piece(params, key, rank)["shape"][dim] += 1
    return how


ISSUE_EDITS = [  # the three edits of the issue, each with the field its error must name
    ("llama_tp2", _set(NORM, 0, "source", 0, 1_000_000_000_000), "model.norm.weight",
     f"{AFFINE}.{NORM}.ranks.0.pieces.0.source[0]"),
    ("llama_tp2", _set(EMBED, 1, "shape", 1, 2_147_483_648), "model.embed_tokens.weight",
     f"{AFFINE}.{EMBED}.ranks.1.pieces.0.shape[1]"),
    ("qwen2_tp2", _grow(DOWN, 0, 1), "model.layers.0.mlp.down_proj.weight",
     f"{AFFINE}.{DOWN}.ranks.0.pieces.0.shape[1]"),
]


def _commands(ck: Path, out: Path) -> list[list[str]]:
    return [[*a] for a in (
        ("convert", str(ck), str(out), "--format", "ucp"),
        ("convert", str(ck), str(out), "--format", "safetensors"),
        ("reshard", str(ck), str(out), "--tp", "1", "--dp", "1"),
        ("inspect", str(ck)),
    )]


@pytest.mark.parametrize("fixture,how,param,field", ISSUE_EDITS, ids=["offset", "stretched-shape", "grown-shape"])
def test_an_edited_recorded_map_is_refused_by_every_command(tmp_path, capsys, fixture, how, param, field):
    ck = copy_fixture(DEEPSPEED / fixture, tmp_path)
    victim = edit_recorded(ck, how)
    out = tmp_path / "out"
    for argv in _commands(ck, out):
        code = cli(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv, err)
        assert "\n" not in err and err.startswith("reshard: error: "), err
        assert f"{victim}: parameter {param!r}: {field}: " in err, (argv, err)
        assert not out.exists() and not list(tmp_path.rglob(".reshard-partial-*")), argv


def _ds_error(ck: Path, name: str) -> str:
    with pytest.raises(CheckpointError) as e:
        DeepSpeedCheckpoint.open(ck).tp_map(name)
    return str(e.value)


def _rename(old: str, new: object) -> Callable[[dict], None]:
    def how(params: dict) -> None:
        params[new] = params.pop(old)
    return how


def _ranks(key: str, how: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda params: how(params[key]["ranks"])


Q = r"^model\.layers\.0\.self_attn\.q_proj\.weight$"
FIELD_EDITS = [  # (edit, parameter, JSON path under the entry, what the reason says)
    (_set(Q, 1, "dest", 0, 1), "model.layers.0.self_attn.q_proj.weight", "ranks.1.pieces.0.dest[0]", "outside the shard"),
    (lambda p: _piece(p, Q, 0)["source"][1].__setitem__(0, 16), "model.layers.0.self_attn.q_proj.weight",
     "ranks.0.pieces.0.source[1]", "more than once"),
    (lambda p: _piece(p, Q, 0).__setitem__("locations", [0, 1]), "model.layers.0.self_attn.q_proj.weight",
     "ranks.0.pieces.0.locations", "locations must be exact"),
    (lambda p: _piece(p, NORM, 1).__setitem__("scale", 0.5), "model.norm.weight", "ranks.1.pieces.0.scale",
     "different scale"),
    (lambda p: _piece(p, Q, 0).__setitem__("scale", 0), "model.layers.0.self_attn.q_proj.weight",
     "ranks.0.pieces.0.scale", "non-zero"),
    (_ranks(Q, lambda r: r.__setitem__(2, r[1])), "model.layers.0.self_attn.q_proj.weight", "ranks.2",
     "not a TP rank"),
    (_ranks(Q, lambda r: r.__setitem__("01", r.pop(1))), "model.layers.0.self_attn.q_proj.weight", "ranks.01",
     "not a non-negative integer"),
    (lambda p: p[Q]["ranks"][0].__setitem__("shard_shape", [17, 32]), "model.layers.0.self_attn.q_proj.weight",
     "ranks.0.shard_shape", "the model state has"),
    (lambda p: p[Q].__setitem__("logical_shape", [33, 32]), "model.layers.0.self_attn.q_proj.weight", "ranks",
     "covered by no piece"),
]


@pytest.mark.parametrize("how,param,field,reason", FIELD_EDITS,
                         ids=["dest-offset", "stride", "locations", "scale", "zero-scale", "extra-rank", "rank-key",
                              "shard-shape", "logical-shape"])
def test_each_field_of_a_recorded_map_is_checked(tmp_path, how, param, field, reason):
    ck = copy_fixture(DEEPSPEED / "llama_tp2", tmp_path)
    victim = edit_recorded(ck, how)
    err = _ds_error(ck, param)
    key = "^" + re.escape(param) + "$"
    assert err.startswith(f"{victim}: parameter {param!r}: {AFFINE}.{key}.{field}: "), err
    assert reason in err, err


K = r"^model\.layers\.0\.self_attn\.k_proj\.weight$"


@pytest.mark.parametrize("old,new,reason", [(Q, "(", "not a regular expression"), (Q, 7, "not a string"),
                                            (K, ".*", "matches several patterns")])
def test_a_recorded_parameter_pattern_is_checked(tmp_path, old, new, reason):
    ck = copy_fixture(DEEPSPEED / "llama_tp2", tmp_path)
    victim = edit_recorded(ck, _rename(old, new))
    err = _ds_error(ck, "model.layers.0.self_attn.q_proj.weight")
    assert err.startswith(f"{victim}: parameter "), err
    assert reason in err, err


@pytest.mark.parametrize("fixture,file", [("llama_tp2", "mp_rank_01_model_states.pt"),
                                          ("llama_zero3_tp2_dp2", "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_every_model_state_file_records_the_maps_read(tmp_path, capsys, fixture, file):
    """Another rank's copy of the maps (which reshard does not lower, and some routes copy as they
    are) must be the copy read: an edit there is refused too."""
    ck = copy_fixture(DEEPSPEED / fixture, tmp_path)
    victim = edit_recorded(ck, _set(NORM, 0, "source", 0, 1), file)
    out = tmp_path / "out"
    for argv in _commands(ck, out):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert f"{victim}: universal_checkpoint_info.affine_map.params.{NORM}.ranks.0.pieces.0.source[0] " \
               "disagrees with " in err, err
        assert not out.exists() and not list(tmp_path.rglob(".reshard-partial-*")), argv


W1 = "model.layers.0.mlp.experts.w1"


def _edit_state(ck: Path, how: Callable[[dict], object]) -> Path:
    victim = next(ck.glob("global_step*/mp_rank_00_model_states.pt"))
    obj = load(victim, mmap=False)
    how(obj)
    save(obj, victim)
    return victim


def _stride_zero(state: dict) -> None:
    state["ds_autoep_layers"][0]["affine_maps"]["params"][W1]["ranks"][0]["pieces"][0]["source"][1][1] = 0


def _uc_renamed(state: dict) -> None:
    params = state["universal_checkpoint_info"]["ds_autoep_layers"][0]["affine_maps"]["params"]
    params[".*"] = params.pop(W1)


AUTOEP_EDITS = [  # what the fuzz suite found in AutoEP's per-layer affine_maps (tracebacks, wrong outputs)
    (lambda s: s["ds_autoep_layers"][0]["affine_maps"]["params"].__setitem__(".*", {}),
     "ds_autoep_layers[0].affine_maps.params: '.*' is not an expert parameter"),
    (_stride_zero, f"ds_autoep_layers[0].affine_maps.params.{W1}.ranks.0.pieces.0.source[1]: "),
    (_uc_renamed, "universal_checkpoint_info.ds_autoep_layers[0].affine_maps.params.model.layers.0.mlp.experts.w1 "
                  "disagrees with ds_autoep_layers"),
]


@pytest.mark.parametrize("how,needle", AUTOEP_EDITS, ids=["stray-name", "stride-zero", "copy-renamed"])
def test_an_edited_autoep_affine_map_is_refused(tmp_path, capsys, how, needle):
    ck = copy_fixture(DEEPSPEED / "mixtral_autoep_ep2", tmp_path)
    victim = _edit_state(ck, how)
    out = tmp_path / "out"
    for argv in _commands(ck, out):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert f"{victim}: {needle}" in err, err
        assert not out.exists() and not list(tmp_path.rglob(".reshard-partial-*")), argv


def test_a_map_document_names_the_json_path_in_the_file(tmp_path, capsys):
    """A map document (``inspect``, ``plan``) is checked as it is read, the path as in the file."""
    import json

    from reshard.layouts import split

    m = split((32, 88), 1, [44, 44]).to_dict()
    m["ranks"]["1"]["pieces"][0]["shape"][1] = 45
    doc = tmp_path / "maps.json"
    doc.write_text(json.dumps({"version": 1, "params": {"w": m}}))
    assert cli(["inspect", str(doc)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{doc}: parameter 'w': params.w.ranks.1.pieces.0.shape[1]: " in err, err
