"""Tensor x pipeline parallel DeepSpeed checkpoints (the Megatron-DeepSpeed layout):
``tests/fixtures/deepspeed/tp_pipe_tp2_pp2``, a ``PipelineModule`` over
``PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)`` with vocabulary-, column- and
row-parallel layers, saved with Megatron-DeepSpeed's ``universal_checkpoint_info``
(``scripts/_fixture_tp_pipe.py``).

Fast tests (no DeepSpeed job): the file numbering (``mp_rank = stage * TP + TP rank``, layer files
per TP rank); ``reshard convert`` bit-identical to DeepSpeed's ``ds_to_universal``; ``reshard
reshard`` to other TP x PP x DP topologies holding exactly the source's universal tensors (and
weights), a round trip giving back the source objects; refusals, and bad layer files refused
naming file, parameter and rank with nothing left behind.

End to end (one DeepSpeed job of 2 ranks, ``_fixture_tp_pipe.py`` in resume mode): for each target
topology, DeepSpeed's own native checkpoint there is made by loading ``ds_to_universal``'s output
with ``load_universal`` and saving at once; then that checkpoint and reshard's are each loaded
natively and trained two steps. Losses and the layout-free digests of weights, fp32 masters and
Adam moments (``tests/e2e/digest.py``) must be equal, and reshard's files must be DeepSpeed's save
object for object (but ``ds_config``, the job's own).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from reshard import ReshardError
from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from reshard.storage.staging import verify
from tests.support.dsconv import FIXTURES, ds_to_universal

pytest.importorskip("deepspeed")

NAME = "tp_pipe_tp2_pp2"
TAG = "global_step3"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
# (tp, pp, dp) checked end to end: all of 2 ranks, so one job runs them all
E2E_TARGETS = [(1, 2, 1), (1, 1, 2), (2, 1, 1)]
# and, without a job, some that need more ranks
TARGETS = E2E_TARGETS + [(2, 2, 2), (1, 2, 3), (2, 1, 3)]
ROW, TWO, REPLICATED = "1.mlp.dense_4h_to_h.weight", "3.mlp.dense_h_to_4h.weight", "4.input_layernorm.weight"


def _equal(a, b, path: str = "") -> None:
    """Bit-for-bit equality of two loaded objects (tensors by dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}/{i}")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b) and vars(a) == vars(b), path
    else:
        assert a == b, (path, a, b)


