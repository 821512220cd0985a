"""Classic ``deepspeed.moe.layer.MoE`` at TP 2 (issue #32 item 5): ``moe_ep2_tp2``, saved by DeepSpeed 0.19.8
at world 4 (TP 2 x DP 2, EP 2, ZeRO-1) through a Megatron-style ``mpu`` (``scripts/_fixture_moe.py``), its
dense MLP tensor-parallel, ``enable_expert_tensor_parallelism=False``; and ``moe_ep2_tp2_etp``, the same job
with ``enable_expert_tensor_parallelism=True`` (the experts column/row-parallel).

What DeepSpeed writes there (``groups._create_expert_and_data_parallel`` ignores the mpu's TP): EP groups of
consecutive *global* ranks ``[0, 1], [2, 3]`` (so EP rank = TP rank here), EDP groups ``[0, 2], [1, 3]``;
EP rank ``e``'s experts saved once, by its first EDP member, as ``layer_L_expert_E_mp_rank_0<its TP rank>``
(experts 0, 1 under ``mp_rank_00``, experts 2, 3 under ``mp_rank_01``): no expert is split or replicated
over TP. The oracle (``oracle.json``) is the saving job's own digests of every whole master, moment and
module weight (TP shards joined, experts under their global index)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from reshard.errors import CheckpointError, ReshardError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert
from reshard.storage.safe_load import load
from tests.e2e.digest import differences, digest
from tests.support.dsconv import FIXTURES, ds_to_universal

NAME = "moe_ep2_tp2"
ETP = "moe_ep2_tp2_etp"
BOTH = pytest.mark.parametrize("fixture", [NAME, ETP])
STATES = ("fp32", "exp_avg", "exp_avg_sq")
EXPERT = "blocks.{L}.moe.deepspeed_moe.experts.deepspeed_experts.{x}.{s}"


def _oracle(kinds: tuple[str, ...], fixture: str = NAME) -> dict:
    digests = json.loads((FIXTURES / fixture / "oracle.json").read_text())["digests"]
    return {n: {k: d[k] for k in kinds} for n, d in digests.items()}


def _digests(tensors: dict) -> dict:
    return {n: {k: digest(n, t) for k, t in states.items()} for n, states in tensors.items()}


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> Path:
    return convert(FIXTURES / NAME, tmp_path_factory.mktemp("u") / "out", fmt="universal").out_dir


@pytest.fixture(scope="module")
def universal_etp(tmp_path_factory) -> Path:
    return convert(FIXTURES / ETP, tmp_path_factory.mktemp("u") / "out", fmt="universal").out_dir


def _read(out: Path, name: str, state: str) -> torch.Tensor:
    obj = load(out / "zero" / name / f"{state}.pt", mmap=False)
    return obj["param"] if isinstance(obj, dict) else obj


def test_reads_the_layout_deepspeed_writes():
    ck = DeepSpeedCheckpoint.open(FIXTURES / NAME)
    ax = ck.moe
    assert (ck.tp, ck.dp, ck.pp, ax.ep, ax.edp) == (2, 2, 1, 2, 2)
    assert [ax.members(e) for e in range(2)] == [[0, 2], [1, 3]]  # global ranks dp * 2 + tp, as the job's groups
    groups = json.loads((FIXTURES / NAME / "oracle.json").read_text())["groups"]
    assert [g["edp_group"] for g in groups] == [ax.members(g["rank"] % 2) for g in groups]
    assert {(L, x): f.name for (L, x), f in ax.files.items() if L == 0} == {
        (0, x): f"layer_0_expert_{x}_mp_rank_0{x // 2}_model_states.pt" for x in range(4)}
    assert ck.tp_map("blocks.0.mlp.fc_out_weight").family == "split dim 1"
    assert ck.tp_map("head.weight").family == "replicated"


def test_reads_the_expert_tp_layout_deepspeed_writes():
    """Expert TP: EP groups inside each TP rank's DP group ({0, 2}, {1, 3}), EDP groups of one rank; an expert
    parameter's map is its TP split (fc_in by rows, fc_out by columns) on holders ep_rank * 2 + t."""
    ck = DeepSpeedCheckpoint.open(FIXTURES / ETP)
    ax = ck.moe
    assert (ck.tp, ck.dp, ax.ep, ax.etp, ax.edp) == (2, 2, 2, 2, 1)
    groups = json.loads((FIXTURES / ETP / "oracle.json").read_text())["groups"]
    assert [(g["ep_group"], g["edp_group"]) for g in groups] == [([0, 2], [0]), ([1, 3], [1]), ([0, 2], [2]),
                                                                  ([1, 3], [3])]
    assert [ax.members(g["ep_rank"] * 2 + g["tp_rank"]) for g in groups] == [g["edp_group"] for g in groups]
    m = ck.tp_map(EXPERT.format(L=1, x=3, s="fc_out_weight")).map
    assert (m.valid_shape, sorted(m.ranks), m.shard(2).shape) == ((16, 24), [2, 3], (16, 12))


