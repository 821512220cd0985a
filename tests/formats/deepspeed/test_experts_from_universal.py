"""AutoEP experts written from a source that is no DeepSpeed checkpoint (issue #32 item 5): ``--ep``
from DeepSpeed's own ``ds_to_universal`` of the ``mixtral_autoep_ep2`` fixture. The target takes a
fresh ZeRO job's files (``templates.fresh``) and AutoEP's uniform placement at ``--ep``, and what it
needs of the source through the contract (``Reader.expert_layers``, ``tied``, ``grad_clip``). Its
files hold the same tensors as what ``reshard reshard`` writes from the DeepSpeed checkpoint itself
at the same EP x DP, and DeepSpeed's own loader resumes them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard import ReshardError
from reshard.errors import CheckpointError
from reshard.jobs.convert import reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.dsconv import FIXTURES, ds_to_universal

NAME = "mixtral_autoep_ep2"
EXPERT = "model.layers.0.mlp.experts.w1"
ALIAS, ROUTER = "model.layers.0.mlp.gate.gate.weight", "model.layers.0.mlp.router.gate.weight"
# what a fresh job's files record otherwise than the DeepSpeed source's own (docs/deepspeed-checkpoints.md §11.2)
FRESH = {"/ds_config", "/global_samples", "/universal_checkpoint_info"}


@pytest.fixture(scope="module")
def ucp(tmp_path_factory) -> Path:
    pytest.importorskip("deepspeed")  # its ds_to_universal makes the source
    root = tmp_path_factory.mktemp("ucp")
    ds_to_universal(NAME, root)
    (root / "latest_universal").write_text((FIXTURES / NAME / "latest").read_text().strip())
    return root


def _differences(x: Any, y: Any, path: str, out: list[str]) -> None:
    """Where ``x`` and ``y`` differ: every tensor by dtype, shape and value; dicts key by key (their
    order aside); objects by their attributes."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and torch.equal(x, y)):
            out.append(path)
    elif isinstance(x, dict) and isinstance(y, dict):
        out += [f"{path}/{k}" for k in set(x) ^ set(y)]
        for k in set(x) & set(y):
            _differences(x[k], y[k], f"{path}/{k}", out)
    elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        for i, (a, b) in enumerate(zip(x, y)):
            _differences(a, b, f"{path}[{i}]", out)
    elif hasattr(x, "__dict__") and type(x) is type(y):
        _differences(vars(x), vars(y), path, out)
    elif x != y:
        out.append(path)


def _fresh_only(paths: list[str]) -> bool:
    return all(p in FRESH or p.startswith(tuple(f"{f}/" for f in FRESH)) for p in paths)


@pytest.mark.parametrize("ep,dp", [(2, 2), (1, 1), (2, 4)])
def test_ep_from_its_universal_holds_what_the_deepspeed_reshard_writes(ucp, ep, dp, tmp_path):
    """Every file the DeepSpeed -> DeepSpeed reshard writes at EP x DP, and no other: every tensor
    equal (masters, moments, module weights, the router alias, each per-expert file), every other
    value equal (the ``ds_autoep_layers`` placement, param_shapes, steps, param groups,
    ``clip_grad``, the loss scaler) but what a fresh job records otherwise (``FRESH``)."""
    ours = reshard(ucp, tmp_path / "ours", tp=1, dp=dp, ep=ep).out_dir
    theirs = reshard(FIXTURES / NAME, tmp_path / "theirs", tp=1, dp=dp, ep=ep).out_dir
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        out: list[str] = []
        _differences(load(ours / p.name), load(p), "", out)
        assert _fresh_only(out), (p.name, sorted(out))
    module = load(ours / "mp_rank_00_model_states.pt")["module"]
    assert torch.equal(module[ALIAS], module[ROUTER])
    assert load(ours / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]["clip_grad"] == 1.0


