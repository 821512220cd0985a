"""``reshard.jobs.convert.reshard``: a DeepSpeed ZeRO-1/2 checkpoint rewritten at another TP x DP topology.

Fast tests (no DeepSpeed job):

* the files have exactly the structure DeepSpeed 0.19.8 writes at the target topology -- keys,
  dtypes, shapes, storages, ``param_slice_mappings``, paddings, ``universal_checkpoint_info`` --
  checked against the fixtures DeepSpeed itself saved at that topology (``llama_tp2_dp2`` to
  TP=1 x DP=2 against ``llama_zero1_dp2``, and back), and their values are within reduction-order
  noise of DeepSpeed's own run there;
* converting a resharded checkpoint with ``reshard.convert`` gives bit-identical universal tensors
  to converting its source (every parameter, state and step), over TP and DP changes, padded DP
  sizes, ZeRO-2, bf16 and a TP increase; a round trip returns the source files exactly;
* layout invariants hold where no reference exists (DP=3 with group padding);
* refusals, and the same crash safety as ``reshard convert``.

End to end (``e2e``): a real gloo DeepSpeed 0.19.8 job at the target topology loads the resharded
checkpoint natively (``engine.load_checkpoint``), takes two steps, and its losses and the digests
of fp32 masters, Adam moments and weights equal those of resuming the same source through
DeepSpeed's ``ds_to_universal`` + ``load_universal`` at that topology; the same for pipeline-module
checkpoints. Each load gets a fresh engine, but loads of the same world size share one job, with
those of ``tests/test_e2e_resume.py`` (``tests/e2e/plan.py``): three jobs in all, ~20-60 s each.
"""

from __future__ import annotations

import copy
import io
import math
import os
import re
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from reshard import ReshardError
from reshard.errors import CheckpointError, OutputError
from reshard.formats.deepspeed import zero12 as dsw
from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.ir.piece import prod
from reshard.jobs.convert import convert, reshard
from reshard.storage import torch_zip
from reshard.storage.pickling import save as save_whole
from reshard.storage.safe_load import FragmentAddress, load
from reshard.storage.staging import verify
from reshard.storage.torch_zip import TensorRef
from tests.support.dsconv import FIXTURES, tag_dir

TAG = "global_step3"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


# -- helpers -------------------------------------------------------------------------------------


def _struct(x, key=None):
    """Everything about a loaded checkpoint object except tensor values and ds_config."""
    if key == "ds_config":
        return "ds_config"
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), x.requires_grad, x.untyped_storage().nbytes(),
                x.storage_offset())
    if isinstance(x, dict):
        return (type(x).__name__, tuple((k, _struct(v, k)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_struct(v, key) for v in x))
    if key in ("global_steps", "global_samples"):
        return type(x).__name__
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return (type(x).__module__, type(x).__qualname__, _struct(dict(vars(x))))
    return (type(x).__name__, x)


def _first_difference(a, b, path=""):
    if a == b:
        return None
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}/{x[0] if isinstance(x, tuple) and x else i}")
            if d:
                return d
    return (path, a, b)


def _tensors(x, path=""):
    """Every tensor of a loaded object by path."""
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensors(v, f"{path}/{i}")


