"""DeepSpeed AutoEP under pipeline parallelism written as DeepSpeed files (docs/deepspeed-checkpoints.md §11.4):
``reshard reshard mixtral_autoep_ep2_pp2 OUT --pp 1 | --pp 2 [--ep E --dp D]``.

The target is the fixture's own ``PipelineModule`` job (``scripts/_fixture_autoep_pipe.py``) at that topology.
Structure: the committed ``mixtral_autoep_ep2_pipe1`` is DeepSpeed's own save of that job at ``pipeline_stages: 1``
(world 2, EP 2); the PP 2 fixture itself is DeepSpeed's save at PP 2. Values: ``oracle.json``, DeepSpeed's own
consolidation of the PP 2 fixture. Slow: DeepSpeed's pipeline job loads reshard's output natively, digests every
parameter (= the oracle), and trains a step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.dsconv import FIXTURES

SOURCE = FIXTURES / "mixtral_autoep_ep2_pp2"
PIPE1 = FIXTURES / "mixtral_autoep_ep2_pipe1"  # DeepSpeed's one-stage save of the same job
ORACLE = SOURCE / "oracle.json"
TAG = "global_step3"


def structure(obj):
    """``obj`` object for object: container types and key order, tensors as (dtype, shape), every other value
    with its type."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape))
    if isinstance(obj, dict):
        return (type(obj).__name__, [(k, structure(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [structure(v) for v in obj])
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__name__, structure(vars(obj)))
    return (type(obj).__name__, obj)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / TAG).iterdir() if p.name.endswith(".pt"))


def _same_structure(ours: Path, ref: Path) -> None:
    from reshard.storage.safe_load import load

    assert _files(ours) == _files(ref)
    for name in _files(ref):
        assert structure(load(ours / TAG / name)) == structure(load(ref / TAG / name)), name


def _values(out: Path) -> dict:
    """Digests of every parameter of a written checkpoint: the fp32 master and Adam moments as reshard's reader
    rebuilds them from the optimizer files, the module weight from the files themselves (the stage's module, an
    expert stacked from its per-expert files)."""
    from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
    from reshard.formats.deepspeed.reader import DeepSpeedReader
    from reshard.storage.safe_load import load
    from tests.e2e.digest import digest

    ck = DeepSpeedCheckpoint.open(out)
    reader = DeepSpeedReader(ck)
    modules: dict = {}
    for path in sorted((out / TAG).glob("mp_rank_*_model_states.pt")):
        modules.update(load(path)["module"])
    experts: dict = {}
    for path in sorted((out / TAG).glob("layer_*_expert_*_model_states.pt")):
        for key, t in load(path).items():
            name, x = key.rsplit(".", 1)
            experts.setdefault(name, {})[int(x)] = t
    modules.update({n: torch.stack([by_x[x] for x in sorted(by_x)]) for n, by_x in experts.items()})
    got = {}
    for name in ck.experts.params.keys() | {n for g in range(ck.mp) for grp in ck.groups(g) for n in grp}:
        entry = {"module": digest(name, modules[name])}
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            m = reader.map(name, state)
            entry[state] = digest(name, m.rebuild({r: reader.fragment(name, state, r) for r in m.ranks}))
        got[name] = entry
    return got


def _equals_oracle(out: Path) -> None:
    from tests.e2e.digest import differences

    oracle = json.loads(ORACLE.read_text())["digests"]
    got = _values(out)
    assert set(got) == set(oracle)
    assert differences(oracle, got) == []


def _reshard(tmp_path: Path, name: str, **kw) -> Path:
    from reshard import reshard

    out = tmp_path / name
    reshard(SOURCE, out, **kw)
    return out


# -- PP 2 -> PP 1 -------------------------------------------------------------------------------------------------


