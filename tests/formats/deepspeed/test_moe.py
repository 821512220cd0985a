"""Classic ``deepspeed.moe.layer.MoE`` experts (issue #12): the ``moe_ep2`` fixture read through
the IR (one universal tensor per global expert parameter, located on its EP rank), converted to
the universal layout, and DeepSpeed's own ``ds_to_universal`` failing on it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import STATES, DeepSpeedCheckpoint
from reshard.jobs.convert import convert
from reshard.present.inspected import open_source
from reshard.storage.safe_load import load
from tests.support.dsconv import FIXTURES, ds_to_universal, tag_dir

NAME = "moe_ep2"
PREFIX = "blocks.{layer}.moe.deepspeed_moe.experts.deepspeed_experts"
SUBS = ("fc1.weight", "fc1.bias", "fc2.weight")
GLOBAL = [f"{PREFIX.format(layer=L)}.{x}.{s}" for L in (0, 1) for x in range(4) for s in SUBS]


@pytest.fixture(scope="module")
def ck() -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint.open(FIXTURES / NAME)


def _expert_file(layer: int, x: int) -> dict:
    return load(tag_dir(NAME) / f"layer_{layer}_expert_{x}_mp_rank_00_model_states.pt")


def _where(name: str) -> tuple[int, int, str]:
    m = re.match(r"blocks\.(\d)\..*deepspeed_experts\.(\d)\.(.+)$", name)
    assert m is not None
    return int(m[1]), int(m[2]), m[3]


def test_reads_the_experts(ck):
    ax = ck.moe
    assert ck.experts is None  # not AutoEP
    assert (ax.ep, ax.edp, ax.data_before_expert, ax.groups) == (2, 1, False, frozenset({1}))
    assert sorted(ax.params) == sorted(GLOBAL)
    assert [ax.members(e) for e in range(2)] == [[0], [1]]
    p = ax.params[f"{PREFIX.format(layer=1)}.3.fc1.weight"]
    # global expert 3 is EP rank 1's local expert 1: the same local name as global expert 1 on EP rank 0
    assert (p.local, p.layer, p.expert, p.ep_rank, p.shape) == (f"{PREFIX.format(layer=1)}.1.fc1.weight", 1, 3, 1,
                                                                (24, 16))
    assert ax.params[f"{PREFIX.format(layer=1)}.1.fc1.weight"].local == p.local
    # names: the dense parameters, then the global experts; no local name is a parameter of F
    assert not ax.local_names & set(ck.names) - set(GLOBAL)
    assert ck.names[-len(GLOBAL):] == GLOBAL


def test_every_map_checks_and_composes(ck):
    for name in ck.names:
        m = ck.tp_map(name).map
        m.check()
        ck.composite_map(name, m).check()
    for name in GLOBAL:
        low, p = ck.tp_map(name), ck.moe.params[name]
        assert low.family == "moe expert" and low.extra == {}
        # one piece, all of F, located on the EP rank holding the expert; its fragments on that DP rank
        assert low.map.ranks == (p.ep_rank,) and low.map.identity_rank == p.ep_rank
        assert [q.locations for q in low.map.shards[p.ep_rank].pieces] == [frozenset({p.ep_rank})]
        assert ck.composite_map(name, low.map).ranks == (p.expert // 2,)
        group, dp = ck.zero_map(name, 0)  # TP rank 0's shard (all of it) over the DP ranks holding it
        assert group == 1 and dp.ranks == (p.ep_rank,)


def test_inspect():
    src = open_source(FIXTURES / NAME)
    name = f"{PREFIX.format(layer=0)}.2.fc2.weight"
    assert src.families[name] == "moe expert"
    assert src.maps[name].ranks == (1,)
    assert src.composed_map(name).ranks == (1,)
    assert src.zero_fragments(name) == {0: {1: 24 * 16}}


def test_convert_gives_every_global_expert(ck, tmp_path: Path):
    out = convert(FIXTURES / NAME, tmp_path).out_dir
    assert sorted(p.name for p in (out / "zero").iterdir() if p.is_dir()) == sorted(ck.names)
    for name in GLOBAL:
        layer, x, sub = _where(name)
        p = ck.moe.params[name]
        osd = ck.osd(0, ck.moe.members(p.ep_rank)[0])
        frag = osd["param_slice_mappings"][p.group][p.local]
        for state in STATES:
            got = load(out / "zero" / name / f"{state}.pt")
            assert set(got) == {"param"} and got["param"].shape == p.shape
            # the optimizer moments (and master) are the fragment of the EP rank holding the expert
            flat = (osd["single_partition_of_fp32_groups"][p.group] if state == "fp32"
                    else osd["base_optimizer_state"]["state"][p.group][state])
            assert torch.equal(got["param"].reshape(-1), flat.narrow(0, int(frag.start), int(frag.numel))), (name,
                                                                                                            state)
        # fp32 training: the master weights are the module weights of the per-expert file
        assert torch.equal(load(out / "zero" / name / "fp32.pt")["param"], _expert_file(layer, x)[name])
        assert str(load(out / "zero" / name / "step.pt")) == "tensor(3.)"
    # EP rank 0 and 1 train different experts under one local name: their moments differ
    a, b = (load(out / "zero" / f"{PREFIX.format(layer=0)}.{x}.fc1.weight" / "exp_avg.pt")["param"] for x in (0, 2))
    assert not torch.equal(a, b)


def test_dense_parameters_are_unchanged(ck, tmp_path: Path):
    out = convert(FIXTURES / NAME, tmp_path).out_dir
    module = ck.model_state(0)["module"]
    for name, w in module.items():
        assert torch.equal(load(out / "zero" / name / "fp32.pt")["param"], w), name


def test_missing_expert_file_is_named(tmp_path: Path):
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    (root / "global_step3" / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"layer_1_expert_2_mp_rank_00_model_states.pt is missing"):
        _ = DeepSpeedCheckpoint.open(root).moe


def test_ds_to_universal_fails_on_classic_moe(tmp_path: Path):
    """The peer: no ``universal_checkpoint_info``, and with ``--inject_missing_state`` the local
    expert names of both EP ranks are merged as ZeRO shards of one parameter (which parameter
    fails first depends on the folder listing, so the shapes are not pinned)."""
    pytest.importorskip("deepspeed")
    with pytest.raises(RuntimeError, match=r"(?s)_merge_zero_shards.*shape '\[[\d, ]+\]' is invalid for input of size \d+"):
        ds_to_universal(NAME, tmp_path)
