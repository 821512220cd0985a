"""DeepSpeed AutoEP x AutoTP ("folding") at ZeRO-3 (docs/deepspeed-checkpoints.md §11.2): the
``mixtral_autoep_ep2_tp2_zero3`` fixture (TP 2 x EP 2 on 2 ranks) and ``mixtral_autoep_ep2_tp2_dp2_zero3``
(TP 2 x DP 2, EP 2 x EDP 2 on 4 ranks), saved by DeepSpeed 0.19.8 itself, read through the one layout
and converted; ``--tp 1`` from them.

As for the ZeRO-1 folded fixture (test_experts_folded.py) the oracle is DeepSpeed's own
consolidation (``oracle.json`` beside the fixture): a folded ZeRO-3 job loads it natively and
digests every parameter's fp32 master, Adam moments and module weight, whole (``safe_get_full_*``,
TP shards put back by their AutoTP maps, experts gathered over EP). Re-write it with
``python -m tests.formats.deepspeed.test_experts_folded_zero3``; the slow test re-runs that load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.e2e.digest import differences, digest
from tests.support.compare import full_state
from tests.support.dsconv import FIXTURES, tag_dir

NAME = "mixtral_autoep_ep2_tp2_zero3"
WORLD4 = "mixtral_autoep_ep2_tp2_dp2_zero3"
LAYOUT = FIXTURES / "mixtral_autoep_ep2_tp2"  # DeepSpeed's folded ZeRO-1 save of the recipe
BOTH = [NAME, WORLD4]
STATES = ("fp32", "exp_avg", "exp_avg_sq")
EXPERTS = [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]
ALIASES = ("model.layers.0.mlp.gate.gate.weight", "model.layers.1.mlp.gate.gate.weight")


def _oracle(kinds: tuple[str, ...] = STATES, names: Any = None, fixture: str = NAME) -> dict:
    digests = json.loads((FIXTURES / fixture / "oracle.json").read_text())["digests"]
    return {n: {k: d[k] for k in kinds if k in d} for n, d in digests.items() if names is None or n in names}


def _digests(tensors: dict[str, dict[str, torch.Tensor]]) -> dict:
    return {n: {k: digest(n, t) for k, t in states.items()} for n, states in tensors.items()}


@pytest.fixture(scope="module")
def ck() -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint.open(FIXTURES / NAME)


def test_what_deepspeed_records_at_folded_zero3(ck):
    """The fixture as DeepSpeed wrote it: a model state and an optimizer file per (TP, DP) rank, no
    per-expert files; a folding record in each (the optimizer's without param_families); each
    rank's ``ds_zero_partition_groups`` over global ranks ``dp * TP + tp``."""
    tag = tag_dir(NAME)
    assert sorted(p.name for p in tag.iterdir()) == [
        f"zero_pp_rank_0_mp_rank_0{t}_{kind}_states.pt" for t in (0, 1) for kind in ("model", "optim")]
    for t in (0, 1):
        optim = load(tag / f"zero_pp_rank_0_mp_rank_0{t}_optim_states.pt")
        assert optim["folding"]["tp_rank"] == t and "param_families" not in optim["folding"]
        groups = optim["optimizer_state_dict"]["ds_zero_partition_groups"]
        assert [g["partition_ranks"] for g in groups] == [[t], [t]]


def test_reads_the_folded_zero3_placement_through_the_one_layout(ck):
    """EP rank ``g % 2`` of global rank g; per TP rank a dense sub-group of its TP shards and an
    expert sub-group of its EP rank's experts (``layout.source``, checked by ``layout.check_sub``)."""
    from reshard.formats.deepspeed.layout import check_sub

    ax = ck.experts
    assert (ck.tp, ck.dp, ck.zero_stage, ax.tp, ax.ep, ax.edp, ax.folded) == (2, 1, 3, 2, 2, 1, True)
    assert ax.params[EXPERTS[0]].experts_by_rank == ((0, 1), (2, 3))
    subs = check_sub(ck)
    assert sorted(subs) == [(0, 0), (1, 0)]
    for t in (0, 1):
        dense, experts = subs[(t, 0)]
        assert dense.numel == 9632 and experts.names == tuple(EXPERTS) and experts.numel == 18432
    for name in EXPERTS:
        assert ck.layout.composite(name).ranks == (0, 1)
    assert ck.tp_map("model.layers.0.self_attn.q_proj.weight").map.shards[1].shape == (16, 32)


def test_the_world_4_fixture_records_its_partition_groups_over_global_ranks():
    """At TP 2 x DP 2 DeepSpeed's partition groups are global ranks: TP rank t's dense sub-group over
    ``[t, 2 + t]``, EP rank e's experts over its EDP group ``[e, e + 2]``; each rank's records its own."""
    tag = tag_dir(WORLD4)
    for t in (0, 1):
        for d in (0, 1):
            optim = load(tag / f"zero_pp_rank_{d}_mp_rank_0{t}_optim_states.pt")
            groups = optim["optimizer_state_dict"]["ds_zero_partition_groups"]
            assert [(g["partition_rank"], g["partition_ranks"]) for g in groups] == [(d, [t, 2 + t])] * 2
            assert (optim["folding"]["zero_partition_rank"], optim["folding"]["ep_rank"]) == (d, t)
            model = load(tag / f"zero_pp_rank_{d}_mp_rank_0{t}_model_states.pt")
            assert (model["folding"]["zero_partition_rank"], model["folding"]["zero_partition_count"]) == (d, 2)
    ck = DeepSpeedCheckpoint.open(FIXTURES / WORLD4)
    assert (ck.tp, ck.dp, ck.experts.ep, ck.experts.edp) == (2, 2, 2, 2)
    assert [ck.experts.members(e) for e in (0, 1)] == [[0, 2], [1, 3]]


@pytest.mark.parametrize("fixture", BOTH)
def test_universal_holds_deepspeeds_own_consolidation(fixture, tmp_path):
    """Every fp32 master and Adam moment of reshard's universal checkpoint, bit for bit; no folding record."""
    out = convert(FIXTURES / fixture, tmp_path, fmt="universal").out_dir

    def read(name: str, state: str) -> torch.Tensor:
        obj = load(out / "zero" / name / f"{state}.pt", mmap=False)
        return obj["param"] if isinstance(obj, dict) else obj

    got = {n: {s: read(n, s) for s in STATES} for n in _oracle(fixture=fixture)}
    assert differences(_oracle(fixture=fixture), _digests(got)) == []
    assert {d.name for d in (out / "zero").iterdir() if d.is_dir()} == set(_oracle(fixture=fixture))
    models = sorted(out.glob("*model_states.pt"))
    assert len(models) == len(list(tag_dir(fixture).glob("*model_states.pt")))
    assert all("folding" not in load(m) for m in models)


def test_dcp_holds_deepspeeds_own_consolidation(tmp_path):
    """torch's own DCP reader (``dcp_to_torch_save``) of reshard's DCP: masters and moments."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = convert(FIXTURES / NAME, tmp_path / "dcp", fmt="dcp").out_dir
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    model, state = sd["model"], sd["optim"]["state"]
    got = {n: {"module": w, **{m: state[n][m] for m in STATES[1:]}} for n, w in model.items() if n in state}
    assert set(got) == set(_oracle())
    assert differences(_oracle(("module", "exp_avg", "exp_avg_sq")), _digests(got)) == []


def test_hf_holds_deepspeeds_weights(tmp_path):
    """A ZeRO-3 checkpoint keeps its weights as fp32 masters: HF's are DeepSpeed's full parameters."""
    from safetensors.torch import load_file

    cfg = tmp_path / "cfg"
    cfg.mkdir()
    full = json.loads((FIXTURES / NAME / "fixture.json").read_text())["model_config_full"]
    (cfg / "config.json").write_text(json.dumps(dict(full, architectures=["MixtralForCausalLM"])))
    out = convert(FIXTURES / NAME, tmp_path / "hf", fmt="hf", hf_config=cfg).out_dir
    weights = load_file(out / "model.safetensors")
    for layer in (0, 1):  # transformers' fused names, back to AutoEP's (autoep_hf: w1 and w3 joined on dim 1)
        at = f"model.layers.{layer}.mlp"
        gate_up = weights.pop(f"{at}.experts.gate_up_proj")
        half = gate_up.shape[1] // 2
        weights[f"{at}.experts.w1"], weights[f"{at}.experts.w3"] = gate_up[:, :half], gate_up[:, half:]
        weights[f"{at}.experts.w2"] = weights.pop(f"{at}.experts.down_proj")
        weights[f"{at}.router.gate.weight"] = weights.pop(f"{at}.gate.weight")
    got = {n: {"module": t.contiguous()} for n, t in weights.items()}
    assert set(got) == set(_oracle())
    assert differences(_oracle(("module",)), _digests(got)) == []


@pytest.mark.parametrize("ep,stage,theirs", [(2, 3, "mixtral_autoep_ep2_zero3"), (2, 1, "mixtral_autoep_ep2")])
def test_written_at_tp1_is_deepspeeds_layout_and_holds_the_source(ep, stage, theirs, tmp_path):
    """``--tp 1 [--zero-stage 1]`` (world 2 kept): every file DeepSpeed's own TP 1 save of this recipe
    has (keys, order, dtypes, shapes, every non-tensor value but ds_config), no folding record; every
    master and moment (ZeRO-1: and module weight) DeepSpeed's consolidation of the source."""
    from tests.formats.deepspeed.test_experts_folded import _shaped

    out = reshard(FIXTURES / NAME, tmp_path / "out", tp=1, ep=ep, zero_stage=stage).out_dir
    ref = tag_dir(theirs)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in ref.glob("*.pt"))
    for p in sorted(ref.glob("*.pt")):
        mine = load(out / p.name)
        assert "folding" not in mine, p.name
        assert _shaped(mine) == _shaped(load(p)), p.name
    new = DeepSpeedCheckpoint.open(out)
    assert (new.tp, new.dp, new.zero_stage, new.experts.ep, new.experts.folded) == (1, 2, stage, ep, False)
    got = {n: {s: full_state(new, n, s) for s in STATES} for n in _oracle()}
    assert differences(_oracle(), _digests(got)) == []
    if stage == 1:
        module = load(out / "mp_rank_00_model_states.pt")["module"]
        weights = {n: {"module": module[n]} for n in _oracle() if n in module}
        assert len(weights) == len(_oracle()) - len(EXPERTS)
        assert differences(_oracle(("module",), weights), _digests(weights)) == []


