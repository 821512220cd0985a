"""AutoEP experts (issue #12): the ``mixtral_autoep_ep2`` fixture read through the IR, its maps
checked, its universal conversion against DeepSpeed's own ``ds_to_universal``, and ``reshard
reshard`` to another EP degree (``ep=``) against what DeepSpeed saves there and in a real job."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from reshard import ReshardError, apply_plan
from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.formats.deepspeed.placement import ds_affine_entry
from reshard.ir import canonicalize
from reshard.ir.param_map import map_from_dict
from reshard.jobs.convert import reshard
from reshard.layouts import autoep_placement
from reshard.plan.planner import plan
from reshard.present.inspected import open_source
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.compare import full_state
from tests.support.dsconv import FIXTURES, ds_to_universal, tag_dir

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


def test_masters_are_the_expert_files(ck):
    """Every expert's fp32 master, as the reader rebuilds it, equals the per-expert file DeepSpeed wrote."""
    for name in EXPERTS:
        layer = int(name.split(".")[2])
        full = _full(ck, name, "fp32").reshape(ck.experts.params[name].full_shape)
        for x in range(full.shape[0]):
            sd = load(tag_dir(NAME) / f"layer_{layer}_expert_{x}_mp_rank_00_model_states.pt")
            assert torch.equal(full[x], sd[f"{name}.{x}"])


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


# -- reshard reshard to another EP degree (reshard/formats/deepspeed/target.py) -------------------------------------

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _full(ck: DeepSpeedCheckpoint, name: str, state: str) -> torch.Tensor:
    """The logical tensor of one state, as reshard's reader rebuilds it from the ranks' fragments."""
    return full_state(ck, name, state)


def test_affine_entry_is_deepspeeds(ck):
    for entry in ck.model_state(0)["ds_autoep_layers"]:
        for name, theirs in entry["affine_maps"]["params"].items():
            assert ds_affine_entry(entry["expert_placement"], ck.experts.params[name].full_shape) == theirs


@pytest.mark.parametrize("ep,dp", [(1, 1), (1, 2), (2, 4), (4, 4)])
def test_experts_and_their_optimizer_state_move_together(ck, ep, dp, tmp_path):
    out = reshard(FIXTURES / NAME, tmp_path, tp=1, dp=dp, ep=ep).out_dir
    new = DeepSpeedCheckpoint.open(out)
    ax = new.experts
    assert (ax.ep, ax.edp, new.dp) == (ep, dp // ep, dp)
    local = 4 // ep
    assert ax.params[EXPERTS[0]].experts_by_rank == tuple(tuple(range(e * local, (e + 1) * local)) for e in range(ep))
    for name in ck.names:
        for state in STATES if ck.has_optimizer_state(name) else ():
            assert torch.equal(_full(new, name, state), _full(ck, name, state)), (name, state)
    assert {str(new.step(n)) for n in EXPERTS} == {str(ck.step(n)) for n in EXPERTS} == {"tensor(3.)"}
    for p in tag_dir(NAME).glob("layer_*_expert_*"):  # the per-expert files are the same at any EP
        assert (out / p.name).read_bytes() == p.read_bytes()


def test_ep_on_a_checkpoint_without_experts_is_refused(tmp_path):
    with pytest.raises(ReshardError, match="needs an AutoEP checkpoint"):
        reshard(FIXTURES / "llama_zero1_dp2", tmp_path, tp=1, ep=2)


@pytest.mark.e2e
@pytest.mark.parametrize("world,ep", [(1, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_deepspeed_resumes_the_resharded_experts_as_its_own_checkpoint(world, ep, tmp_path):
    """One real job at ``world`` ranks: DeepSpeed resumes ds_to_universal's output at the target EP and
    saves it natively, then resumes reshard's output; files, losses and layout-free digests agree."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import assert_autoep_resume_parity

    ucp = ds_to_universal(NAME, tmp_path / "ucp")
    assert_autoep_resume_parity(NAME, ucp, tmp_path, ep=ep, world=world, expert=EXPERTS[0])


def test_reshard_refuses_a_missing_expert_file_and_leaves_nothing(tmp_path: Path):
    root = tmp_path / "src"
    shutil.copytree(FIXTURES / NAME, root)
    tag = root / (root / "latest").read_text().strip()
    (tag / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"per-expert files missing: \['layer_1_expert_2_mp_rank_00"):
        reshard(root, tmp_path / "out", tp=1, dp=1, ep=1)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("damage", ["reshaped", "changed", "extra entry"])
def test_a_module_entry_that_is_no_router_alias_or_differs_from_its_router_is_refused(tmp_path, damage):
    """AutoEP's module holds the router under a second name (``gate.gate.weight``): the same tensor, so an
    alias re-saved in another shape (fuzz case 117 of an earlier run: carried as it was) or with other
    values, or an entry that is no alias at all (fuzz case 64 of f3b94ba: carried as a weight), is refused
    when the checkpoint is opened, naming the file, before any output."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / NAME, src)
    f = tag_dir(src) / "mp_rank_00_model_states.pt"
    sd = load(f, mmap=False)
    alias = "model.layers.0.mlp.gate.gate.weight"
    if damage == "reshaped":
        sd["module"][alias] = sd["module"][alias].reshape(-1, 1).clone()
    elif damage == "changed":
        sd["module"][alias] = sd["module"][alias] * 2
    else:
        sd["module"]["model.layers.0.mlp.gate.extra"] = torch.zeros(3)
    save(sd, f)
    match = "neither a parameter nor an AutoEP router alias" if damage == "extra entry" else "differs from"
    with pytest.raises(CheckpointError, match=match) as e:
        reshard(src, tmp_path / "out", to="deepspeed", dp=2, ep=2)
    assert str(f) in str(e.value)
    assert not (tmp_path / "out").exists()
