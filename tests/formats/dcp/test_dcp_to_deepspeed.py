"""A DeepSpeed job resumes an FSDP2 run, by both routes: ``reshard convert DCP_DIR OUT --format ucp``
and DeepSpeed 0.19.8's own ``engine.load_checkpoint`` with ``checkpoint.load_universal``, and
``reshard reshard DCP_DIR OUT --tp 1 --dp 2`` (DeepSpeed's own files at that topology) and its
ordinary native ``engine.load_checkpoint`` (TP=1 x DP=2, ZeRO-1); and the universal checkpoint of the
first route written natively the same way (universal -> DeepSpeed), all in one DeepSpeed launch.

The source is the committed FSDP2 fixture ``tests/fixtures/dcp/llama_fsdp2_ws2`` (3 AdamW steps of
the DeepSpeed Llama fixtures' recipe), converted from the DCP files alone. One DeepSpeed launch
(``tests/e2e/launch.py``, the model and ds_config of ``llama_zero1_dp2``) loads it and takes two
steps; one torchrun launch loads the same DCP checkpoint into FSDP2 at world size 2 and takes two.

* After the load, DeepSpeed's fp32 masters, module weights and Adam moments are the fixture's, bit
  for bit (``fixture.json`` records ``tests/e2e/digest.py`` digests of every full tensor after the
  last step; the harness reports the same digests of what DeepSpeed holds), and so are the ones
  the FSDP2 job loaded; DeepSpeed's Adam step is 3, and so is its ``global_steps``.
* The first loss after the load, on DeepSpeed's DP rank 0, equals the FSDP2 job's rank 0 loss to
  the last bit: both compute rows ``[0, 2)`` of the same fixed 4-row batch (``micro_batch`` 2 x 2
  ranks, the same draw) with the same fp32 weights on one process, single-threaded, with the same
  ``transformers`` model. The fixture README shows the same for training from scratch.
* The second losses follow one update each, from gradients that DeepSpeed (ZeRO-1 all-reduce, then
  clipping over its flat partitions) and FSDP2 (reduce-scatter, clipping over DTensor shards) sum
  in different orders, so they need not agree to the last bit (with 2 ranks they did when this
  was written): the fixture README records weights ~1e-8 apart after 3 steps from scratch. The
  tolerance, 1e-5 on a loss of ~4.4, admits that rounding and nothing else: one Adam update moves
  the loss by ~0.06 here, and a lost step count (bias correction at step 1 instead of 4) or lost
  moments would move it by far more.
"""

from __future__ import annotations

import json

import pytest
import torch

from reshard import convert, reshard
from tests.e2e.digest import digest
from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many
from tests.support.dcp_jobs import FIXTURES, run_fsdp_job
from tests.support.paths import DEEPSPEED

