"""AutoTP x ZeRO-3 (``llama_zero3_tp2_dp2``: DeepSpeed 0.19.8 trained TP=2 x DP=2 at ZeRO stage 3;
files ``zero_pp_rank_D_mp_rank_TT_{model,optim}_states.pt``, each TP shard partitioned over the DP
ranks of its TP rank).

Fast tests (no DeepSpeed job):

* ``reshard convert`` is tensor for tensor what ``ds_to_universal`` writes (same files, no
  ``step.pt``, model-state files copied byte for byte), in fp32 and bf16
  (``llama_zero3_tp2_dp2_bf16``);
* ``reshard reshard`` to other TP x DP topologies at ZeRO-3 and to ZeRO-1/2 with TP keeps every
  universal tensor bit for bit; a TP=1 ZeRO-3 checkpoint goes to TP=2 with ``layout=``;
* round trips (ZeRO-3 TP -> X -> back, ZeRO-1 TP -> ZeRO-3 TP -> back) give back the source files
  object for object (tensors bit for bit, storages, ``ds_id``, ``universal_checkpoint_info``);
* a truncated partition at a TP rank is refused naming file, rank and parameter, leaving nothing.

End to end (``e2e``, one gloo job of 2 ranks): DeepSpeed loads reshard's TP=2 x DP=1 ZeRO-3
files natively and trains two steps exactly as from its own native save of the same state
(``ds_to_universal`` + ``load_universal`` at TP=2 x DP=1, then ``save_checkpoint``), whose files
equal ours object for object (but ``ds_config``).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from reshard import ReshardError
from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from reshard.storage.staging import verify
from tests.support.compare import flat_universal as _universal
from tests.support.compare import rebase_ds_ids as _rebase_ds_ids
from tests.support.compare import same_strict as _same
from tests.support.dsconv import FIXTURES, tag_dir

SOURCE = "llama_zero3_tp2_dp2"
BF16 = "llama_zero3_tp2_dp2_bf16"  # the same in bf16 (fp32 masters, bf16_ optimizer files)
ZERO1_TP = "llama_tp2_dp2"  # the same training recipe at ZeRO-1
TAG = "global_step3"


@pytest.fixture(scope="module")
def source_universal(tmp_path_factory) -> dict:
    return _universal(FIXTURES / SOURCE, tmp_path_factory.mktemp("z3tp") / "ucp")


def _equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, states in want.items():
        for state, t in states.items():
            assert got[name][state].dtype == t.dtype and torch.equal(got[name][state], t), (name, state)


# -- the fixture --------------------------------------------------------------------------------


def test_fixture_is_tp_shards_partitioned_over_their_dp_ranks():
    ck = DeepSpeedCheckpoint.open(FIXTURES / SOURCE)
    assert (ck.tp, ck.dp, ck.pp, ck.zero_stage) == (2, 2, 1, 3)
    assert sorted(p.name for p in tag_dir(SOURCE).iterdir()) == sorted(
        f"zero_pp_rank_{d}_mp_rank_{t:02d}_{kind}_states.pt" for t in range(2) for d in range(2)
        for kind in ("model", "optim"))
    for t in range(2):
        ms = load(tag_dir(SOURCE) / f"zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt")
        shapes = ms["param_shapes"][0]
        assert tuple(shapes["model.layers.0.self_attn.q_proj.weight"]) == (16, 32)  # a TP shard
        assert tuple(shapes["model.embed_tokens.weight"]) == (96, 32)  # replicated
        assert ms["mp_world_size"] == 2 and ms["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 2}
        part = sum(-(-math.prod(s) // 2) for s in shapes.values())
        for d in range(2):
            osd = load(tag_dir(SOURCE) / f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")["optimizer_state_dict"]
            assert osd["partition_count"] == 2 and osd["fp32_flat_groups"][0].numel() == part == 8144


def test_fixture_holds_the_zero1_fixtures_state(source_universal, tmp_path):
    """The same recipe at ZeRO-1 (``llama_tp2_dp2``) records the same losses; its masters and
    moments agree to float rounding (ZeRO-3 reduces gradients in another order)."""
    import json

    ours, theirs = (json.loads((FIXTURES / n / "fixture.json").read_text()) for n in (SOURCE, ZERO1_TP))
    assert ours["losses"] == theirs["losses"]
    other = _universal(FIXTURES / ZERO1_TP, tmp_path / "z1")
    assert list(other) == list(source_universal)
    for name, states in source_universal.items():
        for state, t in states.items():
            assert torch.allclose(other[name][state], t, rtol=1e-4, atol=1e-7), (name, state)


# -- convert: DeepSpeed's own converter's tensors -------------------------------------------------


@pytest.mark.parametrize("name", [SOURCE, BF16])
def test_convert_is_bit_identical_to_ds_to_universal(name, tmp_path):
    pytest.importorskip("deepspeed")
    from tests.support.compare import same as same_value
    from tests.support.dsconv import ds_to_universal

    theirs = ds_to_universal(name, tmp_path / "ds")
    ours = convert(FIXTURES / name, tmp_path / "reshard").out_dir
    files = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.pt")) == files
    assert not any(f.endswith("step.pt") for f in files)  # ZeRO-3's converter writes no step file
    for rel in files:
        if "model_states" in rel:
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
        else:
            same_value(load(ours / rel), load(theirs / rel), rel)
    assert (tmp_path / "reshard" / "latest_universal").read_text() == (tmp_path / "ds" / "latest_universal").read_text()


# -- reshard: every universal tensor kept ---------------------------------------------------------

TARGETS = [(1, 2, 3), (2, 1, 3), (1, 4, 3), (2, 3, 3), (2, 2, 1), (1, 3, 2), (2, 1, 2)]


@pytest.mark.parametrize("tp,dp,stage", TARGETS, ids=[f"tp{t}dp{d}z{s}" for t, d, s in TARGETS])
def test_resharded_checkpoint_converts_to_the_same_universal_tensors(tp, dp, stage, tmp_path, source_universal):
    report = reshard(FIXTURES / SOURCE, tmp_path / "out", tp=tp, dp=dp, zero_stage=stage)
    out = report.out_dir
    verify(out)
    assert report.source == {"tp": 2, "dp": 2, "pp": 1, "zero_stage": 3}
    assert report.target == {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage}
    shards = [load(tag_dir(SOURCE) / f"zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt")["param_shapes"][0]
              for t in range(2)]
    per_tp = [sum(math.prod(s) for s in shapes.values()) for shapes in shards]
    whole = sum(t.numel() for t in (s["fp32"] for s in source_universal.values()))
    assert report.elements_read == 3 * (sum(per_tp) if tp == 2 else whole)  # each element once per state
    ck = DeepSpeedCheckpoint.open(out)
    assert (ck.tp, ck.dp, ck.zero_stage) == (tp, dp, stage)
    if stage == 3:
        want = [f"zero_pp_rank_{d}_mp_rank_{t:02d}_{k}_states.pt" for t in range(tp) for d in range(dp)
                for k in ("model", "optim")]
    else:
        want = [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)] + [
            f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for t in range(tp) for d in range(dp)]
    assert sorted(p.name for p in out.iterdir()) == sorted(want + ["reshard-manifest.json"])
    src_uc = load(tag_dir(SOURCE) / "zero_pp_rank_0_mp_rank_00_model_states.pt")["universal_checkpoint_info"]
    for t in range(tp):
        ms = load(out / (f"zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt" if stage == 3
                         else f"mp_rank_{t:02d}_model_states.pt"))
        assert ms["mp_world_size"] == tp and ms["dp_world_size"] == dp
        assert ms["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": tp}
        assert ms.get("universal_checkpoint_info") == (src_uc if tp == 2 else None)
        assert ms["ds_config"]["zero_optimization"]["stage"] == stage
        assert ms["ds_config"]["tensor_parallel"]["autotp_size"] == tp
    _equal(_universal(out, tmp_path / "ucp"), source_universal)


@pytest.mark.parametrize("tp,dp,stage", [(1, 2, 3), (2, 3, 1), (1, 1, 2)], ids=["tp1dp2z3", "tp2dp3z1", "tp1dp1z2"])
def test_bf16_reshards_to_the_same_universal_tensors_and_back(tp, dp, stage, tmp_path):
    """bf16: ``bf16_`` optimizer files and bf16 placeholders kept; a ZeRO-1/2 target's module
    weights are the fp32 masters in bf16; back at TP=2 x DP=2 ZeRO-3, the source files."""
    out = reshard(FIXTURES / BF16, tmp_path / "out", tp=tp, dp=dp, zero_stage=stage).out_dir
    assert all(p.name.startswith("bf16_") for p in out.glob("*optim_states.pt"))
    want = _universal(FIXTURES / BF16, tmp_path / "a")
    _equal(_universal(out, tmp_path / "b"), want)
    if stage != 3 and tp == 1:
        module = load(out / "mp_rank_00_model_states.pt", mmap=False)["module"]
        for name, states in want.items():
            w = module[name]
            assert w.dtype == torch.bfloat16 and torch.equal(w.reshape(-1), states["fp32"].to(torch.bfloat16)), name
    back = reshard(out, tmp_path / "back", tp=2, dp=2, zero_stage=3, layout=FIXTURES / BF16 if tp == 1 else None)
    for f in sorted(tag_dir(BF16).iterdir()):
        _same(load(back.out_dir / f.name, mmap=False), load(f, mmap=False), f.name)


def test_tp1_zero3_goes_to_tp2_with_a_layout(tmp_path):
    """A TP=1 ZeRO-3 checkpoint at TP=2 x DP=2 ZeRO-3, the AutoTP layout taken from this fixture:
    the same universal tensors, and the AutoTP metadata DeepSpeed records at TP=2."""
    with pytest.raises(ReshardError, match=r"changing TP from 1 to 2 needs the layout"):
        reshard(FIXTURES / "llama_zero3_dp2", tmp_path / "no", tp=2, dp=2)
    assert not (tmp_path / "no").exists()
    out = reshard(FIXTURES / "llama_zero3_dp2", tmp_path / "out", tp=2, dp=2, layout=FIXTURES / SOURCE).out_dir
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in tag_dir(SOURCE).iterdir()]
                                                          + ["reshard-manifest.json"])
    for t in range(2):
        ours = load(out / f"zero_pp_rank_1_mp_rank_{t:02d}_model_states.pt")
        theirs = load(tag_dir(SOURCE) / f"zero_pp_rank_1_mp_rank_{t:02d}_model_states.pt")
        assert ours["param_shapes"] == theirs["param_shapes"]
        assert list(ours) == list(theirs)
        assert "affine_map" in ours["universal_checkpoint_info"]
    _equal(_universal(out, tmp_path / "a"), _universal(FIXTURES / "llama_zero3_dp2", tmp_path / "b"))


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("t,d,state,match", [
    (1, 1, "fp32", r"zero_pp_rank_1_mp_rank_01_optim_states\.pt: tp rank 1, dp rank 1: parameter 'lm_head\.weight' "
                   r"\(fp32, elements \[7376, 8144\) of sub-group 0\) lies past the end of the partition, which has "
                   r"8139 of 8144 elements: truncated or corrupt"),
    (1, 0, "exp_avg_sq", r"zero_pp_rank_0_mp_rank_01_optim_states\.pt: tp rank 1, dp rank 0: parameter "
                         r"'lm_head\.weight' \(exp_avg_sq, "),
], ids=["tp1dp1-fp32", "tp1dp0-exp_avg_sq"])
def test_truncated_partition_at_a_tp_rank_is_refused_and_nothing_is_left(t, d, state, match, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / SOURCE, src)
    path = src / TAG / f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"
    obj = load(path, mmap=False)
    osd = obj["optimizer_state_dict"]
    if state == "fp32":
        osd["fp32_flat_groups"][0] = osd["fp32_flat_groups"][0][:-5].clone()
    else:
        moments = osd["optimizer_state_dict"]["state"][0]
        moments[state] = moments[state][:-5].clone()
    save(obj, path)
    for kwargs in ({"tp": 1, "dp": 2}, {"tp": 2, "dp": 2, "zero_stage": 1}):
        with pytest.raises(CheckpointError, match=match):
            reshard(src, tmp_path / "out", **kwargs)
        assert not (tmp_path / "out").exists()


def test_tp_ranks_recording_other_parameters_are_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / SOURCE, src)
    for d in range(2):
        path = src / TAG / f"zero_pp_rank_{d}_mp_rank_01_model_states.pt"
        obj = load(path, mmap=False)
        shapes = obj["param_shapes"][0]
        shapes["lm_head.weight2"] = shapes.pop("lm_head.weight")
        save(obj, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_01_model_states\.pt: TP rank 1 records other parameters"):
        reshard(src, tmp_path / "out", tp=1, dp=2)
    assert not (tmp_path / "out").exists()


# -- end to end: DeepSpeed loads it natively ------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow  # ~30 s; make test keeps ds_to_universal parity and the universal-tensor checks of each route
def test_deepspeed_loads_it_natively_at_tp2_dp1_and_trains_as_from_its_own_save(tmp_path):
    """reshard's TP=2 x DP=1 ZeRO-3 files of the TP=2 x DP=2 fixture, loaded with DeepSpeed's
    ordinary ``load_checkpoint``, against DeepSpeed's own native checkpoint there (its save right
    after loading ``ds_to_universal``'s output with ``load_universal``), in one 2-rank job: the
    same losses, the same layout-free digests of fp32 masters, Adam moments and module weights
    after the load and after two steps, and the same files object for object (but ds_config)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from tests.e2e.digest import differences
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many
    from tests.support.dsconv import ds_to_universal

    tp, dp, steps = 2, 1, 2
    ds_to_universal(SOURCE, tmp_path / "ucp")
    ours = reshard(FIXTURES / SOURCE, tmp_path / "ours", tp=tp, dp=dp).out_dir.parent
    spec = model_spec_from_fixture(FIXTURES / SOURCE)
    common = {"model_spec": spec, "tp": tp, "dp": dp, "zero_stage": 3, "steps": steps}
    loads = [resume_load("ds_to_universal", tmp_path / "ucp", universal=True, save_dir=tmp_path / "resaved", **common),
             resume_load("resaved", tmp_path / "resaved", universal=False, **common),
             resume_load("resharded", ours, universal=False, **common)]
    reports = resume_many(loads, world_size=tp * dp, workdir=tmp_path / "job")
    print({k: (r["losses"], round(r["wall_seconds"], 1)) for k, r in reports.items()},
          f"job {reports['resharded']['job_seconds']:.1f}s")
    for name, r in reports.items():
        assert r["topology"] == {"tp": tp, "dp": dp, "world_size": tp * dp, "zero_stage": 3,
                                 "universal": name == "ds_to_universal"}, name
        assert r["ranks_agree"] and r["replica_mismatches"] == [], name
        assert r["global_steps_after_load"] == 3 and r["optimizer_step_after_load"] == [3.0], name
        assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"]), name
    mine, theirs, via_ucp = reports["resharded"], reports["resaved"], reports["ds_to_universal"]
    assert mine["load_path"].startswith(str(ours.resolve()) + f"/{TAG}/")
    assert mine["losses_per_rank"] == theirs["losses_per_rank"] == via_ucp["losses_per_rank"]  # exact
    for phase in ("after_load", "after_steps"):
        for other in (theirs, via_ucp):
            diff = differences(other["digests"][phase], mine["digests"][phase])
            assert diff == [], f"{phase}: the native load of reshard's files differs in {diff[:5]}"
    assert all({"fp32", "exp_avg", "exp_avg_sq", "module"} <= set(v) for v in mine["digests"]["after_load"].values())
    saved = tmp_path / "resaved" / TAG
    names = sorted(p.name for p in (ours / TAG).iterdir() if p.suffix == ".pt")
    assert names == sorted(p.name for p in saved.iterdir() if p.suffix == ".pt")
    for name in names:
        a, b = (_rebase_ds_ids(load(folder / name, mmap=False)) for folder in (ours / TAG, saved))
        _same(a, b, name, skip=("ds_config",))
