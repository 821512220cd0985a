"""AutoEP experts under ZeRO-3 (issue #12, DeepSpeed#8060): ``mixtral_autoep_ep2_zero3`` is
``mixtral_autoep_ep2``'s recipe trained by DeepSpeed 0.19.8 at ZeRO stage 3 (world 2, EP 2, EDP 1),
in DeepSpeed's partition-native format (``checkpoint_format: "zero3_partitioned"``): one model-state
and one optimizer file per DP rank, no per-expert files, each fused expert parameter a ZeRO-3
partition over its EP rank's EDP group (``ds_zero_partition_groups``).

Checked here: the reader against DeepSpeed's files, ``reshard convert`` against ``ds_to_universal``
(tensor for tensor; the rewritten model states byte for byte), ``reshard reshard`` to other EP x DP
at ZeRO-3 against ``ds_to_universal``'s tensors and back to the source (every object, every tensor
record byte for byte), the refusals, and (e2e) DeepSpeed's own native save after ``load_universal``
at the target against reshard's files, and DeepSpeed resuming them."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.compare import full_state as _full
from tests.support.compare import same as _same
from tests.support.compare import tensor_meta
from tests.support.dsconv import FIXTURES, ds_to_universal, tag_dir

NAME = "mixtral_autoep_ep2_zero3"
EXPERTS = [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def ck() -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint.open(FIXTURES / NAME)


@pytest.fixture(scope="module")
def ucp(tmp_path_factory) -> Path:
    """DeepSpeed's own ``ds_to_universal`` of the fixture (its tag folder)."""
    pytest.importorskip("deepspeed")
    return ds_to_universal(NAME, tmp_path_factory.mktemp("ucp"))


def _members(path: Path) -> dict[str, bytes]:
    """A torch zip file's records, without the archive folder name."""
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    return root


# -- reading -----------------------------------------------------------------------------------------


def test_reads_the_zero3_experts(ck):
    ax = ck.experts
    assert (ck.zero_stage, ck.dp, ax.ep, ax.edp, ax.data_before_expert) == (3, 2, 2, 1, False)
    assert sorted(ax.params) == sorted(EXPERTS) and ax.groups == frozenset({1})
    assert ax.aliases == ()  # the router alias is a 0-element placeholder under ZeRO-3
    assert ck.model_state(0)["ds_autoep_layers"][0]["checkpoint_format"] == "zero3_partitioned"
    assert not list(tag_dir(NAME).glob("layer_*_expert_*"))  # DeepSpeed writes no per-expert files under ZeRO-3
    for d in range(2):  # DeepSpeed's record of the partitions: dense over both ranks, experts over EDP {d}
        groups = ck.osd(0, d)["ds_zero_partition_groups"]
        assert [(g["partition_count"], g["partition_ranks"], g["families"]) for g in groups] == \
            [(2, [0, 1], ["replicated"]), (1, [d], ["autoep_expert"])]
    for name in ck.names:
        m = ck.tp_map(name).map
        m.check()
        ck.composite_map(name, m).check()
    comp = ck.composite_map(EXPERTS[0], ck.tp_map(EXPERTS[0]).map)
    assert comp.ranks == (0, 1)


# -- reshard reshard at ZeRO-3 -------------------------------------------------------------------------


