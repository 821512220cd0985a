"""AutoEP experts (issue #12): the ``mixtral_autoep_ep2`` fixture read through the IR, its maps
checked, and its universal conversion against DeepSpeed's own ``ds_to_universal``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from reshard import CheckpointError, apply_plan, canonicalize
from reshard.convert import convert
from reshard.formats.deepspeed import DeepSpeedCheckpoint
from reshard.formats.pickling import save
from reshard.formats.safe_load import load
from reshard.formats.sources import open_source
from reshard.ir.param_map import map_from_dict
from reshard.layouts import autoep_placement
from reshard.planner import plan
from tests.dsconv import FIXTURES, ds_to_universal, tag_dir
from tests.test_convert_parity import _same

NAME = "mixtral_autoep_ep2"
EXPERTS = [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]


@pytest.fixture(scope="module")
def ck() -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint.open(FIXTURES / NAME)


def test_reads_the_placement(ck):
    ax = ck.experts
    assert (ax.ep, ax.edp, ax.data_before_expert) == (2, 1, False)
    assert sorted(ax.params) == sorted(EXPERTS)
    assert ax.aliases == ("model.layers.0.mlp.gate.gate.weight", "model.layers.1.mlp.gate.gate.weight")
    p = ax.params["model.layers.0.mlp.experts.w2"]
    assert p.full_shape == (4, 32, 48) and p.experts_by_rank == ((0, 1), (2, 3)) and p.group == 1
    assert [ax.members(e) for e in range(2)] == [[0], [1]]


def test_expert_map_is_deepspeeds_affine_map(ck):
    layers = ck.model_state(0)["ds_autoep_layers"]
    for name in EXPERTS:
        low = ck.tp_map(name)
        low.map.check()
        assert low.family == "experts"
        entry = layers[int(name.split(".")[2])]["affine_maps"]["params"][name]
        assert canonicalize(low.map) == canonicalize(map_from_dict(entry))
        # one piece per EP rank, located on that rank alone: experts 2r, 2r + 1
        for r, shard in low.map.shards.items():
            assert [p.locations for p in shard.pieces] == [frozenset({r})]
            assert shard.pieces[0].source.offset == 2 * r * 48 * 32


def test_every_map_checks_and_composes(ck):
    for name in ck.names:
        m = ck.tp_map(name).map
        m.check()
        ck.composite_map(name, m).check()
    comp = ck.composite_map(EXPERTS[0], ck.tp_map(EXPERTS[0]).map)
    assert comp.ranks == (0, 1)  # EP rank e is DP rank e (EDP groups of one)


def test_shards_are_the_expert_files(ck):
    """The fp32 master of EP rank e equals the per-expert files DeepSpeed wrote."""
    for name in EXPERTS:
        layer = int(name.split(".")[2])
        for e, experts in enumerate(ck.experts.params[name].experts_by_rank):
            shard = ck.tp_shard(name, e, "fp32", ck.tp_map(name).map.shards[e].shape)
            for i, x in enumerate(experts):
                sd = load(tag_dir(NAME) / f"layer_{layer}_expert_{x}_mp_rank_00_model_states.pt")
                assert torch.equal(shard[i], sd[f"{name}.{x}"])


def test_inspect():
    src = open_source(FIXTURES / NAME)
    assert src.families[EXPERTS[0]] == "experts"
    assert src.maps[EXPERTS[0]].ranks == (0, 1)


def test_placement_lowering_non_uniform_and_plans():
    desc = {"version": 1, "num_experts": 4, "ep_size": 2,
            "ranks": [{"rank": 0, "experts": [0, 3]}, {"rank": 1, "experts": [1, 2]}]}
    m = autoep_placement(desc, (4, 3, 2))
    m.check()
    assert [len(s.pieces) for s in m.shards.values()] == [1, 1]  # experts 0, 3: one strided piece
    one = autoep_placement({"version": 1, "num_experts": 4, "ep_size": 1,
                            "ranks": [{"rank": 0, "experts": [0, 1, 2, 3]}]}, (4, 3, 2))
    f = torch.arange(24.0).reshape(4, 3, 2)
    shards = {r: m.extract(f, r) for r in m.ranks}
    assert torch.equal(shards[0][1], f[3])
    moved = apply_plan(plan(m, one), shards)  # EP 2 -> EP 1: every expert to rank 0
    assert torch.equal(moved[0].reshape(4, 3, 2), f)


def test_refuses_a_placement_disagreeing_with_affine_maps(tmp_path: Path):
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    path = root / "global_step3" / "mp_rank_00_model_states.pt"
    sd = load(path, mmap=False)
    sd["ds_autoep_layers"][1]["expert_placement"]["ranks"] = [{"rank": 0, "experts": [2, 3]},
                                                              {"rank": 1, "experts": [0, 1]}]
    save(sd, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt.*model.layers.1.mlp.experts.w1.*affine_maps"):
        _ = DeepSpeedCheckpoint.open(root).experts


def test_convert_is_ds_to_universal(tmp_path: Path):
    pytest.importorskip("deepspeed")
    theirs = ds_to_universal(NAME, tmp_path / "ds")
    ours = convert(FIXTURES / NAME, tmp_path / "reshard").out_dir
    their_files = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.pt")) == their_files
    assert "zero/model.layers.0.mlp.experts.w1/exp_avg_sq.pt" in their_files
    for rel in their_files:
        if rel.startswith("mp_rank"):  # rewritten by both under AutoEP: byte for byte
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
            continue
        _same(load(ours / rel), load(theirs / rel), rel)
