"""AutoEP experts whose ZeRO partitions are split over an expert-data-parallel (EDP) group of more
than one rank (issue #12): ``mixtral_autoep_ep2_dp4`` is ``mixtral_autoep_ep2``'s recipe trained by
DeepSpeed at world 4 with EP=2, so EDP=2 and each EP rank's expert group is cut over two DP ranks
(DeepSpeed's default order: EP rank ``d % 2``, EDP groups {0, 2} and {1, 3}).

Checked here: the reader's EDP groups and composite maps against DeepSpeed's own files, ``reshard
convert`` against ``ds_to_universal``, ``reshard reshard`` to other (EP, DP) and back, the EP 2 x DP
2 output against the structure of the committed EP 2 x DP 2 fixture and against DeepSpeed's own
native save there (e2e), and what ``reshard inspect`` says of the expert groups."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from reshard.cli import main as cli
from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.formats.deepspeed.reader import DeepSpeedReader
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.compare import full_state as _full
from tests.support.compare import same as _same
from tests.support.dsconv import FIXTURES, ds_to_universal, tag_dir

NAME = "mixtral_autoep_ep2_dp4"
EP2_DP2 = "mixtral_autoep_ep2"  # the same recipe trained at world 2 (EDP = 1)
EXPERTS = [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]
STATES = ("fp32", "exp_avg", "exp_avg_sq")
WORLD, EP = 4, 2


@pytest.fixture(scope="module")
def ck() -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint.open(FIXTURES / NAME)


@pytest.fixture(scope="module")
def ucp(tmp_path_factory) -> Path:
    """DeepSpeed's own ``ds_to_universal`` of the fixture (its tag folder)."""
    pytest.importorskip("deepspeed")
    return ds_to_universal(NAME, tmp_path_factory.mktemp("ucp"))


def _deepspeed_edp_groups(world: int, ep: int, data_before_expert: bool = False) -> list[list[int]]:
    """DeepSpeed 0.19.8's expert-data-parallel groups (``utils/groups.py``,
    ``_create_expert_and_data_parallel``, mp_size 1, pp 1), EP rank ``i``'s group at index ``i``."""
    edp = world // ep
    if data_before_expert:
        return [list(range(i * edp, (i + 1) * edp)) for i in range(ep)]
    return [list(range(i, world, ep)) for i in range(ep)]


def _members(path: Path) -> dict[str, bytes]:
    """A torch zip file's records, without the archive folder name (torch.save names it after
    the file, reshard's writer ``archive``)."""
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


# -- reading: EDP groups and composite maps ----------------------------------------------------------


def test_reads_the_edp_groups(ck):
    ax = ck.experts
    assert (ax.ep, ax.edp, ax.data_before_expert, ck.dp) == (EP, 2, False, WORLD)
    assert sorted(ax.params) == sorted(EXPERTS)
    assert [ax.members(e) for e in range(EP)] == _deepspeed_edp_groups(WORLD, EP) == [[0, 2], [1, 3]]
    # DeepSpeed's files agree: the expert group is cut in 2 (partition_count), and the DP ranks of one
    # EDP group hold consecutive halves of one EP rank's flat group (layer 0's tensors, then layer 1's)
    for d in range(WORLD):
        osd = ck.osd(0, d)
        assert osd["partition_count"] == [WORLD, 2]
        layer = d // EP  # EDP rank of DP rank d
        assert list(osd["param_slice_mappings"][1]) == [f"model.layers.{layer}.mlp.experts.{w}" for w in ("w1", "w2", "w3")]
    assert ck.model_state(0)["ds_autoep_layers"][0]["expert_data_parallel_world_size"] == 2