def test_pp1_is_deepspeeds_one_stage_job_object_for_object_with_the_oracles_values(tmp_path):
    """Every file DeepSpeed's one-stage job writes, with the same keys in the same order, types, shapes and
    scalars (``ds_config`` included: nothing a fresh job writes differs here), and every value the oracle's;
    the layers renumbered as a one-stage job counts them, stage 1's per-expert files renamed, not changed."""
    from reshard.storage.safe_load import load

    out = _reshard(tmp_path, "pp1", pp=1)
    _same_structure(out, PIPE1)
    _equals_oracle(out)
    ms = load(out / TAG / "mp_rank_00_model_states.pt")
    assert [(e["moe_layer_id"], e["module_path"]) for e in ms["ds_autoep_layers"]] == [(0, "1.mlp"), (1, "2.mlp")]
    assert ms["universal_checkpoint_info"]["ds_autoep_layers"] == ms["ds_autoep_layers"]
    assert list(ms["param_shapes"][0])[-2:] == ["1.mlp.router.gate.weight", "2.mlp.router.gate.weight"]
    for x in range(4):
        assert (out / TAG / f"layer_1_expert_{x}_mp_rank_00_model_states.pt").read_bytes() == \
            (SOURCE / TAG / f"layer_0_expert_{x}_mp_rank_01_model_states.pt").read_bytes()


def test_deepspeeds_one_stage_save_holds_the_oracles_values():
    """The reference's own values: DeepSpeed's one-stage job trained to the same bits as the PP 2 job."""
    _equals_oracle(PIPE1)


# -- PP 1 -> PP 2 ---------------------------------------------------------------------------------------------------


def test_pp1_to_pp2_takes_the_stages_from_layout_and_round_trips_to_the_fixture(tmp_path):
    """PP 2 -> 1 -> 2 (the split from ``--layout``, the fixture itself): the fixture, tensor for tensor."""
    from reshard import reshard
    from reshard.storage.safe_load import load

    one = _reshard(tmp_path, "pp1", pp=1)
    back = tmp_path / "pp2"
    reshard(one, back, pp=2, layout=SOURCE)
    _same_structure(back, SOURCE)
    for name in _files(SOURCE):
        assert _same_tensors(load(back / TAG / name), load(SOURCE / TAG / name)), name


def test_deepspeeds_one_stage_save_at_pp2_is_the_pp2_layout_with_the_oracles_values(tmp_path):
    from reshard import reshard

    out = tmp_path / "pp2"
    reshard(PIPE1, out, pp=2, layout=SOURCE)
    _same_structure(out, SOURCE)
    _equals_oracle(out)


@pytest.mark.parametrize("layout, match", [
    (None, r"partition_method .*pass --layout, a DeepSpeed checkpoint of this PipelineModule saved at PP=2"),
    ("pipe_pp2_dp2", r"its stages hold layers \[0, 1, 2, 3, 4, 5\], the source \[0, 1, 2, 3\]: not the same "
                     r"PipelineModule"),
], ids=["no-layout", "another-model"])
def test_pp1_to_pp2_without_a_layout_is_refused_naming_partition_method(layout, match, tmp_path):
    from reshard import ReshardError, reshard

    with pytest.raises(ReshardError, match=match):
        reshard(PIPE1, tmp_path / "out", pp=2, layout=FIXTURES / layout if layout else None)
    assert not (tmp_path / "out").exists()


# -- PP 2 kept ------------------------------------------------------------------------------------------------------


def test_pp2_kept_rewrites_the_fixture_itself(tmp_path):
    """At its own topology the target is the fixture: object for object, and the same tensors."""
    from reshard.storage.safe_load import load

    out = _reshard(tmp_path, "pp2", pp=2)
    _same_structure(out, SOURCE)
    for name in _files(SOURCE):
        a, b = load(out / TAG / name), load(SOURCE / TAG / name)
        assert _same_tensors(a, b), name


def _tensors(obj, path: str = "") -> dict:
    """Every tensor in ``obj`` by its path, as raw bytes."""
    if isinstance(obj, torch.Tensor):
        return {path: obj.detach().reshape(-1).view(torch.uint8)}
    out = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        out.update(_tensors(v, f"{path}/{k}"))
    return out


