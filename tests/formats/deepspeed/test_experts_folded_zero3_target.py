"""A folded (AutoEP x AutoTP) ZeRO-3 *target* (docs/deepspeed-checkpoints.md §11.2): ``reshard reshard SRC
OUT --tp 2 --ep E [--dp D] --zero-stage 3`` as DeepSpeed 0.19.8 saves it, one model-state and one optimizer
file per (TP, DP) rank, partition groups in global ranks, a ``folding`` record in every file.

What it is checked against: DeepSpeed's own folded ZeRO-3 saves (``mixtral_autoep_ep2_tp2_zero3``, world 2;
``mixtral_autoep_ep2_tp2_dp2_zero3``, world 4) object for object at their own topology; their layout
(every key, order, type, dtype, shape, ``ds_id`` and non-tensor value but ``ds_config`` and the source's
``global_samples``) from every other source, whose masters and moments it holds bit for bit (DeepSpeed's
consolidation, ``oracle.json``, where the source has one); the slow test has DeepSpeed load the outputs
natively (digests = the oracle) and save them straight back (= our files)."""

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
from reshard.storage.safe_load import load
from tests.e2e.digest import differences, digest
from tests.formats.deepspeed.test_experts_folded_zero3 import CASES
from tests.support.compare import full_state, same_strict, tensor_meta
from tests.support.dsconv import FIXTURES, tag_dir

W2 = "mixtral_autoep_ep2_tp2_zero3"  # DeepSpeed's folded ZeRO-3 save, TP 2 x EP 2, world 2
W4 = "mixtral_autoep_ep2_tp2_dp2_zero3"  # ... TP 2 x DP 2, EP 2 x EDP 2, world 4
Z1 = "mixtral_autoep_ep2_tp2"  # its folded ZeRO-1 save
STATES = ("fp32", "exp_avg", "exp_avg_sq")
EXPERT = "model.layers.0.mlp.experts.w1"


def _identical(ours: Path, theirs: Path) -> None:
    """Every file of ``theirs`` in ``ours`` and no other, object for object (key order, types, every
    tensor's dtype, shape, strides, ``requires_grad``, ``ds_id`` and bits) but ``ds_config``."""
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        same_strict(load(ours / p.name), load(p), p.name, skip=("ds_config",))