def test_every_map_checks_and_expert_composites_sit_on_the_edp_groups(ck, ucp):
    """Every composite map check()s; an expert parameter's composite puts EP rank e's experts on
    DP ranks d with d % ep == e, and each DP rank's piece is exactly what DeepSpeed's flat fp32
    partition of that rank holds (F from ds_to_universal, not from reshard's own reading)."""
    for name in ck.names:
        m = ck.tp_map(name).map
        m.check()
        ck.composite_map(name, m).check()
    for name in EXPERTS:
        p = ck.experts.params[name]
        comp = ck.composite_map(name, ck.tp_map(name).map)
        layer = int(name.split(".")[2])
        assert comp.ranks == (2 * layer, 2 * layer + 1)  # EDP rank `layer` of both EP ranks
        full = load(ucp / "zero" / name / "fp32.pt")["param"]
        per_expert = full[0].numel()
        for d in comp.ranks:
            ep_rank = d % EP
            assert d in _deepspeed_edp_groups(WORLD, EP)[ep_rank]
            mine = comp.extract(full, d)
            experts = {int(i) // per_expert for i in comp.extract(torch.arange(full.numel()).view(full.shape), d)}
            assert experts == set(p.experts_by_rank[ep_rank]), (name, d)
            sm = ck.osd(0, d)["param_slice_mappings"][1][name]
            flat = ck.osd(0, d)["single_partition_of_fp32_groups"][1]
            assert torch.equal(mine.reshape(-1), flat[sm.start:sm.start + sm.numel]), (name, d)


def test_a_contradicting_edp_order_is_refused(tmp_path):
    """With ``use_data_before_expert_parallelism`` set, EP rank 0's EDP group would be DP ranks
    {0, 1}, whose partitions hold the same part of two EP ranks' groups: refused, not misread."""
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    path = root / "global_step3" / "mp_rank_00_model_states.pt"
    sd = load(path, mmap=False)
    sd["ds_config"]["use_data_before_expert_parallelism"] = True
    save(sd, path)
    bad = DeepSpeedCheckpoint.open(root)
    assert [bad.experts.members(e) for e in range(EP)] == _deepspeed_edp_groups(WORLD, EP, True) == [[0, 1], [2, 3]]
    # the reader's check (every route runs it before reading a map) compares the files with the layout
    with pytest.raises(CheckpointError, match=r"dp rank 1 \(EP rank 0, EDP group \[0, 1\] in DeepSpeed's "
                                              r"use_data_before_expert_parallelism order\) group 1: "
                                              r"param_slice_mappings differ"):
        DeepSpeedReader(bad).check()
    with pytest.raises(CheckpointError):
        convert(root, tmp_path / "out")


def test_a_wrong_partition_count_is_refused(tmp_path):
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    path = root / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    sd = load(path, mmap=False)
    sd["optimizer_state_dict"]["partition_count"] = [WORLD, 4]
    save(sd, path)
    bad = DeepSpeedCheckpoint.open(root)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_2_mp_rank_00_optim_states.pt: partition_count \[4, 4\] "
                                              r"cuts expert group 1 into 4 partitions, but its EDP group has 2 ranks"):
        DeepSpeedReader(bad).check()


# -- reshard reshard: other (EP, DP) and back --------------------------------------------------------