def _universal(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {d.name: {s: load(d / f"{s}.pt", mmap=False)["param"] for s in STATES}
            for d in sorted((folder / "zero").iterdir()) if d.is_dir()}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp_pipe")


@pytest.fixture(scope="module")
def ds_ucp(work) -> Path:
    """DeepSpeed's ds_to_universal of the fixture: the tag folder."""
    return ds_to_universal(NAME, work / "ds")


@pytest.fixture(scope="module")
def source_universal(work) -> dict:
    return _universal(convert(FIXTURES / NAME, work / "reshard_ucp").out_dir)


def _resharded(work: Path, tp: int, pp: int, dp: int) -> Path:
    """reshard's output at TP x PP x DP (made once per module): the tag folder."""
    out = work / f"resharded_tp{tp}pp{pp}dp{dp}"
    if not (out / "latest").is_file():
        reshard(FIXTURES / NAME, out, tp=tp, pp=pp, dp=dp)
    return out / TAG


# -- what DeepSpeed writes ------------------------------------------------------------------------


def test_files_are_numbered_stage_major_and_layer_files_per_tp_rank():
    """mp_rank m = stage * TP + TP rank: file m's fp32 partition holds exactly the weights of the
    layer files of TP rank m % TP for the layers of stage m // TP."""
    ck = DeepSpeedCheckpoint.open(FIXTURES / NAME)
    assert (ck.pp, ck.tp, ck.dp, ck.mp, ck.zero_stage) == (2, 2, 1, 4, 1)
    assert sorted(ck.layer_files) == [(layer, t) for layer in range(6) for t in range(2)]
    for m in range(4):
        layers = {int(n.split(".")[0]) for n in ck.param_shapes[m]}
        assert layers == ({0, 1, 2} if m < 2 else {3, 4, 5}), m
        osd = ck.osd(m, 0)
        flat = osd["single_partition_of_fp32_groups"][0]
        for n, frag in osd["param_slice_mappings"][0].items():
            weight = ck.module_tensor(n, m % 2)
            assert torch.equal(flat[frag.start:frag.start + frag.numel], weight.reshape(-1)), (m, n)
    assert ck.model_state(3)["checkpoint_parallel_dimensions"] == {"pp_degree": 2, "tp_degree": 2}
    assert ck.model_state(3)["mp_world_size"] == 4 and ck.model_state(3)["module"] is None
    assert ck.tp_map(ROW).family == "split dim 1" and ck.tp_map(TWO).family == "2 sub-params"
    assert ck.tp_map(REPLICATED).family == "replicated"


# -- phase 1: the universal checkpoint ------------------------------------------------------------


def test_convert_is_bit_identical_to_ds_to_universal(ds_ucp, work):
    ours = convert(FIXTURES / NAME, work / "parity").out_dir
    theirs = ds_ucp
    files = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.pt")) == files
    assert len(files) == 4 + 1 + 29 * 4  # mp_rank copies, optimizer_state, 29 params x 4 files
    for rel in files:
        if rel.startswith("mp_rank"):
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
        else:
            _equal(load(ours / rel), load(theirs / rel), rel)
    full = load(ours / "zero" / ROW / "fp32.pt")
    assert full["cat_dim"] == 1 and list(full["param"].shape) == [24, 40]


def test_without_universal_checkpoint_info_convert_refuses(tmp_path):
    """DeepSpeed's converter with --inject_missing_state concatenates every parameter on dim 0;
    reshard refuses, naming the file."""
    src = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, src)
    for f in (src / TAG).glob("mp_rank_*"):
        state = load(f, mmap=False)
        del state["universal_checkpoint_info"]
        save(state, f)
    theirs = ds_to_universal_at(src / TAG, tmp_path / "ds")
    assert list(load(theirs / "zero" / ROW / "fp32.pt")["param"].shape) == [48, 20]  # wrong, silently
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt: a pipeline checkpoint at TP=2 without universal_checkpoint_info"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ReshardError, match="without universal_checkpoint_info"):
        reshard(src, tmp_path / "out2", tp=1, pp=2)
    assert not (tmp_path / "out2").exists()