@pytest.mark.parametrize("fixture,ep,stage", [(WORLD4, 2, 3), (WORLD4, 4, 1)])
def test_world_4_written_at_tp1_holds_deepspeeds_consolidation(fixture, ep, stage, tmp_path):
    """``--tp 1`` from TP 2 x DP 2: at ZeRO-3 (EP 2 x EDP 2 over 4 DP ranks) and at ZeRO-1 EP 4, every
    master and moment the oracle's."""
    out = reshard(FIXTURES / fixture, tmp_path / "out", tp=1, ep=ep, zero_stage=stage).out_dir
    new = DeepSpeedCheckpoint.open(out)
    assert (new.tp, new.dp, new.zero_stage, new.experts.ep, new.experts.folded) == (1, 4, stage, ep, False)
    assert not any("folding" in load(p) for p in out.glob("*.pt"))
    if (FIXTURES / fixture / "oracle.json").exists():
        oracle = _oracle(fixture=fixture)
        got = {n: {s: full_state(new, n, s) for s in STATES} for n in oracle}
        assert differences(oracle, _digests(got)) == []
    else:  # a TP 1 source (--layout): its own masters and moments
        src = DeepSpeedCheckpoint.open(FIXTURES / fixture)
        for n in _oracle():
            for s in STATES:
                assert torch.equal(full_state(new, n, s), full_state(src, n, s)), (n, s)