def _shaped(x: Any) -> Any:
    """``x`` with every tensor as its metadata (and ``ds_id``): what two saves of one layout share;
    ``ds_config`` and ``global_samples`` (the source's own history) left out."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tensor_meta(x)[:4], getattr(x, "ds_id", None))
    if isinstance(x, dict):
        return (type(x).__name__, [(k, _shaped(v)) for k, v in x.items() if k not in ("ds_config", "global_samples")])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_shaped(v) for v in x])
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return (type(x).__name__, _shaped(vars(x)))
    return (type(x).__name__, x)


def _oracle(fixture: str) -> dict:
    return json.loads((FIXTURES / fixture / "oracle.json").read_text())["digests"]


@pytest.mark.parametrize("fixture,options", [(W2, {}), (W2, {"tp": 2, "ep": 2, "zero_stage": 3}),
                                             (W4, {"tp": 2, "ep": 2})])
def test_written_at_its_own_topology_is_deepspeeds_own_save(fixture, options, tmp_path):
    """Asked nothing (the source's TP 2 and stage kept) or its own topology: DeepSpeed's save, object
    for object."""
    out = reshard(FIXTURES / fixture, tmp_path / "out", **options).out_dir
    _identical(out, tag_dir(fixture))


ROUTES = {
    # (source, options, DeepSpeed's save of the target layout, the source's oracle)
    "zero1-folded": (Z1, {"tp": 2, "ep": 2, "zero_stage": 3}, W2, Z1),
    "zero1-folded-layout": (Z1, {"tp": 2, "ep": 2, "zero_stage": 3, "layout": FIXTURES / W2}, W2, Z1),
    "world2-to-4": (W2, {"tp": 2, "ep": 2, "dp": 2}, W4, W2),
    "world4-to-2": (W4, {"tp": 2, "ep": 2, "dp": 1}, W2, W4),
    "tp1-zero3-layout": ("mixtral_autoep_ep2_zero3", {"tp": 2, "ep": 2, "dp": 1, "layout": FIXTURES / W2}, W2, None),
    "tp1-zero1-layout-zero1": ("mixtral_autoep_ep2", {"tp": 2, "ep": 2, "dp": 1, "zero_stage": 3,
                                                      "layout": FIXTURES / Z1}, W2, None),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_written_folded_at_zero3_has_deepspeeds_layout_and_holds_the_source(route, tmp_path):
    """From a folded ZeRO-1 save, the other world size, or a TP 1 save with ``--layout`` (a folded
    checkpoint at TP 2, ZeRO-3 or ZeRO-1: the dense TP maps and AutoTP's universal_checkpoint_info):
    DeepSpeed's folded ZeRO-3 layout, file for file; every master and moment the source's
    (DeepSpeed's consolidation of it where it has an oracle)."""
    source, options, theirs, oracle = ROUTES[route]
    out = reshard(FIXTURES / source, tmp_path / "out", **options).out_dir
    ref = tag_dir(theirs)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in ref.glob("*.pt"))
    for p in sorted(ref.glob("*.pt")):
        assert _shaped(load(out / p.name)) == _shaped(load(p)), p.name
    new, src = DeepSpeedCheckpoint.open(out), DeepSpeedCheckpoint.open(FIXTURES / source)
    assert (new.tp, new.zero_stage, new.experts.ep, new.experts.folded) == (2, 3, 2, True)
    names = [n for g in src.groups(0) for n in g]
    got = {n: {s: full_state(new, n, s) for s in STATES} for n in names}
    for n in names:
        for s in STATES:
            assert torch.equal(got[n][s], full_state(src, n, s)), (n, s)
    if oracle is not None:
        want = {n: {s: d[s] for s in STATES} for n, d in _oracle(oracle).items()}
        assert differences(want, {n: {s: digest(n, t) for s, t in st.items()} for n, st in got.items()}) == []


def test_written_at_world_4_with_ep_4_lays_the_experts_across_tp_lanes_and_dp_ranks(tmp_path):
    """``--ep 4`` at TP 2 x DP 2: every global rank its own EP rank (EDP 1); each rank's partition
    groups and folding records say so; the states the source's; read back, every check a folded
    ZeRO-3 source gets passes (``convert``)."""
    out = reshard(FIXTURES / W2, tmp_path / "out", tp=2, ep=4, dp=2).out_dir
    for t in (0, 1):
        for d in (0, 1):
            g = d * 2 + t
            optim = load(out / f"zero_pp_rank_{d}_mp_rank_0{t}_optim_states.pt")
            groups = optim["optimizer_state_dict"]["ds_zero_partition_groups"]
            assert [(x["partition_rank"], x["partition_ranks"], x["partition_count"]) for x in groups] == \
                [(d, [t, 2 + t], 2), (0, [g], 1)]
            assert (optim["folding"]["ep_rank"], optim["folding"]["zero_partition_rank"]) == (g, d)
            model = load(out / f"zero_pp_rank_{d}_mp_rank_0{t}_model_states.pt")
            assert [x["ep_rank"] for x in model["ds_autoep_layers"]] == [g, g]
            assert model["param_shapes"][1][EXPERT] == (1, 48, 32)
    new, src = DeepSpeedCheckpoint.open(out), DeepSpeedCheckpoint.open(FIXTURES / W2)
    for n in (n for g in src.groups(0) for n in g):
        for s in STATES:
            assert torch.equal(full_state(new, n, s), full_state(src, n, s)), (n, s)
    convert(out.parent, tmp_path / "back")


@pytest.mark.parametrize("source,options,match", [
    ("mixtral_autoep_ep2_zero3", {"tp": 2, "ep": 2, "dp": 1},
     r"an AutoEP target at TP=2 takes its dense TP maps .* saved folded at TP=2 \(--layout\)"),
    ("mixtral_autoep_ep2_zero3", {"tp": 2, "ep": 2, "dp": 1, "layout": FIXTURES / "llama_tp2"},
     r"layout checkpoint .*llama_tp2.* has no parameter 'model.embed_tokens.weight'|has no parameter"),
    (W2, {"tp": 4, "ep": 2, "dp": 1, "layout": FIXTURES / W2}, r"layout checkpoint .* is at TP=2, the target is TP=4"),
    (W2, {"tp": 2, "ep": 1, "dp": 1}, r"DeepSpeed 0\.19\.8 does not train it.*autoep_size > 1"),
    (W2, {"tp": 2, "ep": 3, "dp": 3}, r"4 experts do not split evenly over ep=3"),
    (W2, {"tp": 2, "ep": 4, "dp": 1}, r"ep=4 must divide the target world size dp=2"),
    (W2, {"tp": 2, "ep": 2, "dp": 1, "pp": 2}, r"DeepSpeed 0\.19\.8 does not train it.*supports pp_size=1 only"),
])
def test_what_a_folded_zero3_target_cannot_be_is_refused(source, options, match, tmp_path):
    with pytest.raises(ReshardError, match=match):
        reshard(FIXTURES / source, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fixture,fname,edit,match", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_a_wrong_source_record_is_refused_naming_it_before_a_folded_target(fixture, fname, edit, match, tmp_path):
    """The planted defects of test_experts_folded_zero3.py, on this route: refused naming file and
    field, nothing written."""
    from tests.formats.deepspeed.test_experts_folded_zero3 import _plant

    root = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, root)
    _plant(root / "global_step3" / fname, edit)
    with pytest.raises(CheckpointError, match=match):
        reshard(root, tmp_path / "out", tp=2, ep=2, zero_stage=3)
    assert not (tmp_path / "out").exists()


# -- DeepSpeed itself: its native folded ZeRO-3 loads of reshard's outputs ------------------------------------


def _spec(ep: int = 2) -> dict:
    from tests.e2e.launch import model_spec_from_fixture

    spec = model_spec_from_fixture(FIXTURES / W2)
    spec["ds_config"]["expert_parallel"]["autoep_size"] = ep
    return spec


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_loads_the_folded_zero3_outputs_natively_at_world_2(tmp_path):
    """World 2 (TP 2 x EP 2): DeepSpeed's folded ZeRO-3 load of reshard's output from the folded ZeRO-1
    save, and from the world-4 folded ZeRO-3 save, gives that source's oracle and step 3; from the TP 1
    ZeRO-3 save (``--layout``) the digests of DeepSpeed's own TP 1 load of it; every native save right
    after a load equals reshard's files (but ds_config)."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import resume_load, resume_many
    from tests.support.compare import diff_files

    outs = {"z1": (Z1, {}), "w4": (W4, {"dp": 1}), "tp1": ("mixtral_autoep_ep2_zero3", {"dp": 1, "layout": FIXTURES / W2})}
    dirs = {k: reshard(FIXTURES / src, tmp_path / f"ours_{k}", tp=2, ep=2, zero_stage=3, **kw).out_dir
            for k, (src, kw) in outs.items()}
    tp1 = _spec()
    tp1["ds_config"].pop("tensor_parallel")
    loads = [resume_load("tp1_source", FIXTURES / "mixtral_autoep_ep2_zero3", model_spec=tp1, tp=1, dp=2,
                         universal=False, zero_stage=3)]
    loads += [resume_load(k, d.parent, model_spec=_spec(), tp=2, dp=1, universal=False, zero_stage=3,
                          save_dir=tmp_path / f"native_{k}") for k, d in dirs.items()]
    reports = resume_many(loads, world_size=2, workdir=tmp_path / "job")
    want = {"z1": _oracle(Z1), "w4": _oracle(W4), "tp1": reports["tp1_source"]["digests"]["after_load"]}
    for k, d in dirs.items():
        r = reports[k]
        assert differences(want[k], r["digests"]["after_load"]) == [], k
        assert r["global_steps_after_load"] == 3 and r["optimizer_step_after_load"] == [3.0], k
        assert r["ranks_agree"] and r["layouts"][EXPERT] == "autoep", k
        diff_files(d, tmp_path / f"native_{k}" / d.name)


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_loads_the_folded_zero3_outputs_natively_at_world_4(tmp_path):
    """World 4 (TP 2 x DP 2): reshard's output of the world-2 folded ZeRO-3 save at EP 2 (EDP 2) and EP 4
    (EP groups across TP lanes and DP ranks): DeepSpeed's folded ZeRO-3 load gives the source's oracle
    and step 3, and its save right after equals reshard's files (but ds_config)."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import resume_load, resume_many
    from tests.support.compare import diff_files

    dirs = {ep: reshard(FIXTURES / W2, tmp_path / f"ours_ep{ep}", tp=2, ep=ep, dp=2, zero_stage=3).out_dir
            for ep in (2, 4)}
    loads = [resume_load(f"ep{ep}", d.parent, model_spec=_spec(ep), tp=2, dp=2, universal=False, zero_stage=3,
                         save_dir=tmp_path / f"native_ep{ep}") for ep, d in dirs.items()]
    reports = resume_many(loads, world_size=4, workdir=tmp_path / "job")
    for ep, d in dirs.items():
        r = reports[f"ep{ep}"]
        assert differences(_oracle(W2), r["digests"]["after_load"]) == [], ep
        assert r["global_steps_after_load"] == 3 and r["optimizer_step_after_load"] == [3.0], ep
        assert r["ranks_agree"] and r["layouts"][EXPERT] == "autoep", ep
        diff_files(d, tmp_path / f"native_ep{ep}" / d.name)