def ds_to_universal_at(tag: Path, out: Path) -> Path:
    """ds_to_universal (with --inject_missing_state) of a tag folder outside the fixtures."""
    import subprocess
    import sys

    cmd = [sys.executable, "-W", "ignore", "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
           "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1",
           "--num_merge_workers", "1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


# -- phase 2: other topologies -------------------------------------------------------------------


@pytest.mark.parametrize("tp,pp,dp", TARGETS, ids=[f"tp{t}pp{p}dp{d}" for t, p, d in TARGETS])
def test_resharded_checkpoint_holds_the_source_state(tp, pp, dp, work, source_universal):
    """Every file DeepSpeed writes at the target, no other; the same universal tensors as the
    source's; every layer file's weights are the fp32 masters' shards (fp32 training)."""
    out = _resharded(work, tp, pp, dp)
    verify(out)
    ck = DeepSpeedCheckpoint.open(out)
    assert (ck.tp, ck.pp, ck.dp, ck.zero_stage) == (tp, pp, dp, 1)
    names = {p.name for p in out.iterdir()} - {"reshard-manifest.json"}
    want = {f"layer_{layer:02d}-model_{t:02d}-model_states.pt" for layer in range(6) for t in range(tp)}
    want |= {f"mp_rank_{m:02d}_model_states.pt" for m in range(tp * pp)}
    want |= {f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for m in range(tp * pp) for d in range(dp)}
    assert names == want
    for m in range(tp * pp):
        ms = ck.model_state(m)
        assert ms["checkpoint_parallel_dimensions"] == {"pp_degree": pp, "tp_degree": tp}
        assert ms["mp_world_size"] == tp * pp and ms["dp_world_size"] == dp and ms["module"] is None
        assert ms["universal_checkpoint_info"] == ck.model_state(0)["universal_checkpoint_info"]
    ours = _universal(convert(out, work / f"ucp_tp{tp}pp{pp}dp{dp}").out_dir)
    assert list(ours) == list(source_universal)
    for n, states in source_universal.items():
        for s in STATES:
            assert torch.equal(ours[n][s], states[s]), (n, s)
        m = ck.tp_map(n).map
        for t in range(tp):
            assert torch.equal(ck.module_tensor(n, t), m.extract(states["fp32"], t)), (n, t)
    if tp == 2:  # TP kept: layer files are the source's, byte for byte
        for layer in sorted((FIXTURES / NAME / TAG).glob("layer_*")):
            assert (out / layer.name).read_bytes() == layer.read_bytes()




@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 2, "pp": 3}, r"partition_method"),
    ({"tp": 3, "pp": 2}, r"parameter '1\.mlp\.dense_h_to_4h\.weight' at TP=3: each of two sub-parameters"),
    ({"tp": 1, "pp": 2, "layout": "geometry"}, r"layout= does not apply"),
    ({"tp": 1, "pp": 2, "zero_stage": 2}, r"ZeRO stage 1 only"),
])
def test_targets_that_cannot_be_known_are_refused(kwargs, match, tmp_path):
    with pytest.raises(ReshardError, match=match):
        reshard(FIXTURES / NAME, tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []


def _shape(path: Path, key: str, value) -> None:
    state = load(path, mmap=False)
    state[key] = value
    save(state, path)


def _drop(path: Path, key: str) -> None:
    state = load(path, mmap=False)
    del state[key]
    save(state, path)


BAD_LAYER_FILES = {
    "wrong shape": (lambda tag: _shape(tag / "layer_03-model_01-model_states.pt", "mlp.dense_4h_to_h.weight",
                                       torch.zeros(20, 24)),
                    r"layer_03-model_01-model_states.pt: parameter '3\.mlp\.dense_4h_to_h\.weight' \(TP rank 1, "
                    r"model-parallel rank 3\) has shape \[20, 24\], mp_rank_03_model_states.pt records \[24, 20\]"),
    "missing parameter": (lambda tag: _drop(tag / "layer_00-model_01-model_states.pt", "position_embeddings.weight"),
                          r"layer_00-model_01-model_states.pt: no tensor for parameter '0\.position_embeddings\.weight'"
                          r" \(TP rank 1, model-parallel rank 1\)"),
    "missing file": (lambda tag: (tag / "layer_05-model_00-model_states.pt").unlink(),
                     r"layer 5 has files for TP ranks \[1\].*PP=2, TP=2"),
    "unrecorded layer": (lambda tag: [shutil.copy(tag / f"layer_05-model_{t:02d}-model_states.pt",
                                                  tag / f"layer_06-model_{t:02d}-model_states.pt") for t in range(2)],
                         r"layer_06-model_00-model_states.pt: holds \['final_layernorm.weight', .*\(TP rank 0\), but "
                         r"no model-state file records a parameter of layer 6"),
}


@pytest.mark.parametrize("case", list(BAD_LAYER_FILES))
def test_layer_files_disagreeing_with_the_metadata_are_refused(case, tmp_path):
    damage, match = BAD_LAYER_FILES[case]
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / NAME, src)
    damage(src / TAG)
    with pytest.raises(CheckpointError, match=match):
        reshard(src, tmp_path / "out", tp=1, pp=2)
    assert not (tmp_path / "out").exists()  # nothing that looks finished, nothing at all


# -- end to end: DeepSpeed loads it natively ------------------------------------------------------