def test_written_folded_at_zero1_is_deepspeeds_folded_layout_and_holds_the_source(tmp_path):
    """``--tp 2 --ep 2 --zero-stage 1`` (its own TP maps and ``universal_checkpoint_info``): every file
    DeepSpeed's own folded ZeRO-1 save of this recipe (``mixtral_autoep_ep2_tp2``) has (keys, order,
    dtypes, shapes, every non-tensor value but ds_config, the folding records); every master and
    moment DeepSpeed's consolidation of the source."""
    from tests.formats.deepspeed.test_experts_folded import _shaped

    out = reshard(FIXTURES / NAME, tmp_path / "out", tp=2, ep=2, zero_stage=1).out_dir
    ref = tag_dir("mixtral_autoep_ep2_tp2")
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in ref.glob("*.pt"))
    for p in sorted(ref.glob("*.pt")):
        assert _shaped(load(out / p.name)) == _shaped(load(p)), p.name
    new = DeepSpeedCheckpoint.open(out)
    assert (new.tp, new.dp, new.zero_stage, new.experts.ep, new.experts.folded) == (2, 1, 1, 2, True)
    got = {n: {s: full_state(new, n, s) for s in STATES} for n in _oracle()}
    assert differences(_oracle(), _digests(got)) == []


@pytest.mark.parametrize("fixture,options", [(NAME, {"ep": 2, "zero_stage": 1}), (NAME, {"ep": 2, "zero_stage": 2}),
                                             (WORLD4, {"ep": 4, "dp": 2, "zero_stage": 1}),
                                             ("mixtral_autoep_ep2_zero3", {"ep": 2, "zero_stage": 1, "layout": LAYOUT})])