def test_universal_holds_the_jobs_own_masters_and_moments(universal):
    oracle = _oracle(STATES)
    got = {n: {s: _read(universal, n, s) for s in STATES} for n in oracle}
    assert differences(oracle, _digests(got)) == []
    assert {d.name for d in (universal / "zero").iterdir() if d.is_dir()} == set(oracle)


def test_universal_of_the_expert_tp_fixture_holds_the_jobs_own_state(universal_etp):
    oracle = _oracle(STATES, ETP)
    got = {n: {s: _read(universal_etp, n, s) for s in STATES} for n in oracle}
    assert differences(oracle, _digests(got)) == []
    assert {d.name for d in (universal_etp / "zero").iterdir() if d.is_dir()} == set(oracle)


@BOTH
def test_safetensors_and_dcp_hold_the_jobs_own_weights_and_moments(fixture, tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = convert(FIXTURES / fixture, tmp_path / "st", fmt="safetensors").out_dir
    weights = load_file(out / "model.safetensors")
    assert differences(_oracle(("module",), fixture), _digests({n: {"module": t} for n, t in weights.items()})) == []
    out = convert(FIXTURES / fixture, tmp_path / "dcp", fmt="dcp").out_dir
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    state = sd["optim"]["state"]
    got = {n: {"module": w, **{m: state[n][m] for m in STATES[1:]}} for n, w in sd["model"].items()}
    assert differences(_oracle(("module", "exp_avg", "exp_avg_sq"), fixture), _digests(got)) == []


@pytest.mark.slow  # ~11 s (DeepSpeed's converter in a subprocess); the oracle tests above prove our side
def test_ds_to_universal_agrees_on_the_dense_part_and_merges_the_experts_wrongly(universal, tmp_path):
    """DeepSpeed's own converter accepts the checkpoint: every dense parameter equals ours (and the oracle);
    but it knows only the local expert names, so its ``experts.<j>`` folders hold TP rank 0's local expert j
    and TP rank 1's (global experts j and 2 + j) concatenated on dim 0 as if TP shards, and global experts
    2, 3 have no folder."""
    pytest.importorskip("deepspeed")
    theirs = ds_to_universal(NAME, tmp_path) / "zero"
    ck = DeepSpeedCheckpoint.open(FIXTURES / NAME)
    dense = [n for n in ck.names if ck.moe_param(n) is None]
    for n in dense:
        for s in STATES:
            assert torch.equal(_read(universal, n, s), _read(theirs.parent, n, s)), (n, s)
    for s in STATES:
        got = _read(theirs.parent, EXPERT.format(L=1, x=0, s="fc1.weight"), s)
        ours = [_read(universal, EXPERT.format(L=1, x=x, s="fc1.weight"), s) for x in (0, 2)]
        assert torch.equal(got, torch.cat(ours))
    assert not (theirs / EXPERT.format(L=0, x=2, s="fc1.weight")).exists()


@pytest.mark.slow  # ~10 s (DeepSpeed's converter in a subprocess)
def test_ds_to_universal_fails_on_the_expert_tp_fixture(tmp_path):
    """Its local expert names of both EP ranks are merged as ZeRO shards of one parameter, whose shape then
    does not fit (which parameter fails first depends on the order of its work list, so the shapes are not
    pinned); ours equals the saving job's oracle (above)."""
    pytest.importorskip("deepspeed")
    with pytest.raises(RuntimeError, match=r"(?s)_merge_zero_shards.*shape '\[[\d, ]+\]' is invalid for input of "
                                           r"size \d+"):
        ds_to_universal(ETP, tmp_path)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    return root


def test_a_missing_expert_file_of_tp_rank_1_is_named(tmp_path):
    root = _copy(tmp_path)
    (root / "global_step3" / "layer_1_expert_3_mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"layer_1_expert_3_mp_rank_01_model_states.pt is missing"):
        _ = DeepSpeedCheckpoint.open(root).moe


def test_an_expert_file_under_the_other_tp_rank_is_refused(tmp_path):
    """Expert 2 is EP rank 1's, saved by TP rank 1 only: a copy under TP rank 0 (even a differing one) is a
    file DeepSpeed does not write for this layout, refused naming it, never one of the two picked."""
    root = _copy(tmp_path)
    tag = root / "global_step3"
    sd = torch.load(tag / "layer_0_expert_2_mp_rank_01_model_states.pt", weights_only=True)
    torch.save({k: v + 1 for k, v in sd.items()}, tag / "layer_0_expert_2_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"layer_0_expert_2_mp_rank_00_model_states.pt: a per-expert file "
                                              r"DeepSpeed does not write"):
        _ = DeepSpeedCheckpoint.open(root).moe


def test_a_missing_expert_shard_of_tp_rank_1_is_named(tmp_path):
    root = tmp_path / ETP
    shutil.copytree(FIXTURES / ETP, root)
    (root / "global_step3" / "layer_0_expert_1_mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"layer_0_expert_1_mp_rank_01_model_states.pt is missing \(TP rank 1's "
                                              r"shard of expert 1"):
        _ = DeepSpeedCheckpoint.open(root).moe


def test_an_expert_shard_unlike_param_shapes_is_named(tmp_path):
    """TP rank 1's shard of expert 2 saved whole (as an unsplit expert would be): refused naming the file."""
    root = tmp_path / ETP
    shutil.copytree(FIXTURES / ETP, root)
    f = root / "global_step3" / "layer_1_expert_2_mp_rank_01_model_states.pt"
    sd = torch.load(f, weights_only=True)
    key = EXPERT.format(L=1, x=2, s="fc_out_weight")
    sd[key] = torch.cat([sd[key], sd[key]], dim=1)
    torch.save(sd, f)
    with pytest.raises(CheckpointError, match=r"layer_1_expert_2_mp_rank_01_model_states.pt: .*fc_out_weight' has "
                                              r"shape \[16, 24\], TP rank 1's param_shapes give .* \[16, 12\]"):
        _ = DeepSpeedCheckpoint.open(root).moe


def test_a_wrong_ep_size_record_is_named(tmp_path):
    root = _copy(tmp_path)
    path = root / "global_step3" / "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][1]["name"] = "ep_size_4"
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_01_optim_states.pt: optimizer group 1 is "
                                              r"named 'ep_size_4'.*EP size 2"):
        _ = DeepSpeedCheckpoint.open(root).moe


def test_num_experts_differing_between_tp_ranks_is_named(tmp_path):
    root = _copy(tmp_path)
    path = root / "global_step3" / "mp_rank_01_model_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["num_experts"] = [4, 8]
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_01_model_states.pt: num_experts \[4, 8\] differs"):
        _ = DeepSpeedCheckpoint.open(root).moe


def _same(a, b, where: str) -> None:
    """``a`` and ``b`` alike object for object: types, key order, values, tensors' dtype, shape and bits
    (a loss scaler by its attributes: it defines no equality)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__"):
        _same(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)


@BOTH
def test_written_at_its_own_topology_as_deepspeed_saves_it(fixture, tmp_path):
    """``--tp 2 --ep 2`` (world 4): DeepSpeed's own files, object for object -- per-TP model states (dense TP
    shards, local expert names in ``param_shapes``), the per-expert files under the names and saver TP ranks
    DeepSpeed uses in each mode, every rank's optimizer file with its ``param_slice_mappings`` -- and nothing
    else but the manifest. ds_config included: the TP degree is the mpu's, so no AutoTP section is added."""
    from reshard.jobs.convert import reshard

    out = reshard(FIXTURES / fixture, tmp_path / "out", tp=2, ep=2, dp=2).out_dir
    src = FIXTURES / fixture / "global_step3"
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in src.iterdir()] + ["reshard-manifest.json"])
    for p in sorted(src.iterdir()):
        _same(torch.load(p, weights_only=False), torch.load(out / p.name, weights_only=False), p.name)


