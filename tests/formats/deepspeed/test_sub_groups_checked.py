"""ZeRO-3 sub-group facts are checked from the one layout (``layout.check_sub``,
``zero3.check_partitions``) in ``DeepSpeedReader.check``, for every kind and every route, before
any output exists: an AutoEP ZeRO-3 source whose files contradict DeepSpeed 0.19.8's rule is
refused by ``inspect`` (``reshard.open``), ``convert`` and ``reshard`` alike, naming the file, the
tensor or sub-group and the rank (issue 32). Before, its sub-group cut was checked only when a
DeepSpeed target was built, and its partitions' lengths only as a fragment was read. Also run
under ``python -O`` (tests/test_input_guards.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import reshard as rs
from reshard.errors import CheckpointError
from reshard.jobs.convert import convert, reshard
from reshard.storage.pickling import save
from reshard.storage.safe_load import load
from tests.support.dsconv import FIXTURES

NAME = "mixtral_autoep_ep2_zero3"
TAG = "global_step3"
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
ROUTES: dict[str, Callable[[Path, Path], object]] = {
    "inspect": lambda src, out: rs.open(src),
    "convert": lambda src, out: convert(src, out),
    "reshard": lambda src, out: reshard(src, out, tp=1, dp=2, ep=2),
}


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, root)
    return root


def _edit(root: Path, name: str, edit: Callable[[dict], None]) -> None:
    path = root / TAG / name
    sd = load(path, mmap=False)
    edit(sd)
    save(sd, path)


def _groups(sd: dict) -> list[dict]:
    return sd["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]


def _sub_group_size(sd: dict) -> None:  # DeepSpeed's rule would cut the dense group in many
    sd["ds_config"]["zero_optimization"]["sub_group_size"] = 1000


def _mixed(sd: dict) -> None:  # one optimizer group holding the dense and the expert sub-group
    groups = _groups(sd)
    groups[0]["params"] = [0, 1]
    del groups[1]


def _out_of_order(sd: dict) -> None:
    groups = _groups(sd)
    groups[0]["params"], groups[1]["params"] = [1], [0]


def _cut(state: str) -> Callable[[dict], None]:
    def edit(sd: dict) -> None:
        osd = sd["optimizer_state_dict"]
        if state == "fp32":
            osd["fp32_flat_groups"][1] = osd["fp32_flat_groups"][1][:10000].clone()
        else:
            entry = osd["optimizer_state_dict"]["state"][1]
            entry[state] = entry[state][:10000].clone()
    return edit


def _partition_count(sd: dict) -> None:
    sd["optimizer_state_dict"]["partition_count"] = 4


# (file, edit, message): one planted defect per check
DEFECTS = {
    "cut": (MODEL.format(0), _sub_group_size,
            rf"{MODEL.format(0)}: param_shapes records sub-groups of sizes \[17, 6\], DeepSpeed 0\.19\.8's rule "
            r"\(sub_group_size 1000\) gives \["),
    "mixed-group": (OPTIM.format(0), _mixed, rf"{OPTIM.format(0)}: optimizer group 0 mixes expert and dense sub-groups"),
    "group-order": (OPTIM.format(0), _out_of_order,
                    rf"{OPTIM.format(0)}: param_groups number the sub-groups \[\[1\], \[0\]\], expected 0\.\.1 in order"),
    "fp32-truncated": (OPTIM.format(1), _cut("fp32"),
                       rf"{OPTIM.format(1)}: dp rank 1: parameter 'model\.layers\.1\.mlp\.experts\.w1' \(fp32, elements "
                       r"\[9216, 12288\) of sub-group 1\) lies past the end of the partition, which has 10000 of 18432"),
    "moment-truncated": (OPTIM.format(0), _cut("exp_avg_sq"),
                         rf"{OPTIM.format(0)}: dp rank 0: parameter 'model\.layers\.1\.mlp\.experts\.w1' \(exp_avg_sq, "),
    "partition-count": (OPTIM.format(1), _partition_count, rf"{OPTIM.format(1)}: partition_count 4, the files say DP=2"),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("defect", list(DEFECTS))
def test_an_autoep_zero3_source_against_the_rule_is_refused_by_every_route(defect, route, tmp_path):
    name, edit, match = DEFECTS[defect]
    root = _copy(tmp_path)
    _edit(root, name, edit)
    with pytest.raises(CheckpointError, match=match):
        ROUTES[route](root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_fixture_passes_every_check():
    rs.open(FIXTURES / NAME)


def test_tp_ranks_cut_into_other_sub_groups_are_refused(tmp_path):
    """Each TP rank's sub-groups follow DeepSpeed's rule over its own shards, so two TP ranks may
    in principle be cut otherwise; the one layout has one list of units, so that is refused by
    name (never an index error). Planted: TP rank 1 records a 2e9-element first parameter, which
    the rule (sub_group_size 1e9) closes into a sub-group of its own."""
    name = "llama_zero3_tp2_dp2"
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    tag = next(p for p in root.iterdir() if p.is_dir())

    def split(sd: dict) -> None:
        (shapes,) = sd["param_shapes"]
        first = next(iter(shapes))
        sd["param_shapes"] = [{first: (2_000_000_000,)}, {n: s for n, s in shapes.items() if n != first}]

    def number(sd: dict) -> None:
        (group,) = sd["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
        group["params"] = [0, 1]

    for d in range(2):
        for fname, edit in ((f"zero_pp_rank_{d}_mp_rank_01_model_states.pt", split),
                            (f"zero_pp_rank_{d}_mp_rank_01_optim_states.pt", number)):
            sd = load(tag / fname, mmap=False)
            edit(sd)
            save(sd, tag / fname)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_01_model_states\.pt: TP rank 1 records 2 "
                                              r"sub-groups, TP rank 0 1: not supported"):
        rs.open(root)