def _deep_equal(a, b, path=""):
    """Bit-for-bit equality of two loaded objects (tensors by value and dtype)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _deep_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _deep_equal(x, y, f"{path}/{i}")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b) and vars(a) == vars(b), path
    else:
        assert a == b, (path, a, b)


def _universal(ckpt: Path, out: Path) -> dict:
    """``reshard.convert`` of ``ckpt``: {param: {state: tensor}} plus the optimizer state."""
    folder = convert(ckpt, out).out_dir
    params = {}
    for d in sorted(p for p in (folder / "zero").iterdir() if p.is_dir()):
        params[d.name] = {s: load(d / f"{s}.pt", mmap=False)["param"] for s in STATES}
        params[d.name]["step"] = load(d / "step.pt", mmap=False)
    return {"params": params, "optimizer_state": load(folder / "zero" / "optimizer_state.pt", mmap=False)}


def _same_params(ours: dict, theirs: dict) -> None:
    assert list(ours["params"]) == list(theirs["params"])
    for name, states in theirs["params"].items():
        for state, t in states.items():
            got = ours["params"][name][state]
            assert got.dtype == t.dtype and torch.equal(got, t), (name, state)


@pytest.fixture(scope="module")
def source_universal(tmp_path_factory):
    cache: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("source_ucp")

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = _universal(FIXTURES / name, root / name)
        return cache[name]

    return get


def _check_layout_invariants(tag: Path, tp: int, dp: int, dtype=torch.float32) -> None:
    """What DeepSpeed's loader and converters rely on, checked from first principles: one flat
    buffer per TP rank aligned to 2*dp, cut into dp equal partitions; param_slice_mappings tile
    each parameter in order; the fp32 masters, put back together, are the module weights."""
    ck = DeepSpeedCheckpoint.open(tag)
    assert (ck.tp, ck.dp) == (tp, dp)
    for t in range(tp):
        ms = ck.model_state(t)
        assert ms["mp_world_size"] == tp and ms["dp_world_size"] == dp
        assert ms["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": tp}
        shapes = ms["param_shapes"][0]
        numel = sum(prod(s) for s in shapes.values())
        total = numel + (-numel % (2 * dp))
        part = total // dp
        flat = []
        for d in range(dp):
            osd = ck.osd(t, d)
            pad = max(0, min(part, (d + 1) * part - numel))
            assert osd["partition_count"] == [dp] and osd["group_paddings"] == [pad]
            assert osd["base_optimizer_state"]["state"][0]["exp_avg"].numel() == part
            lean = osd["single_partition_of_fp32_groups"][0]
            assert lean.numel() == part - pad and lean.requires_grad
            cursor = 0
            for name, frag in osd["param_slice_mappings"][0].items():
                assert isinstance(frag, FragmentAddress) and frag.start == cursor, (t, d, name)
                cursor += frag.numel
            assert cursor == part - pad
            flat.append(lean)
        flat = torch.cat(flat)
        off = 0
        for name, shape in shapes.items():
            n = prod(shape)
            assert torch.equal(flat[off:off + n].view(shape).to(dtype), ms["module"][name]), (t, name)
            off += n


# -- structure: exactly what DeepSpeed writes ---------------------------------------------------

# (source, tp, dp, layout, fixture DeepSpeed saved at that topology)
AGAINST_DEEPSPEED = [
    ("llama_tp2_dp2", 1, 2, None, "llama_zero1_dp2"),
    ("llama_zero1_dp2", 2, 2, "llama_tp2_dp2", "llama_tp2_dp2"),
]


@pytest.mark.parametrize("source,tp,dp,layout,reference", AGAINST_DEEPSPEED,
                         ids=[f"{s}-to-tp{t}dp{d}" for s, t, d, _, _ in AGAINST_DEEPSPEED])
def test_files_are_what_deepspeed_writes_at_the_target(source, tp, dp, layout, reference, tmp_path):
    out = reshard(FIXTURES / source, tmp_path, tp=tp, dp=dp,
                  layout=None if layout is None else FIXTURES / layout).out_dir
    ref = tag_dir(reference)
    assert (tmp_path / "latest").read_text() == TAG and out == tmp_path / TAG
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in ref.iterdir()] + ["reshard-manifest.json"])
    for f in sorted(ref.iterdir()):
        ours, theirs = load(out / f.name), load(f)
        diff = _first_difference(_struct(ours), _struct(theirs))
        assert diff is None, f"{f.name}: {diff}"
        # ds_config: the source's, at the target's ZeRO stage and AutoTP size
        cfg = ours["ds_config"]
        assert cfg["zero_optimization"]["stage"] == 1
        assert cfg.get("tensor_parallel", {"autotp_size": 1})["autotp_size"] == tp
        if "universal_checkpoint_info" in theirs:
            assert ours["universal_checkpoint_info"] == theirs["universal_checkpoint_info"]
        # Same model, init, data and steps, trained by DeepSpeed at the two topologies: the values
        # agree up to the reduction order of TP (fp32 ~1e-7); a misplaced block would not.
        for (path, a), (_, b) in zip(_tensors(ours), _tensors(theirs)):
            if a.dtype.is_floating_point and a.numel() > 1:
                assert torch.allclose(a, b, rtol=1e-3, atol=1e-6), (f.name, path, (a - b).abs().max())


def test_affine_map_entry_is_deepspeeds_format():
    ck = DeepSpeedCheckpoint.open(FIXTURES / "llama_tp2_dp2")
    entry = dsw.affine_map_entry({n: ck.tp_map(n).map for n in ck.names})
    recorded = ck.model_state(0)["universal_checkpoint_info"]["affine_map"]
    assert entry["version"] == recorded["version"]
    assert entry["params"] == recorded["params"]  # same keys (^escaped$), dicts, int ranks


# -- values: bit-identical universal tensors ----------------------------------------------------

# (source, tp, dp, zero stage, layout)
CASES = [
    ("llama_tp2_dp2", 1, 2, None, None),
    ("llama_tp2_dp2", 2, 1, None, None),
    ("llama_tp2_dp2", 1, 1, None, None),
    ("llama_tp2_dp2", 2, 3, 2, None),  # group padding on the last DP rank, ZeRO-2
    ("llama_zero1_dp2", 1, 4, None, None),
    ("llama_zero1_dp2", 1, 3, None, None),
    ("llama_zero1_dp2", 2, 2, None, "llama_tp2_dp2"),  # TP up, layout from a TP=2 checkpoint
    ("llama_zero2_dp2", 1, 3, 1, None),
    ("llama_zero1_dp2_bf16", 1, 4, None, None),
    ("qwen2_tp2", 1, 3, None, None),
    ("llama_tp2", 4, 1, None, "geometry"),  # TP 2 -> 4, layouts rebuilt from their geometry
]


@pytest.mark.parametrize("source,tp,dp,stage,layout", CASES,
                         ids=[f"{s}-to-tp{t}dp{d}" + (f"z{z}" if z else "") for s, t, d, z, _ in CASES])
def test_resharded_checkpoint_converts_to_the_same_universal_tensors(source, tp, dp, stage, layout, tmp_path,
                                                                    source_universal):
    lay = FIXTURES / layout if layout not in (None, "geometry") else layout
    report = reshard(FIXTURES / source, tmp_path / "out", tp=tp, dp=dp, zero_stage=stage, layout=lay)
    ck = DeepSpeedCheckpoint.open(report.out_dir)
    src = DeepSpeedCheckpoint.open(FIXTURES / source)
    assert (ck.tp, ck.dp, ck.zero_stage) == (tp, dp, stage or src.zero_stage)
    bf16 = source.endswith("bf16")
    assert all(p.name.startswith("bf16_") == bf16 for p in ck.optim_files.values())
    verify(report.out_dir)
    if source != "qwen2_tp2" and tp != 4:
        _check_layout_invariants(report.out_dir, tp, dp, torch.bfloat16 if bf16 else torch.float32)

    ours, theirs = _universal(report.out_dir, tmp_path / "ucp"), source_universal(source)
    _same_params(ours, theirs)
    a, b = ours["optimizer_state"], theirs["optimizer_state"]
    assert list(a) == list(b)
    for k in a:
        if k == "partition_count":
            assert a[k] == [dp]
        elif k == "zero_stage":
            assert int(a[k]) == (stage or src.zero_stage)
        elif k != "group_paddings":
            _deep_equal(a[k], b[k], k)


@pytest.mark.parametrize("stage", [1, 2])
def test_round_trip_keeps_per_rank_replicas_and_empty_shards(stage, tmp_path):
    """GPT-BigCode TP=2: TP rank 1 holds no query rows (zero-element shards, outside the
    optimizer, recorded as frozen under ZeRO-2) and its copy of the replicated k/v rows drifted
    from rank 0's. DP 1 -> 2 -> 1 at the same TP keeps each TP rank's own copy."""
    mid = reshard(FIXTURES / "gpt_bigcode_tp2", tmp_path / "mid", tp=2, dp=2, zero_stage=stage).out_dir
    ms = load(mid / "mp_rank_01_model_states.pt")
    empty = [f"transformer.h.{i}.attn.c_proj.weight" for i in (0, 1)]
    assert all(n not in ms["param_shapes"][0] and ms["module"][n].shape == (32, 0) for n in empty)
    assert (list(ms["frozen_param_shapes"]) == empty) if stage == 2 else ms["frozen_param_shapes"] is None
    back = reshard(mid, tmp_path / "back", tp=2, dp=1, zero_stage=1).out_dir
    for f in sorted(tag_dir("gpt_bigcode_tp2").iterdir()):
        _deep_equal(load(back / f.name, mmap=False), load(f, mmap=False), f.name)


def test_module_storage_and_dtype_follow_deepspeed(tmp_path):
    out = reshard(FIXTURES / "llama_zero1_dp2_bf16", tmp_path, tp=1, dp=3).out_dir
    module = load(out / "mp_rank_00_model_states.pt")["module"]
    numel = sum(t.numel() for t in module.values())
    sizes = {(t.dtype, t.untyped_storage().nbytes()) for t in module.values()}
    # one flat bf16 buffer, padded to a multiple of 2 * dp, as DeepSpeed's bit16 group
    assert sizes == {(torch.bfloat16, (numel + (-numel % 6)) * 2)}
    src = load(tag_dir("llama_zero1_dp2_bf16") / "mp_rank_00_model_states.pt")["module"]
    for k in src:
        assert torch.equal(module[k], src[k])


def test_zero_stage_change_and_stage_2_fields(tmp_path):
    out = reshard(FIXTURES / "llama_zero1_dp2", tmp_path, tp=1, dp=2, zero_stage=2).out_dir
    ms = load(out / "mp_rank_00_model_states.pt")
    assert ms["frozen_param_shapes"] == OrderedDict() and ms["frozen_param_fragments"] == OrderedDict()
    assert ms["ds_config"]["zero_optimization"]["stage"] == 2
    osd = load(out / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert int(osd["zero_stage"]) == 2 and type(osd["zero_stage"]).__name__ == "ZeroStageEnum"
    # and back to ZeRO-1: identical to the source
    back = reshard(out, tmp_path / "back", tp=1, dp=2, zero_stage=1).out_dir
    for f in sorted(tag_dir("llama_zero1_dp2").iterdir()):
        _deep_equal(load(back / f.name, mmap=False), load(f, mmap=False), f.name)


def test_dp_defaults_to_the_sources(tmp_path):
    out = reshard(FIXTURES / "llama_tp2_dp2", tmp_path, tp=1).out_dir
    assert (DeepSpeedCheckpoint.open(out).tp, DeepSpeedCheckpoint.open(out).dp) == (1, 2)


def test_reads_only_what_it_writes(tmp_path):
    """Each output partition reads exactly its own elements: the elements read equal the
    elements written into partitions (no full parameter is assembled, nothing is read twice)."""
    report = reshard(FIXTURES / "llama_tp2_dp2", tmp_path, tp=1, dp=2)
    assert report.elements_read == 3 * 29344  # fp32, exp_avg, exp_avg_sq of every element once


def test_layout_from_a_map_document(tmp_path, source_universal):
    """TP 1 -> 2 with the target layout given as a JSON map document: the written
    universal_checkpoint_info.affine_map describes it, and it converts to the same tensors."""
    import json

    from reshard.ir import maps_to_document

    ck = DeepSpeedCheckpoint.open(FIXTURES / "llama_tp2_dp2")
    doc = tmp_path / "tp2.json"
    doc.write_text(json.dumps(maps_to_document({n: ck.tp_map(n).map for n in ck.names})))
    out = reshard(FIXTURES / "llama_zero1_dp2", tmp_path / "out", tp=2, dp=1, layout=doc).out_dir
    info = load(out / "mp_rank_01_model_states.pt")["universal_checkpoint_info"]
    assert info["affine_map"] == ck.model_state(0)["universal_checkpoint_info"]["affine_map"]
    ours = _universal(out, tmp_path / "ucp")
    for name, states in source_universal("llama_zero1_dp2")["params"].items():
        for state, t in states.items():
            assert torch.equal(ours["params"][name][state], t), (name, state)


# -- refusals ------------------------------------------------------------------------------------


def test_tp_change_needs_a_recorded_tp_layout(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_tp2", src)
    from reshard.storage.pickling import save

    for t in (0, 1):
        path = src / TAG / f"mp_rank_{t:02d}_model_states.pt"
        obj = load(path, mmap=False)
        del obj["universal_checkpoint_info"]
        save(obj, path)
    with pytest.raises(CheckpointError, match=r"without universal_checkpoint_info"):
        reshard(src, tmp_path / "out", tp=1, dp=2)
    out = reshard(src, tmp_path / "out", tp=2, dp=2).out_dir  # DP alone can change
    assert "universal_checkpoint_info" not in load(out / "mp_rank_00_model_states.pt")


def test_tp_change_without_a_layout_is_refused(tmp_path):
    with pytest.raises(ReshardError, match=r"layout"):
        reshard(FIXTURES / "llama_tp2_dp2", tmp_path, tp=4, dp=1)
    with pytest.raises(ReshardError, match=r"layout"):
        reshard(FIXTURES / "llama_zero1_dp2", tmp_path, tp=2, dp=2)
    with pytest.raises(ReshardError, match=r"TP=2, the target is TP=4"):
        reshard(FIXTURES / "llama_zero1_dp2", tmp_path, tp=4, dp=1, layout=FIXTURES / "llama_tp2_dp2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 1, "dp": 2, "pp": 2}, r"pipeline"),
    ({"tp": 2, "dp": 2, "zero_stage": 3}, r"changing TP from 1 to 2 needs the layout"),  # ZeRO-3: test_zero3_tp
    ({"tp": 0, "dp": 2}, r"tp must be a positive integer"),
    ({"tp": 1, "dp": 2.0}, r"dp must be a positive integer"),
])
def test_bad_arguments_are_refused(kwargs, match, tmp_path):
    with pytest.raises(ReshardError, match=match):
        reshard(FIXTURES / "llama_zero1_dp2", tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_output_over_the_source_is_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_zero1_dp2", src)
    with pytest.raises(ReshardError, match=r"would replace the source"):
        reshard(src, src, tp=1, dp=4, overwrite=True)
    assert DeepSpeedCheckpoint.open(src).dp == 2


# ZeRO-3 sources: tests/formats/deepspeed/test_zero3_reshard.py


def test_truncated_source_partition_is_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_zero1_dp2", src)
    path = src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    obj = load(path, mmap=False)
    obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] = \
        obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][:-5].clone()
    from reshard.storage.pickling import save

    save(obj, path)
    with pytest.raises(CheckpointError, match=r"fp32 partition has 14667 elements"):
        reshard(src, tmp_path / "out", tp=1, dp=4)


def test_unknown_zero_layout_is_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_zero1_dp2", src)
    path = src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    obj = load(path, mmap=False)
    mappings = obj["optimizer_state_dict"]["param_slice_mappings"][0]
    first = next(iter(mappings))
    mappings[first] = FragmentAddress(numel=mappings[first].numel, start=mappings[first].start + 8)
    from reshard.storage.pickling import save

    save(obj, path)
    with pytest.raises(CheckpointError, match=r"param_slice_mappings differ from DeepSpeed 0.19.8's"):
        reshard(src, tmp_path / "out", tp=1, dp=4)


# -- crash safety --------------------------------------------------------------------------------


def test_failure_midway_leaves_no_output_and_no_latest(tmp_path, monkeypatch):
    """The disk fills while an optimizer file's stripe is written (``storage.zip_stripes``)."""
    from reshard.storage import zip_stripes

    real = zip_stripes._pwrite

    def flaky(fd, view, at):
        if "optim" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError("disk full (simulated)")
        real(fd, view, at)

    monkeypatch.setattr(zip_stripes, "_pwrite", flaky)
    with pytest.raises(OutputError, match=r"optim_states\.pt: cannot write the output \(disk full \(simulated\)\)"):
        reshard(FIXTURES / "llama_tp2_dp2", tmp_path, tp=1, dp=4)
    assert list(tmp_path.iterdir()) == []  # no tag folder, no partial folder, no latest