def _universal_equals_oracle(ckpt: Path, tmp_path: Path, fixture: str) -> None:
    u = convert(ckpt, tmp_path / "u", fmt="universal").out_dir
    oracle = _oracle(STATES, fixture)
    assert differences(oracle, _digests({n: {s: _read(u, n, s) for s in STATES} for n in oracle})) == []


def test_expert_tp_fixture_written_at_tp1_holds_the_jobs_own_state(tmp_path):
    """TP 2 -> TP 1 (``--tp 1 --ep 2``, world 2), experts split over TP at the source: one model state with
    the dense weights whole, every expert whole in ``layer_L_expert_X_mp_rank_00``, the experts' optimizer
    group over EDP groups of one rank; read back, every master and moment is the saving job's (oracle)."""
    from reshard.jobs.convert import reshard

    out = reshard(FIXTURES / ETP, tmp_path / "out", tp=1, ep=2, dp=2).out_dir
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(
        [f"layer_{L}_expert_{x}_mp_rank_00_model_states.pt" for L in range(2) for x in range(4)]
        + ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
    ms = torch.load(out / "mp_rank_00_model_states.pt", weights_only=False)
    assert (ms["mp_world_size"], ms["dp_world_size"], ms["checkpoint_parallel_dimensions"]["tp_degree"]) == (1, 2, 1)
    assert "tensor_parallel" not in ms["ds_config"]
    assert ms["module"]["blocks.0.mlp.fc_in_weight"].shape == (24, 16)
    assert ms["param_shapes"][1]["blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.1.fc_out_weight"] == (16, 24)
    expert = torch.load(out / "layer_1_expert_3_mp_rank_00_model_states.pt", weights_only=False)
    assert {k: tuple(v.shape) for k, v in expert.items()} == {
        EXPERT.format(L=1, x=3, s="fc_in_weight"): (24, 16), EXPERT.format(L=1, x=3, s="fc_in_bias"): (24,),
        EXPERT.format(L=1, x=3, s="fc_out_weight"): (16, 24)}
    _universal_equals_oracle(out.parent, tmp_path, ETP)


def test_tp2_to_tp1_and_back_at_a_layouts_tp_gives_deepspeeds_own_files(tmp_path):
    """TP 2 -> TP 1 -> TP 2: the TP-1 output (a TP-1 classic MoE source) written at TP 2 with the fixture as
    ``--layout`` (its dense TP maps and ``universal_checkpoint_info``) is the fixture's own files again, object for
    object; without a layout TP 2 stays refused, as does an expert-TP layout (a TP-1 source's experts are whole)."""
    from reshard.jobs.convert import reshard

    tp1 = reshard(FIXTURES / NAME, tmp_path / "tp1", tp=1, ep=2, dp=2).out_dir
    out = reshard(tp1.parent, tmp_path / "tp2", tp=2, ep=2, dp=2, layout=FIXTURES / NAME).out_dir
    src = FIXTURES / NAME / "global_step3"
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in src.iterdir()] + ["reshard-manifest.json"])
    for p in sorted(src.iterdir()):
        _same(torch.load(p, weights_only=False), torch.load(out / p.name, weights_only=False), p.name)
    with pytest.raises(ReshardError, match=r"classic MoE checkpoints are resharded at TP = PP = 1 only"):
        reshard(tp1.parent, tmp_path / "no_layout", tp=2, ep=2, dp=2)
    with pytest.raises(ReshardError, match=r"its experts are split over TP .*written unsplit only"):
        reshard(tp1.parent, tmp_path / "etp_layout", tp=2, ep=2, dp=2, layout=FIXTURES / ETP)
    assert not (tmp_path / "no_layout").exists() and not (tmp_path / "etp_layout").exists()


