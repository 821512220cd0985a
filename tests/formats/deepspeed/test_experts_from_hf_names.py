"""``--ep`` (DeepSpeed AutoEP) from sources in Hugging Face names (issue #32 item 5, issue #35 item 3):
a Megatron-Core MoE checkpoint (read in HF names) and a DCP checkpoint of the same model. Their
experts are fused tensors (``mlp.experts.gate_up_proj`` / ``down_proj``, ``Reader.expert_layers``);
the DeepSpeed writer reads them in AutoEP's names (``formats/deepspeed/autoep.json``). The files
have the structure DeepSpeed itself saves for a natively trained AutoEP job at the same EP x DP
(the ``mixtral_autoep_ep2`` fixture, resharded there by DeepSpeed's own layout), every value is the
source's mapped (Megatron's own reload for the experts and routers), and DeepSpeed 0.19.8 loads them
natively and trains on (``e2e``)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard import ReshardError
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.support.paths import DCP, DEEPSPEED, HF, MEGATRON

MOE = MEGATRON / "torch_dist_moe_ep2"  # Mixtral-shaped: 4 experts top-2, SwiGLU, no shared expert, untied
NATIVE = DEEPSPEED / "mixtral_autoep_ep2"  # DeepSpeed AutoEP on an HF Mixtral, EP 2
FRESH = {"/ds_config", "/global_samples", "/universal_checkpoint_info"}  # what a fresh job's files record otherwise
MOMENTS = ("exp_avg", "exp_avg_sq")


def _structure(x: Any) -> Any:
    """``x`` with every tensor as (dtype, dims) and every size as its length: what two checkpoints
    of one architecture at different widths share."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.dim())
    if isinstance(x, tuple) and all(isinstance(n, int) for n in x):  # a shape (DeepSpeed: tuple, reshard: Size)
        return ("size", len(x))
    if isinstance(x, dict):
        return {k: _structure(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_structure(v) for v in x]
    if hasattr(x, "__dict__"):
        return (type(x).__name__, _structure(vars(x)))
    return type(x).__name__


def _key_order(x: Any, path: str = "") -> list[str]:
    """Every dict's keys in order, by path (param_shapes, module, param groups, records)."""
    out = []
    if isinstance(x, dict):  # a param group's keys aside: reshard puts AdamW's first, DeepSpeed its name
        out.append(f"{path}: {sorted(x) if path.rpartition('/')[2].startswith('param_groups') else list(x)}")
        for k, v in x.items():
            out += _key_order(v, f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            out += _key_order(v, f"{path}[{i}]")
    return out


def _oracle() -> dict[str, torch.Tensor]:
    """Megatron's own TP=1 reload of the source (``oracle/``), keyed ``<state>.<HF-side name>`` for
    the router and the experts: the values AutoEP's names must hold."""
    from safetensors.torch import load_file

    o = MOE / "oracle"
    model, optim = load_file(o / "model.safetensors"), load_file(o / "optimizer.safetensors")
    info = json.loads((o / "oracle.json").read_text())
    out = {}
    for name, (key, idx) in info["names"].items():
        if ".mlp.router." not in key and ".mlp.experts." not in key:
            continue
        layer = idx[0]
        for state, t in (("weight", model[name]), *((m, optim[f"{m}.{name}"]) for m in MOMENTS)):
            mod = f"model.layers.{layer}.mlp"
            if key == "decoder.layers.mlp.router.weight":
                out[f"{state}.{mod}.router.gate.weight"] = t
            elif key.endswith("experts.experts.linear_fc1.weight"):  # [gate; up] of expert idx[1]
                f = t.shape[0] // 2
                out.setdefault(f"{state}.{mod}.experts.w1", {})[idx[1]] = t[:f]
                out.setdefault(f"{state}.{mod}.experts.w3", {})[idx[1]] = t[f:]
            elif key.endswith("experts.experts.linear_fc2.weight"):
                out.setdefault(f"{state}.{mod}.experts.w2", {})[idx[1]] = t
    return {k: torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v for k, v in out.items()}


def _read_back(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The written AutoEP checkpoint read back by reshard's DeepSpeed reader (safetensors with the
    moments), keyed ``<state>.<name>``."""
    from safetensors.torch import load_file

    folder = convert(out.parent, tmp, fmt="safetensors", with_optimizer=True).out_dir
    got = {f"weight.{n}": t for n, t in load_file(folder / "model.safetensors").items()}
    for d in (folder / "zero").iterdir():
        for m in MOMENTS:
            if (d / f"{m}.pt").is_file():
                got[f"{m}.{d.name}"] = load(d / f"{m}.pt")["param"]
    return got


def _native(ep: int, dp: int, tmp: Path) -> Path:
    """The tag folder DeepSpeed itself saved for the AutoEP job at EP x DP (a committed fixture),
    else its layout there (the fixture resharded by reshard's DeepSpeed -> DeepSpeed route)."""
    saved = {(2, 2): NATIVE, (2, 4): DEEPSPEED / "mixtral_autoep_ep2_dp4"}.get((ep, dp))
    if saved is not None:
        return saved / (saved / "latest").read_text().strip()
    return reshard(NATIVE, tmp, tp=1, dp=dp, ep=ep).out_dir


@pytest.mark.parametrize("ep,dp", [(2, 2), (2, 4), (1, 2)])
def test_megatron_moe_to_autoep_has_deepspeeds_own_structure(ep, dp, tmp_path):
    """Every file DeepSpeed saved for the natively trained AutoEP job at EP x DP (2x2, 2x4: the
    fixtures; 1x2: its layout there), and no other; each with the same keys in the same order, the
    same dtypes and dims, the same ``ds_autoep_layers`` placement fields and optimizer group names,
    the same flat-partition layout (param_slice_mappings' names per group, partition counts)."""
    ours = reshard(MOE, tmp_path / "ours", to="deepspeed", tp=1, dp=dp, ep=ep).out_dir
    theirs = _native(ep, dp, tmp_path / "theirs")
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        mine, native = load(ours / p.name), load(p)
        for k in FRESH:
            mine.pop(k[1:], None), native.pop(k[1:], None)
        assert _structure(mine) == _structure(native), p.name
        assert _key_order(mine) == _key_order(native), p.name
        if "ds_autoep_layers" in native:
            for a, b in zip(mine["ds_autoep_layers"], native["ds_autoep_layers"]):
                assert {k: v for k, v in a.items() if k != "affine_maps"} == \
                       {k: v for k, v in b.items() if k != "affine_maps"}
            assert mine["num_experts"] == native["num_experts"]
        if "optimizer_state_dict" in native:
            o, n = mine["optimizer_state_dict"], native["optimizer_state_dict"]
            assert o["partition_count"] == n["partition_count"]
            assert [list(g) for g in o["param_slice_mappings"]] == [list(g) for g in n["param_slice_mappings"]]
            # DeepSpeed names the expert group by its EP degree (engine.py: f"ep_size_{ep_size}"), as the
            # DeepSpeed -> DeepSpeed route does
            assert [(g["name"], g.get("moe")) for g in o["base_optimizer_state"]["param_groups"]] == \
                   [("dense-params", None), (f"ep_size_{ep}", True)]
            assert [g.get("moe") for g in n["base_optimizer_state"]["param_groups"]] == [None, True]
            assert o["clip_grad"] == 1.0  # Megatron's args.clip_grad (DeepSpeed's ZeRO-1/2 loader restores it)
    module = load(ours / "mp_rank_00_model_states.pt")["module"]
    for layer in range(2):
        mod = f"model.layers.{layer}.mlp"
        assert torch.equal(module[f"{mod}.gate.gate.weight"], module[f"{mod}.router.gate.weight"])


def test_megatron_moe_to_autoep_holds_the_source_values(tmp_path):
    """Every router and expert value (weights and both Adam moments) is Megatron's own reload
    mapped (w1 = fc1's gate half, w3 its up half, w2 = fc2, router = the router), bit for bit; every
    other parameter equals reshard's HF-named conversion of the same source."""
    ours = reshard(MOE, tmp_path / "ours", to="deepspeed", tp=1, dp=4, ep=2).out_dir
    got = _read_back(ours, tmp_path / "back")
    want = _oracle()
    assert want and all(torch.equal(got[k], v) for k, v in want.items()), \
        [k for k, v in want.items() if not torch.equal(got[k], v)]
    hf = _read_back_hf(tmp_path / "hf")
    for k, v in hf.items():
        if ".mlp." not in k:
            assert torch.equal(got[k], v), k
    for layer in range(2):  # AutoEP's router alias, read back beside its router
        alias = got.pop(f"weight.model.layers.{layer}.mlp.gate.gate.weight")
        assert torch.equal(alias, want[f"weight.model.layers.{layer}.mlp.router.gate.weight"])
    n = {k.split(".", 1)[1] for k in got if k.startswith("weight.")}
    assert n == {k.split(".", 1)[1] for k in hf if k.startswith("weight.") and ".mlp." not in k} | \
        {k.split(".", 1)[1] for k in want if k.startswith("weight.")}


def _read_back_hf(tmp: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = convert(MOE, tmp, fmt="safetensors", with_optimizer=True, names="hf").out_dir
    got = {f"weight.{n}": t for n, t in load_file(folder / "model.safetensors").items()}
    for d in (folder / "zero").iterdir():
        for m in MOMENTS:
            if (d / f"{m}.pt").is_file():
                got[f"{m}.{d.name}"] = load(d / f"{m}.pt")["param"]
    return got


def test_dcp_of_the_moe_model_to_autoep_is_the_megatron_route(tmp_path):
    """A DCP checkpoint of the same model in HF names (reshard's own DCP of the Megatron source)
    holds its experts fused as well: ``--ep`` from it writes the same files as from Megatron, its
    flat groups in the HF model's order though the DCP keeps Megatron's mapping order (no config:
    the preset's architecture at its layer count), but ``clip_grad``, which a DCP does not record."""
    dcp = convert(MOE, tmp_path / "dcp", fmt="dcp", names="hf").out_dir
    a = reshard(dcp, tmp_path / "a", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    b = reshard(MOE, tmp_path / "b", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    for p in sorted(b.glob("*.pt")):
        out: list[str] = []
        _differences(load(a / p.name), load(p), "", out)
        assert out == (["/optimizer_state_dict/clip_grad"] if "optim" in p.name else []), (p.name, out)
        if out:
            assert load(a / p.name)["optimizer_state_dict"]["clip_grad"] == 0.0


def _differences(x: Any, y: Any, path: str, out: list[str]) -> None:
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


FSDP2 = DCP / "mixtral_fsdp2_ws2"  # an FSDP2 job's save of mixtral_autoep_ep2's model: experts fused in memory


def _autoep_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers Mixtral's in-memory tensors under AutoEP's names (an independent oracle of
    ``autoep.json``: w1/w3 the gate/up halves of ``gate_up_proj``, w2 ``down_proj``, the router)."""
    out = {}
    for n, t in sd.items():
        if n.endswith("experts.gate_up_proj"):
            m, f = n.rpartition(".gate_up_proj")[0], t.shape[1] // 2
            out[f"{m}.w1"], out[f"{m}.w3"] = t[:, :f], t[:, f:]
        elif n.endswith("experts.down_proj"):
            out[n.replace("down_proj", "w2")] = t
        elif n.endswith("mlp.gate.weight"):
            out[n.replace("mlp.gate.weight", "mlp.router.gate.weight")] = t
        else:
            out[n] = t
    return out


def test_an_fsdp2_jobs_dcp_to_autoep_is_laid_out_as_deepspeeds_own_and_holds_its_state(tmp_path):
    """FSDP2 saved the experts fused and sharded over its 2 ranks: ``--ep 2 --dp 2`` gives DeepSpeed's
    own file layout of the same model (keys, order, dtypes, shapes, partitions) and every weight and
    Adam moment of the job, read back by torch's own DCP loader, bit for bit under AutoEP's names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ours = reshard(FSDP2, tmp_path / "ours", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    theirs = _native(2, 2, tmp_path / "theirs")
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        mine, native = load(ours / p.name), load(p)
        for k in (*FRESH, "/global_steps", "/skipped_steps"):
            mine.pop(k[1:], None), native.pop(k[1:], None)
        if "optimizer_state_dict" in native:
            for d in (mine, native):
                d["optimizer_state_dict"]["clip_grad"] = None  # a DCP records none: 0.0, said in a note
        assert _shaped(mine) == _shaped(native), p.name
        assert _key_order(mine) == _key_order(native), p.name
    dcp_to_torch_save(FSDP2, tmp_path / "whole.pt")
    sd = torch.load(tmp_path / "whole.pt", weights_only=True)
    state = sd["optim"]["state"]
    want = {f"weight.{n}": t for n, t in _autoep_names(sd["model"]).items()}
    for m in MOMENTS:
        want.update({f"{m}.{n}": t for n, t in _autoep_names({k: v[m] for k, v in state.items()}).items()})
    got = _read_back(ours, tmp_path / "back")
    for layer in range(2):
        got.pop(f"weight.model.layers.{layer}.mlp.gate.gate.weight")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items()), [k for k, v in want.items() if not torch.equal(got[k], v)]


@pytest.mark.parametrize("fixture,options,match", [
    (MOE, {"dp": 3, "ep": 3}, r"model.layers.0.mlp: 4 experts do not split evenly over ep=3"),
    (MOE, {"dp": 2, "ep": 2, "zero_stage": 3}, r"written at ZeRO stage 1 or 2 \(asked 3\)"),
])
def test_what_autoep_cannot_place_is_refused_naming_it(fixture, options, match, tmp_path):
    with pytest.raises(ReshardError, match=match):
        reshard(fixture, tmp_path / "out", to="deepspeed", tp=1, **options)
    assert not (tmp_path / "out").exists()


# -- an HF folder (save_pretrained: the Hub's per-expert layout) --------------------------------------

PRETRAINED = HF / "pretrained_mixtral"  # transformers' save_pretrained of mixtral_autoep_ep2's config


def _shaped(x: Any) -> Any:
    """``x`` with every tensor as (dtype, shape): the same model's files at the same EP x DP agree on it."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape))
    if isinstance(x, dict):
        return {k: _shaped(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_shaped(v) for v in x]
    if hasattr(x, "__dict__"):
        return (type(x).__name__, _shaped(vars(x)))
    return x


@pytest.mark.parametrize("ep,dp", [(2, 2), (2, 4)])
def test_hf_mixtral_folder_to_autoep_is_laid_out_as_deepspeeds_own(ep, dp, tmp_path):
    """The same config as the natively trained ``mixtral_autoep_ep2``: every file DeepSpeed's layout
    writes there, each with the same keys in the same order, the same dtypes and shapes and every
    other value equal (the whole partition layout: param_slice_mappings, paddings, partition counts,
    ``ds_autoep_layers``), but the weights, moments, steps and optimizer settings a fresh model holds."""
    ours = reshard(PRETRAINED, tmp_path / "ours", tp=1, dp=dp, ep=ep).out_dir
    theirs = _native(ep, dp, tmp_path / "theirs")
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        mine, native = load(ours / p.name), load(p)
        for k in (*FRESH, "/global_steps", "/skipped_steps"):
            mine.pop(k[1:], None), native.pop(k[1:], None)
        if "optimizer_state_dict" in native:
            for d in (mine, native):  # the steps and Adam settings are the source's, its moments zero
                o = d["optimizer_state_dict"]["base_optimizer_state"]
                o["state"] = {k: sorted(v) for k, v in o["state"].items()}
                o["param_groups"] = [sorted(g) for g in o["param_groups"]]
                d["optimizer_state_dict"]["clip_grad"] = None  # the folder records none: 0.0, said in a note
        assert _shaped(mine) == _shaped(native), p.name
        assert _key_order(mine) == _key_order(native), p.name


def test_hf_mixtral_folder_to_autoep_holds_what_transformers_loads(tmp_path):
    """Every module and expert value is the model ``from_pretrained`` builds (transformers' own
    loader fuses the Hub's per-expert tensors): w1/w3 the gate/up halves of ``gate_up_proj``, w2
    ``down_proj``, the router (and its alias) ``mlp.gate.weight``, bit for bit."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(PRETRAINED).state_dict()
    ours = reshard(PRETRAINED, tmp_path / "ours", tp=1, dp=4, ep=2).out_dir
    got = _read_back(ours, tmp_path / "back")
    want = _autoep_names(model)
    for layer in range(2):  # AutoEP's router alias, read back beside its router
        assert torch.equal(got.pop(f"weight.model.layers.{layer}.mlp.gate.gate.weight"),
                           model[f"model.layers.{layer}.mlp.gate.weight"])
    assert {k.split(".", 1)[1] for k in got if k.startswith("weight.")} == set(want)
    for n, t in want.items():
        assert torch.equal(got[f"weight.{n}"], t), n
    assert all(not got[f"{m}.{n}"].any() for m in MOMENTS for n in want)  # a folder without moments: zeros


def test_a_hub_folder_missing_one_experts_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(PRETRAINED, src)
    sd = load_file(src / "model.safetensors")
    del sd["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ReshardError, match=r"model.layers.1.block_sparse_moe.experts.3.w3.weight: missing"):
        reshard(src, tmp_path / "out", tp=1, dp=2, ep=2)
    assert not (tmp_path / "out").exists()


# -- DeepSpeed's own loader ---------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow  # make test-all; make test keeps the file-level checks of the same routes
def test_deepspeed_loads_autoep_written_from_megatron_and_trains(tmp_path):
    """One real job at world 2, EP 2: DeepSpeed 0.19.8 builds the HF Mixtral the Megatron model is
    (its ``config.json`` as reshard exports it), wraps it in AutoEP, loads reshard's files natively,
    saves them straight back (the same tensors and values: only what a fresh job records otherwise
    differs) and trains two steps with finite losses."""
    pytest.importorskip("deepspeed")
    from reshard.formats.registry import open_reader
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    cfg = open_reader(MOE, names="hf").hf_config()
    spec = model_spec_from_fixture(NATIVE)
    spec.update(model_type=cfg["model_type"],
                model_config={k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    ours = reshard(MOE, tmp_path / "ours", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    native = tmp_path / "native"
    reports = resume_many([resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=2, universal=False,
                                       save_dir=native)], world_size=2, workdir=tmp_path / "job")
    mine = reports["reshard"]
    assert mine["global_steps_after_load"] == 3 and mine["optimizer_step_after_load"] == [3.0]
    assert mine["ranks_agree"]
    assert mine["layouts"]["model.layers.0.mlp.experts.w1"] == "autoep"
    assert len(mine["losses"]) == 2 and all(math.isfinite(x) for x in mine["losses"])
    for p in sorted(ours.glob("*.pt")):
        out: list[str] = []
        _differences(load(p), load(native / ours.name / p.name), "", out)
        assert all(x in FRESH or x.startswith(tuple(f"{f}/" for f in FRESH)) for x in out), (p.name, sorted(out))