@pytest.mark.parametrize("ep,dp", [(1, 1), (2, 2), (4, 4), (1, 2), (1, 4)])
def test_round_trip_through_another_ep_and_dp(ep, dp, ucp, tmp_path):
    """Out to (ep, dp) -- every state of every parameter there equals DeepSpeed's universal
    conversion of the source -- and back to EP 2 x DP 4: every tensor byte-identical to the
    fixture's. (1, 4) cuts each EP rank's group over 4 EDP ranks, parameters straddling them.)"""
    mid = reshard(FIXTURES / NAME, tmp_path / "mid", tp=1, dp=dp, ep=ep).out_dir
    new = DeepSpeedCheckpoint.open(mid)
    assert (new.experts.ep, new.experts.edp, new.dp) == (ep, dp // ep, dp)
    for name in new.names:
        for state in STATES if new.has_optimizer_state(name) else ():
            theirs = load(ucp / "zero" / name / f"{state}.pt")["param"]
            assert torch.equal(_full(new, name, state), theirs), (ep, dp, name, state)
    back = reshard(mid, tmp_path / "back", tp=1, dp=WORLD, ep=EP).out_dir
    src = tag_dir(NAME)
    assert sorted(p.name for p in back.glob("*.pt")) == sorted(p.name for p in src.glob("*.pt"))
    for p in src.glob("*.pt"):
        _same(load(back / p.name), load(p), p.name)
        ours, theirs = _members(back / p.name), _members(p)
        assert sorted(ours) == sorted(theirs), p.name
        # every tensor's storage record byte for byte; only the model-state pickle differs (reshard
        # pickles param_shapes' sizes as torch.Size, DeepSpeed's AutoEP files as plain tuples) and
        # with it the serialization id
        skip = {"data.pkl", ".data/serialization_id"} if p.name.startswith("mp_rank") else set()
        assert [k for k in theirs if k not in skip and ours[k] != theirs[k]] == [], p.name


def test_reshard_to_ep2_dp2_is_the_ep2_fixtures_layout_with_this_state(ucp, tmp_path):
    """mixtral_autoep_ep2 (world 2) and this fixture (world 4) hold different states (the global
    batch grows with DP: their losses differ from step 2), so the EP 2 x DP 2 output is compared
    with that fixture for layout (every key, shape, dtype, slice mapping and scalar but
    ``global_samples``) and with ds_to_universal's conversion of this fixture for values."""
    out = reshard(FIXTURES / NAME, tmp_path / "ep2dp2", tp=1, dp=2, ep=2).out_dir
    ref = tag_dir(EP2_DP2)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in ref.glob("*.pt"))
    differ: list[str] = []

    def same_layout(a, b, where: str) -> None:
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape), where
            if not torch.equal(a, b):
                differ.append(where)
        elif isinstance(a, dict):
            assert isinstance(b, dict) and list(a) == list(b), where
            for k in a:
                same_layout(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same_layout(x, y, f"{where}[{i}]")
        elif hasattr(a, "__dict__") and not isinstance(a, type):
            same_layout(vars(a), vars(b), where)
        elif a != b:
            assert where == "mp_rank_00_model_states.pt.global_samples" and (a, b) == (24, 12), (where, a, b)

    for p in ref.glob("*.pt"):
        same_layout(load(out / p.name), load(p), p.name)
    assert differ  # the states do differ
    # values: the universal conversion of the output is ds_to_universal's of the source
    conv = convert(out.parent, tmp_path / "conv").out_dir
    zero = sorted(p.relative_to(ucp).as_posix() for p in (ucp / "zero").rglob("*.pt"))
    assert sorted(p.relative_to(conv).as_posix() for p in (conv / "zero").rglob("*.pt")) == zero
    for rel in zero:
        a, b = load(conv / rel), load(ucp / rel)
        if rel == "zero/optimizer_state.pt":  # DeepSpeed sets every group's count to the source DP
            assert (a.pop("partition_count"), b.pop("partition_count")) == ([2, 2], [WORLD, WORLD])
        _same(a, b, rel)


def test_reshard_command_line(tmp_path, capsys):
    rc = cli(["reshard", str(FIXTURES / NAME), str(tmp_path / "out"), "--tp", "1", "--dp", "2", "--ep", "1"])
    assert rc == 0, capsys.readouterr().err
    new = DeepSpeedCheckpoint.open(tmp_path / "out")
    assert (new.experts.ep, new.experts.edp, new.dp) == (1, 2, 2)


# -- reshard inspect ------------------------------------------------------------------------------


def test_inspect_summarises_the_expert_groups(capsys):
    assert cli(["inspect", str(FIXTURES / NAME)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(x for x in lines if x.startswith("AutoEP experts:"))
    assert "6 fused parameter(s) over EP=2" in head and "EDP=2" in head and "d % 2" in head
    assert "  EDP groups: EP 0: dp 0, 2; EP 1: dp 1, 3" in lines
    # 18,432 elements per EP rank (6 tensors of 2 experts), cut in halves over its EDP group
    assert "  expert elements per DP rank: dp 0 9216, dp 1 9216, dp 2 9216, dp 3 9216" in lines
    assert "  elements of the TP shards per DP rank, all parameters but the AutoEP experts (below):" in lines
    assert cli(["inspect", str(FIXTURES / EP2_DP2)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  EDP groups: EP 0: dp 0; EP 1: dp 1" in lines
    assert "  expert elements per DP rank: dp 0 18432, dp 1 18432" in lines
    assert cli(["inspect", str(FIXTURES / "llama_zero1_dp2")]) == 0
    assert "AutoEP" not in capsys.readouterr().out


# -- DeepSpeed resumes it ---------------------------------------------------------------------------


@pytest.mark.e2e
# both in the slow tier (~30 s each); make test keeps the file-for-file checks of the same routes
@pytest.mark.parametrize("world,ep", [pytest.param(2, 2, marks=pytest.mark.slow),
                                      pytest.param(1, 1, marks=pytest.mark.slow)])  # (4, 1) passes too, but takes 45-85 s more
def test_deepspeed_resumes_the_resharded_edp_source_as_its_own_checkpoint(world, ep, ucp, tmp_path):
    """One real job per target: DeepSpeed resumes ds_to_universal's output of the EDP=2 source at
    EP ``ep`` x world ``world`` and saves it natively, then resumes reshard's output there; files
    (but ds_config), losses and layout-free digests agree."""
    from tests.e2e.launch import assert_autoep_resume_parity

    assert_autoep_resume_parity(NAME, ucp, tmp_path, ep=ep, world=world, expert=EXPERTS[0])