@pytest.mark.slow  # ~6 s: the same at TP 1 for the unsplit-expert fixture, and at TP 2 EP 4
@pytest.mark.parametrize("tp, ep, dp", [(1, 2, 2), (1, 4, 4), (2, 4, 2)])
def test_unsplit_expert_fixture_at_other_topologies_holds_the_jobs_own_state(tp, ep, dp, tmp_path):
    from reshard.jobs.convert import reshard

    out = reshard(FIXTURES / NAME, tmp_path / "out", tp=tp, ep=ep, dp=dp).out_dir
    if (tp, ep) == (2, 4):  # EP groups [0..3]: EP rank g's experts saved by global rank g, named by its TP rank
        assert sorted(p.name for p in out.glob("layer_0_*")) == [
            f"layer_0_expert_{x}_mp_rank_0{x % 2}_model_states.pt" for x in range(4)]
    _universal_equals_oracle(out.parent, tmp_path, NAME)


@BOTH
@pytest.mark.parametrize("tp, pp, why", [(4, 1, r"at its own TP=2 or at TP=1 \(PP=1\) only \(asked tp=4"),
                                         (2, 2, r"at its own TP=2 or at TP=1 \(PP=1\) only \(asked tp=2, pp=2")])
def test_another_tp_or_pp_is_refused_before_any_output(fixture, tp, pp, why, tmp_path):
    from reshard.jobs.convert import reshard

    with pytest.raises(ReshardError, match=why):
        reshard(FIXTURES / fixture, tmp_path / "out", tp=tp, pp=pp, ep=2, dp=2)
    assert not (tmp_path / "out").exists()


