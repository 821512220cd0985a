"""The conformance suite: every reader to every writer, one engine.

For each source fixture (written by its framework) and each target format, the output is read back
by the *target framework's own reader* and compared, tensor for tensor and bit for bit, with the
*source framework's own consolidation* of the source: weights, and both Adam moments wherever both
ends hold them. The other contracts every route keeps are tested once for all writers: a target a
source cannot be written as is refused naming what is missing, before anything exists; a failure
midway leaves nothing; a DeepSpeed checkpoint written at another topology and back is its source.

Readers of the target: ``torch.load(weights_only=True)`` of universal files, ``safetensors.load_file``,
torch's ``dcp_to_torch_save``, DeepSpeed's ``ds_to_universal``. Consolidations of the source:
DeepSpeed's ``ds_to_universal``, the universal files themselves, ``dcp_to_torch_save``,
``safetensors.load_file``.
"""

from __future__ import annotations

import functools
import json
import zipfile
from pathlib import Path

import pytest
import torch

from reshard.errors import OutputError, ReshardError
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.support.compare import same_strict
from tests.support.dsconv import ds_to_universal_folder
from tests.support.paths import DCP, DEEPSPEED, HF

MOMENTS = ("exp_avg", "exp_avg_sq")

# source name -> (kind, path or recipe)
SOURCES = {
    "deepspeed-autotp-zero1": ("deepspeed", DEEPSPEED / "llama_tp2_dp2"),
    "deepspeed-zero3": ("deepspeed", DEEPSPEED / "llama_zero3_dp2"),
    "deepspeed-autoep": ("deepspeed", DEEPSPEED / "mixtral_autoep_ep2"),
    "deepspeed-tp-pp": ("deepspeed", DEEPSPEED / "tp_pipe_tp2_pp2"),
    "universal": ("universal", DEEPSPEED / "llama_zero1_dp2"),  # DeepSpeed's ds_to_universal of it
    "dcp-fsdp2": ("dcp", DCP / "llama_fsdp2_ws2"),
    "hf-sharded": ("hf", HF / "pretrained_llama_sharded"),
}
DEEPSPEED_SOURCES = [s for s, (k, _) in SOURCES.items() if k == "deepspeed"]
OTHER_SOURCES = [s for s, (k, _) in SOURCES.items() if k != "deepspeed"]
ROUTES = [(s, t) for s in SOURCES for t in ("ucp", "safetensors", "dcp")] + [(s, "deepspeed") for s in OTHER_SOURCES]


# -- consolidations: {name: {"weight": F, "exp_avg": ..., "exp_avg_sq": ...}} -------------------------


def _universal_tensors(folder: Path, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """A universal folder's tensors by parameter and state (``weight`` its fp32.pt)."""
    out = {}
    for d in sorted(p for p in (folder / "zero").iterdir() if p.is_dir()):
        states = {}
        for state, file in (("weight", "fp32"), *((m, m) for m in MOMENTS)):
            f = d / f"{file}.pt"
            if f.is_file():
                obj = load(f, mmap=False)
                t = obj["param"] if isinstance(obj, dict) else obj
                states[state] = t.reshape(shapes[d.name]) if shapes and d.name in shapes else t
        out[d.name] = states
    return out


def _dcp_tensors(folder: Path, tmp: Path) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp / "whole.pt")
    sd = torch.load(tmp / "whole.pt", weights_only=True)
    model, state = sd.get("model", sd), (sd.get("optim") or {}).get("state", {})
    return {n: {"weight": w, **{m: state[n][m] for m in MOMENTS if m in state.get(n, {})}} for n, w in model.items()}


def _safetensors_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    out = {}
    for f in files:
        out.update({n: {"weight": t} for n, t in load_file(folder / f).items()})
    moments = folder / "zero"
    if moments.is_dir():
        for n, states in _universal_tensors(folder).items():
            out[n].update({m: states[m] for m in MOMENTS if m in states})
    return out


@functools.cache
def _source_universal(name: str, root: Path) -> Path:
    """DeepSpeed's own ds_to_universal of a DeepSpeed fixture (made once per session)."""
    return ds_to_universal_folder(SOURCES[name][1], root / name)


def _consolidated(name: str, root: Path) -> dict[str, dict[str, torch.Tensor]]:
    kind, path = SOURCES[name]
    if kind in ("deepspeed", "universal"):
        return _universal_tensors(_source_universal(name, root), _shapes(path) if kind == "deepspeed" else None)
    if kind == "dcp":
        return _dcp_tensors(path, root)
    return _safetensors_tensors(path)


def _shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """F's shape of every parameter of a ZeRO-3 job without TP, whose universal files are flat: the
    ``param_shapes`` its model states record (full shapes there)."""
    tag = ckpt / (ckpt / "latest").read_text().strip()
    files = sorted(tag.glob("zero_pp_rank_0_mp_rank_00_model_states.pt"))
    if not files:
        return {}
    groups = load(files[0])["param_shapes"]
    return {n: tuple(s) for g in (groups if isinstance(groups, list) else [groups]) for n, s in g.items()}