# the slow tier (one FSDP2 and three DeepSpeed launches, ~65 s): make test keeps the DCP -> DeepSpeed routes of
# tests/formats/test_routes.py, read back against DeepSpeed's own consolidation bit for bit
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIXTURE = FIXTURES / "llama_fsdp2_ws2"
DS_FIXTURE = DEEPSPEED / "llama_zero1_dp2"
FX = json.loads((FIXTURE / "fixture.json").read_text())
KINDS = (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("dcp_to_ds")
    report = convert(FIXTURE, tmp / "ucp", fmt="ucp")
    spec = model_spec_from_fixture(DS_FIXTURE)
    assert spec["model_config"] == FX["model_config"] and spec["seed"] == FX["seed"]
    assert spec["micro_batch"] == FX["data"]["micro_batch"] and spec["seq_len"] == FX["data"]["seq_len"]
    native = reshard(FIXTURE, tmp / "native", to="deepspeed", tp=1, dp=2, zero_stage=1)
    reshard(report.out_dir.parent, tmp / "ucp_native", tp=1, dp=2, zero_stage=1)
    loads = [resume_load("fsdp2->ucp", tmp / "ucp", model_spec=spec, tp=1, dp=2, universal=True, zero_stage=1,
                         steps=2),
             resume_load("fsdp2->native", tmp / "native", model_spec=spec, tp=1, dp=2, universal=False, zero_stage=1,
                         steps=2),
             resume_load("ucp->native", tmp / "ucp_native", model_spec=spec, tp=1, dp=2, universal=False,
                         zero_stage=1, steps=2)]
    reports = resume_many(loads, world_size=2)
    fsdp = run_fsdp_job("load", 2, FIXTURE, steps=2)
    return {"out": report.out_dir, "ds": reports["fsdp2->ucp"], "native": reports["fsdp2->native"],
            "ucp_native": reports["ucp->native"], "native_report": native, "fsdp": fsdp}


def test_converted_files_are_a_universal_checkpoint(runs: dict) -> None:
    out = runs["out"]
    assert (out.parent / "latest_universal").read_text() == out.name
    ms = torch.load(out / "mp_rank_00_model_states.pt", weights_only=True)
    ref = torch.load(DS_FIXTURE / "global_step3" / "mp_rank_00_model_states.pt", weights_only=True)
    # DeepSpeed's own key set and order, but for global_samples (not in DCP: the engine derives it)
    assert list(ms) == [k for k in ref if k != "global_samples"]
    assert ms["global_steps"] == 3 and ms["skipped_steps"] == 0
    assert (ms["dp_world_size"], ms["mp_world_size"]) == (1, 1)
    assert ms["param_shapes"] == ref["param_shapes"] and ms["buffer_names"] == ref["buffer_names"] == []
    assert ms["ds_version"] == ref["ds_version"]
    assert list(ms["module"]) == list(ref["module"])
    for name, t in ms["module"].items():
        assert t.dtype == torch.float32 and digest(name, t) == FX["digests"][name]["param"], name
    osd = torch.load(out / "zero" / "optimizer_state.pt", weights_only=True)
    assert osd["ds_version"] == "0.19.8" and osd["overflow"] is False
    (group,) = osd["param_groups"]
    assert group["lr"] == 0.001 and group["betas"] == (0.9, 0.999) and group["weight_decay"] == 0.01
    assert group["params"] == list(range(len(ref["module"])))


@pytest.mark.parametrize("route", ["ds", "native", "ucp_native"])
def test_deepspeed_loads_the_fsdp2_state_bit_for_bit(runs: dict, route: str) -> None:
    ds, fsdp = runs[route], runs["fsdp"]
    assert ds["topology"] == {"tp": 1, "dp": 2, "world_size": 2, "zero_stage": 1, "universal": route == "ds"}
    assert ds["ranks_agree"] and not ds["replica_mismatches"]
    loaded = ds["digests"]["after_load"]
    assert sorted(loaded) == sorted(FX["digests"])
    for name, want in FX["digests"].items():
        for fx_kind, ds_kind in KINDS:
            assert loaded[name][ds_kind] == want[fx_kind], (name, ds_kind)
            assert fsdp["digests"][name][fx_kind] == want[fx_kind], (name, fx_kind)
        assert loaded[name]["module"] == want["param"], name
    assert ds["optimizer_step_after_load"] == [3.0] and fsdp["adam_step"] == 3.0
    assert ds["global_steps_after_load"] == 3 and ds["global_steps_after_steps"] == 5
    assert ds["optimizer_step_after_steps"] == [5.0]


@pytest.mark.parametrize("route", ["ds", "native", "ucp_native"])
def test_first_loss_equals_fsdp2_bit_for_bit(runs: dict, route: str) -> None:
    ds, fsdp = runs[route], runs["fsdp"]
    assert ds["batch_shape"] == [2, FX["data"]["seq_len"]] and fsdp["local_batch_rows"] == 2
    first = ds["losses_per_dp_rank"]["0"][0]
    assert first == fsdp["losses_rank0"][0]
    assert first < FX["losses_rank0"][-1]  # training went on from step 3
    second = ds["losses_per_dp_rank"]["0"][1]
    assert second < first and abs(second - fsdp["losses_rank0"][1]) <= 1e-5


def test_the_native_files_say_what_a_fresh_optimizer_would_not_know(runs: dict) -> None:
    """DCP records no DeepSpeed job: the report says the files are a fresh ZeRO-1 job's over the
    FSDP2 state (its step kept), and DeepSpeed's own converter reads them as its own."""
    notes = " ".join(runs["native_report"].notes)
    assert "fresh DeepSpeed ZeRO-1 job" in notes and "Adam step 3" in notes
