"""``DeepSpeedReader.param_groups()`` lists each parameter in the optimizer group DeepSpeed's own
files put it in, for every kind: ZeRO-1/2 ``param_shapes`` group ``g`` (every model-parallel rank's;
a classic MoE expert under its global name), ZeRO-3 the sub-groups ``param_groups[g]['params']``
numbers. An AutoEP source's experts are in their ``moe`` group (``ep_size_N``), as a classic MoE
source's are; its router aliases -- module entries no optimizer group owns (a tied copy of the
router) -- are in none. What DCP and the fresh-template writers take the groups from."""

from __future__ import annotations

import pytest

from reshard.formats.deepspeed.reader import DeepSpeedReader
from tests.support.paths import DEEPSPEED

FIXTURES = sorted(p.name for p in DEEPSPEED.iterdir() if p.is_dir())


def _recorded(r: DeepSpeedReader) -> list[set[str]]:
    """Each optimizer group's parameters, as the files record them."""
    ck = r.ck
    if ck.zero_stage == 3:
        lists = [pg["params"] for pg in ck.osd(0, 0)["optimizer_state_dict"]["param_groups"]]
        return [{n for k in lst for n in ck.groups(0)[k]} for lst in lists]
    n_groups = len(ck.groups(0))
    out = [{n for m in range(ck.mp) for n in ck.groups(m)[g]} for g in range(n_groups)]
    if ck.moe is not None:  # param_shapes lists EP rank 0's local names; the reader the global ones
        out = [{n for n in grp if n not in ck.moe.local_names} for grp in out]
        for p in ck.moe.params.values():
            out[p.group].add(p.name)
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_each_parameter_is_in_the_group_the_files_record(name):
    r = DeepSpeedReader.open(DEEPSPEED / name)
    r.check()
    groups = r.param_groups()
    assert [set(g["params"]) for g in groups] == _recorded(r)
    listed = [n for g in groups for n in g["params"]]
    assert len(listed) == len(set(listed))
    for g in groups:  # each in the reader's (model) order
        assert g["params"] == [n for n in r.names if n in set(g["params"])]


def test_autoep_experts_are_in_their_moe_group():
    r = DeepSpeedReader.open(DEEPSPEED / "mixtral_autoep_ep2")
    r.check()
    dense, experts = r.param_groups()
    assert (dense["name"], experts["name"], experts["moe"]) == ("dense-params", "ep_size_2", True)
    assert sorted(experts["params"]) == sorted(r.ck.experts.params)
    assert not set(r.ck.experts.aliases) & {n for g in (dense, experts) for n in g["params"]}


@pytest.mark.parametrize("name,ep,dp,stage", [
    ("mixtral_autoep_ep2", 1, 1, None), ("mixtral_autoep_ep2", 2, 4, None), ("mixtral_autoep_ep2", 1, 2, 3),
    ("mixtral_autoep_ep2_zero3", 1, 1, None), ("mixtral_autoep_ep2_zero3", 4, 4, None),
    ("mixtral_autoep_ep2_zero3", 1, 1, 1)])
def test_the_expert_group_is_named_by_the_target_ep(name, ep, dp, stage, tmp_path):
    """DeepSpeed's engine names the expert group ``ep_size_<ep>`` (engine.py) and a native load
    keeps the saved name, which ``bf16_optimizer`` then looks the expert-parallel group up by: every
    optimizer file of the target names it by the target's EP (the ZeRO-3 partition groups alike),
    as the classic MoE target does."""
    from reshard.jobs.convert import reshard
    from reshard.storage.safe_load import load

    out = reshard(DEEPSPEED / name, tmp_path / "out", tp=1, dp=dp, ep=ep,
                  **({} if stage is None else {"zero_stage": stage})).out_dir
    files = sorted(out.glob("*optim_states.pt"))
    assert len(files) == dp
    for f in files:
        osd = load(f)["optimizer_state_dict"]
        groups = (osd["base_optimizer_state"] if "base_optimizer_state" in osd else osd["optimizer_state_dict"])[
            "param_groups"]
        assert [(g["name"], g.get("moe")) for g in groups] == [("dense-params", None), (f"ep_size_{ep}", True)], f.name
        if "ds_zero_partition_groups" in osd:
            assert osd["ds_zero_partition_groups"][-1]["group_names"] == [f"ep_size_{ep}"]
