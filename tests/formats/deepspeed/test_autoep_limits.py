"""AutoEP layouts at DeepSpeed 0.19.8's own limits (docs/deepspeed-checkpoints.md §11.2 and §11.4).

* **A folded (AutoEP x AutoTP) target at EP 1, or under pipeline parallelism**: DeepSpeed itself refuses to
  train it (``validate_folding_global``, run by ``deepspeed.initialize``), so no DeepSpeed job could load such
  files. reshard refuses the target in DeepSpeed's words, from every source kind, before any output exists.
  The quoted text and its file:line are checked against the installed DeepSpeed.
* **AutoEP under pipeline parallelism at TP 1**: DeepSpeed trains, saves and reloads it (fixture
  ``mixtral_autoep_ep2_pp2``, written by DeepSpeed), in a layout of its own that DeepSpeed's
  ``ds_to_universal`` refuses. reshard reads it (``test_autoep_pipe.py``) and writes it as DeepSpeed files at
  ZeRO-1, PP 1 or the source's PP (``test_autoep_pipe_write.py``); ZeRO-3 is refused by name, leaving no output.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from reshard import ReshardError
from reshard.formats.deepspeed.placement import DEEPSPEED_FOLDING_REFUSALS
from reshard.jobs.convert import reshard
from reshard.storage.safe_load import load
from tests.support.dsconv import FIXTURES, tag_dir

FOLDED = FIXTURES / "mixtral_autoep_ep2_tp2"
PIPE = "mixtral_autoep_ep2_pp2"
HF = FIXTURES.parent / "hf"


def test_the_quoted_refusals_are_deepspeeds_own():
    """Each quoted refusal is the text DeepSpeed's validate_folding_global raises, at the cited line; and
    AutoEP under PP at TP 1 passes the same validation (DeepSpeed trains it)."""
    folding = pytest.importorskip("deepspeed.module_inject.auto_ep_folding")
    lines, _ = inspect.findsource(folding)
    for why, (where, text) in DEEPSPEED_FOLDING_REFUSALS.items():
        path, line = where.rsplit(":", 1)
        assert Path(folding.__file__).as_posix().endswith(path), (why, folding.__file__)
        assert "raise ValueError(" in lines[int(line) - 1] and text.split(";")[0][:40] in lines[int(line) - 1], why
    cases = {"ep1": dict(pp_size=1, tp_size=2, ep_size=1), "pp": dict(pp_size=2, tp_size=2, ep_size=2)}
    for why, sizes in cases.items():
        spec = folding.build_folding_spec(world_size=4, **sizes)
        with pytest.raises(ValueError) as e:
            folding.validate_folding_global(spec, zero_stage=1)
        assert str(e.value) == DEEPSPEED_FOLDING_REFUSALS[why][1].format(pp=sizes["pp_size"]), why
    with pytest.raises(ValueError, match=re.escape(DEEPSPEED_FOLDING_REFUSALS["data_before_expert"][1])):
        folding.validate_folding_global(folding.build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=2),
                                        zero_stage=1, use_data_before_expert_parallel=True)
    folding.validate_folding_global(folding.build_folding_spec(world_size=4, pp_size=2, tp_size=1, ep_size=2),
                                    zero_stage=1)


EP1 = re.escape(DEEPSPEED_FOLDING_REFUSALS["ep1"][1])
PP = re.escape(DEEPSPEED_FOLDING_REFUSALS["pp"][1].format(pp=2))


@pytest.mark.parametrize("source,options,match", [
    ("mixtral_autoep_ep2_tp2", {"tp": 2, "ep": 1}, r"\(asked tp=2, ep=1\).*auto_ep_folding.py:241.*" + EP1),
    ("mixtral_autoep_ep2_tp2", {"tp": 2, "ep": 1, "dp": 1}, EP1),
    ("mixtral_autoep_ep2_tp2", {"tp": 2, "ep": 1, "zero_stage": 3}, EP1),  # before: the ZeRO-3 refusal
    ("mixtral_autoep_ep2", {"tp": 2, "dp": 1, "ep": 1, "layout": FOLDED}, EP1),
    ("mixtral_autoep_ep2_zero3", {"tp": 2, "dp": 1, "ep": 1}, EP1),
    ("mixtral_autoep_ep2_tp2_zero3", {"tp": 2, "ep": 1}, EP1),
    ("mixtral_autoep_ep2_tp2", {"tp": 2, "ep": 2, "pp": 2}, r"\(asked tp=2, ep=2, pp=2\).*auto_ep_folding.py:207.*" + PP),
    ("mixtral_autoep_ep2", {"tp": 2, "dp": 1, "ep": 2, "pp": 2}, PP),
    (HF / "pretrained_mixtral", {"to": "deepspeed", "tp": 2, "ep": 1}, EP1),
])
def test_a_folded_target_deepspeed_refuses_is_refused_in_its_words(source, options, match, tmp_path):
    src = source if isinstance(source, Path) else FIXTURES / source
    with pytest.raises(ReshardError, match=r"an AutoEP target folded over TP .* is refused: DeepSpeed 0\.19\.8 "
                                           r"does not train it") as e:
        reshard(src, tmp_path / "out", **options)
    assert re.search(match, str(e.value)), str(e.value)
    assert not (tmp_path / "out").exists()


def test_the_pipeline_fixture_is_deepspeeds_autoep_pipeline_layout():
    """What the refusal describes is what DeepSpeed wrote: no per-layer pipeline files, one model state per
    stage with its own ds_autoep_layers (moe_layer_id from 0 on each stage), per-expert files per stage."""
    tag = tag_dir(PIPE)
    names = sorted(p.name for p in tag.iterdir())
    assert not [n for n in names if n.startswith("layer_") and "-model" in n]
    assert [n for n in names if n.startswith("mp_rank_")] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert len([n for n in names if n.endswith("_optim_states.pt")]) == 4  # PP 2 x DP 2
    for stage, block in ((0, "1"), (1, "2")):
        state = load(tag / f"mp_rank_{stage:02d}_model_states.pt")
        assert state["checkpoint_parallel_dimensions"] == {"pp_degree": 2, "tp_degree": 1}
        layers = state["ds_autoep_layers"]
        assert [(x["moe_layer_id"], x["module_path"], x["ep_size"]) for x in layers] == [(0, f"{block}.mlp", 2)]
        for e in range(4):
            expert = load(tag / f"layer_0_expert_{e}_mp_rank_{stage:02d}_model_states.pt")
            assert sorted(expert) == [f"{block}.mlp.experts.w{i}.{e}" for i in (1, 2, 3)]


def test_autoep_under_pipeline_at_zero3_is_refused_leaving_nothing(tmp_path):
    """Written as DeepSpeed files since h32pipew (test_autoep_pipe_write.py) at ZeRO-1 only: DeepSpeed's
    PipelineEngine refuses ZeRO-2 and ZeRO-3."""
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match=r"AutoEP under pipeline parallelism is written at ZeRO stage 1 only "
                                           r"\(asked 3\).*PipelineEngine refuses ZeRO-2 and ZeRO-3"):
        reshard(FIXTURES / PIPE, out, tp=1, zero_stage=3)
    assert not out.exists()


def test_a_pipeline_target_from_autoep_says_why(tmp_path):
    with pytest.raises(ReshardError, match=r"AutoEP checkpoints are resharded at TP = PP = 1 only \(asked tp=1, "
                                           r"pp=2\); an AutoEP pipeline \(deepspeed.pipe\) target is written from a "
                                           r"PipelineModule's AutoEP checkpoint only.*model.layers.0.mlp.experts"):
        reshard(FIXTURES / "mixtral_autoep_ep2", tmp_path / "out", tp=1, dp=1, pp=2, ep=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_reloads_the_pipeline_fixture_and_saves_it_back_unchanged(tmp_path):
    """The claim of the refusal: DeepSpeed itself reloads this layout. Its pipeline job (the fixture's
    recipe, ``scripts/_fixture_autoep_pipe.py``) loads the fixture natively and saves at once: every file
    equals the fixture's, tensor for tensor, but ``ds_config``."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import REPO, launch
    from tests.support.compare import diff_files

    fx = json.loads((FIXTURES / PIPE / "fixture.json").read_text())
    spec = {"model_type": fx["model_type"], "model_config": fx["model_config"], "ds_config": fx["ds_config"],
            "steps": 0, "seed": fx["seed"], "seq_len": fx["data"]["seq_len"], "micro_batch": fx["data"]["micro_batch"],
            "save_dir": str(tmp_path / "native"), "tag": fx["tag"], "report_dir": str(tmp_path / "report"),
            "patches": fx["patches"], "load_dir": str(FIXTURES / PIPE)}
    launch(REPO / "scripts" / "_fixture_autoep_pipe.py", spec, world_size=fx["world_size"], workdir=tmp_path)
    report = json.loads((tmp_path / "report" / "rank_0.json").read_text())
    assert report["global_steps"] == 3
    diff_files(tag_dir(PIPE), tmp_path / "native" / fx["tag"])


def test_deepspeeds_own_consolidation_refuses_the_pipeline_fixture():
    """The refusal's second claim: DeepSpeed's ds_to_universal cannot consolidate these files either; it
    stops where it looks up an expert's file (the function and line the message quotes)."""
    au = pytest.importorskip("deepspeed.checkpoint.autoep_universal")
    lines, _ = inspect.findsource(au)
    assert "Multiple expert checkpoint files found" in lines[153 - 1]
    with pytest.raises(NotImplementedError, match=r"Multiple expert checkpoint files found for layer_0 expert_0: "
                                                  r".*Multi-mp_rank expert files are not yet supported"):
        au.resolve_expert_ckpt_path(str(tag_dir(PIPE)), 0, 0)
