"""``--ep`` with ``--tp 2`` from a universal, DCP or HF Mixtral source: AutoEP folded over AutoTP
(docs/deepspeed-checkpoints.md §11.2), the dense TP maps and ``universal_checkpoint_info`` of the
folded DeepSpeed fixture ``mixtral_autoep_ep2_tp2`` (``--layout``), the experts placed through the
AutoEP view the TP 1 ``--ep`` route uses, the files a fresh ZeRO job's.

The oracles: from the universal checkpoints of ``mixtral_autoep_ep2``, what the same route writes
from that DeepSpeed checkpoint itself (object for object but the job's ``ds_config`` and
``global_samples``, which a universal checkpoint does not record), and every master and moment the
source's; from the HF folder and its DCP, what the route through DeepSpeed's TP 1 layout writes
(``--tp 1 --ep 2``, checked against DeepSpeed's own save in test_autoep_presets.py, then folded from
that DeepSpeed checkpoint), object for object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from reshard import ReshardError
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.support.compare import full_state
from tests.support.dsconv import FIXTURES, ds_to_universal

SOURCE = "mixtral_autoep_ep2"  # DeepSpeed's TP 1 x EP 2 save of the recipe
LAYOUT = FIXTURES / "mixtral_autoep_ep2_tp2"  # the same recipe DeepSpeed saved folded at TP 2 x EP 2
HF = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "pretrained_mixtral"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
# what a fresh job records otherwise than the DeepSpeed source (as at TP 1: test_experts_from_universal.py);
# its optimizer groups also list their keys in another order (name and moe after torch's defaults)
FRESH = ("/ds_config", "/global_samples")


def _differences(x: Any, y: Any, path: str, out: list[str], fresh: tuple[str, ...]) -> None:
    """Where ``x`` and ``y`` differ, outside the paths ``fresh``: tensors by dtype, shape and value;
    dicts by their keys in order and key by key; objects by their attributes."""
    if path.startswith(fresh) and path:
        return
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and torch.equal(x, y)):
            out.append(path)
    elif isinstance(x, dict) and isinstance(y, dict):
        kept = [[k for k in d if not f"{path}/{k}".startswith(fresh)] for d in (x, y)]
        if "/param_groups[" in path:  # a fresh job's optimizer groups: their keys in torch's order (noted)
            kept = [sorted(k) for k in kept]
        if kept[0] != kept[1]:
            out.append(f"{path}:keys {kept[0]} != {kept[1]}")
        for k in set(kept[0]) & set(kept[1]):
            _differences(x[k], y[k], f"{path}/{k}", out, fresh)
    elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y) and type(x) is type(y):
        for i, (a, b) in enumerate(zip(x, y)):
            _differences(a, b, f"{path}[{i}]", out, fresh)
    elif hasattr(x, "__dict__") and type(x) is type(y):
        _differences(vars(x), vars(y), path, out, fresh)
    elif type(x) is not type(y) or x != y:
        out.append(path)


def _same_files(ours: Path, theirs: Path, fresh: tuple[str, ...]) -> None:
    """The same files, each object equal (keys in order, types, tensors bit for bit) outside ``fresh``."""
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        out: list[str] = []
        _differences(load(ours / p.name), load(p), "", out, fresh)
        assert not out, (p.name, sorted(out))


@pytest.fixture(scope="module", params=["ds_to_universal", "reshard"])
def ucp(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ucp")
    if request.param == "reshard":
        return convert(FIXTURES / SOURCE, root / "u", fmt="universal").out_dir.parent
    pytest.importorskip("deepspeed")  # its ds_to_universal makes the source
    ds_to_universal(SOURCE, root)
    (root / "latest_universal").write_text((FIXTURES / SOURCE / "latest").read_text().strip())
    return root


@pytest.mark.parametrize("stage", [1, 3])
def test_folded_from_its_universal_is_what_the_deepspeed_source_gives(ucp, stage, tmp_path):
    """``--tp 2 --ep 2 --zero-stage S --layout <folded>`` from the universal checkpoint: every file the
    same route writes from the DeepSpeed source, every key in order, every tensor and value equal
    but ``ds_config`` and ``global_samples``; every master and moment the source's."""
    ours = reshard(ucp, tmp_path / "ours", to="deepspeed", tp=2, ep=2, zero_stage=stage, layout=LAYOUT).out_dir
    theirs = reshard(FIXTURES / SOURCE, tmp_path / "theirs", tp=2, ep=2, zero_stage=stage, layout=LAYOUT).out_dir
    _same_files(ours, theirs, FRESH)
    new, src = DeepSpeedCheckpoint.open(ours.parent), DeepSpeedCheckpoint.open(FIXTURES / SOURCE)
    assert (new.tp, new.dp, new.zero_stage, new.experts.ep, new.experts.folded) == (2, 1, stage, 2, True)
    for n in [n for grp in src.groups(0) for n in grp]:  # every parameter of an optimizer group
        for s in STATES:
            assert torch.equal(full_state(new, n, s), full_state(src, n, s)), (n, s)