def test_killed_run_is_cleaned_up_and_existing_output_is_kept(tmp_path):
    # a run killed mid-way leaves only the hidden partial folder
    partial = tmp_path / f".reshard-partial-{TAG}"
    partial.mkdir()
    (partial / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"half")
    (tmp_path / "latest").write_text("global_step1")  # an older checkpoint's pointer
    out = reshard(FIXTURES / "llama_zero1_dp2", tmp_path, tp=1, dp=4).out_dir
    assert not partial.exists() and (tmp_path / "latest").read_text() == TAG
    assert verify(out)["target_topology"] == {"tp": 1, "dp": 4, "pp": 1, "zero_stage": 1}
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match="already exists"):
        reshard(FIXTURES / "llama_zero1_dp2", tmp_path, tp=1, dp=2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    again = reshard(FIXTURES / "llama_zero1_dp2", tmp_path, tp=1, dp=2, overwrite=True).out_dir
    assert DeepSpeedCheckpoint.open(again).dp == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [TAG, "latest"]


# -- streaming: every file written as its bytes are produced ------------------------------------


def _materialised(obj):
    """``obj`` with every ``torch_zip`` placeholder replaced by the real tensor it stands for,
    each storage filled in one window, every sharing kept: what ``torch.save`` would have been
    handed had the writer built its tensors in memory."""
    refs, flats, memo = [], {}, {}

    def walk(x):
        if isinstance(x, TensorRef):
            refs.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    for r in refs:
        st = r.storage
        if id(st) not in flats:
            flats[id(st)] = torch.zeros(st.numel, dtype=st.dtype)
            st.source(flats[id(st)], 0)
        t = flats[id(st)].as_strided(r.shape, r.stride, r.offset)
        memo[id(r)] = t.requires_grad_(True) if r.requires_grad else t
    assert refs, "nothing was streamed"
    return copy.deepcopy(obj, memo)


STREAMED = [("llama_tp2_dp2", {"tp": 1, "dp": 3}), ("gpt_bigcode_tp2", {"tp": 2, "dp": 2, "zero_stage": 2}),
            ("llama_zero1_dp2_bf16", {"tp": 1, "dp": 3}), ("llama_zero2_dp2", {"tp": 1, "dp": 4})]


@pytest.mark.parametrize("source,kw", STREAMED, ids=[s for s, _ in STREAMED])
def test_streamed_files_are_byte_identical_to_saving_the_built_tensors(source, kw, tmp_path, monkeypatch):
    """Module and optimizer files are streamed (``storage.torch_zip``): their flat buffers are
    placeholders filled window by window from the plan. Each file, at tiny and odd chunk sizes
    and as written (in stripes of at most a few KiB, by two workers), is byte for byte what
    ``torch.save`` writes for the same object built in memory."""
    from reshard.storage import zip_stripes

    laid_out, references = zip_stripes.Archive.__init__, []

    def checked(self, staging, rel, obj, stripes, **kw):
        reference = io.BytesIO()
        save_whole(_materialised(obj), reference)
        for chunk in (64, 4100):
            streamed = io.BytesIO()
            torch_zip.save(obj, streamed, chunk_bytes=chunk)
            assert streamed.getvalue() == reference.getvalue(), chunk
        references.append(reference.getvalue())
        laid_out(self, staging, rel, obj, stripes, **kw)

    monkeypatch.setattr(zip_stripes.Archive, "__init__", checked)
    monkeypatch.setenv("RESHARD_STRIPE_BYTES", "1000")  # and written in stripes
    out = reshard(FIXTURES / source, tmp_path, workers=2, **kw).out_dir
    files = sorted(p.read_bytes() for p in out.iterdir() if p.suffix == ".pt")
    assert len(files) == 1 + kw["dp"] if kw["tp"] == 1 else 2 * (1 + kw["dp"])
    assert files == sorted(references)
    verify(out)


# -- end to end: DeepSpeed loads it natively ------------------------------------------------------
# The jobs, and the reshard / ds_to_universal outputs they load, are made once per session and
# shared with tests/test_e2e_resume.py: tests/e2e/plan.py, the ``e2e`` fixture of tests/conftest.py.

from tests.e2e.plan import PIPE_TARGETS, RESHARD_QUICK, RESHARD_TARGETS  # noqa: E402

# (source, tp, dp); make test loads RESHARD_QUICK natively, the others are in the slow tier (make test-all)
E2E = [pytest.param(*t, marks=[] if t in RESHARD_QUICK else [pytest.mark.slow]) for t in RESHARD_TARGETS]
STEPS = 2


def _sane(report: dict, tp: int, dp: int, universal: bool) -> None:
    assert report["topology"] == {"tp": tp, "dp": dp, "world_size": tp * dp, "zero_stage": 1, "universal": universal}
    assert report["load_path"].startswith(report["load_dir"] + f"/{TAG}/")
    assert len(report["losses"]) == STEPS and all(math.isfinite(x) for x in report["losses"])
    assert report["ranks_agree"] and report["tp_peers_same_loss"] and report["replica_mismatches"] == []
    assert report["global_steps_after_load"] == 3 and report["optimizer_step_after_load"] == [3.0]
    assert report["optimizer_step_after_steps"] == [3.0 + STEPS]


@pytest.mark.e2e
@pytest.mark.parametrize("source,tp,dp", E2E, ids=[f"{s}-to-tp{t}dp{d}" for s, t, d in RESHARD_TARGETS])
def test_deepspeed_loads_it_natively_and_trains_as_from_universal(source, tp, dp, e2e):
    """``reshard.jobs.convert.reshard`` of ``source`` to TP=tp x DP=dp, loaded with DeepSpeed's ordinary
    load_checkpoint, against ds_to_universal of ``source`` loaded with load_universal there."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from tests.e2e.digest import differences

    native = e2e.report("resharded", source, tp, dp)
    via_ucp = e2e.report("ds_to_universal", source, tp, dp)
    assert Path(native["load_dir"]) == e2e.resharded(source, tp, dp).resolve()
    assert Path(via_ucp["load_dir"]) == e2e.ds_ucp(source).resolve()
    print(f"{source} -> TP={tp} x DP={dp}: native losses {native['losses_per_dp_rank']} "
          f"({native['wall_seconds']:.1f}s), via ds_to_universal {via_ucp['losses_per_dp_rank']} "
          f"({via_ucp['wall_seconds']:.1f}s)")
    _sane(native, tp, dp, universal=False)
    _sane(via_ucp, tp, dp, universal=True)
    assert native["losses_per_rank"] == via_ucp["losses_per_rank"]  # exact float equality
    for phase in ("after_load", "after_steps"):
        diff = differences(via_ucp["digests"][phase], native["digests"][phase])
        assert diff == [], f"{phase}: native load of the resharded checkpoint differs in {diff[:5]}"
        assert native["digests"][phase] == via_ucp["digests"][phase]
    # every parameter was loaded, with its Adam moments
    assert all({"fp32", "exp_avg", "exp_avg_sq", "module"} <= set(v) for v in native["digests"]["after_load"].values())
    assert all(re.fullmatch(r"[0-9a-f]{64}", v["fp32"]["sha256"]) for v in native["digests"]["after_load"].values())


# -- pipeline (deepspeed.pipe) checkpoints: stages kept or merged, any DP ------------------------

PIPE_CASES = [("pipe_pp2_dp2", 1, 2), ("pipe_pp2_dp2", 2, 1), ("pipe_pp2_dp2", 2, 4),
              ("pipe_pp2_dp2_bf16_odd", 1, 3), ("pipe_pp2_dp2_bf16_odd", 2, 1)]


@pytest.mark.parametrize("source,pp,dp", PIPE_CASES, ids=[f"{s}-to-pp{p}dp{d}" for s, p, d in PIPE_CASES])
def test_pipeline_checkpoint_keeps_or_merges_stages(source, pp, dp, tmp_path, source_universal):
    """Every target stage file and DP partition holds the same universal tensors as the source;
    layer files are carried over byte for byte."""
    report = reshard(FIXTURES / source, tmp_path / "out", tp=1, pp=pp, dp=dp)
    verify(report.out_dir)
    ck = DeepSpeedCheckpoint.open(report.out_dir)
    assert (ck.pp, ck.tp, ck.dp, ck.zero_stage) == (pp, 1, dp, 1)
    for m in range(pp):
        ms = ck.model_state(m)
        assert ms["module"] is None and ms["mp_world_size"] == pp and ms["dp_world_size"] == dp
        assert ms["checkpoint_parallel_dimensions"] == {"pp_degree": pp, "tp_degree": 1}
    src_tag = FIXTURES / source / TAG
    for layer in sorted(src_tag.glob("layer_*")):
        assert (report.out_dir / layer.name).read_bytes() == layer.read_bytes()
    ours, theirs = _universal(report.out_dir, tmp_path / "ucp"), source_universal(source)
    _same_params(ours, theirs)


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 1, "pp": 3, "dp": 2}, r"partition_method"),
    ({"tp": 2, "pp": 2, "dp": 1}, r"TP=1 and keeps it"),
    ({"tp": 1, "pp": 1, "dp": 2, "zero_stage": 2}, r"ZeRO stage 1 only"),
])
def test_pipeline_targets_that_cannot_be_known_are_refused(kwargs, match, tmp_path):
    with pytest.raises(ReshardError, match=match):
        reshard(FIXTURES / "pipe_pp2_dp2", tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []


PIPE_E2E = PIPE_TARGETS  # (pp, dp)


@pytest.mark.e2e
@pytest.mark.parametrize("pp,dp", PIPE_E2E, ids=[f"pp{p}dp{d}" for p, d in PIPE_E2E])
def test_deepspeed_pipeline_loads_it_natively_and_trains_as_from_universal(pp, dp, e2e):
    """A PipelineModule job at the target topology loads the resharded checkpoint with its
    ordinary load_checkpoint: its two next losses equal those after loading ds_to_universal's
    output with load_universal, and what it saves right after loading equals our files."""
    pytest.importorskip("deepspeed")

    source = "pipe_pp2_dp2"
    ours = e2e.pipe_resharded(pp, dp)
    native, via_ucp = e2e.pipe_report("resharded", pp, dp), e2e.pipe_report("ds_to_universal", pp, dp)
    for report in (native, via_ucp):
        assert (report["stages"], report["dp"]) == (pp, dp)
    native, via_ucp = native["losses"], via_ucp["losses"]
    print(f"{source} -> PP={pp} x DP={dp}: native {native}, via ds_to_universal {via_ucp}")
    assert len(native) == STEPS and all(math.isfinite(x) for x in native)
    assert native == via_ucp  # exact float equality
    resaved = e2e.pipe_resaved(pp, dp)
    again = resaved / (resaved / "latest").read_text().strip()
    files = sorted(p.name for p in ours.iterdir() if p.suffix == ".pt")
    assert files == sorted(p.name for p in again.iterdir() if p.suffix == ".pt")
    for name in files:  # DeepSpeed's own save of what it loaded: the same objects, bit for bit
        _deep_equal(load(ours / name, mmap=False), load(again / name, mmap=False), name)
