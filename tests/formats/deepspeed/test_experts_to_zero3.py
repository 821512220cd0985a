"""AutoEP ZeRO-1/2 -> ZeRO-3 (issue #32, item 5): ``reshard reshard --ep E --dp W --zero-stage 3``
from ``mixtral_autoep_ep2`` (ZeRO-1, world 2, EP 2) or ``mixtral_autoep_ep2_dp4`` (world 4, EDP 2)
writes DeepSpeed's AutoEP ZeRO-3 files (docs/deepspeed-checkpoints.md §11.1).

The oracle is DeepSpeed's own: ``mixtral_autoep_ep2_zero3`` is the same recipe trained at ZeRO-3, so
at its topology (EP 2 x world 2) every file reshard writes has that checkpoint's structure; the
ZeRO-3 -> ZeRO-1 route of the same writer, which DeepSpeed loads natively, leads back to DeepSpeed's
ZeRO-3 files object for object; and (e2e) DeepSpeed 0.19.8 loads reshard's ZeRO-3 files natively
to the masters, moments and weights its native ZeRO-1 load of the source has, and trains the same
losses."""

from __future__ import annotations

import pytest
import torch

from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import reshard
from reshard.storage.safe_load import load
from tests.support.compare import full_state as _full
from tests.support.compare import same_strict, tensor_meta
from tests.support.dsconv import FIXTURES, tag_dir

ZERO1, DP4, ZERO3 = "mixtral_autoep_ep2", "mixtral_autoep_ep2_dp4", "mixtral_autoep_ep2_zero3"
EXPERTS = [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("w1", "w2", "w3")]
STATES = ("fp32", "exp_avg", "exp_avg_sq")


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