@pytest.fixture(scope="module")
def via_tp1(tmp_path_factory) -> Path:
    """The HF folder at DeepSpeed's TP 1 AutoEP layout, then folded from that DeepSpeed checkpoint."""
    root = tmp_path_factory.mktemp("via")
    tp1 = reshard(HF, root / "tp1", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    return reshard(tp1.parent, root / "folded", tp=2, ep=2, layout=LAYOUT).out_dir


@pytest.mark.parametrize("kind", ["hf", "dcp"])
def test_folded_from_an_hf_folder_or_its_dcp_is_the_route_through_tp1(kind, via_tp1, tmp_path):
    """The HF folder transformers saved, or its DCP checkpoint, written folded directly: the files of
    the route through DeepSpeed's TP 1 layout, object for object."""
    src = HF if kind == "hf" else convert(HF, tmp_path / "dcp", fmt="dcp").out_dir
    ours = reshard(src, tmp_path / "ours", to="deepspeed", tp=2, ep=2, layout=LAYOUT).out_dir
    _same_files(ours, via_tp1, ())


def test_folded_from_a_universal_without_layout_is_refused(tmp_path):
    """No folded DeepSpeed checkpoint to take the dense TP maps from: refused naming ``--layout``,
    before any output exists."""
    ucp = convert(FIXTURES / SOURCE, tmp_path / "u", fmt="universal").out_dir.parent
    with pytest.raises(ReshardError, match=r"an AutoEP target at TP=2 from .* saved folded at TP=2 \(--layout\)"):
        reshard(ucp, tmp_path / "out", to="deepspeed", tp=2, ep=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_loads_the_folded_outputs_natively(tmp_path):
    """One world-2 job: DeepSpeed loads, folded at TP 2 x EP 2, reshard's output from the universal
    checkpoint of ``mixtral_autoep_ep2`` (its digests those of DeepSpeed's own TP 1 load of that
    checkpoint) and from the folded ZeRO-3 fixture written at ZeRO-1 (its digests that fixture's
    ``oracle.json``); step 3, ranks agree, and its save right after each load is our files but
    ``ds_config`` (and ``global_samples``, which the fresh job's files lack)."""
    pytest.importorskip("deepspeed")
    import json

    from tests.e2e.digest import differences
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    zero3 = FIXTURES / "mixtral_autoep_ep2_tp2_zero3"
    ucp = convert(FIXTURES / SOURCE, tmp_path / "u", fmt="universal").out_dir.parent
    outs = {"from_universal": reshard(ucp, tmp_path / "a", to="deepspeed", tp=2, ep=2, layout=LAYOUT).out_dir,
            "from_zero3": reshard(zero3, tmp_path / "b", tp=2, ep=2, zero_stage=1).out_dir}
    spec = model_spec_from_fixture(LAYOUT)
    tp1 = model_spec_from_fixture(LAYOUT)
    tp1["ds_config"].pop("tensor_parallel")
    loads = [resume_load("unfolded", FIXTURES / SOURCE, model_spec=tp1, tp=1, dp=2, universal=False)]
    loads += [resume_load(k, out.parent, model_spec=spec, tp=2, dp=1, universal=False, save_dir=tmp_path / f"n_{k}")
              for k, out in outs.items()]
    reports = resume_many(loads, world_size=2, workdir=tmp_path / "job")
    want = {"from_universal": reports["unfolded"]["digests"]["after_load"],
            "from_zero3": json.loads((zero3 / "oracle.json").read_text())["digests"]}
    for k, out in outs.items():
        r = reports[k]
        assert differences(want[k], r["digests"]["after_load"]) == [], k
        assert r["global_steps_after_load"] == 3 and r["optimizer_step_after_load"] == [3.0], k
        assert r["ranks_agree"] and r["layouts"]["model.layers.0.mlp.experts.w1"] == "autoep", k
        _same_files(out, tmp_path / f"n_{k}" / out.name, FRESH)