def test_written_folded_at_zero12_is_the_route_through_tp1(fixture, options, tmp_path):
    """Folded at ZeRO-1/2 directly: the files of ``--tp 1 --zero-stage S`` (DeepSpeed's own TP 1 layout,
    checked above) written folded again (``--layout`` the folded ZeRO-1 fixture, the route from a
    ZeRO-1/2 source), object for object (keys in order, every value and bit, ds_config too); every
    master and moment the source's oracle."""
    from tests.formats.deepspeed.test_experts_folded_from_any import _same_files

    out = reshard(FIXTURES / fixture, tmp_path / "out", tp=2, **options).out_dir
    world = {k: v for k, v in options.items() if k != "layout"}
    tp1 = reshard(FIXTURES / fixture, tmp_path / "tp1", tp=1, **{**world, "dp": 2 * options.get("dp", 1)})
    via = reshard(tp1.out_dir.parent, tmp_path / "via", tp=2, layout=LAYOUT, **world).out_dir
    _same_files(out, via, ())
    new = DeepSpeedCheckpoint.open(out)
    assert (new.tp, new.zero_stage, new.experts.folded) == (2, options["zero_stage"], True)
    if (FIXTURES / fixture / "oracle.json").exists():
        oracle = _oracle(fixture=fixture)
        got = {n: {s: full_state(new, n, s) for s in STATES} for n in oracle}
        assert differences(oracle, _digests(got)) == []
    else:  # a TP 1 source (--layout): its own masters and moments
        src = DeepSpeedCheckpoint.open(FIXTURES / fixture)
        for n in _oracle():
            for s in STATES:
                assert torch.equal(full_state(new, n, s), full_state(src, n, s)), (n, s)


# -- planted defects: the checks a folded ZeRO-3 source adds ------------------------------------------------


def _plant(path: Path, edit: Any) -> None:
    sd = load(path, mmap=False)
    edit(sd)
    save(sd, path)


def _zpg(t: int, k: int, **kw: Any) -> Any:
    return lambda sd: sd["optimizer_state_dict"]["ds_zero_partition_groups"][k].update(**kw)


