"""DeepSpeed AutoEP x AutoTP ("folding", docs/deepspeed-checkpoints.md §11.2): the
``mixtral_autoep_ep2_tp2`` fixture (TP 2 x EP 2 on 2 ranks, ZeRO-1, saved by DeepSpeed 0.19.8 itself)
read, converted and written at TP 1.

The oracle is DeepSpeed's own consolidation of the fixture (``oracle.json`` beside it): a folded job
loads it natively and digests every parameter's fp32 master, Adam moments and module weight, whole
(``tests/e2e/resume_train.py``; DeepSpeed's ``ds_to_universal`` refuses folded checkpoints:
"Universal checkpoint conversion for folded AutoEP+AutoTP expert shards is not supported yet").
The slow test re-runs that load, checks the committed oracle, and has DeepSpeed load reshard's
TP 1 outputs natively and save them again. Re-write the oracle with
``python -m tests.formats.deepspeed.test_experts_folded``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard import ReshardError
from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.e2e.digest import differences, digest
from tests.support.compare import full_state, same
from tests.support.dsconv import FIXTURES, tag_dir

NAME = "mixtral_autoep_ep2_tp2"
UNFOLDED = "mixtral_autoep_ep2"  # the same recipe DeepSpeed saved at TP 1 x EP 2
ORACLE = FIXTURES / NAME / "oracle.json"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
EXPERTS = [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]


def _oracle(kinds: tuple[str, ...] = STATES, names: Any = None) -> dict:
    digests = json.loads(ORACLE.read_text())["digests"]
    return {n: {k: d[k] for k in kinds if k in d} for n, d in digests.items() if names is None or n in names}


def _digests(tensors: dict[str, dict[str, torch.Tensor]]) -> dict:
    return {n: {k: digest(n, t) for k, t in states.items()} for n, states in tensors.items()}


@pytest.fixture(scope="module")
def ck() -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint.open(FIXTURES / NAME)


def test_reads_the_folded_placement(ck):
    """EP groups over global ranks ``dp * TP + tp`` (DeepSpeed's folding), experts whole per EP rank."""
    ax = ck.experts
    assert (ck.tp, ck.dp, ax.tp, ax.ep, ax.edp, ax.folded) == (2, 1, 2, 2, 1, True)
    assert [ax.members(e) for e in range(2)] == [[0], [1]]
    assert ax.params[EXPERTS[0]].experts_by_rank == ((0, 1), (2, 3))
    for name in EXPERTS:
        assert ck.layout.composite(name).ranks == (0, 1)
    # a dense TP shard and the router (replicated over TP) compose with the dense DP group
    assert ck.tp_map("model.layers.0.self_attn.q_proj.weight").map.shards[1].shape == (16, 32)
    assert ck.tp_map("model.layers.0.mlp.router.gate.weight").map.ranks == (0, 1)


def test_inspect_says_it_is_folded(capsys):
    from reshard.cli import main

    assert main(["inspect", str(FIXTURES / NAME)]) == 0
    out = capsys.readouterr().out
    assert "EP rank of global rank g: g % 2, folded over TP=2: g = dp * 2 + tp" in out
    assert "EDP groups: EP 0: rank 0; EP 1: rank 1" in out


def test_universal_holds_deepspeeds_own_consolidation(tmp_path):
    """Every fp32 master and Adam moment of reshard's universal checkpoint, bit for bit."""
    out = convert(FIXTURES / NAME, tmp_path, fmt="universal").out_dir
    def read(name: str, state: str) -> torch.Tensor:
        obj = load(out / "zero" / name / f"{state}.pt", mmap=False)
        return obj["param"] if isinstance(obj, dict) else obj

    got = {n: {s: read(n, s) for s in STATES} for n in _oracle()}
    assert differences(_oracle(), _digests(got)) == []
    folders = {d.name for d in (out / "zero").iterdir() if d.is_dir()}
    aliases = {"model.layers.0.mlp.gate.gate.weight", "model.layers.1.mlp.gate.gate.weight"}
    assert folders == set(_oracle()) | aliases
    for alias in aliases:  # AutoEP's router alias: its module weight, the router's
        assert torch.equal(read(alias, "fp32"), read(alias.replace(".gate.gate.", ".router.gate."), "fp32"))
    for m in out.glob("mp_rank_*_model_states.pt"):  # a universal checkpoint has no topology
        assert "folding" not in load(m)


def test_dcp_holds_deepspeeds_own_consolidation(tmp_path):
    """torch's own DCP reader (``dcp_to_torch_save``) of reshard's DCP: weights and moments."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = convert(FIXTURES / NAME, tmp_path / "dcp", fmt="dcp").out_dir
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    model, state = sd["model"], sd["optim"]["state"]
    got = {n: {"module": w, **{m: state[n][m] for m in STATES[1:]}} for n, w in model.items() if n in state}
    assert differences(_oracle(("module", "exp_avg", "exp_avg_sq"), got), _digests(got)) == []
    assert set(got) == set(_oracle())


def test_hf_holds_deepspeeds_module_weights(tmp_path):
    from safetensors.torch import load_file

    cfg = tmp_path / "cfg"
    cfg.mkdir()
    full = json.loads((FIXTURES / NAME / "fixture.json").read_text())["model_config_full"]
    (cfg / "config.json").write_text(json.dumps(dict(full, architectures=["MixtralForCausalLM"])))
    out = convert(FIXTURES / NAME, tmp_path / "hf", fmt="hf", hf_config=cfg).out_dir
    weights = load_file(out / "model.safetensors")
    # the export is in transformers' names (autoep.json read backwards): AutoEP's back from them
    back = dict(weights)
    for layer in (0, 1):
        mlp = f"model.layers.{layer}.mlp"
        gate_up = back.pop(f"{mlp}.experts.gate_up_proj")
        w1, w3 = gate_up.chunk(2, dim=1)
        back |= {f"{mlp}.experts.w1": w1, f"{mlp}.experts.w3": w3, f"{mlp}.experts.w2": back.pop(f"{mlp}.experts.down_proj"),
                 f"{mlp}.router.gate.weight": back.pop(f"{mlp}.gate.weight")}
    got = {n: {"module": t} for n, t in back.items()}
    assert set(got) == set(_oracle())  # the router alias written once, as the router
    assert differences(_oracle(("module",)), _digests(got)) == []


# -- written at TP 1 -----------------------------------------------------------------------------------------


def _shaped(x: Any) -> Any:
    """``x`` with every tensor as (dtype, shape): what two saves of one layout share."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape))
    if isinstance(x, dict):
        return {k: _shaped(v) for k, v in x.items() if k != "ds_config"}
    if isinstance(x, (list, tuple)):
        return [_shaped(v) for v in x]
    if hasattr(x, "__dict__"):
        return (type(x).__name__, _shaped(vars(x)))
    return x


def _layout_of(ep: int, stage: int, tmp: Path) -> Path:
    """DeepSpeed's own TP 1 x EP ``ep`` x world 2 layout of this recipe: its save (``mixtral_autoep_ep2``)
    at EP 2, that save resharded by the DeepSpeed -> DeepSpeed route elsewhere (at EP 1, checked
    against DeepSpeed's native save in test_experts.py; at ZeRO-3 in test_experts_to_zero3.py)."""
    if (ep, stage) == (2, 1):
        return tag_dir(UNFOLDED)
    return reshard(FIXTURES / UNFOLDED, tmp, tp=1, dp=2, ep=ep, zero_stage=stage).out_dir


@pytest.mark.parametrize("ep,stage", [(2, 1), (1, 1), (2, 3)])
def test_written_at_tp1_is_deepspeeds_layout_and_holds_the_source(ep, stage, tmp_path):
    """``--tp 1 --ep E [--zero-stage 3]`` (world 2 kept): every file DeepSpeed writes at TP 1, laid
    out as its own (keys, order, dtypes, shapes, every non-tensor value but ds_config), no folding
    record; every master and moment DeepSpeed's consolidation of the source; at ZeRO-1 the module's
    weights too and the per-expert files the source's."""
    out = reshard(FIXTURES / NAME, tmp_path / "out", tp=1, ep=ep, zero_stage=stage).out_dir
    theirs = _layout_of(ep, stage, tmp_path / "layout")
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        mine = load(out / p.name)
        assert "folding" not in mine, p.name
        assert _shaped(mine) == _shaped(load(p)), p.name
    new = DeepSpeedCheckpoint.open(out)
    assert (new.tp, new.dp, new.zero_stage, new.experts.ep, new.experts.folded) == (1, 2, stage, ep, False)
    got = {n: {s: full_state(new, n, s) for s in STATES} for n in _oracle()}
    assert differences(_oracle(), _digests(got)) == []
    if stage == 3:  # placeholders and no per-expert files: a ZeRO-3 engine loads the masters
        return
    src = tag_dir(NAME)
    for p in sorted(out.glob("layer_*_expert_*")):
        [q] = src.glob(p.name.replace("mp_rank_00", "mp_rank_*"))
        theirs_expert = load(q)
        theirs_expert.pop("folding")
        mine_expert = load(p)
        assert list(mine_expert) == list(theirs_expert), p.name
        assert all(torch.equal(mine_expert[k], theirs_expert[k]) for k in mine_expert), p.name
    module = load(out / "mp_rank_00_model_states.pt")["module"]
    weights = {n: {"module": module[n]} for n in _oracle() if n in module}
    assert len(weights) == len(_oracle()) - len(EXPERTS)
    assert differences(_oracle(("module",), weights), _digests(weights)) == []


# -- written folded (TP 2 x EP 2) ---------------------------------------------------------------------------


def _identical(ours: Path, theirs: Path) -> None:
    """Every file of ``theirs`` (DeepSpeed's save) in ``ours``, object for object: keys in order, every
    value, every tensor's dtype, shape and bits."""
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        mine, native = load(ours / p.name), load(p)
        assert list(mine) == list(native), p.name
        same(mine, native, p.name)


def test_written_folded_at_its_own_topology_is_deepspeeds_own_save(tmp_path):
    out = reshard(FIXTURES / NAME, tmp_path / "out", tp=2, ep=2).out_dir  # the source's TP 2, world 2
    _identical(out, tag_dir(NAME))


def test_through_tp1_and_back_is_deepspeeds_own_save(tmp_path):
    """``--tp 1 --ep 2``, then ``--tp 2 --ep 2 --layout FIXTURE`` (the dense TP maps and the
    universal_checkpoint_info DeepSpeed records at TP 2): DeepSpeed's own folded save again."""
    tp1 = reshard(FIXTURES / NAME, tmp_path / "tp1", tp=1, ep=2).out_dir
    back = reshard(tp1.parent, tmp_path / "back", tp=2, ep=2, layout=FIXTURES / NAME).out_dir
    _identical(back, tag_dir(NAME))


def test_deepspeeds_tp1_save_written_folded_holds_it_in_the_folded_layout(tmp_path):
    """DeepSpeed's TP 1 x EP 2 save of the recipe at TP 2 x EP 2: the folded fixture's layout (every
    key, order, dtype, shape and non-tensor value but ds_config), every master and moment its own."""
    out = reshard(FIXTURES / UNFOLDED, tmp_path / "out", tp=2, ep=2, layout=FIXTURES / NAME).out_dir
    theirs = tag_dir(NAME)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        assert _shaped(load(out / p.name)) == _shaped(load(p)), p.name
    new, src = DeepSpeedCheckpoint.open(out), DeepSpeedCheckpoint.open(FIXTURES / UNFOLDED)
    assert (new.tp, new.dp, new.experts.ep, new.experts.folded) == (2, 1, 2, True)
    for n in _oracle():
        for s in STATES:
            assert torch.equal(full_state(new, n, s), full_state(src, n, s)), (n, s)


@pytest.mark.parametrize("ep", [2, 4])
def test_written_folded_at_world_4_reads_back_with_the_source_state(ep, tmp_path):
    """``--tp 2 --ep E --dp 2``: EP groups over global ranks (EP 4: across TP lanes and DP ranks), the
    per-expert files one per (EP rank, TP rank) of DeepSpeed's writers, every master and moment the
    source's (the slow test has DeepSpeed load both)."""
    out = reshard(FIXTURES / NAME, tmp_path / "out", tp=2, ep=ep, dp=2).out_dir
    new, src = DeepSpeedCheckpoint.open(out), DeepSpeedCheckpoint.open(FIXTURES / NAME)
    ax = new.experts
    assert (new.tp, new.dp, ax.ep, ax.edp) == (2, 2, ep, 4 // ep)
    assert [ax.members(e) for e in range(ep)] == ([[0, 2], [1, 3]] if ep == 2 else [[0], [1], [2], [3]])
    experts = sorted(p.name for p in out.glob("layer_0_*"))
    assert experts == [f"layer_0_expert_{x}_mp_rank_{x * ep // 4 % 2:02d}_model_states.pt" for x in range(4)]
    for n in _oracle():
        for s in STATES:
            assert torch.equal(full_state(new, n, s), full_state(src, n, s)), (n, s)
    if ep == 2:  # DeepSpeed's race: EDP rank 1 wrote the file last; its folded load does not check that field
        _plant_record(out / experts[0], lambda sd: sd["folding"].update(zero_partition_rank=1))
        convert(out.parent, tmp_path / "back")


@pytest.mark.parametrize("options,match", [
    ({"tp": 2, "ep": 1}, r"DeepSpeed 0\.19\.8 does not train it.*autoep_size > 1"),
    ({"tp": 2, "ep": 1, "zero_stage": 3}, r"DeepSpeed 0\.19\.8 does not train it.*autoep_size > 1"),
    ({"tp": 4, "ep": 2, "dp": 1}, r"an AutoEP target at TP=4 takes its dense TP maps .* from a DeepSpeed checkpoint "
                                  r"of this model saved folded at TP=4 \(--layout\)"),
])
def test_what_a_folded_target_cannot_be_is_refused(options, match, tmp_path):
    with pytest.raises(ReshardError, match=match):
        reshard(FIXTURES / NAME, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


# -- the folding records, checked as DeepSpeed's folded load checks them -------------------------------------


def _plant_record(path: Path, edit: Any) -> None:
    sd = load(path, mmap=False)
    edit(sd)
    save(sd, path)


PLANTED = [
    ("mp_rank_01_model_states.pt", lambda sd: sd["folding"].update(tp_rank=0),
     r"mp_rank_01_model_states.pt: folding.tp_rank is 0, DeepSpeed's folded load expects 1"),
    ("zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda sd: sd.pop("folding"),
     r"zero_pp_rank_0_mp_rank_00_optim_states.pt: no 'folding' record"),
    ("zero_pp_rank_0_mp_rank_01_optim_states.pt",
     lambda sd: sd["folding"]["param_families"]["model.layers.1.mlp.experts.w2"].update(zero_partition_count=2),
     r"zero_pp_rank_0_mp_rank_01_optim_states.pt: folding.param_families.model.layers.1.mlp.experts.w2"
     r".zero_partition_count is 2, DeepSpeed's folded load expects 1"),
    ("layer_1_expert_2_mp_rank_01_model_states.pt", lambda sd: sd["folding"].update(ep_rank=0),
     r"layer_1_expert_2_mp_rank_01_model_states.pt: folding.ep_rank is 0, DeepSpeed's folded load expects 1"),
    ("mp_rank_01_model_states.pt", lambda sd: sd["ds_autoep_layers"][1].update(ep_rank=0),
     r"mp_rank_01_model_states.pt: ds_autoep_layers\[1\].ep_rank is 0, but TP rank 1 \(global rank 1\) is EP rank 1"),
    ("mp_rank_01_model_states.pt", lambda sd: sd["ds_autoep_layers"][0].update(num_local_experts=1),
     r"mp_rank_01_model_states.pt: ds_autoep_layers\[0\].num_local_experts disagrees with mp_rank_00"),
]


@pytest.mark.parametrize("fname,edit,match", PLANTED, ids=[f"{i}-{p[0]}" for i, p in enumerate(PLANTED)])
def test_a_wrong_folding_record_is_refused_naming_it(fname, edit, match, tmp_path):
    root = tmp_path / "src"
    shutil.copytree(FIXTURES / NAME, root)
    _plant_record(root / "global_step3" / fname, edit)
    with pytest.raises(CheckpointError, match=match):
        convert(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_per_expert_files_are_looked_up_by_their_writers_tp_rank(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(FIXTURES / NAME, root)
    tag = root / "global_step3"
    (tag / "layer_0_expert_3_mp_rank_01_model_states.pt").rename(tag / "layer_0_expert_3_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"per-expert files missing: \['layer_0_expert_3_mp_rank_01"):
        convert(root, tmp_path / "out")


# -- DeepSpeed itself: its native folded load (the oracle) and its native loads of the TP 1 outputs ----------


def _native_loads(work: Path, outs: dict[tuple[int, int], Path], folded: Path | None = None) -> dict[str, dict]:
    """One job at world 2: DeepSpeed loads each TP 1 output (``{(ep, zero stage): tag folder}``) at its
    EP and stage, saving it straight back, and with ``folded`` (reshard's folded output of
    ``mixtral_autoep_ep2``) that fixture at TP 1; then the fixture folded (TP 2 x EP 2) and ``folded``
    there, saved straight back (TP 1 loads first, as DeepSpeed's groups allow)."""
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    def tp1(ep: int) -> dict:
        spec = model_spec_from_fixture(FIXTURES / NAME)
        spec["ds_config"]["expert_parallel"]["autoep_size"] = ep
        spec["ds_config"].pop("tensor_parallel")
        return spec

    loads = [resume_load(f"ep{ep}_z{stage}", out.parent, model_spec=tp1(ep), tp=1, dp=2, universal=False,
                         zero_stage=stage, save_dir=work / f"native_ep{ep}_z{stage}")
             for (ep, stage), out in outs.items()]
    if folded is not None:
        loads.append(resume_load("unfolded", FIXTURES / UNFOLDED, model_spec=tp1(2), tp=1, dp=2, universal=False))
    spec = model_spec_from_fixture(FIXTURES / NAME)
    loads.append(resume_load("folded", FIXTURES / NAME, model_spec=spec, tp=2, dp=1, universal=False))
    if folded is not None:
        loads.append(resume_load("ours_folded", folded.parent, model_spec=spec, tp=2, dp=1, universal=False,
                                 save_dir=work / "native_folded"))
    return resume_many(loads, world_size=2, workdir=work / "job")


def write_oracle(work: Path) -> None:
    """The committed oracle, from DeepSpeed's native folded load of the fixture."""
    report = _native_loads(work, {})["folded"]
    ORACLE.write_text(json.dumps({**json.loads(ORACLE.read_text()), "topology": report["topology"],
                                  "global_steps_after_load": report["global_steps_after_load"],
                                  "optimizer_step_after_load": report["optimizer_step_after_load"],
                                  "layouts": report["layouts"], "digests": report["digests"]["after_load"]},
                                 indent=1) + "\n")


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_loads_the_fixture_and_reshards_outputs_natively(tmp_path):
    """DeepSpeed's folded load of the fixture gives the committed oracle; its loads of reshard's
    ``--tp 1 --ep 2``, ``--tp 1 --ep 1`` and ``--tp 1 --ep 2 --zero-stage 3`` outputs give the same
    digests (masters, moments, weights) and step 3; its folded load of ``mixtral_autoep_ep2`` written
    at TP 2 x EP 2 gives the digests of its TP 1 load of that fixture; every native save right after
    a load equals reshard's files (but ds_config)."""
    pytest.importorskip("deepspeed")
    from tests.support.compare import diff_files

    outs = {(ep, stage): reshard(FIXTURES / NAME, tmp_path / f"ours_ep{ep}_z{stage}", tp=1, ep=ep,
                                 zero_stage=stage).out_dir for ep, stage in ((2, 1), (1, 1), (2, 3))}
    folded = reshard(FIXTURES / UNFOLDED, tmp_path / "ours_folded", tp=2, ep=2, layout=FIXTURES / NAME).out_dir
    reports = _native_loads(tmp_path, outs, folded)
    oracle = json.loads(ORACLE.read_text())
    assert differences(oracle["digests"], reports["folded"]["digests"]["after_load"]) == []
    for (ep, stage), out in outs.items():
        r = reports[f"ep{ep}_z{stage}"]
        assert differences(oracle["digests"], r["digests"]["after_load"]) == [], (ep, stage)
        assert r["global_steps_after_load"] == 3 and r["optimizer_step_after_load"] == [3.0]
        assert r["ranks_agree"] and r["layouts"][EXPERTS[0]] == "autoep"
        diff_files(out, tmp_path / f"native_ep{ep}_z{stage}" / out.name)
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    mine, theirs = reports["ours_folded"], reports["unfolded"]
    assert differences(theirs["digests"]["after_load"], mine["digests"]["after_load"]) == []
    assert mine["global_steps_after_load"] == 3 and mine["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"] and mine["layouts"][EXPERTS[0]] == "autoep"
    diff_files(folded, tmp_path / "native_folded" / folded.name)


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_loads_the_fixture_written_folded_at_world_4(tmp_path):
    """``--tp 2 --ep 2 --dp 2`` (EDP 2) and ``--tp 2 --ep 4 --dp 2`` (EP groups across TP lanes and DP
    ranks): DeepSpeed loads each folded at world 4, the digests are the oracle's, step 3, and its
    native save right after equals our files (but ds_config)."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    outs, loads = {}, []
    for ep in (2, 4):
        outs[ep] = reshard(FIXTURES / NAME, tmp_path / f"ours_ep{ep}", tp=2, ep=ep, dp=2).out_dir
        spec = model_spec_from_fixture(FIXTURES / NAME)
        spec["ds_config"]["expert_parallel"]["autoep_size"] = ep
        loads.append(resume_load(f"ep{ep}", outs[ep].parent, model_spec=spec, tp=2, dp=2, universal=False,
                                 save_dir=tmp_path / f"native_ep{ep}"))
    reports = resume_many(loads, world_size=4, workdir=tmp_path / "job")
    oracle = json.loads(ORACLE.read_text())
    for ep, out in outs.items():
        r = reports[f"ep{ep}"]
        assert differences(oracle["digests"], r["digests"]["after_load"]) == [], ep
        assert r["global_steps_after_load"] == 3 and r["optimizer_step_after_load"] == [3.0]
        assert r["ranks_agree"] and r["layouts"][EXPERTS[0]] == "autoep"
        native = tmp_path / f"native_ep{ep}" / out.name
        assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in native.glob("*.pt"))
        for p in sorted(native.glob("*.pt")):
            mine, theirs = load(out / p.name), load(p)
            for obj in (mine, theirs):
                obj.pop("ds_config", None)
                if p.name.startswith("layer_"):  # two EDP ranks write this file: whichever wrote last
                    assert obj["folding"].pop("zero_partition_rank") in range(4 // ep)
            same(mine, theirs, p.name)


if __name__ == "__main__":  # re-write the oracle (a DeepSpeed job, minutes)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_oracle(Path(tmp))