@pytest.mark.parametrize("name,ep,dp", [(ZERO1, 2, 2), (ZERO1, 1, 1), (ZERO1, 2, 4), (DP4, 2, 4), (DP4, 1, 2)])
def test_zero12_experts_written_at_zero3(name, ep, dp, tmp_path):
    """Every state of every parameter at the ZeRO-3 target is the source's (read back through the
    ZeRO-3 AutoEP reader, which checks the sub-groups, ``ds_zero_partition_groups`` and each
    fragment's length); one file pair per DP rank, no per-expert file; each rank's layer entries its
    own view of the placement in DeepSpeed's ZeRO-3 format."""
    src = DeepSpeedCheckpoint.open(FIXTURES / name)
    out = reshard(FIXTURES / name, tmp_path, tp=1, dp=dp, ep=ep, zero_stage=3).out_dir
    new = DeepSpeedCheckpoint.open(out)
    assert (new.zero_stage, new.experts.ep, new.experts.edp, new.dp) == (3, ep, dp // ep, dp)
    # the ZeRO-1 module's router alias is its router's weight: a placeholder at ZeRO-3, no parameter
    assert sorted(new.names) == sorted(n for n in src.names if n not in src.experts.aliases)
    for n in new.names:
        for state in STATES:
            assert torch.equal(_full(new, n, state), _full(src, n, state)), (n, state)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(
        f"zero_pp_rank_{d}_mp_rank_00_{kind}_states.pt" for d in range(dp) for kind in ("model", "optim"))
    local = 4 // ep
    for d in range(dp):
        ms = load(out / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt")
        assert all(t.numel() == 0 for t in ms["module"].values())
        for entry in ms["ds_autoep_layers"] + ms["universal_checkpoint_info"]["ds_autoep_layers"]:
            e = d % ep
            assert (entry["checkpoint_format"], entry["checkpoint_format_version"]) == ("zero3_partitioned", 1)
            assert (entry["ep_rank"], entry["expert_data_parallel_rank"], entry["global_expert_start"]) == \
                (e, d // ep, e * local)
        groups = load(out / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert [t.ds_id for t in groups["fp32_flat_groups"]] == ["0_22", "6_18"]


def test_zero12_experts_at_zero3_are_laid_out_as_deepspeeds_own_zero3_save(tmp_path):
    """At EP 2 x world 2 every file reshard writes from the ZeRO-1 checkpoint has the structure of
    ``mixtral_autoep_ep2_zero3`` (the same recipe DeepSpeed trained at ZeRO-3): the same files, keys
    in order, every non-tensor value (configuration, placement entries, partition groups, parameter
    groups, step, loss scaler), each tensor's dtype, shape, strides, storage and ``ds_id``; only the
    numbers differ (ZeRO-1 and ZeRO-3 training round differently)."""
    out = reshard(FIXTURES / ZERO1, tmp_path, tp=1, dp=2, ep=2, zero_stage=3).out_dir
    native = tag_dir(ZERO3)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in native.glob("*.pt"))
    for p in native.glob("*.pt"):
        assert _layout(load(out / p.name)) == _layout(load(p)), p.name


def test_deepspeeds_zero3_files_come_back_through_zero1(tmp_path):
    """DeepSpeed's own ZeRO-3 files, written at ZeRO-1 (the route DeepSpeed loads natively, see
    test_experts_zero3.py) and back at ZeRO-3, are DeepSpeed's files object for object: keys and
    their order, types, every tensor's metadata and bits, ``ds_id``, the per-rank layer entries
    and partition groups. (fp32 training: the ZeRO-1 weights are the masters themselves.)"""
    mid = reshard(FIXTURES / ZERO3, tmp_path / "z1", tp=1, dp=2, ep=2, zero_stage=1).out_dir
    back = reshard(mid.parent, tmp_path / "z3", tp=1, dp=2, ep=2, zero_stage=3).out_dir
    native = tag_dir(ZERO3)
    assert sorted(p.name for p in back.glob("*.pt")) == sorted(p.name for p in native.glob("*.pt"))
    for p in native.glob("*.pt"):
        same_strict(load(back / p.name), load(p), p.name)


def test_round_trip_through_zero3_gives_the_zero1_states(tmp_path):
    """ZeRO-1 (EP 2 x world 2) -> ZeRO-3 at EP 1 x world 1 -> ZeRO-1 at the source's topology:
    every optimizer file and per-expert file object for object, and the module's weights the
    source's (fp32 training: the ZeRO-1 weights are the masters)."""
    mid = reshard(FIXTURES / ZERO1, tmp_path / "z3", tp=1, dp=1, ep=1, zero_stage=3).out_dir
    back = reshard(mid.parent, tmp_path / "z1", tp=1, dp=2, ep=2, zero_stage=1).out_dir
    native = tag_dir(ZERO1)
    assert sorted(p.name for p in back.glob("*.pt")) == sorted(p.name for p in native.glob("*.pt"))
    for p in native.glob("*optim_states.pt"):
        same_strict(load(back / p.name), load(p), p.name)
    for p in native.glob("layer_*.pt"):
        same_strict(load(back / p.name), load(p), p.name)
    ours, theirs = (load(d / "mp_rank_00_model_states.pt")["module"] for d in (back, native))
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


# -- DeepSpeed itself (e2e) ----------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow  # make test-all; make test keeps the file-level checks of the same route
def test_deepspeed_loads_the_zero1_experts_written_at_zero3(tmp_path):
    """One real job at world 2, EP 2: DeepSpeed resumes the ZeRO-1 source natively at ZeRO-1, then
    reshard's ZeRO-3 files natively at ZeRO-3 (``_rigid_load_state_dict`` checks the partition
    groups). After the load every parameter's master, moments and module weight are the same
    (layout-free digests), Adam's step is 3 in both, and both train the same two losses. DeepSpeed's
    own native save of what it loaded from reshard's files is those files."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many
    from tests.support.compare import rebase_ds_ids, same

    spec = model_spec_from_fixture(FIXTURES / ZERO1)
    ours = reshard(FIXTURES / ZERO1, tmp_path / "ours", tp=1, dp=2, ep=2, zero_stage=3).out_dir
    native = tmp_path / "native"
    loads = [resume_load("deepspeed", FIXTURES / ZERO1, model_spec=spec, tp=1, dp=2, universal=False, zero_stage=1),
             resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=2, universal=False, zero_stage=3,
                         save_dir=native)]
    reports = resume_many(loads, world_size=2, workdir=tmp_path / "job")
    theirs, mine = reports["deepspeed"], reports["reshard"]
    saved = native / ours.name
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in saved.glob("*.pt"))
    for p in saved.glob("*.pt"):  # but ds_config (the resuming job's); ds_id counts over a job's ZeRO-3 engines
        a, b = (rebase_ds_ids(load(x)) for x in (ours / p.name, p))
        for obj in (a, b):
            obj.pop("ds_config", None)
        same(a, b, p.name)
    assert mine["global_steps_after_load"] == theirs["global_steps_after_load"] == 3
    assert mine["optimizer_step_after_load"] == theirs["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"] and theirs["ranks_agree"]
    assert mine["layouts"][EXPERTS[0]] == "autoep"
    assert mine["digests"]["after_load"] == theirs["digests"]["after_load"]
    assert mine["losses"] == theirs["losses"]
    assert mine["optimizer_step_after_steps"] == [5.0]
