"""Frozen parameters (``requires_grad=False``) in DeepSpeed checkpoints, through every route.

Three fixtures DeepSpeed 0.19.8 wrote from one training recipe with the embedding and one
LayerNorm frozen (``llama_frozen_zero{1,2,3}_dp2``; the same losses, bit for bit): ZeRO-1 keeps a
frozen parameter only as a module entry no optimizer group lists; ZeRO-2 also records it in
``frozen_param_shapes`` / ``frozen_param_fragments`` (the module entry's tensor); ZeRO-3 keeps a
placeholder in the module and each DP rank's partition in its own model-state file. A frozen
parameter is a module weight without optimizer state: read from where the stage keeps it, written
as DeepSpeed writes it at the target stage, never as a buffer, never with a master or moments.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from reshard.errors import ReshardError
from reshard.formats.registry import open_reader
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from reshard.storage.torch_zip import save
from tests.support.compare import diff_files, same
from tests.support.dsconv import FIXTURES, ds_to_universal, tag_dir

FROZEN = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight")
STAGES = (1, 2, 3)


def _name(stage: int) -> str:
    return f"llama_frozen_zero{stage}_dp2"


def _frozen_values(stage: int) -> dict[str, torch.Tensor]:
    """The frozen weights as the fixture holds them: the ZeRO-1/2 module entries (never trained, the
    same in every fixture), or ZeRO-3's partitions joined as ``zero_to_fp32`` joins them."""
    tag = tag_dir(_name(stage))
    if stage != 3:
        module = load(tag / "mp_rank_00_model_states.pt")["module"]
        return {n: module[n] for n in FROZEN}
    parts = [load(tag / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt") for d in range(2)]
    shapes = parts[0]["frozen_param_shapes"]
    return {n: torch.cat([p["frozen_param_fragments"][n] for p in parts])[:shapes[n].numel()].view(shapes[n])
            for n in FROZEN}


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.rglob("*.safetensors")):
        out.update(load_file(f))
    return out


# -- reading --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_read_as_module_weights_without_optimizer_state(stage):
    r = open_reader(FIXTURES / _name(stage))
    r.check()
    assert r.frozen() == FROZEN
    assert r.names[0] == FROZEN[0] and r.names.index(FROZEN[1]) == 8  # the module's order
    assert len(r.names) == 21
    groups = r.param_groups()
    assert not any(n in g["params"] for g in groups for n in FROZEN)
    for n in FROZEN:
        assert r.states(n) == ("weight",) and r.step(n) is None
    # the frozen weights are the same in all three fixtures (never trained) and equal the LayerNorm's init
    assert torch.equal(_frozen_values(stage)[FROZEN[1]], torch.ones(32))
    from reshard.present.inspected import open_source

    assert open_source(FIXTURES / _name(stage)).names == r.names  # inspect shows them, in the same order


def test_zero_stages_hold_the_same_frozen_weights():
    a, b, c = (_frozen_values(s) for s in STAGES)
    for n in FROZEN:
        assert torch.equal(a[n], b[n]) and torch.equal(a[n], c[n])


@pytest.mark.parametrize("stage", STAGES)
def test_safetensors_is_zero_to_fp32(stage, tmp_path):
    """Every weight DeepSpeed's own consolidation gives (frozen ones included from ZeRO-2 on; at
    ZeRO-1 ``zero_to_fp32`` leaves them out: they are the module entries), bit for bit."""
    pytest.importorskip("deepspeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    oracle = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / _name(stage)))
    assert (set(FROZEN) <= set(oracle)) == (stage != 1)
    oracle.update(_frozen_values(stage))
    got = _safetensors(convert(FIXTURES / _name(stage), tmp_path / "st", fmt="safetensors").out_dir)
    assert sorted(got) == sorted(oracle)
    for k, v in oracle.items():
        same(got[k], v.contiguous(), k)


# -- DeepSpeed targets: DeepSpeed's own save at the other stage ------------------------------------


@pytest.mark.parametrize("src,stage", [(1, 2), (2, 1), (1, 1), (3, 3)])
def test_other_zero12_stage_is_deepspeeds_own_save(src, stage, tmp_path):
    """ZeRO-1 <-> ZeRO-2 (and each at its own topology): DeepSpeed's own files of the same run at the
    target stage, tensor for tensor (the frozen entries, ZeRO-2's frozen records sharing the module
    entry's tensor), but ``ds_config``."""
    out = reshard(FIXTURES / _name(src), tmp_path / "out", zero_stage=stage).out_dir
    diff_files(out, tag_dir(_name(stage)))
    if stage == 2:
        ms = load(out / "mp_rank_00_model_states.pt")
        assert list(ms["frozen_param_shapes"]) == list(FROZEN) and ms["buffer_names"] == []
        for n in FROZEN:
            frag, w = ms["frozen_param_fragments"][n], ms["module"][n]
            assert frag.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()  # one storage, as DeepSpeed


@pytest.mark.parametrize("src", [1, 2])
def test_zero3_target_model_states_are_deepspeeds_own(src, tmp_path):
    """ZeRO-1/2 -> ZeRO-3: every model-state file is DeepSpeed's own ZeRO-3 save of the run (frozen
    placeholders, each DP rank's partition of each frozen parameter) but ``ds_config``; the ZeRO-3
    run's trained values differ from the ZeRO-1/2 run's in the last bits (another reduction order),
    so the optimizer files hold the source's masters and moments, laid out as DeepSpeed's."""
    out = reshard(FIXTURES / _name(src), tmp_path / "out", zero_stage=3).out_dir
    theirs = tag_dir(_name(3))
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*model_states.pt")):
        a, b = load(out / p.name), load(p)
        a.pop("ds_config"), b.pop("ds_config")
        same(a, b, p.name)
    for p in sorted(theirs.glob("*optim_states.pt")):
        a, b = load(out / p.name)["optimizer_state_dict"], load(p)["optimizer_state_dict"]
        assert [(t.shape, t.ds_id) for t in a["fp32_flat_groups"]] == [(t.shape, t.ds_id) for t in b["fp32_flat_groups"]]


def test_zero3_to_zero12_writes_the_frozen_weights_whole(tmp_path):
    """ZeRO-3 -> ZeRO-1/2: the frozen parameters' partitions joined into the module entries (never
    the ZeRO-3 placeholders), recorded as DeepSpeed records them at the target stage."""
    for stage in (1, 2):
        out = reshard(FIXTURES / _name(3), tmp_path / f"z{stage}", zero_stage=stage).out_dir
        ms, theirs = load(out / "mp_rank_00_model_states.pt"), load(tag_dir(_name(stage)) / "mp_rank_00_model_states.pt")
        assert list(ms["module"]) == list(theirs["module"]) and ms["buffer_names"] == []
        for n in FROZEN:
            same(ms["module"][n], theirs["module"][n], n)
        assert (ms["frozen_param_shapes"] is None) == (stage == 1)
        assert [list(s) for s in ms["param_shapes"]] == [list(s) for s in theirs["param_shapes"]]


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_other_dp_and_back_is_the_source(stage, tmp_path):
    """DP 2 -> 3 (ZeRO-3: padded partitions of the frozen parameters) -> 2: the source's files."""
    mid = reshard(FIXTURES / _name(stage), tmp_path / "mid", dp=3).out_dir
    if stage == 3:
        ms = load(mid / "zero_pp_rank_2_mp_rank_00_model_states.pt")
        assert ms["frozen_param_fragments"][FROZEN[1]].shape == (11,)  # ceil(32 / 3), one element of padding
    back = reshard(mid, tmp_path / "back", dp=2).out_dir
    diff_files(back, tag_dir(_name(stage)))


# -- universal, DCP ----------------------------------------------------------------------------------


def _whole(r, name: str) -> torch.Tensor:
    """A reader's weight of ``name`` joined from its fragments (each rank's, in rank order)."""
    state = r.states(name)[0]
    m = r.map(name, state)
    return torch.cat([r.fragment(name, state, k) for k in sorted(m.ranks)])[:m.numel].view(r.shape(name))


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_universal_holds_them_as_ds_to_universal_and_reads_back(stage, tmp_path):
    """As ``ds_to_universal`` writes them: ZeRO-1/2 ``zero/<name>/fp32.pt`` alone (no moments, no
    step), ZeRO-3 nothing in ``zero/`` (the partitions stay in the copied model states); read back,
    every frozen weight is the source's."""
    ucp = convert(FIXTURES / _name(stage), tmp_path / "ucp").out_dir
    for n in FROZEN:
        files = sorted(p.name for p in (ucp / "zero" / n).glob("*")) if (ucp / "zero" / n).exists() else []
        assert files == ([] if stage == 3 else ["fp32.pt"])
    r = open_reader(ucp)
    r.check()
    assert r.frozen() == FROZEN and r.buffers() == () and len(r.names) == 21
    for n, v in _frozen_values(stage).items():
        assert r.states(n) == (("weight",) if stage == 3 else ("fp32",)) and r.step(n) is None
        same(_whole(r, n), v, n)


def test_universal_from_a_non_deepspeed_reader_keeps_them_out_of_buffer_names(tmp_path):
    """The universal writer's own model states (a source other than DeepSpeed's files: here a
    universal checkpoint): a frozen parameter is a module entry in no group and not a buffer, as
    DeepSpeed's ZeRO-1 keeps it, and reads back frozen."""
    ucp = convert(FIXTURES / _name(1), tmp_path / "ucp").out_dir
    assert [sorted(p.name for p in (ucp / "zero" / n).iterdir()) for n in FROZEN] == [["fp32.pt"]] * 2
    again = convert(ucp, tmp_path / "again").out_dir
    ms = load(again / "mp_rank_00_model_states.pt")
    assert ms["buffer_names"] == [] and list(ms["module"])[:1] == [FROZEN[0]]
    assert not any(n in g for g in ms["param_shapes"] for n in FROZEN)
    assert open_reader(again).frozen() == FROZEN


@pytest.mark.slow
def test_dcp_route_keeps_them_frozen(tmp_path):
    """Through a DCP (reshard's manifest names them): to universal they are no buffers, to DeepSpeed
    ZeRO-2 they are frozen records, in no optimizer group."""
    dcp = convert(FIXTURES / _name(2), tmp_path / "dcp", fmt="dcp").out_dir
    assert open_reader(dcp).frozen() == FROZEN
    ucp = convert(dcp, tmp_path / "ucp").out_dir
    ms = load(ucp / "mp_rank_00_model_states.pt")
    assert ms["buffer_names"] == [] and not any(n in g for g in ms["param_shapes"] for n in FROZEN)
    assert open_reader(ucp).frozen() == FROZEN
    ds = reshard(ucp, tmp_path / "ds", to="deepspeed", dp=2, zero_stage=2).out_dir
    ms = load(ds / "mp_rank_00_model_states.pt")
    assert list(ms["frozen_param_shapes"]) == list(FROZEN) and ms["buffer_names"] == []
    assert sum(len(g) for g in ms["param_shapes"]) == 19
    for n, v in _frozen_values(2).items():
        same(ms["module"][n], v, n)


# -- refusals ----------------------------------------------------------------------------------------


def _planted(tmp_path: Path, stage: int, file: str, change) -> Path:
    root = tmp_path / "src"
    shutil.copytree(FIXTURES / _name(stage), root)
    path = root / "global_step3" / file
    obj = load(path, mmap=False)
    change(obj)
    path.unlink()
    save(obj, path)
    return root


def _refused(src: Path, tmp_path: Path, *words: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(ReshardError) as e:
        convert(src, out, fmt="safetensors")
    assert not out.exists()
    for w in words:
        assert w in str(e.value), str(e.value)


def _short_fragment(obj):
    obj["frozen_param_fragments"][FROZEN[1]] = obj["frozen_param_fragments"][FROZEN[1]][:-1].clone()


def _other_shape(obj):
    obj["frozen_param_shapes"][FROZEN[0]] = torch.Size([32, 96])


def _unrecorded(obj):
    del obj["frozen_param_shapes"][FROZEN[1]]


def _z3_short(obj):
    obj["frozen_param_fragments"][FROZEN[0]] = obj["frozen_param_fragments"][FROZEN[0]][:-8].clone()


PLANTED = [
    (2, "mp_rank_00_model_states.pt", _short_fragment, ("frozen_param_fragments", FROZEN[1], "31 elements")),
    (2, "mp_rank_00_model_states.pt", _other_shape, ("frozen_param_shapes", FROZEN[0], "[96, 32]")),
    (2, "mp_rank_00_model_states.pt", _unrecorded, ("mp_rank_00_model_states.pt", FROZEN[1], "frozen_param_shapes")),
    (3, "zero_pp_rank_1_mp_rank_00_model_states.pt", _z3_short,
     ("zero_pp_rank_1_mp_rank_00_model_states.pt", FROZEN[0], "DP rank 1", "1536")),
]


@pytest.mark.parametrize("stage,file,change,words", PLANTED, ids=["z2-fragment-size", "z2-shape", "z2-unrecorded",
                                                                   "z3-partition-size"])
def test_planted_defects_are_refused_by_file_and_tensor(stage, file, change, words, tmp_path):
    _refused(_planted(tmp_path, stage, file, change), tmp_path, file, *words)


def test_z3_shapes_that_differ_between_ranks_are_refused(tmp_path):
    def change(obj):
        obj["frozen_param_shapes"] = OrderedDict(list(obj["frozen_param_shapes"].items())[:1])

    _refused(_planted(tmp_path, 3, "zero_pp_rank_1_mp_rank_00_model_states.pt", change), tmp_path,
             "zero_pp_rank_1_mp_rank_00_model_states.pt", "frozen_param_shapes differ")


@pytest.mark.parametrize("topology", [{"tp": 2, "layout": "geometry"}, {"ep": 2}])
def test_targets_without_a_deepspeed_record_are_refused(topology, tmp_path):
    with pytest.raises(ReshardError, match="frozen parameter 'model.embed_tokens.weight'"):
        reshard(FIXTURES / _name(1), tmp_path / "out", **topology)
    assert not (tmp_path / "out").exists()


# -- slow: DeepSpeed's own converter and loader ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_universal_is_ds_to_universal(stage, tmp_path):
    pytest.importorskip("deepspeed")
    from tests.support.compare import assert_same_as_ds_to_universal

    theirs = ds_to_universal(_name(stage), tmp_path / "ds")
    ours = convert(FIXTURES / _name(stage), tmp_path / "reshard").out_dir
    assert_same_as_ds_to_universal(ours, theirs, "zero/model.norm.weight/fp32.pt")
    # DeepSpeed's universal of each, read by reshard: every weight the source's (the ZeRO-3 one's frozen
    # partitions from its copied model states)
    got = _safetensors(convert(theirs, tmp_path / "st", fmt="safetensors").out_dir)
    for n, v in _frozen_values(stage).items():
        same(got[n], v, n)


NATIVE = [(1, 3, 2), (3, 1, 2), (2, 2, 3)]  # (source stage, target stage, target DP)


@pytest.mark.slow  # one DeepSpeed job each, ~1 min
@pytest.mark.parametrize("src,stage,dp", NATIVE, ids=[f"zero{a}-to-zero{b}-dp{d}" for a, b, d in NATIVE])
def test_deepspeed_loads_it_natively_and_saves_the_same_files(src, stage, dp, tmp_path):
    """DeepSpeed builds the fixtures' model with the same parameters frozen, loads reshard's files
    with its ordinary ``load_checkpoint`` at the target's DP and stage, and saves at once: its save
    is reshard's files object for object (but ``ds_config``), the frozen weights the source's."""
    pytest.importorskip("deepspeed")
    import json

    from tests.e2e.launch import REPO, launch

    ours = reshard(FIXTURES / _name(src), tmp_path / "ours", dp=dp, zero_stage=stage).out_dir
    fx = json.loads((FIXTURES / _name(src) / "fixture.json").read_text())
    ds_config = dict(fx["ds_config"], zero_optimization={"stage": stage})
    spec = {"model_type": fx["model_type"], "model_config": fx["model_config"], "ds_config": ds_config, "steps": 0,
            "seed": fx["seed"], "seq_len": fx["data"]["seq_len"], "micro_batch": fx["data"]["micro_batch"],
            "save_dir": str(tmp_path / "saved"), "tag": "global_step3", "report_dir": str(tmp_path / "report"),
            "load_dir": str(ours.parent), "frozen": fx["frozen"]}
    launch(REPO / "scripts" / "_fixture_train.py", spec, world_size=dp, workdir=tmp_path / "job")
    diff_files(ours, tmp_path / "saved" / "global_step3")
    names = sorted(p.name for p in (tmp_path / "saved" / "global_step3").glob("*model_states.pt"))
    if stage == 3:  # the frozen partitions joined: the source's weights
        parts = [load(tmp_path / "saved" / "global_step3" / n) for n in names]
        for n, v in _frozen_values(src).items():
            same(torch.cat([p["frozen_param_fragments"][n] for p in parts])[:v.numel()].view(v.shape), v, n)
    else:
        module = load(tmp_path / "saved" / "global_step3" / names[0])["module"]
        for n, v in _frozen_values(src).items():
            same(module[n], v, n)