PLANTED = [
    # the dense sub-group of TP rank 1 recorded over DP ranks, not its global ranks
    ("zero_pp_rank_0_mp_rank_01_optim_states.pt", _zpg(1, 0, partition_ranks=[0]),
     r"zero_pp_rank_0_mp_rank_01_optim_states.pt: ds_zero_partition_groups\[0\] is .*'partition_ranks': \[0\].*, "
     r"but global rank 1 \(TP rank 1, DP rank 0\) \(EP rank 1, .*\) should have .*'partition_ranks': \[1\]"),
    ("zero_pp_rank_0_mp_rank_00_optim_states.pt", _zpg(0, 1, partition_ranks=[1]),
     r"zero_pp_rank_0_mp_rank_00_optim_states.pt: ds_zero_partition_groups\[1\] .* global rank 0 "),
    ("zero_pp_rank_0_mp_rank_01_model_states.pt", lambda sd: sd["folding"].update(zero_partition_rank=1),
     r"zero_pp_rank_0_mp_rank_01_model_states.pt: folding.zero_partition_rank is 1, DeepSpeed's folded load "
     r"expects 0"),
    ("zero_pp_rank_0_mp_rank_01_model_states.pt", lambda sd: sd.pop("folding"),
     r"zero_pp_rank_0_mp_rank_01_model_states.pt: no 'folding' record"),
    ("zero_pp_rank_0_mp_rank_00_optim_states.pt",  # ZeRO-3's optimizer record has no families
     lambda sd: sd["folding"].update(param_families={}),
     r"zero_pp_rank_0_mp_rank_00_optim_states.pt: folding.param_families is \{\}, DeepSpeed's folded load expects "
     r"None"),
    ("zero_pp_rank_0_mp_rank_01_model_states.pt", lambda sd: sd["ds_autoep_layers"][0].update(ep_rank=0),
     r"zero_pp_rank_0_mp_rank_01_model_states.pt: ds_autoep_layers\[0\].ep_rank is 0, but TP rank 1 \(global rank "
     r"1\) is EP rank 1"),
]


PLANTED_WORLD4 = [
    # EP 1's EDP group in DeepSpeed's order is [1, 3]; recorded in DP order instead
    ("zero_pp_rank_1_mp_rank_01_optim_states.pt", _zpg(1, 1, partition_ranks=[2, 3]),
     r"zero_pp_rank_1_mp_rank_01_optim_states.pt: ds_zero_partition_groups\[1\] is .*\[2, 3\].*, but global rank 3 "
     r"\(TP rank 1, DP rank 1\) \(EP rank 1, EDP groups in DeepSpeed's expert before data order\) should have .*"
     r"'partition_ranks': \[1, 3\]"),
    ("zero_pp_rank_1_mp_rank_00_model_states.pt", lambda sd: sd["folding"].update(zero_partition_rank=0),
     r"zero_pp_rank_1_mp_rank_00_model_states.pt: folding.zero_partition_rank is 0, DeepSpeed's folded load "
     r"expects 1"),
    ("zero_pp_rank_1_mp_rank_01_model_states.pt",  # both copies DeepSpeed writes of the layer entry
     lambda sd: [x["ds_autoep_layers"][1].update(ep_rank=0) for x in (sd, sd["universal_checkpoint_info"])],
     r"zero_pp_rank_1_mp_rank_01_model_states.pt: ds_autoep_layers records EP rank\(s\) \[0, 1\], the partition "
     r"groups say global rank 3 is EP rank 1"),
]
CASES = [(NAME, *p) for p in PLANTED] + [(WORLD4, *p) for p in PLANTED_WORLD4]


