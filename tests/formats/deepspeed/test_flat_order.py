"""A DeepSpeed ZeRO-1/2 engine loads its optimizer's flat fp32 partitions (and Adam's moments) in
the order of its own ``model.parameters()``, not by name: files flattened in another order load
each state into the wrong parameter, silently where the sizes add up (they always do: the same
parameters), and the next step writes those masters over the weights.

Sources in Hugging Face names that do not keep the model's order themselves: a Megatron-Core
checkpoint read in HF names (its mapping document's order: each layer's norm first), and a DCP
checkpoint reshard wrote (an earlier reshard sorted its entries by key: ``lm_head`` first). The order
the engine derives is ``named_parameters()`` of the model transformers builds from the config (the
model a DeepSpeed job of it wraps); every parameter group of the written files must follow it, and
each parameter's slice of the flat partitions must hold that parameter's master and moments, read by
name by torch's own ``dcp_to_torch_save`` from the DCP. DeepSpeed itself loading such files:
``tests/formats/hf/test_hf_to_deepspeed.py::test_deepspeed_loads_a_dcp_reshard_wrote_in_model_order``
(slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from reshard import convert, reshard
from reshard.errors import ReshardError
from reshard.formats.registry import open_reader
from reshard.storage.safe_load import load
from tests.support.paths import DCP, HF, MEGATRON

transformers = pytest.importorskip("transformers")

MEGATRON_SRC = MEGATRON / "torch_dist_tp2_dp2_distopt"
SOURCES = {"megatron-hf-names": (MEGATRON_SRC, "hf"), "hf-folder": (HF / "pretrained_llama", None)}


def _model_order(cfg: dict) -> list[str]:
    """``named_parameters()`` of the model a DeepSpeed job wraps: built from the config by transformers."""
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = getattr(transformers, cfg["architectures"][0])(config)
    return [n for n, _ in model.named_parameters()]


def _config(name: str) -> dict:
    path, names = SOURCES[name]
    if names == "hf":
        return open_reader(path, names="hf").hf_config()
    return json.loads((path / "config.json").read_text())


def _dcp(name: str, tmp: Path) -> Path:
    path, names = SOURCES[name]
    return convert(path, tmp / "dcp", fmt="dcp", **({"names": names} if names else {})).out_dir


def _dcp_entries(folder: Path) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def _dcp_tensors(folder: Path, tmp: Path) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp / "whole.pt")
    sd = torch.load(tmp / "whole.pt", weights_only=True)
    state = sd.get("optim", {}).get("state", {})
    return {n: {"fp32": w.float(), **{m: state[n][m] for m in ("exp_avg", "exp_avg_sq") if m in state.get(n, {})}}
            for n, w in sd["model"].items()}


@pytest.mark.parametrize("name", SOURCES)
def test_a_dcp_reshard_writes_lists_the_weights_in_the_model_order(name, tmp_path):
    order = _model_order(_config(name))
    entries = [k.removeprefix("model.") for k in _dcp_entries(_dcp(name, tmp_path)) if k.startswith("model.")]
    assert entries == [n for n in order if n in set(entries)] and len(entries) >= len(order) - 1  # tied: once


def test_megatron_in_hf_names_tells_the_hf_model_order():
    reader = open_reader(MEGATRON_SRC, names="hf")
    order = _model_order(reader.hf_config())
    assert reader.model_order() == [n for n in order if n in set(reader.names)]
    assert set(reader.model_order()) == set(reader.names)
    assert reader.names != reader.model_order()  # the mapping document's order is not the model's


@pytest.mark.parametrize("name", SOURCES)
def test_deepspeed_from_a_dcp_flattens_in_the_engine_order(name, tmp_path):
    dcp_dir = _dcp(name, tmp_path)
    out = reshard(dcp_dir, tmp_path / "ds", to="deepspeed", dp=2, zero_stage=1).out_dir
    order = _model_order(_config(name))
    ms = load(out / "mp_rank_00_model_states.pt")
    groups = [dict(g) for g in ms["param_shapes"]]
    for g in groups:
        assert list(g) == [n for n in order if n in g]
    # each parameter's slice of the flat partitions (DP ranks in order) is its own master and moments
    ranks = [load(out / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"] for r in range(2)]
    want = _dcp_tensors(dcp_dir, tmp_path)
    for i, g in enumerate(groups):
        flat = {"fp32": torch.cat([o["single_partition_of_fp32_groups"][i] for o in ranks]),
                **{m: torch.cat([o["base_optimizer_state"]["state"][i][m] for o in ranks])
                   for m in ("exp_avg", "exp_avg_sq")}}
        at = 0
        for n, shape in g.items():
            size = math.prod(shape)
            for state, t in flat.items():
                expect = want[n].get(state)
                if expect is None:
                    assert not t[at:at + size].any(), (n, state)  # a fresh optimizer's moments
                else:
                    assert torch.equal(t[at:at + size].view(tuple(shape)), expect), (n, state)
            at += size


def test_a_dcp_an_earlier_reshard_wrote_is_refused_as_a_deepspeed_source(tmp_path):
    """Its entries sorted by key (no model's order) and its manifest without ``entry_order``."""
    dcp_dir = _dcp("hf-folder", tmp_path)
    manifest = dcp_dir / "reshard-manifest.json"
    old = json.loads(manifest.read_text())
    del old["entry_order"]
    manifest.write_text(json.dumps(old))
    with pytest.raises(ReshardError, match=r"does not record the model.s parameter order.*sorted by key.*"
                                           r"entry_order"):
        reshard(dcp_dir, tmp_path / "ds", to="deepspeed", dp=2)
    assert not (tmp_path / "ds").exists()


def test_a_universal_checkpoint_without_the_model_order_is_refused_as_a_deepspeed_source(tmp_path):
    """A universal checkpoint of a source that tells no model order (a safetensors folder without
    config.json, no optimizer groups: the model states record no ``param_shapes``) knows its
    parameters only as folder names, sorted (``lm_head`` first): no model's order, so refused; one
    whose model states record every parameter is written from."""
    import shutil

    src = tmp_path / "weights"
    src.mkdir()
    shutil.copy(HF / "pretrained_llama" / "model.safetensors", src / "model.safetensors")
    ucp = convert(src, tmp_path / "ucp", fmt="ucp").out_dir
    with pytest.raises(ReshardError, match=r"does not record the model's parameter order.*no param_shapes"):
        reshard(ucp, tmp_path / "ds", to="deepspeed", dp=2)
    assert not (tmp_path / "ds").exists()
    # one of an FSDP2 job's DCP (its optimizer groups list every parameter, in the model's order)
    fsdp = DCP / "llama_fsdp2_ws2"
    ucp = convert(fsdp, tmp_path / "ucp2", fmt="ucp").out_dir
    assert open_reader(ucp).model_order() == open_reader(fsdp).names


def _flat_holds(out: Path, order: list[str], want: dict[str, dict[str, torch.Tensor]], groups: int) -> int:
    """Each param_shapes group of DeepSpeed files ``out`` follows ``order`` and each parameter's slice
    of the flat partitions (DP ranks in order) holds its own ``want`` states (a fresh optimizer's zero
    moments where ``want`` has none); returns how many slices were compared."""
    ms = load(out / "mp_rank_00_model_states.pt")
    recorded = [dict(g) for g in ms["param_shapes"]]
    assert len(recorded) == groups
    ranks = [load(out / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"] for r in range(2)]
    n = 0
    for i, g in enumerate(recorded):
        assert list(g) == [x for x in order if x in g]
        flat = {"fp32": torch.cat([o["single_partition_of_fp32_groups"][i] for o in ranks]),
                **{m: torch.cat([o["base_optimizer_state"]["state"][i][m] for o in ranks])
                   for m in ("exp_avg", "exp_avg_sq")}}
        at = 0
        for name, shape in g.items():
            size = math.prod(shape)
            for state, t in flat.items():
                expect = want[name].get(state)
                if expect is None:
                    assert not t[at:at + size].any(), (name, state)
                else:
                    assert torch.equal(t[at:at + size].view(tuple(shape)), expect), (name, state)
                n += 1
            at += size
    return n


def test_reshards_universal_checkpoint_records_the_model_order_and_is_a_deepspeed_source(tmp_path):
    """The universal writer records every parameter in ``param_shapes``, each group in the model's
    order (transformers' ``named_parameters()``): a universal checkpoint of an HF folder (no optimizer:
    one group) and of a Megatron checkpoint in HF names (Megatron's weight-decay and no-decay groups,
    its mapping document's order within them) are DeepSpeed sources whose flat partitions hold each
    parameter's own master and moments: the folder's weights, and Megatron's own reload."""
    from safetensors.torch import load_file

    ucp = convert(HF / "pretrained_llama", tmp_path / "ucp", fmt="ucp").out_dir
    out = reshard(ucp, tmp_path / "ds", to="deepspeed", dp=2, zero_stage=1).out_dir
    want = {n: {"fp32": w.float()} for n, w in load_file(HF / "pretrained_llama" / "model.safetensors").items()}
    assert _flat_holds(out, _model_order(_config("hf-folder")), want, 1) == 3 * len(want)
    ucp = convert(MEGATRON_SRC, tmp_path / "ucp2", fmt="ucp", names="hf").out_dir
    groups = open_reader(ucp).param_groups()
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    out = reshard(ucp, tmp_path / "ds2", to="deepspeed", dp=2, zero_stage=1).out_dir
    want = _megatron_in_hf_names(MEGATRON_SRC)
    assert _flat_holds(out, _model_order(_config("megatron-hf-names")), want, 2) == 3 * len(want)


def test_a_dcp_of_a_source_without_its_model_order_is_not_marked_and_is_refused(tmp_path):
    """A safetensors folder without config.json does not tell its model's order (its headers are
    sorted): the DCP written from it keeps that order unmarked, and DeepSpeed is not written from it."""
    import shutil

    src = tmp_path / "weights"
    src.mkdir()
    shutil.copy(HF / "pretrained_llama" / "model.safetensors", src / "model.safetensors")
    dcp_dir = convert(src, tmp_path / "dcp", fmt="dcp").out_dir
    assert "entry_order" not in json.loads((dcp_dir / "reshard-manifest.json").read_text())
    with pytest.raises(ReshardError, match=r"no model's order.*lacks entry_order"):
        reshard(dcp_dir, tmp_path / "ds", to="deepspeed", dp=2)
    assert not (tmp_path / "ds").exists()


def _megatron_in_hf_names(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Megatron's own TP=1 reload of ``path`` (``oracle/``: weights, fp32 masters, moments) cut into HF
    names by the source's mapping document (``hfmap.hf_params``, the valid vocabulary rows)."""
    from safetensors.torch import load_file

    from reshard.formats.megatron.hfmap import hf_params
    from reshard.formats.megatron.reader import MegatronReader

    o = path / "oracle"
    info = json.loads((o / "oracle.json").read_text())
    tensors = {"weight": load_file(o / "model.safetensors")}
    optim = load_file(o / "optimizer.safetensors")
    tensors.update({s: {k[len(p):]: v for k, v in optim.items() if k.startswith(p)}
                    for s, p in (("fp32", "param."), ("exp_avg", "exp_avg."), ("exp_avg_sq", "exp_avg_sq."))})
    keyed: dict[str, dict[str, torch.Tensor]] = {}
    for state, named in tensors.items():
        for name, (key, idx) in info["names"].items():
            full = keyed.setdefault(key, {}).setdefault(state, named[name].new_zeros(info["key_shapes"][key]))
            full[tuple(idx)] = named[name]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for p in hf_params(MegatronReader.open(path).arch):
        for state, full in keyed[p.key].items():
            t = full.new_zeros(p.shape)
            for b in p.blocks:
                src = full[tuple(slice(s, s + n) for s, n in zip(b.start, b.size))].reshape(b.size[b.fixed:])
                t[tuple(slice(h, h + n) for h, n in zip(b.hf_start, b.size[b.fixed:]))] = src
            out.setdefault(p.name, {})[state] = t[tuple(slice(0, n) for n in p.valid)]
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_loads_a_megatron_sourced_zero1_checkpoint_with_its_two_groups(tmp_path):
    """Megatron-Core (TP 2 x DP 2, distributed optimizer) -> DCP in HF names -> DeepSpeed ZeRO-1 at
    DP 2: the files keep Megatron's two optimizer groups (weight decay, and none for the norms), and
    the DeepSpeed 0.19.8 job built with those groups (``launch.recorded_groups``: names in the files'
    order, each group's Adam settings) loads them natively: every parameter's fp32 master, both Adam
    moments and module weight equal Megatron's own reload of the source, by name, bit for bit."""
    pytest.importorskip("deepspeed")
    from tests.e2e.digest import digest
    from tests.e2e.launch import recorded_groups, resume_load, resume_many
    from tests.support.paths import DEEPSPEED

    dcp_dir = _dcp("megatron-hf-names", tmp_path)
    out = reshard(dcp_dir, tmp_path / "ds", to="deepspeed", dp=2, zero_stage=1).out_dir
    groups = recorded_groups(out.parent, out.name)
    assert len(groups) == 2 and [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert all(n.endswith("norm.weight") for n in groups[1]["params"])
    cfg = _config("megatron-hf-names")
    spec = {"model_type": cfg["model_type"], "patches": [], "seed": 1234, "seq_len": 16, "micro_batch": 2,
            "model_config": {k: v for k, v in cfg.items()
                             if k not in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")},
            "ds_config": json.loads((DEEPSPEED / "llama_zero1_dp2" / "fixture.json").read_text())["ds_config"]}
    job = resume_many([resume_load("megatron", out.parent, model_spec=spec, tp=1, dp=2, universal=False, zero_stage=1,
                                   steps=1, tag=out.name, param_groups=groups)], world_size=2)["megatron"]
    after = job["digests"]["after_load"]
    want = _megatron_in_hf_names(MEGATRON_SRC)
    assert sorted(after) == sorted(want)
    for n, states in want.items():
        assert after[n]["module"] == digest(n, states["weight"]), n
        for s in ("fp32", "exp_avg", "exp_avg_sq"):
            assert after[n][s] == digest(n, states[s]), (n, s)
    assert job["ranks_agree"] and all(math.isfinite(x) for x in job["losses"])