def _same_tensors(a, b) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("kw", [{"ep": 1}, {"dp": 4, "ep": 4}], ids=["ep1", "dp4-ep4"])
def test_pp2_at_another_ep_or_dp_holds_the_oracles_values(kw, tmp_path):
    from reshard.storage.safe_load import load

    out = _reshard(tmp_path, "pp2", pp=2, **kw)
    dp, ep = kw.get("dp", 2), kw["ep"]
    assert _files(out) == sorted([f"mp_rank_0{s}_model_states.pt" for s in range(2)]
                                 + [f"layer_0_expert_{x}_mp_rank_0{s}_model_states.pt" for s in range(2) for x in range(4)]
                                 + [f"zero_pp_rank_{d}_mp_rank_0{s}_optim_states.pt" for s in range(2) for d in range(dp)])
    for s in range(2):
        ms = load(out / TAG / f"mp_rank_0{s}_model_states.pt")
        assert (ms["dp_world_size"], ms["mp_world_size"]) == (dp, 2)
        assert [(e["ep_size"], e["expert_data_parallel_world_size"]) for e in ms["ds_autoep_layers"]] == [(ep, dp // ep)]
    _equals_oracle(out)


# -- refused ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    ({"pp": 3}, "partition_method"),
    ({"pp": 3, "layout": FIXTURES / "mixtral_autoep_ep2_pipe1"}, r"is at PP=1, TP=1; the target is PP=3"),
    ({"pp": 1, "tp": 2}, "folding"),
    ({"pp": 1, "ep": 3}, "must divide"),
    ({"pp": 1, "zero_stage": 2}, "ZeRO-2 and ZeRO-3"),
], ids=["pp3", "pp3-layout", "tp2", "ep3", "zero2"])
def test_what_a_pipeline_target_cannot_be_is_refused_leaving_nothing(kw, match, tmp_path):
    from reshard import ReshardError, reshard

    with pytest.raises(ReshardError, match=match):
        reshard(SOURCE, tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


def test_a_non_pipeline_autoep_source_is_not_written_into_pipeline_stages(tmp_path):
    """``model.layers.N.mlp`` has no map to a PipelineModule's ``N.mlp``: refused, naming why."""
    from reshard import ReshardError, reshard

    with pytest.raises(ReshardError, match="model.layers"):
        reshard(FIXTURES / "mixtral_autoep_ep2", tmp_path / "out", pp=2)
    assert not (tmp_path / "out").exists()


# -- DeepSpeed loads it --------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("source, pp, dp, ep", [(SOURCE, 1, 2, 2), (SOURCE, 2, 2, 1), (PIPE1, 2, 2, 2)],
                         ids=["pp1", "pp2-ep1", "from-pipe1-pp2"])
def test_deepspeeds_pipeline_job_loads_it_natively_with_the_oracles_values_and_trains(source, pp, dp, ep, tmp_path):
    """DeepSpeed's own pipeline job at the target's topology ``engine.load_checkpoint``s reshard's output (of the
    PP 2 fixture, or of DeepSpeed's one-stage save split as the fixture's stages), digests every stage's parameters
    right after the load (= the oracle), trains a step (a finite loss) and saves."""
    pytest.importorskip("deepspeed")
    from reshard import reshard
    from tests.e2e.digest import differences
    from tests.formats.deepspeed.autoep_pipe_native import run

    out = tmp_path / "out"
    reshard(source, out, pp=pp, dp=dp, ep=ep, layout=SOURCE if source == PIPE1 else None)
    got = run(tmp_path / "job", pp=pp, world=pp * dp, ep=ep, steps=1, load_dir=out, tag="global_step4")
    assert got["digests"]["global_steps"] == 3
    assert differences(json.loads(ORACLE.read_text())["digests"], got["digests"]["digests"]) == []
    report = json.loads((tmp_path / "job" / "report" / "rank_0.json").read_text())
    assert report["global_steps"] == 4 and all(map(math.isfinite, report["losses"])), report["losses"]
    assert (got["native"] / "global_step4" / "mp_rank_00_model_states.pt").is_file()