def _source_path(name: str, root: Path) -> Path:
    kind, path = SOURCES[name]
    return _source_universal(name, root).parent if kind == "universal" else path


def _read_target(fmt: str, out: Path, tmp: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, torch.Tensor]]:
    if fmt == "ucp":
        return _universal_tensors(out, shapes)
    if fmt == "safetensors":
        return _safetensors_tensors(out)
    if fmt == "dcp":
        return _dcp_tensors(out, tmp)
    return _universal_tensors(ds_to_universal_folder(out.parent, tmp / "ds"), shapes)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("routes")


@pytest.mark.parametrize("source,target", ROUTES, ids=[f"{s}-to-{t}" for s, t in ROUTES])
def test_every_route_gives_the_source_frameworks_tensors(source: str, target: str, root: Path, tmp_path: Path):
    pytest.importorskip("deepspeed")
    ref = _consolidated(source, root)
    shapes = {n: tuple(s["weight"].shape) for n, s in ref.items()}
    src = _source_path(source, root)
    if target == "deepspeed":
        out = reshard(src, tmp_path / "out", to="deepspeed", tp=1, dp=2).out_dir
    else:
        out = convert(src, tmp_path / "out", fmt=target).out_dir
    got = _read_target(target, out, tmp_path, shapes)
    assert sorted(got) == sorted(ref), (sorted(set(got) ^ set(ref)))
    for name, states in ref.items():
        for state, want in states.items():
            if state not in got[name]:
                assert state in MOMENTS and target in ("safetensors",), (name, state)  # weights only
                continue
            have = got[name][state]
            assert have.shape == want.shape, (name, state, have.shape, want.shape)
            if have.dtype != want.dtype:  # widened (a bf16 source's weights in fp32 files): exact
                assert have.dtype.itemsize > want.dtype.itemsize, (name, state, have.dtype, want.dtype)
                want = want.to(have.dtype)
            assert torch.equal(have.view(torch.uint8) if have.is_floating_point() else have,
                               want.contiguous().view(torch.uint8) if want.is_floating_point() else want), (name, state)
        if target in ("dcp", "deepspeed", "ucp"):  # a fresh optimizer's moments where the source has none
            for m in MOMENTS:
                if m in got[name] and m not in states:
                    assert not got[name][m].any(), (name, m)


# -- refusals: named, and before anything exists ----------------------------------------------------------


REFUSALS = [
    ("dcp-fsdp2", "deepspeed", {"tp": 2}, r"does not record how its parameters split over TP ranks.*--layout"),
    ("hf-sharded", "deepspeed", {"pp": 2}, r"records no pipeline stages or experts"),
    ("dcp-fsdp2", "deepspeed", {"ep": 2}, r"records no pipeline stages or experts"),
    ("deepspeed-autoep", "deepspeed", {"tp": 2, "dp": 2}, r"TP = PP = 1 only"),
    ("deepspeed-zero3", "deepspeed", {"pp": 2}, r"PP=1"),
    ("universal", "dcp", {"files": 2, "tp": 2}, r"--tp goes with --to deepspeed or --to megatron or --format vllm, not with a "
     r"PyTorch DCP checkpoint \(the target\)"),
    ("hf-sharded", "ucp", {"rename": ["a=b"]}, r"--rename goes with --format dcp"),
    ("dcp-fsdp2", "ucp", {"with_optimizer": True}, r"--with-optimizer goes with --format safetensors"),
]


@pytest.mark.parametrize("source,target,options,match", REFUSALS, ids=[f"{s}-to-{t}-{'-'.join(o)}" for s, t, o, _ in
                                                                         REFUSALS])
def test_targets_a_source_cannot_give_are_refused_before_anything_exists(source, target, options, match, root,
                                                                          tmp_path):
    pytest.importorskip("deepspeed")
    src = _source_path(source, root)
    with pytest.raises(ReshardError, match=match):
        if target in ("deepspeed",) or "files" in options:
            reshard(src, tmp_path / "out", to=target, **options)
        else:
            convert(src, tmp_path / "out", fmt=target, **options)
    assert not (tmp_path / "out").exists()


# -- a failure midway leaves nothing ----------------------------------------------------------------------


@pytest.mark.parametrize("source,target", [("deepspeed-autotp-zero1", "ucp"), ("dcp-fsdp2", "safetensors"),
                                           ("hf-sharded", "dcp"), ("universal", "deepspeed"),
                                           ("deepspeed-zero3", "deepspeed")])
def test_a_failure_midway_leaves_nothing(source, target, root, tmp_path, monkeypatch):
    from reshard.storage.staging import Staging

    real, calls = Staging.record, []

    def flaky(self, rel, size, digest):  # every writer records each file it finishes here
        calls.append(rel)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, rel, size, digest)

    monkeypatch.setattr(Staging, "record", flaky)
    src = _source_path(source, root)
    with pytest.raises((OutputError, OSError)):
        if target == "deepspeed":
            reshard(src, tmp_path / "out", to="deepspeed", tp=1, dp=2)
        else:
            convert(src, tmp_path / "out", fmt=target)
    assert calls, "the writer wrote nothing at all"
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


