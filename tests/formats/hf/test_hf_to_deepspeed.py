"""A run started from pretrained weights at a DeepSpeed topology: ``reshard reshard HF_FOLDER OUT
--tp 1 --dp 2`` writes DeepSpeed's own ZeRO-1 files from a ``save_pretrained`` folder, and DeepSpeed
0.19.8's ordinary ``engine.load_checkpoint`` loads them (one launch, world 2): its fp32 masters and
module weights are the folder's weights bit for bit, its Adam moments zero and its step 0, as a
fresh optimizer's, and it trains from there. A tied Qwen2 (``save_pretrained`` left out
``lm_head.weight``) loads strictly: the alias is back in the module, sharing the embedding. At
``--tp 2`` (slow) AutoTP's engine loads the layout of transformers' TP plan as AutoTP reads it."""

from __future__ import annotations

import json

import pytest

from reshard.jobs.convert import reshard
from tests.e2e.digest import digest
from tests.support.paths import DEEPSPEED, HF

pytestmark = pytest.mark.e2e
FOLDERS = ("pretrained_llama", "pretrained_qwen2_tied")


def _spec(name: str) -> dict:
    """The DeepSpeed job's model: the folder's own config, built as the fixtures' jobs build theirs."""
    cfg = json.loads((HF / name / "config.json").read_text())
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
            "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "head_dim", "rms_norm_eps")
    ds = json.loads((DEEPSPEED / "llama_zero1_dp2" / "fixture.json").read_text())["ds_config"]
    return {"model_type": cfg["model_type"], "model_config": {k: cfg[k] for k in keep if k in cfg}, "patches": [],
            "seed": 1234, "seq_len": 16, "micro_batch": 2, "ds_config": ds}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import resume_load, resume_many

    tmp = tmp_path_factory.mktemp("hf_to_ds")
    loads, reports = [], {}
    for name in FOLDERS:
        reports[name] = reshard(HF / name, tmp / name, tp=1, dp=2, zero_stage=1)
        loads.append(resume_load(name, tmp / name, model_spec=_spec(name), tp=1, dp=2, universal=False,
                                 zero_stage=1, steps=2))
    return {"jobs": resume_many(loads, world_size=2), "reports": reports}


@pytest.mark.slow  # one 2-rank DeepSpeed launch (~40 s); make test keeps the HF -> DeepSpeed routes of test_routes
@pytest.mark.parametrize("name", FOLDERS)
def test_deepspeed_loads_pretrained_weights_as_a_fresh_run(loaded, name):
    from safetensors.torch import load_file

    job, report = loaded["jobs"][name], loaded["reports"][name]
    assert "Adam step 0" in " ".join(report.notes) and "exp_avg" in " ".join(report.notes)
    weights = load_file(HF / name / "model.safetensors")
    after = job["digests"]["after_load"]
    assert sorted(after) == sorted(weights)  # every parameter DeepSpeed optimizes, the tied one once
    for n, w in weights.items():
        want = digest(n, w.float())
        assert after[n]["fp32"] == want and after[n]["module"] == want, n
        assert after[n]["exp_avg"]["wsum"] == 0.0 and after[n]["exp_avg_sq"]["wsum"] == 0.0, n
    assert job["optimizer_step_after_load"] == [0.0] and job["global_steps_after_load"] == 0
    losses = job["losses_per_dp_rank"]["0"]
    assert len(losses) == 2 and all(x == x for x in losses)  # it trains on from the pretrained weights


@pytest.mark.slow
def test_deepspeed_autotp_loads_an_hf_folder_written_at_tp2(tmp_path):
    """``--tp 2`` without ``--layout``: the layout of transformers' TP plan, as AutoTP reads it
    (docs/hf-checkpoints.md §7.1). DeepSpeed's AutoTP engine at TP=2 loads it (strict shapes: an
    untied embedding whole, a tied one vocabulary-parallel), holds the folder's weights and trains."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from tests.e2e.launch import resume_load, resume_many

    loads = []
    for name in FOLDERS:
        reshard(HF / name, tmp_path / name, tp=2, dp=1, zero_stage=1)
        loads.append(resume_load(name, tmp_path / name, model_spec=_spec(name), tp=2, dp=1, universal=False,
                                 zero_stage=1, steps=2))
    jobs = resume_many(loads, world_size=2)
    for name in FOLDERS:
        job, weights = jobs[name], load_file(HF / name / "model.safetensors")
        after = job["digests"]["after_load"]
        assert sorted(after) == sorted(weights), name
        for n, w in weights.items():
            assert after[n]["module"] == digest(n, w.float()), (name, n)
        losses = job["losses_per_dp_rank"]["0"]
        assert len(losses) == 2 and all(x == x for x in losses)


@pytest.mark.slow
def test_deepspeed_loads_a_dcp_reshard_wrote_in_model_order(tmp_path):
    """HF folder -> ``convert --format dcp`` -> ``reshard --to deepspeed``: DeepSpeed's ZeRO-1 loader
    takes the flat partitions in its model's parameter order, not by name; an earlier reshard wrote
    the DCP's entries sorted by key (``lm_head`` first) and the files followed it, loading every
    master into another parameter. Now each parameter's fp32 master and module weight are its own."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from reshard.jobs.convert import convert
    from tests.e2e.launch import resume_load, resume_many

    name = "pretrained_llama"
    dcp_dir = convert(HF / name, tmp_path / "dcp", fmt="dcp").out_dir
    reshard(dcp_dir, tmp_path / "ds", tp=1, dp=2, zero_stage=1, to="deepspeed")
    job = resume_many([resume_load(name, tmp_path / "ds", model_spec=_spec(name), tp=1, dp=2, universal=False,
                                   zero_stage=1, steps=1)], world_size=2)[name]
    after = job["digests"]["after_load"]
    weights = load_file(HF / name / "model.safetensors")
    assert sorted(after) == sorted(weights)
    for n, w in weights.items():
        want = digest(n, w.float())
        assert after[n]["fp32"] == want and after[n]["module"] == want, n