@pytest.mark.parametrize("ep,dp", [(2, 2), (1, 1), (2, 4)])
def test_ep_from_its_universal_at_zero3_holds_what_the_deepspeed_reshard_writes(ucp, ep, dp, tmp_path):
    """At ZeRO-3 (``--zero-stage 3``): every file the DeepSpeed -> DeepSpeed reshard writes there
    (AutoEP ZeRO-1 -> ZeRO-3, whose files have DeepSpeed's own ZeRO-3 save's structure:
    test_experts_to_zero3.py), and no other; every tensor (masters, moments, placeholders, ``ds_id``)
    and every other value (placement entries, ``ds_zero_partition_groups``, param_shapes, steps,
    param groups, the loss scaler, ``universal_checkpoint_info``) equal, but the job's ``ds_config``
    and ``global_samples``, which a universal checkpoint does not record."""
    ours = reshard(ucp, tmp_path / "ours", tp=1, dp=dp, ep=ep, zero_stage=3).out_dir
    theirs = reshard(FIXTURES / NAME, tmp_path / "theirs", tp=1, dp=dp, ep=ep, zero_stage=3).out_dir
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        out: list[str] = []
        _differences(load(ours / p.name), load(p), "", out)
        assert all(x.startswith(("/ds_config", "/global_samples")) for x in out), (p.name, sorted(out))
        if "optim" in p.name:
            assert [t.ds_id for t in load(ours / p.name)["optimizer_state_dict"]["fp32_flat_groups"]] == \
                ["0_22", "6_18"]


def test_deepspeed_without_ep_from_an_autoep_universal_is_refused(ucp, tmp_path):
    """Its optimizer groups are AutoEP's (``moe``, named by the EP group): a dense target is not written."""
    with pytest.raises(ReshardError, match=r"holds AutoEP experts \(ds_autoep_layers\); DeepSpeed is written from it "
                                           r"as an AutoEP checkpoint only: pass --ep"):
        reshard(ucp, tmp_path / "out", tp=1, dp=2)
    assert not (tmp_path / "out").exists()


def test_a_router_alias_that_is_not_its_router_is_refused(ucp, tmp_path):
    """The alias's folder must hold its router's values: otherwise it is no alias, and nothing is written."""
    root = tmp_path / "ucp"
    shutil.copytree(ucp, root)
    f = root / ucp.joinpath("latest_universal").read_text() / "zero" / ALIAS / "fp32.pt"
    obj = load(f, mmap=False)
    obj["param"] = obj["param"] + 1
    save(obj, f)
    with pytest.raises(CheckpointError, match=rf"{ALIAS}/fp32.pt: differs from the fp32 master of "
                                                 rf"'{ROUTER}', whose AutoEP router alias"):
        reshard(root, tmp_path / "out", tp=1, dp=2, ep=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
@pytest.mark.slow  # make test-all; make test keeps the file-for-file checks of the same route
def test_deepspeed_loads_the_experts_written_from_its_universal(ucp, tmp_path):
    """One real job at world 2, EP 2: DeepSpeed resumes its own universal checkpoint of the fixture,
    then reshard's files written from that universal checkpoint natively. Masters, moments and
    module weights after the load, the steps, the digests after two more steps and the losses are
    the same; DeepSpeed's native save right after loading reshard's files holds the same tensors."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    spec = model_spec_from_fixture(FIXTURES / NAME)
    ours = reshard(ucp, tmp_path / "ours", tp=1, dp=2, ep=2).out_dir
    native = tmp_path / "native"
    loads = [resume_load("deepspeed", ucp, model_spec=spec, tp=1, dp=2, universal=True),
             resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=2, universal=False, save_dir=native)]
    reports = resume_many(loads, world_size=2, workdir=tmp_path / "job")
    theirs, mine = reports["deepspeed"], reports["reshard"]
    assert mine["global_steps_after_load"] == theirs["global_steps_after_load"] == 3
    assert mine["optimizer_step_after_load"] == theirs["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"] and theirs["ranks_agree"]
    assert mine["layouts"][EXPERT] == "autoep"
    assert mine["digests"] == theirs["digests"]
    assert mine["losses"] == theirs["losses"]
    for p in sorted(ours.glob("*.pt")):
        out: list[str] = []
        _differences(load(p), load(native / ours.name / p.name), "", out)
        assert _fresh_only(out), (p.name, sorted(out))
