"""DeepSpeed AutoEP under pipeline parallelism at TP 1 (docs/deepspeed-checkpoints.md §11.4): the
``mixtral_autoep_ep2_pp2`` fixture (PP 2 x DP 2, EP 2 per stage, ZeRO-1, saved by DeepSpeed 0.19.8) read.

The oracle is DeepSpeed's own consolidation of the fixture (``oracle.json`` beside it): the fixture's
pipeline job (``scripts/_fixture_autoep_pipe.py``) loads it natively and digests every parameter's whole
fp32 master, Adam moments and module weight on its stage (experts gathered over the stage's EP group).
DeepSpeed's ``ds_to_universal`` refuses this layout (``autoep_universal.py:153``). The slow test re-runs
that load and checks the committed oracle. Re-write the oracle with
``python -m tests.formats.deepspeed.test_autoep_pipe``."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.dsconv import FIXTURES

NAME = "mixtral_autoep_ep2_pp2"
ORACLE = FIXTURES / NAME / "oracle.json"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def native_digests(work: Path) -> dict:
    """DeepSpeed's pipeline job loads the fixture (no step) and digests every stage's parameters."""
    from tests.e2e.launch import REPO, launch

    fx = json.loads((FIXTURES / NAME / "fixture.json").read_text())
    spec = {"model_type": fx["model_type"], "model_config": fx["model_config"], "ds_config": fx["ds_config"],
            "steps": 0, "seed": fx["seed"], "seq_len": fx["data"]["seq_len"], "micro_batch": fx["data"]["micro_batch"],
            "save_dir": str(work / "native"), "tag": fx["tag"], "report_dir": str(work / "report"),
            "patches": fx["patches"], "load_dir": str(FIXTURES / NAME), "digests_out": str(work / "digests.json")}
    launch(REPO / "scripts" / "_fixture_autoep_pipe.py", spec, world_size=fx["world_size"], workdir=work)
    return json.loads((work / "digests.json").read_text())


def write_oracle(work: Path) -> None:
    got = native_digests(work)
    ORACLE.write_text(json.dumps({
        "what": "DeepSpeed 0.19.8's own consolidation of this checkpoint: its pipeline job "
                "(scripts/_fixture_autoep_pipe.py, PP 2 x DP 2, EP 2 per stage) loads it natively "
                "(engine.load_checkpoint) and each stage digests every parameter's fp32 master, Adam moments and "
                "module weight, whole (tests/e2e/resume_train.collect: experts gathered over the stage's EP "
                "group); written by `python -m tests.formats.deepspeed.test_autoep_pipe`",
        "global_steps_after_load": got["global_steps"], "digests": got["digests"]}, indent=1) + "\n")


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeeds_pipeline_load_gives_the_committed_oracle(tmp_path):
    pytest.importorskip("deepspeed")
    from tests.e2e.digest import differences

    got = native_digests(tmp_path)
    oracle = json.loads(ORACLE.read_text())
    assert got["global_steps"] == oracle["global_steps_after_load"] == 3
    assert differences(oracle["digests"], got["digests"]) == []


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        write_oracle(Path(d))
    print(f"wrote {ORACLE}", file=sys.stderr)


# -- read: universal / DCP / HF equal DeepSpeed's own consolidation ------------------------------------------


def _oracle(kinds: tuple[str, ...] = STATES) -> dict:
    digests = json.loads(ORACLE.read_text())["digests"]
    return {n: {k: d[k] for k in kinds if k in d} for n, d in digests.items()}


def _digests(tensors: dict) -> dict:
    from tests.e2e.digest import digest

    return {n: {k: digest(n, t) for k, t in states.items()} for n, states in tensors.items()}


EXPERTS = [f"{layer}.mlp.experts.{w}" for layer in (1, 2) for w in ("w1", "w2", "w3")]
ALIASES = {"1.mlp.gate.gate.weight", "2.mlp.gate.gate.weight"}


def test_reads_each_stages_experts():
    from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint

    ck = DeepSpeedCheckpoint.open(FIXTURES / NAME)
    ax = ck.experts
    assert (ck.tp, ck.pp, ck.dp, ax.ep, ax.edp, ax.pp) == (1, 2, 2, 2, 1, 2)
    assert {n: ax.stage(n) for n in EXPERTS} == {n: int(n[0]) - 1 for n in EXPERTS}
    assert [ax.holder_ranks(h) for h in range(4)] == [[0], [2], [1], [3]]  # global rank dp * 2 + stage
    assert ck.layout.composite("2.mlp.experts.w1").ranks == (1, 3)
    assert set(ax.aliases) == ALIASES


def test_universal_holds_deepspeeds_own_consolidation(tmp_path):
    import torch

    from reshard.jobs.convert import convert
    from reshard.storage.safe_load import load
    from tests.e2e.digest import differences

    out = convert(FIXTURES / NAME, tmp_path, fmt="universal").out_dir

    def read(name: str, state: str) -> torch.Tensor:
        obj = load(out / "zero" / name / f"{state}.pt", mmap=False)
        return obj["param"] if isinstance(obj, dict) else obj

    got = {n: {s: read(n, s) for s in STATES} for n in _oracle()}
    assert differences(_oracle(), _digests(got)) == []
    assert {d.name for d in (out / "zero").iterdir() if d.is_dir()} == set(_oracle()) | ALIASES


def test_dcp_holds_deepspeeds_own_consolidation(tmp_path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from reshard.jobs.convert import convert
    from tests.e2e.digest import differences

    out = convert(FIXTURES / NAME, tmp_path / "dcp", fmt="dcp").out_dir
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    model, state = sd["model"], sd["optim"]["state"]
    got = {n: {"module": w, **{m: state[n][m] for m in STATES[1:]}} for n, w in model.items() if n in state}
    assert set(got) == set(_oracle())
    assert differences(_oracle(("module", "exp_avg", "exp_avg_sq")), _digests(got)) == []


def test_safetensors_holds_deepspeeds_module_weights(tmp_path):
    """The whole weights in the pipeline's own names (experts fused ``[num_experts, ...]``); the router
    alias written once, as the router."""
    from safetensors.torch import load_file

    from reshard.jobs.convert import convert
    from tests.e2e.digest import differences

    out = convert(FIXTURES / NAME, tmp_path / "st", fmt="safetensors").out_dir
    weights = load_file(out / "model.safetensors")
    got = {n: {"module": t} for n, t in weights.items() if n not in ALIASES}
    assert set(got) == set(_oracle())
    assert differences(_oracle(("module",)), _digests(got)) == []


def test_hf_names_are_refused_for_a_pipeline_module(tmp_path):
    """A PipelineModule names its layers by index (``1.mlp``): a model of the user's own, with no
    transformers names, so an HF export is refused by name, before any output."""
    from reshard import ReshardError
    from reshard.jobs.convert import convert

    cfg = tmp_path / "cfg"
    cfg.mkdir()
    full = json.loads((FIXTURES / NAME / "fixture.json").read_text())["model_config_full"]
    (cfg / "config.json").write_text(json.dumps(dict(full, architectures=["MixtralForCausalLM"])))
    with pytest.raises(ReshardError, match=r"1\.mlp: an AutoEP MoE module .* a pipeline \(deepspeed\.pipe\) module "
                                           r"names its layers by their index"):
        convert(FIXTURES / NAME, tmp_path / "hf", fmt="hf", hf_config=cfg)
    assert not (tmp_path / "hf").exists()


def test_inspect_shows_the_stages_experts(capsys):
    from reshard.cli import main

    assert main(["inspect", str(FIXTURES / NAME)]) == 0
    out = capsys.readouterr().out
    assert "DeepSpeed TP=1 DP=2 PP=2 ZeRO-1" in out and "EP=2" in out
    for name in EXPERTS:
        assert name in out
    assert "EP rank of DP rank d in its stage: d % 2; global rank g = d * 2 + stage" in out
    assert "EDP groups: stage 0 EP 0: rank 0; stage 0 EP 1: rank 2; stage 1 EP 0: rank 1; stage 1 EP 1: rank 3" in out


# -- planted defects: refused naming the file, before any output ---------------------------------------------


def _copy(tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / "src"
    shutil.copytree(FIXTURES / NAME, root)
    return root


def _plant_layers(root: Path, change) -> None:
    import torch

    path = root / "global_step3" / "mp_rank_01_model_states.pt"
    state = torch.load(path, weights_only=False)
    for key in ("ds_autoep_layers",):
        change(state[key][0])
    change(state["universal_checkpoint_info"]["ds_autoep_layers"][0])
    torch.save(state, path)


@pytest.mark.parametrize("change,match", [
    (lambda e: e.update(num_experts=8), r"mp_rank_01_model_states.pt: ds_autoep_layers\[0\]"),
    (lambda e: e["expert_placement"]["ranks"][1].update(experts=[3, 2]), r"mp_rank_01_model_states.pt: ds_autoep_layers"),
    (lambda e: e.update(expert_key_prefix="2.mlp.moe"), r"mp_rank_01_model_states.pt: ds_autoep_layers\[0\]"),
    (lambda e: e.update(expert_data_parallel_world_size=2), r"mp_rank_01_model_states.pt: ds_autoep_layers\[0\]: "
                                                            r"expert_data_parallel_world_size is 2"),
], ids=["num_experts", "placement", "prefix", "edp"])
def test_a_stages_wrong_layer_record_is_refused_naming_its_file(change, match, tmp_path):
    from reshard import ReshardError
    from reshard.jobs.convert import convert

    root = _copy(tmp_path)
    _plant_layers(root, change)
    with pytest.raises(ReshardError, match=match):
        convert(root, tmp_path / "out", fmt="universal")
    assert not (tmp_path / "out").exists()


def test_a_stages_record_differing_from_its_copy_is_refused(tmp_path):
    import torch

    from reshard import ReshardError
    from reshard.jobs.convert import convert

    root = _copy(tmp_path)
    path = root / "global_step3" / "mp_rank_01_model_states.pt"
    state = torch.load(path, weights_only=False)
    state["ds_autoep_layers"][0]["moe_layer_id"] = 1
    torch.save(state, path)
    with pytest.raises(ReshardError, match=r"mp_rank_01_model_states.pt: universal_checkpoint_info.ds_autoep_layers"):
        convert(root, tmp_path / "out", fmt="universal")


def test_a_missing_expert_file_is_refused_naming_it(tmp_path):
    from reshard import ReshardError
    from reshard.jobs.convert import convert

    root = _copy(tmp_path)
    (root / "global_step3" / "layer_0_expert_3_mp_rank_01_model_states.pt").unlink()
    with pytest.raises(ReshardError, match=r"per-expert files missing: \['layer_0_expert_3_mp_rank_01_model_states.pt"):
        convert(root, tmp_path / "out", fmt="universal")
    assert not (tmp_path / "out").exists()


def test_its_universal_checkpoint_reads_back_as_the_oracle(tmp_path):
    """reshard's universal checkpoint of it (each stage's model state beside ``zero/``, every stage's
    router alias a folder) is a source again: its DCP equals the oracle."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from reshard.jobs.convert import convert
    from tests.e2e.digest import differences

    ucp = convert(FIXTURES / NAME, tmp_path / "ucp", fmt="universal").out_dir
    # the router aliases: dropped, as from a non-pipeline AutoEP universal checkpoint (DCP holds no alias)
    out = convert(ucp, tmp_path / "dcp", fmt="dcp", drop=[r"\.gate\.gate\.weight$"]).out_dir
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    model, state = sd["model"], sd["optim"]["state"]
    # a universal checkpoint holds no module weight: DCP's model weight is the fp32 master
    got = {n: {"fp32": w, **{m: state[n][m] for m in STATES[1:]}} for n, w in model.items() if n in state}
    assert set(got) == set(_oracle())
    assert differences(_oracle(), _digests(got)) == []