@pytest.mark.parametrize("fixture,fname,edit,match", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_a_wrong_folded_zero3_record_is_refused_naming_it(fixture, fname, edit, match, tmp_path):
    root = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, root)
    _plant(root / "global_step3" / fname, edit)
    with pytest.raises(CheckpointError, match=match):
        convert(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- DeepSpeed itself: its native folded ZeRO-3 load (the oracle) ------------------------------------------


def _native_loads(work: Path, outs: dict[tuple[int, int], Path], fixture: str = NAME) -> dict[str, dict]:
    """One job at the fixture's world: DeepSpeed loads each TP 1 output (``{(ep, zero stage): tag
    folder}``) at its EP and stage, then the fixture folded (TP 2 x EP 2, ZeRO-3; TP 1 loads first,
    as its groups allow)."""
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    def tp1(ep: int) -> dict:
        spec = model_spec_from_fixture(FIXTURES / fixture)
        spec["ds_config"]["expert_parallel"]["autoep_size"] = ep
        spec["ds_config"].pop("tensor_parallel")
        return spec

    world = json.loads((FIXTURES / fixture / "fixture.json").read_text())["world_size"]
    loads = [resume_load(f"ep{ep}_z{stage}", out.parent, model_spec=tp1(ep), tp=1, dp=world, universal=False,
                         zero_stage=stage, save_dir=work / f"native_ep{ep}_z{stage}")
             for (ep, stage), out in outs.items()]
    loads.append(resume_load("folded", FIXTURES / fixture, model_spec=model_spec_from_fixture(FIXTURES / fixture),
                             tp=2, dp=world // 2, universal=False, zero_stage=3))
    return resume_many(loads, world_size=world, workdir=work / "job")


def write_oracle(work: Path, fixture: str) -> None:
    """The committed oracle, from DeepSpeed's native folded ZeRO-3 load of the fixture."""
    report = _native_loads(work, {}, fixture)["folded"]
    (FIXTURES / fixture / "oracle.json").write_text(json.dumps({"fixture": fixture, "how": "DeepSpeed 0.19.8's native folded ZeRO-3 load "
                                  "(tests/e2e/resume_train.py), whole states digested",
                                  "topology": report["topology"],
                                  "global_steps_after_load": report["global_steps_after_load"],
                                  "optimizer_step_after_load": report["optimizer_step_after_load"],
                                  "layouts": report["layouts"], "digests": report["digests"]["after_load"]},
                                 indent=1) + "\n")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("fixture", BOTH)
def test_deepspeed_loads_the_fixture_and_the_tp1_outputs_natively(fixture, tmp_path):
    """DeepSpeed's folded ZeRO-3 load of the fixture gives the committed oracle; its native loads of
    reshard's ``--tp 1`` (ZeRO-3) and ``--tp 1 --zero-stage 1`` outputs (EP 2, the world kept) give the
    same digests (masters, moments, weights) and step 3; its save right after each load equals
    reshard's files (but ds_config)."""
    pytest.importorskip("deepspeed")
    from tests.support.compare import diff_files

    outs = {(2, stage): reshard(FIXTURES / fixture, tmp_path / f"ours_z{stage}", tp=1, ep=2,
                                zero_stage=stage).out_dir for stage in (3, 1)}
    reports = _native_loads(tmp_path, outs, fixture)
    oracle = json.loads((FIXTURES / fixture / "oracle.json").read_text())
    assert differences(oracle["digests"], reports["folded"]["digests"]["after_load"]) == []
    assert reports["folded"]["global_steps_after_load"] == 3
    for (ep, stage), out in outs.items():
        r = reports[f"ep{ep}_z{stage}"]
        assert differences(oracle["digests"], r["digests"]["after_load"]) == [], stage
        assert r["global_steps_after_load"] == 3 and r["optimizer_step_after_load"] == [3.0]
        assert r["ranks_agree"] and r["layouts"][EXPERTS[0]] == "autoep"
        diff_files(out, tmp_path / f"native_ep{ep}_z{stage}" / out.name)


if __name__ == "__main__":  # re-write the oracle (a DeepSpeed job, minutes)
    import tempfile

    for fixture in BOTH:
        with tempfile.TemporaryDirectory() as tmp:
            write_oracle(Path(tmp), fixture)
