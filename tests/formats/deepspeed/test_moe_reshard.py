"""``reshard reshard --ep`` of a classic ``deepspeed.moe.layer.MoE`` checkpoint (issue #12;
``reshard/formats/deepspeed/target.py``): ``moe_ep2`` (EP 2 x DP 2, 4 experts, 2 MoE layers) written at other
(EP, DP) as DeepSpeed 0.19.8 saves them there, round trips, universal conversion of the output,
refusals, and a real DeepSpeed job resuming the output natively (e2e)."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from reshard.cli import main as cli
from reshard.errors import CheckpointError
from reshard.formats.deepspeed.checkpoint import STATES, DeepSpeedCheckpoint
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.compare import full_state
from tests.support.compare import same as _same
from tests.support.compare import skeleton as _skeleton
from tests.support.dsconv import FIXTURES, tag_dir

NAME = "moe_ep2"
PREFIX = "blocks.{layer}.moe.deepspeed_moe.experts.deepspeed_experts"
SUBS = ("fc1.weight", "fc1.bias", "fc2.weight")
SHAPES = {"fc1.weight": (24, 16), "fc1.bias": (24,), "fc2.weight": (16, 24)}
GLOBAL = [f"{PREFIX.format(layer=L)}.{x}.{s}" for L in (0, 1) for x in range(4) for s in SUBS]
TARGETS = [(1, 1), (4, 4), (2, 4)]


@pytest.fixture(scope="module")
def ck() -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint.open(FIXTURES / NAME)


@pytest.fixture(scope="module")
def outs(tmp_path_factory) -> dict[tuple[int, int], Path]:
    """The fixture resharded to each target (EP, DP), once per module."""
    root = tmp_path_factory.mktemp("moe_reshard")
    return {(ep, dp): reshard(FIXTURES / NAME, root / f"ep{ep}_dp{dp}", tp=1, dp=dp, ep=ep).out_dir
            for ep, dp in TARGETS}


def _state(ck: DeepSpeedCheckpoint, name: str, state: str) -> torch.Tensor:
    """The whole parameter for one state, as reshard's reader rebuilds it from the ranks' fragments."""
    return full_state(ck, name, state)


@pytest.mark.parametrize("ep,dp", TARGETS)
def test_written_as_deepspeed_saves_it(ck, outs, ep, dp):
    """The layout DeepSpeed 0.19.8 itself saves for MoE(ep_size=ep) at world dp (checked against
    its native saves, docs/deepspeed-checkpoints.md §12): EP rank e holds experts [e*L, (e+1)*L),
    the expert group cut over EDP, named ep_size_<ep>; param_shapes lists EP rank 0's local names."""
    out, local, edp = outs[(ep, dp)], 4 // ep, dp // ep
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(
        [f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(dp)] + ["mp_rank_00_model_states.pt"]
        + [p.name for p in tag_dir(NAME).glob("layer_*_expert_*")])
    ms = load(out / "mp_rank_00_model_states.pt")
    assert ms["dp_world_size"] == dp and ms["num_experts"] == [4, 4] and ms["ds_autoep_layers"] is None
    assert list(ms["param_shapes"][1].items()) == [(f"{PREFIX.format(layer=L)}.{j}.{s}", SHAPES[s])
                                                  for L in (0, 1) for j in range(local) for s in SUBS]
    assert all(type(s) is tuple for g in ms["param_shapes"] for s in g.values())  # as DeepSpeed's MoE save
    src_groups = load(tag_dir(NAME) / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[
        "optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    for d in range(dp):
        osd = load(out / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert osd["partition_count"] == [dp, edp]
        groups = osd["base_optimizer_state"]["param_groups"]
        assert [g["name"] for g in groups] == ["dense", f"ep_size_{ep}"] and groups[1]["moe"] is True
        assert [{k: v for k, v in g.items() if k != "name"} for g in groups] == \
               [{k: v for k, v in g.items() if k != "name"} for g in src_groups]
        expert_flat = 2 * local * (24 * 16 + 24 + 16 * 24)  # both layers' local experts, cut over EDP
        assert osd["single_partition_of_fp32_groups"][1].numel() == expert_flat // edp
    new = DeepSpeedCheckpoint.open(out)
    assert (new.moe.ep, new.moe.edp, new.dp) == (ep, edp, dp)
    assert sorted(new.names) == sorted(ck.names)
    for name in ck.names:  # every parameter's master and moments, whatever rank now holds them
        if name in new.moe.params:  # global expert x: EP rank x // L, local name x % L
            p, m = new.moe.params[name], re.match(r"(.+deepspeed_experts)\.(\d+)\.(.+)$", name)
            assert p.ep_rank == p.expert // local and p.local == f"{m[1]}.{p.expert % local}.{m[3]}"
        for state in STATES:
            assert torch.equal(_state(new, name, state), _state(ck, name, state)), (name, state)
        assert str(new.step(name)) == str(ck.step(name)) == "tensor(3.)"


@pytest.mark.parametrize("ep,dp", TARGETS)
def test_round_trip_gives_back_the_source_tensors(outs, ep, dp, tmp_path):
    back = reshard(outs[(ep, dp)], tmp_path, tp=1, dp=2, ep=2).out_dir
    for p in tag_dir(NAME).glob("*.pt"):  # every flat partition, moment, module tensor and key
        _same(load(back / p.name), load(p), p.name)
        if p.name.startswith("layer_"):
            assert (back / p.name).read_bytes() == p.read_bytes()


@pytest.mark.parametrize("ep,dp", TARGETS)
def test_universal_form_is_the_sources(outs, ep, dp, tmp_path):
    theirs = convert(FIXTURES / NAME, tmp_path / "src").out_dir
    ours = convert(outs[(ep, dp)].parent, tmp_path / "out").out_dir
    files = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.pt")) == files
    assert f"zero/{GLOBAL[-1]}/exp_avg_sq.pt" in files
    for rel in files:
        a, b = load(ours / rel), load(theirs / rel)
        if rel == "zero/optimizer_state.pt":  # the optimizer's topology: partitions, per-parameter paddings
            topo = ("partition_count", "param_alignment_paddings", "param_groups")
            assert (a["partition_count"], [g["name"] for g in a["param_groups"]]) == ([dp, dp // ep],
                                                                                     ["dense", f"ep_size_{ep}"])
            a["param_groups"][1]["name"] = "ep_size_2"
            _same(a["param_groups"], b["param_groups"], rel)
            a, b = ({k: v for k, v in x.items() if k not in topo} for x in (a, b))
        elif not rel.startswith("zero/"):  # the model state: its own topology and param_shapes
            a, b = a["module"], b["module"]
        _same(a, b, rel)


def test_cli_reshards_with_ep_and_dp(tmp_path):
    assert cli(["reshard", str(FIXTURES / NAME), str(tmp_path / "out"), "--ep", "4", "--dp", "4"]) == 0
    new = DeepSpeedCheckpoint.open(tmp_path / "out")
    assert (new.moe.ep, new.moe.edp, new.dp) == (4, 1, 4)


# -- refusals ------------------------------------------------------------------------------------


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    shutil.copytree(FIXTURES / NAME, root)
    return root


def test_missing_expert_file_is_refused_before_anything_is_written(tmp_path):
    root = _copy(tmp_path)
    (root / "global_step3" / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"global_step3: layer_1_expert_2_mp_rank_00_model_states.pt is missing"):
        reshard(root, tmp_path / "out", tp=1, dp=4, ep=4)
    assert not (tmp_path / "out").exists()


def test_expert_file_disagreeing_with_param_shapes_is_refused(tmp_path):
    root = _copy(tmp_path)
    path = root / "global_step3" / "layer_0_expert_3_mp_rank_00_model_states.pt"
    sd = load(path, mmap=False)
    name = f"{PREFIX.format(layer=0)}.3.fc1.weight"
    sd[name] = torch.zeros(24, 8)
    save(sd, path)
    local = f"{PREFIX.format(layer=0)}.1.fc1.weight"
    with pytest.raises(CheckpointError, match=re.escape(f"layer_0_expert_3_mp_rank_00_model_states.pt: {name!r} has "
                                                        f"shape [24, 8], param_shapes gives its local name {local!r} "
                                                        "[24, 16]")):
        reshard(root, tmp_path / "out", tp=1, dp=4, ep=4)
    assert not (tmp_path / "out").exists()


def test_expert_group_not_named_by_its_ep_size_is_refused(tmp_path):
    root = _copy(tmp_path)
    for d in (0, 1):
        path = root / "global_step3" / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt"
        sd = load(path, mmap=False)
        sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][1]["name"] = "experts"
        save(sd, path)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt: optimizer group 1 holds "
                                              r"the experts but is not DeepSpeed's MoE group"):
        reshard(root, tmp_path / "out", tp=1, dp=4, ep=4)
    assert not (tmp_path / "out").exists()


# -- a real DeepSpeed job ------------------------------------------------------------------------

LOSS_RTOL = 1e-6  # see the e2e test's docstring


@pytest.mark.e2e
@pytest.mark.slow  # 33-44 s; make test keeps test_written_as_deepspeed_saves_it (file for file) and the round trips
def test_deepspeed_resumes_the_resharded_moe_natively(tmp_path):
    """DeepSpeed resumes reshard's output with its ordinary ``load_checkpoint`` at EP 4 x DP 4, EP 2
    x DP 4 (one world-4 job) and EP 1 x DP 2 (with the reference, one world-2 job; the two jobs run
    side by side). The reference is DeepSpeed's native resume of the *source* at its own EP 2 x DP 2
    (``ds_to_universal`` cannot convert classic MoE). After the load, the fp32 masters, Adam moments
    and module weights, digested by global expert name, equal the reference's bit for bit. At every
    target the same engine saves twice: before the load (fresh weights: DeepSpeed's own layout at
    that topology, which reshard's files match key for key and shape for shape) and right after it
    (equal to reshard's files tensor for tensor). Then 2 steps on the
    reference's token set (rank r runs reference rank r % 2's batch, ``resume_moe.py``): each rank's
    losses equal its reference rank's within ``LOSS_RTOL`` -- the gradients are the reference's but
    summed over 4 ranks instead of 2 (and, at EP 1, over the EDP group instead of through the
    all-to-all), so float additions happen in another order (observed: bit-identical losses at DP 4,
    one loss 6e-8 off at EP 1 x DP 2; weights after the steps within 2e-6, ``STEPS_RTOL``)."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import free_port, resume_moe_many

    fx = json.loads((FIXTURES / NAME / "fixture.json").read_text())

    def job(name: str, load_dir: Path, ep: int, save_dir: Path | None = None) -> dict:
        return {"name": name, "model_config": {**fx["model_config"], "ep_size": ep}, "seed": fx["seed"],
                "seq_len": fx["data"]["seq_len"], "micro_batch": fx["data"]["micro_batch"], "ref_dp": 2,
                "ds_config": fx["ds_config"], "load_dir": str(load_dir), "tag": None, "steps": 2,
                "save_dir": None if save_dir is None else str(save_dir / "loaded"),
                "fresh_save_dir": None if save_dir is None else str(save_dir / "fresh")}

    ours = {(ep, dp): reshard(FIXTURES / NAME, tmp_path / f"ep{ep}_dp{dp}", tp=1, dp=dp, ep=ep).out_dir
            for ep, dp in ((4, 4), (2, 4), (1, 2))}
    loads = {2: [job("source", FIXTURES / NAME, 2), job("ep1_dp2", ours[(1, 2)].parent, 1, save_dir=tmp_path / "n12")],
             4: [job("ep4_dp4", ours[(4, 4)].parent, 4, save_dir=tmp_path / "n44"),
                 job("ep2_dp4", ours[(2, 4)].parent, 2, save_dir=tmp_path / "n24")]}
    ports = {2: free_port()}
    while (p := free_port()) == ports[2]:
        pass
    ports[4] = p
    with ThreadPoolExecutor(2) as pool:
        futures = {w: pool.submit(resume_moe_many, ls, world_size=w, port=ports[w], workdir=tmp_path / f"job{w}")
                   for w, ls in loads.items()}
        reports = {name: r for f in futures.values() for name, r in f.result().items()}

    ref = reports["source"]
    assert ref["global_steps_after_load"] == 3 and ref["optimizer_step_after_load"] == [3.0]
    assert sorted(ref["digests"]["after_load"]) == sorted(
        n for n in DeepSpeedCheckpoint.open(FIXTURES / NAME).names)  # every global expert, by its global name
    for name, (ep, dp) in (("ep4_dp4", (4, 4)), ("ep2_dp4", (2, 4)), ("ep1_dp2", (1, 2))):
        mine = reports[name]
        assert mine["topology"]["world_size"] == dp and mine["topology"]["ep"] == ep
        assert mine["param_group_names"] == [["dense", f"ep_size_{ep}"]], name
        assert not mine["ranks_disagree"] and not ref["ranks_disagree"]
        assert mine["global_steps_after_load"] == 3 and mine["optimizer_step_after_load"] == [3.0]
        assert mine["digests"]["after_load"] == ref["digests"]["after_load"], name
        for r, losses in mine["losses_per_rank"].items():
            want = ref["losses_per_rank"][str(int(r) % 2)]
            assert losses == pytest.approx(want, rel=LOSS_RTOL, abs=0), (name, r, losses, want)
        for param, kinds in ref["digests"]["after_steps"].items():  # the same training, up to rounding
            for kind, d in kinds.items():
                assert mine["digests"]["after_steps"][param][kind]["wsum"] == pytest.approx(d["wsum"], rel=STEPS_RTOL)
        assert all(f"_{mine['port']}_" in s for s in mine["shm_removed"])
        # DeepSpeed's save of what it loaded from reshard's files: the same files
        mine_dir, saved = ours[(ep, dp)], tmp_path / f"n{ep}{dp}"
        assert sorted(p.name for p in (saved / "loaded" / mine_dir.name).glob("*.pt")) == \
               sorted(p.name for p in mine_dir.glob("*.pt"))
        for p in (saved / "loaded" / mine_dir.name).glob("*.pt"):
            _same(load(mine_dir / p.name), load(p), p.name)
        # ... and DeepSpeed's own layout at this topology, saved by the same engine before the load
        # (fresh weights: the same keys, names, shapes, partitions and group names; values aside)
        for p in (saved / "fresh" / "fresh").glob("*.pt"):
            assert _skeleton(load(mine_dir / p.name)) == _skeleton(load(p)), (name, p.name)


STEPS_RTOL = 1e-4  # observed: <= 2e-6 (the after-step digests' weighted sums)