def test_an_ep_size_the_expert_tp_groups_cannot_take_is_refused_before_any_output(tmp_path):
    from reshard.jobs.convert import reshard

    with pytest.raises(ReshardError, match=r"ep=4 must divide the DP size dp=2 with the experts split over TP"):
        reshard(FIXTURES / ETP, tmp_path / "out", tp=2, ep=4, dp=2)
    assert not (tmp_path / "out").exists()


LOSS_RTOL = 1e-5  # TP 1 sums the dense MLP's products in one matmul where TP 2 all-reduces two halves


@pytest.mark.e2e
@pytest.mark.slow  # two DeepSpeed jobs per fixture (world 4 and world 2, gloo): ~1-2 min each on 2 cores
@BOTH
def test_deepspeed_resumes_the_written_files_natively_at_tp2_and_tp1(fixture, tmp_path):
    """DeepSpeed's own job (``scripts/_fixture_moe.py``: the fixture's model, its mpu) loads reshard's output with
    its ordinary ``load_checkpoint`` at TP 2 x DP 2 (the source's topology) and at TP 1 x DP 2 (the same model
    through an mpu of TP 1): right after the load every whole master, moment and module weight equals the saving
    job's oracle bit for bit, then it trains 2 steps; each DP rank's losses at TP 1 equal TP 2's within
    ``LOSS_RTOL`` (the dense MLP's TP all-reduce sums in another order)."""
    pytest.importorskip("deepspeed")
    from reshard.jobs.convert import reshard
    from tests.e2e.launch import launch

    fx = json.loads((FIXTURES / fixture / "fixture.json").read_text())
    script = Path(__file__).resolve().parents[3] / "scripts" / "_fixture_moe.py"
    oracle = json.loads((FIXTURES / fixture / "oracle.json").read_text())["digests"]
    reports = {}
    for tp in (2, 1):
        out = reshard(FIXTURES / fixture, tmp_path / f"tp{tp}", tp=tp, ep=2, dp=2).out_dir
        spec = {"model_config": {**fx["model_config"], "tp": tp, "mpu": True}, "ds_config": fx["ds_config"],
                "seed": fx["seed"], "seq_len": fx["data"]["seq_len"], "micro_batch": fx["data"]["micro_batch"],
                "steps": 2, "load_dir": str(out.parent), "save_dir": None, "tag": None,
                "report_dir": str(tmp_path / f"report{tp}")}
        launch(script, spec, world_size=2 * tp, workdir=tmp_path / f"job{tp}", timeout_s=400)
        loaded = json.loads((tmp_path / f"report{tp}" / "loaded.json").read_text())
        assert loaded["global_steps"] == 3
        assert differences(oracle, loaded["digests"]) == [], tp
        reports[tp] = {r: json.loads((tmp_path / f"report{tp}" / f"rank_{r}.json").read_text()) for r in range(2 * tp)}
    for r, rep in reports[1].items():
        want = reports[2][2 * r]["losses"]  # TP 2's rank of DP rank r (TP rank 0)
        assert rep["losses"] == pytest.approx(want, rel=LOSS_RTOL, abs=0), (r, rep["losses"], want)