@pytest.mark.parametrize("ep,dp", [(1, 1), (1, 2), (2, 4), (4, 4)])
def test_reshard_to_other_ep_and_dp(ep, dp, ucp, tmp_path):
    """Every state of every parameter at the target equals ds_to_universal's tensor; the target's
    partition records are DeepSpeed's (checked by the reader) and its per-rank layer entries say
    which EP / EDP rank wrote them."""
    out = reshard(FIXTURES / NAME, tmp_path, tp=1, dp=dp, ep=ep).out_dir
    new = DeepSpeedCheckpoint.open(out)
    ax = new.experts
    assert (new.zero_stage, ax.ep, ax.edp, new.dp) == (3, ep, dp // ep, dp)
    local = 4 // ep
    assert ax.params[EXPERTS[0]].experts_by_rank == tuple(tuple(range(e * local, (e + 1) * local)) for e in range(ep))
    for name in new.names:
        for state in STATES:
            f = load(ucp / "zero" / name / f"{state}.pt")
            theirs = f["param"] if isinstance(f, dict) else f.view(new.tp_map(name).map.logical_shape)
            assert torch.equal(_full(new, name, state), theirs), (ep, dp, name, state)
    for d in range(dp):
        entry = load(out / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt")["ds_autoep_layers"][0]
        e = d % ep
        assert (entry["ep_rank"], entry["expert_data_parallel_rank"], entry["global_expert_start"]) == \
            (e, d // ep, e * local)
        flats = load(out / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]["fp32_flat_groups"]
        assert flats[1].ds_id == "6_18"
    assert not list(out.glob("layer_*"))


# -- ZeRO-3 -> ZeRO-1/2 ----------------------------------------------------------------------------------


def _layout(obj):
    """``obj`` with each tensor as its metadata (dtype, shape, strides, storage size and offset,
    attributes), every other value kept: a file's structure, without its numbers."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tensor_meta(obj))
    if isinstance(obj, dict):
        return (type(obj).__name__, [(k, _layout(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_layout(v) for v in obj])
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__name__, _layout(vars(obj)))
    return obj


@pytest.mark.parametrize("ep,dp,stage", [(2, 2, 1), (1, 2, 2), (2, 4, 1)])
def test_zero3_experts_written_at_zero12(ck, ep, dp, stage, tmp_path):
    """AutoEP ZeRO-3 -> ZeRO-1/2: every state of every parameter is the source's (read back through
    the ZeRO-1/2 reader, which checks the flat layout against ``param_shapes``); the weights the
    ZeRO-3 source keeps only as fp32 masters -- the module's (a router alias its router's) and each
    per-expert file's -- are those masters (fp32 training)."""
    out = reshard(FIXTURES / NAME, tmp_path, tp=1, dp=dp, ep=ep, zero_stage=stage).out_dir
    new = DeepSpeedCheckpoint.open(out)
    assert (new.zero_stage, new.experts.ep, new.experts.edp, new.dp) == (stage, ep, dp // ep, dp)
    for name in ck.names:
        for state in STATES:
            assert torch.equal(_full(new, name, state), _full(ck, name, state)), (name, state)
    module = load(out / "mp_rank_00_model_states.pt")["module"]
    assert sorted(module) == sorted(ck.model_state(0)["module"])
    for key, value in module.items():
        router = key.replace(".mlp.gate.gate.", ".mlp.router.gate.")
        assert torch.equal(value, _full(ck, router, "fp32")), key
    for name in EXPERTS:
        master, layer = _full(ck, name, "fp32"), name.split(".")[2]
        for x in range(4):
            got = load(out / f"layer_{layer}_expert_{x}_mp_rank_00_model_states.pt")
            assert list(got) == [f"{name.rsplit('.', 1)[0]}.{w}.{x}" for w in ("w1", "w2", "w3")]
            assert torch.equal(got[f"{name}.{x}"], master[x]), (name, x)


def test_zero3_experts_at_zero1_are_laid_out_as_deepspeeds_own_zero1_save(tmp_path):
    """``mixtral_autoep_ep2`` is the same recipe trained at ZeRO-1 (EP 2, world 2): every file reshard
    writes from the ZeRO-3 checkpoint at that topology has DeepSpeed's ZeRO-1 save's structure --
    keys in order, every non-tensor value (configuration, placement entries, parameter groups,
    step, loss scaler), each tensor's dtype, shape, strides and storage -- only the numbers
    differ (ZeRO-3 and ZeRO-1 training round differently)."""
    out = reshard(FIXTURES / NAME, tmp_path, tp=1, dp=2, ep=2, zero_stage=1).out_dir
    native = tag_dir("mixtral_autoep_ep2")
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in native.glob("*.pt"))
    for p in native.glob("*.pt"):
        assert _layout(load(out / p.name)) == _layout(load(p)), p.name


def _edit(root: Path, name: str, edit) -> None:
    path = root / "global_step3" / name
    sd = load(path, mmap=False)
    edit(sd)
    save(sd, path)


def test_unknown_zero3_expert_format_is_refused(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "zero_pp_rank_0_mp_rank_00_model_states.pt",
          lambda sd: sd["ds_autoep_layers"][1].update(checkpoint_format_version=2))
    with pytest.raises(CheckpointError, match=r"ds_autoep_layers\[1\]: a ZeRO-3 AutoEP layer entry has "
                                              r"checkpoint_format \('zero3_partitioned', 2\)"):
        convert(root, tmp_path / "out")


def test_partition_groups_contradicting_the_layout_are_refused(tmp_path):
    """An expert sub-group recorded as cut over both DP ranks (as a dense one) is not misread."""
    root = _copy(tmp_path)
    _edit(root, "zero_pp_rank_1_mp_rank_00_optim_states.pt",
          lambda sd: sd["optimizer_state_dict"]["ds_zero_partition_groups"][1].update(
              partition_count=2, partition_ranks=[0, 1]))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                                              r"ds_zero_partition_groups\[1\] is .* should have"):
        reshard(root, tmp_path / "out", tp=1, dp=1, ep=1)