@pytest.fixture(scope="module")
def e2e_reports(work, ds_ucp) -> dict:
    """One DeepSpeed job of 2 ranks (``_fixture_tp_pipe.py`` resume mode). Per target: load
    ds_to_universal's output with load_universal and save natively (DeepSpeed's own checkpoint
    there), then load that save natively, then reshard's output natively; two steps after each."""
    from tests.e2e.launch import REPO, launch

    fx = json.loads((FIXTURES / NAME / "fixture.json").read_text())
    loads = []
    for tp, pp, dp in E2E_TARGETS:
        key = f"tp{tp}pp{pp}dp{dp}"
        base = {"model_config": dict(fx["model_config"], tp=tp, stages=pp), "seed": fx["seed"],
                "seq_len": fx["data"]["seq_len"], "micro_batch": fx["data"]["micro_batch"],
                "ds_config": fx["ds_config"], "steps": 2}
        resaved = work / f"resaved_{key}"
        loads += [dict(base, name=f"universal:{key}", load_dir=str(ds_ucp.parent), universal=True,
                       save_dir=str(resaved)),
                  dict(base, name=f"resaved:{key}", load_dir=str(resaved), universal=False, save_dir=None),
                  dict(base, name=f"resharded:{key}", load_dir=str(_resharded(work, tp, pp, dp).parent),
                       universal=False, save_dir=None)]
    job = work / "job"
    report_path = job / "report.json"
    launch(REPO / "scripts" / "_fixture_tp_pipe.py", {"mode": "resume", "loads": loads,
                                                       "report_path": str(report_path)},
           world_size=2, workdir=job, timeout_s=600)
    return json.loads(report_path.read_text())["loads"]


@pytest.mark.e2e
@pytest.mark.slow  # one DeepSpeed launch per world size (~35 s); make test keeps the universal-tensor checks
@pytest.mark.parametrize("tp,pp,dp", E2E_TARGETS, ids=[f"tp{t}pp{p}dp{d}" for t, p, d in E2E_TARGETS])
def test_deepspeed_loads_it_natively_and_trains_as_from_its_own_checkpoint(tp, pp, dp, work, e2e_reports):
    key = f"tp{tp}pp{pp}dp{dp}"
    ours, native, via_ucp = (e2e_reports[f"{kind}:{key}"] for kind in ("resharded", "resaved", "universal"))
    print(f"{NAME} -> TP={tp} x PP={pp} x DP={dp}: reshard {ours['losses']}, DeepSpeed native {native['losses']}, "
          f"universal {via_ucp['losses']}")
    for report in (ours, native, via_ucp):
        assert report["topology"] == {"tp": tp, "pp": pp, "dp": dp}
        assert report["ranks_agree"] and report["replica_mismatches"] == []
        assert len(report["losses"]) == 2 and all(math.isfinite(x) for x in report["losses"])
    assert Path(ours["load_path"]).parent == _resharded(work, tp, pp, dp)  # reshard's files, loaded natively
    assert ours["losses"] == native["losses"]  # exact float equality
    for phase in ("after_load", "after_steps"):
        assert ours["digests"][phase] == native["digests"][phase], phase
    digests = ours["digests"]["after_load"]
    assert len(digests) == 29 and all(set(v) == {"module", *STATES} for v in digests.values())
    # a universal resume differs from a native one by at most an ulp in the second loss
    assert via_ucp["losses"][0] == native["losses"][0]
    assert via_ucp["digests"]["after_load"] == native["digests"]["after_load"]
    # DeepSpeed's own save of what it loaded from ds_to_universal: reshard's files, object for object
    mine = _resharded(work, tp, pp, dp)
    resaved = work / f"resaved_{key}" / TAG
    files = sorted(p.name for p in mine.iterdir() if p.suffix == ".pt")
    assert files == sorted(p.name for p in resaved.iterdir() if p.suffix == ".pt")
    for name in files:
        a, b = load(mine / name, mmap=False), load(resaved / name, mmap=False)
        if "ds_config" in a:  # the loading job's own config (load_universal, no train_batch_size)
            a, b = dict(a, ds_config=None), dict(b, ds_config=None)
        _equal(a, b, name)
