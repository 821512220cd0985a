"""A ZeRO-3 DeepSpeed checkpoint written from a universal checkpoint (issue #32, item 5):
``reshard reshard UCP OUT --to deepspeed --zero-stage 3 --dp W`` with UCP DeepSpeed's own
``ds_to_universal`` of ``llama_zero3_dp2``, or reshard's ``convert`` of it. The target is a fresh
ZeRO-3 job's files (``templates.fresh``) over the source's tensors.

The oracle is DeepSpeed's: ``llama_zero3_dp3`` is DeepSpeed's ``load_universal`` of that very
universal checkpoint at DP=3 saved natively, and ``llama_zero3_dp2`` the job that wrote it. Adam's
step comes from ``optimizer_state.pt`` (a ZeRO-3 universal checkpoint has no ``step.pt``), as
DeepSpeed's ZeRO-3 universal loader takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.formats.deepspeed.test_experts_from_universal import _differences
from tests.support.dsconv import FIXTURES, ds_to_universal, tag_dir

NAME = "llama_zero3_dp2"
# what a fresh job's files record otherwise than DeepSpeed's (the job's config, the samples seen)
FRESH = ("/ds_config", "/global_samples")


# DeepSpeed's own universal costs a ds_to_universal run (about 18 s): make test-all; reshard's convert
# writes the same files (tests/formats/deepspeed/test_convert_parity.py)
@pytest.fixture(scope="module", params=[pytest.param("deepspeed", marks=pytest.mark.slow), "reshard"])
def ucp(request, tmp_path_factory) -> Path:
    """The universal checkpoint of the fixture: DeepSpeed's ``ds_to_universal``'s or reshard's."""
    root = tmp_path_factory.mktemp(f"ucp_{request.param}")
    if request.param == "reshard":
        return convert(FIXTURES / NAME, root).out_dir.parent
    pytest.importorskip("deepspeed")
    out = ds_to_universal(NAME, root)
    (root / "latest_universal").write_text(out.name)
    return root


@pytest.mark.parametrize("dp,native", [(3, "llama_zero3_dp3"), (2, NAME)])
def test_zero3_from_a_universal_is_deepspeeds_own_save(ucp, dp, native, tmp_path):
    """Every file DeepSpeed saves at DP=``dp`` and no other; every tensor (masters, moments,
    placeholders: values, padding, ``ds_id``) and every other value (param_shapes, sub-groups,
    param groups, Adam's step 3, global_steps, the empty frozen-parameter records) equal, but the
    job's ``ds_config`` and ``global_samples``, which a universal checkpoint does not record."""
    out = reshard(ucp, tmp_path / "out", tp=1, dp=dp, zero_stage=3).out_dir
    theirs = tag_dir(native)
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        diff: list[str] = []
        _differences(load(out / p.name), load(p), "", diff)
        assert all(d.startswith(FRESH) for d in diff), (p.name, sorted(diff))
        obj = load(out / p.name)
        if "optim" in p.name:
            osd = obj["optimizer_state_dict"]
            assert float(osd["optimizer_state_dict"]["state"][0]["step"]) == 3.0
            assert [t.ds_id for t in osd["fp32_flat_groups"]] == \
                [t.ds_id for t in load(p)["optimizer_state_dict"]["fp32_flat_groups"]]
        else:
            assert obj["global_steps"] == 3 and obj["frozen_param_shapes"] == {}


@pytest.mark.e2e
@pytest.mark.slow  # make test-all; make test keeps the file-for-file checks of the same route
def test_deepspeed_loads_the_zero3_written_from_its_universal(tmp_path):
    """One real job at DP=2: DeepSpeed resumes its own universal checkpoint of the fixture at ZeRO-3
    (``load_universal``), then reshard's ZeRO-3 files written from it natively. Masters, moments and
    weights after the load, Adam's step, the digests after two more steps and the losses are the
    same; DeepSpeed's native save right after loading reshard's files is those files (but
    ``ds_config`` and ``global_samples``, which a universal checkpoint does not record)."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many
    from tests.support.compare import rebase_ds_ids, same

    root = tmp_path / "ucp"
    (root / "latest_universal").parent.mkdir()
    (root / "latest_universal").write_text(ds_to_universal(NAME, root).name)
    spec = model_spec_from_fixture(FIXTURES / NAME)
    ours = reshard(root, tmp_path / "ours", tp=1, dp=2, zero_stage=3).out_dir
    native = tmp_path / "native"
    loads = [resume_load("deepspeed", root, model_spec=spec, tp=1, dp=2, universal=True, zero_stage=3),
             resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=2, universal=False, zero_stage=3,
                         save_dir=native)]
    reports = resume_many(loads, world_size=2, workdir=tmp_path / "job")
    theirs, mine = reports["deepspeed"], reports["reshard"]
    assert mine["global_steps_after_load"] == theirs["global_steps_after_load"] == 3
    assert mine["optimizer_step_after_load"] == theirs["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"] and theirs["ranks_agree"]
    assert mine["digests"] == theirs["digests"]
    assert mine["losses"] == theirs["losses"]
    saved = native / ours.name
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in saved.glob("*.pt"))
    for p in saved.glob("*.pt"):  # ds_id counts over a job's ZeRO-3 engines
        a, b = (rebase_ds_ids(load(x)) for x in (ours / p.name, p))
        for key in FRESH:
            a.pop(key[1:], None)
            b.pop(key[1:], None)
        same(a, b, p.name)