def test_missing_partition_groups_are_refused(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "zero_pp_rank_0_mp_rank_00_optim_states.pt",
          lambda sd: sd["optimizer_state_dict"].pop("ds_zero_partition_groups"))
    with pytest.raises(CheckpointError, match=r"ds_zero_partition_groups should list the 2 sub-groups"):
        convert(root, tmp_path / "out")


def test_a_truncated_expert_partition_is_refused(tmp_path):
    root = _copy(tmp_path)

    def cut(sd):
        osd = sd["optimizer_state_dict"]
        osd["fp32_flat_groups"][1] = osd["fp32_flat_groups"][1][:10000].clone()

    _edit(root, "zero_pp_rank_1_mp_rank_00_optim_states.pt", cut)
    # checked against the layout before any output exists (layout.check_sub, zero3.check_partitions)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: dp rank 1: parameter "
                                              r"'model.layers.1.mlp.experts.w1' \(fp32, elements \[9216, 12288\) of "
                                              r"sub-group 1\) lies past the end of the partition"):
        convert(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- DeepSpeed itself (e2e) ----------------------------------------------------------------------------


def _diff_files(ours: Path, theirs: Path, ep: int) -> None:
    """Our files equal DeepSpeed's own save at the target, object for object, but ``ds_config``
    (the resuming job's there) and the expert group's ``name``: DeepSpeed's ZeRO-3 universal loader
    copies ``param_groups[0]``'s entries into every group (so it saves ``'dense-params'`` there),
    reshard names it as DeepSpeed's engine does at the target EP, ``ep_size_<ep>``
    (docs/deepspeed-checkpoints.md §10)."""
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in theirs.glob("*.pt"):
        a, b = load(ours / p.name), load(p)
        for obj in (a, b):
            obj.pop("ds_config", None)
        if "optim" in p.name:
            groups = [obj["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"] for obj in (a, b)]
            assert (groups[0][1].pop("name"), groups[1][1].pop("name")) == (f"ep_size_{ep}", "dense-params")
            assert [t.ds_id for t in a["optimizer_state_dict"]["fp32_flat_groups"]] == \
                [t.ds_id for t in b["optimizer_state_dict"]["fp32_flat_groups"]]
        _same(a, b, p.name)


@pytest.mark.e2e
# both in the slow tier (~25 s each); make test keeps the file-for-file checks of the same routes
@pytest.mark.parametrize("world,ep", [pytest.param(2, 1, marks=pytest.mark.slow),
                                      pytest.param(1, 1, marks=pytest.mark.slow)])
def test_deepspeed_resumes_the_resharded_experts_as_its_own_checkpoint(world, ep, ucp, tmp_path):
    """One real job at ``world`` ranks: DeepSpeed resumes ds_to_universal's output at the target EP
    (ZeRO-3) and saves it natively, then resumes reshard's output natively: the files are DeepSpeed's
    save (``_diff_files``), the states after the load and the first loss are the same.

    The later steps are not compared with DeepSpeed's: its ZeRO-3 universal loader gives every
    sub-group the *same* ``step`` tensor (docs/deepspeed-checkpoints.md §10), and with two sub-groups
    (dense, experts) torch's AdamW then counts each optimizer step twice (3 -> 7 after two steps,
    also when DeepSpeed resumes its own native save of that state, which keeps one shared step
    storage). reshard's files keep one ``step`` per sub-group, as training does (3 -> 5). Should
    DeepSpeed count right, the losses and digests after the steps must agree as well."""
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    (ucp.parent / "latest_universal").write_text(ucp.name)
    spec = model_spec_from_fixture(FIXTURES / NAME)
    spec["ds_config"]["expert_parallel"]["autoep_size"] = ep
    ours = reshard(FIXTURES / NAME, tmp_path / f"ours_{world}", tp=1, dp=world, ep=ep).out_dir
    native = tmp_path / f"native_{world}"
    loads = [resume_load("deepspeed", ucp.parent, model_spec=spec, tp=1, dp=world, universal=True, zero_stage=3,
                         save_dir=native),
             resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=world, universal=False, zero_stage=3)]
    reports = resume_many(loads, world_size=world, workdir=tmp_path / f"job_{world}")
    theirs, mine = reports["deepspeed"], reports["reshard"]
    where = f"EP {ep} x world {world}"
    _diff_files(ours, native / ours.name, ep)
    assert mine["global_steps_after_load"] == theirs["global_steps_after_load"] == 3
    assert mine["optimizer_step_after_load"] == theirs["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"] and theirs["ranks_agree"]
    assert mine["digests"]["after_load"] == theirs["digests"]["after_load"], where
    assert mine["losses"][0] == theirs["losses"][0], where
    assert mine["optimizer_step_after_steps"] == [5.0], where
    if theirs["optimizer_step_after_steps"] == [5.0]:  # DeepSpeed no longer shares the step tensor
        assert mine["digests"] == theirs["digests"] and mine["losses"] == theirs["losses"], where
    else:
        assert theirs["optimizer_step_after_steps"] == [7.0], where
    shared = load(native / ours.name / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    state = shared["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    assert state[0]["step"].untyped_storage().data_ptr() == state[1]["step"].untyped_storage().data_ptr()


@pytest.mark.e2e
@pytest.mark.slow  # make test-all; make test keeps the file-for-file checks of the same route
def test_deepspeed_loads_the_zero3_experts_written_at_zero1(tmp_path):
    """One real job at world 2, EP 2: DeepSpeed resumes the ZeRO-3 source natively at ZeRO-3, then
    reshard's ZeRO-1 files natively at ZeRO-1. After the load every parameter's master, moments and
    module weight are the same (layout-free digests), Adam's step is 3 in both, and both train the
    same two losses. DeepSpeed's own native save of what it loaded from reshard's files is those
    files (``diff_files``). The digests after the steps are not compared: ZeRO-3 and ZeRO-1 reduce
    gradients in another order. (DeepSpeed cannot make this move itself: its universal of a ZeRO-3
    AutoEP checkpoint has no ``mp_rank_00_model_states.pt`` for a ZeRO-1 engine to load.)"""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many
    from tests.support.compare import diff_files

    spec = model_spec_from_fixture(FIXTURES / NAME)
    ours = reshard(FIXTURES / NAME, tmp_path / "ours", tp=1, dp=2, ep=2, zero_stage=1).out_dir
    native = tmp_path / "native"
    loads = [resume_load("deepspeed", FIXTURES / NAME, model_spec=spec, tp=1, dp=2, universal=False, zero_stage=3),
             resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=2, universal=False, zero_stage=1,
                         save_dir=native)]
    reports = resume_many(loads, world_size=2, workdir=tmp_path / "job")
    theirs, mine = reports["deepspeed"], reports["reshard"]
    diff_files(ours, native / ours.name)
    assert mine["global_steps_after_load"] == theirs["global_steps_after_load"] == 3
    assert mine["optimizer_step_after_load"] == theirs["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"] and theirs["ranks_agree"]
    assert mine["layouts"][EXPERTS[0]] == "autoep"
    assert mine["digests"]["after_load"] == theirs["digests"]["after_load"]
    assert mine["losses"] == theirs["losses"]
    assert mine["optimizer_step_after_steps"] == [5.0]


def test_a_module_entry_the_zero3_source_holds_no_value_of_is_refused_at_zero1(tmp_path):
    """A ZeRO-3 module entry that is neither a parameter, a buffer nor an AutoEP router alias has no
    value in the checkpoint (a placeholder): a ZeRO-1/2 target, whose module holds weights, refuses
    it, naming the file and the entry, before anything exists."""
    root = _copy(tmp_path)
    for d in (0, 1):
        _edit(root, f"zero_pp_rank_{d}_mp_rank_00_model_states.pt",
              lambda sd: sd["module"].update({"model.layers.0.mlp.extra.weight": torch.empty(0)}))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_model_states.pt: module entry "
                                              r"'model.layers.0.mlp.extra.weight' is neither a parameter nor an "
                                              r"AutoEP router alias"):
        reshard(root, tmp_path / "out", tp=1, dp=2, ep=2, zero_stage=1)
    assert not (tmp_path / "out").exists()