# -- a DeepSpeed checkpoint at another topology and back is its source --------------------------------------


def _z(tp: int, dp: int, stage: int, **more) -> dict:
    return {"tp": tp, "dp": dp, "zero_stage": stage, **more}


# (fixture, there, back): out to another topology (TP, DP, PP, EP, ZeRO stage) and back to the source's
ROUND_TRIPS = [
    ("llama_tp2_dp2", {"tp": 1, "dp": 3}, {"tp": 2, "dp": 2, "layout": DEEPSPEED / "llama_tp2_dp2"}),
    ("llama_zero3_dp2", {"tp": 1, "dp": 3}, {"tp": 1, "dp": 2}),
    ("llama_zero3_dp2", _z(1, 3, 1), _z(1, 2, 3)),
    ("llama_zero3_dp2_bf16", _z(1, 1, 2), _z(1, 2, 3)),
    ("llama_zero1_dp2", _z(1, 3, 3), _z(1, 2, 1)),
    ("llama_zero2_dp2", _z(1, 1, 3), _z(1, 2, 2)),
    ("llama_zero1_dp2_bf16", _z(1, 3, 3), _z(1, 2, 1)),
    ("llama_zero3_tp2_dp2", _z(2, 1, 3), _z(2, 2, 3)),
    ("llama_zero3_tp2_dp2", _z(1, 4, 3), _z(2, 2, 3, layout=DEEPSPEED / "llama_zero3_tp2_dp2")),
    ("llama_zero3_tp2_dp2", _z(2, 3, 1), _z(2, 2, 3)),
    ("llama_zero3_tp2_dp2", _z(1, 3, 2), _z(2, 2, 3, layout=DEEPSPEED / "llama_zero3_tp2_dp2")),
    ("llama_tp2_dp2", _z(2, 3, 3), _z(2, 2, 1)),
    ("llama_tp2_dp2", _z(1, 1, 3), _z(2, 2, 1, layout=DEEPSPEED / "llama_tp2_dp2")),
    ("mixtral_autoep_ep2", {"tp": 1, "dp": 1, "ep": 1}, {"tp": 1, "dp": 2, "ep": 2}),
    ("mixtral_autoep_ep2_zero3", {"tp": 1, "dp": 1, "ep": 1}, {"tp": 1, "dp": 2, "ep": 2}),
    ("mixtral_autoep_ep2_zero3", {"tp": 1, "dp": 4, "ep": 4}, {"tp": 1, "dp": 2, "ep": 2}),
    ("moe_ep2", {"tp": 1, "dp": 1, "ep": 1}, {"tp": 1, "dp": 2, "ep": 2}),
    ("pipe_pp2_dp2", {"tp": 1, "dp": 1, "pp": 2}, {"tp": 1, "dp": 2, "pp": 2}),
    ("tp_pipe_tp2_pp2", {"tp": 1, "pp": 2, "dp": 3}, {"tp": 2, "pp": 2, "dp": 1}),
]


def _records(path: Path) -> dict[str, bytes]:
    """A torch archive's tensor records (``data/<key>``), without the archive folder's name."""
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if n.split("/", 1)[1].startswith("data/")}


@pytest.mark.parametrize("name,there,back", ROUND_TRIPS,
                         ids=[f"{r[0]}-{'-'.join(f'{k}{v}' for k, v in r[1].items())}" for r in ROUND_TRIPS])
def test_there_and_back_gives_the_source_files(name, there, back, tmp_path):
    """Every file of the source loads to exactly the same objects (types, key order, tensors' dtype,
    shape, strides, storage, attributes and bits; metadata too), every tensor record byte for byte."""
    mid = reshard(DEEPSPEED / name, tmp_path / "mid", **there).out_dir
    out = reshard(mid, tmp_path / "back", **back).out_dir
    src = DEEPSPEED / name / (DEEPSPEED / name / "latest").read_text().strip()
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in src.glob("*.pt"))
    for f in sorted(src.glob("*.pt")):
        same_strict(load(out / f.name, mmap=False), load(f, mmap=False), f.name)
        assert _records(out / f.name) == _records(f), f.name


def test_a_universal_checkpoint_of_a_zero3_job_keeps_its_shapes(root, tmp_path):
    """ZeRO-3 without TP: ``--format ucp`` writes each fp32 master flat, as ds_to_universal does (its
    universal loader expects that), and the shapes come back from the model states beside it: the
    same universal folder converts to shaped safetensors."""
    ucp = convert(DEEPSPEED / "llama_zero3_dp2", tmp_path / "ucp").out_dir
    flat = load(ucp / "zero" / "model.embed_tokens.weight" / "fp32.pt", mmap=False)
    assert flat.dim() == 1
    st = convert(ucp.parent, tmp_path / "st", fmt="safetensors").out_dir
    from safetensors.torch import load_file

    got = load_file(st / "model.safetensors")["model.embed_tokens.weight"]
    assert got.dim() == 2 and torch.equal(got.reshape(-1), flat)
