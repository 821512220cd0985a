"""DeepSpeed AutoEP beyond Mixtral (issue #32 item 5, issue #35): a model type per preset of
DeepSpeed 0.19.8 (``deepspeed/module_inject/auto_ep_presets``), each an entry of the mapping
document ``formats/deepspeed/autoep.json``. Per preset two fixtures: DeepSpeed's own AutoEP job at
EP 2, ZeRO-1, world 2 (``tests/fixtures/deepspeed/<preset>_autoep_ep2``, one step) and
transformers' ``save_pretrained`` of the same model type (``tests/fixtures/hf/pretrained_<preset>``).
Checked: reading DeepSpeed's files (the universal conversion is ``ds_to_universal``'s; the HF
export is what ``from_pretrained`` loads, every weight DeepSpeed's), and writing them (``--ep 2``
from the HF folder and from a DCP of it: DeepSpeed's own files, keys, dtypes and partition
layout; every value transformers' model's; DeepSpeed loads them natively and trains, slow tier)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from reshard import ReshardError
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.formats.deepspeed.test_experts_from_hf_names import (
    FRESH,
    MOMENTS,
    _differences,
    _key_order,
    _read_back,
    _shaped,
)
from tests.support.compare import same
from tests.support.paths import DEEPSPEED, HF

PRESETS = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "qwen3_5_moe", "minimax_m3"]
# presets whose HF model holds a shared expert and its gate (shared_expert, shared_expert_gate: AutoEP renames them)
SHARED_GATE = ("qwen2_moe", "qwen3_5_moe")
# presets whose model's order a source without config.json cannot tell (per-layer kinds in the config)
NO_ORDER_WITHOUT_CONFIG = ("qwen3_5_moe", "minimax_m3")
# presets whose AutoEP layer keeps no router alias (DeepSpeed captures no router logits from the router)
NO_ALIAS = ("deepseek_v3", "deepseek_v2")
# the slowest DeepSpeed-side checks of the last three presets run in the slow tier; make test keeps their
# cheaper siblings (laid out as DeepSpeed's own files, what transformers loads, the DCP route) and these
# same checks on the other presets
HEAVY = ("deepseek_v2", "qwen3_5_moe", "minimax_m3")


def tiered(presets, heavy=HEAVY):
    return [pytest.param(p, marks=pytest.mark.slow) if p in heavy else p for p in presets]


def _native(preset: str) -> Path:
    """The tag folder DeepSpeed saved for the preset's AutoEP job (EP 2, world 2, ZeRO-1)."""
    root = DEEPSPEED / f"{preset}_autoep_ep2"
    return root / (root / "latest").read_text().strip()


def _pretrained(preset: str) -> Path:
    """transformers' save_pretrained of the DeepSpeed fixture's model (DeepSeek-V3's: with its MoE)."""
    return HF / ("pretrained_deepseek_v3_moe" if preset == "deepseek_v3" else f"pretrained_{preset}")


def _autoep_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers MoE model's in-memory tensors under AutoEP's names, written out here
    independently of ``autoep.json``: w1/w3 the gate/up halves of ``gate_up_proj``, w2
    ``down_proj``, the router ``router.gate.weight`` (its bias ``router.e_score_correction_bias``),
    a shared expert and its gate ``shared_experts``/``shared_experts_gate`` (DeepSpeed's
    ``AutoEPMoELayer`` attributes)."""
    out = {}
    for n, t in sd.items():
        if n.endswith("experts.gate_up_proj"):
            m, f = n.rpartition(".gate_up_proj")[0], t.shape[1] // 2
            out[f"{m}.w1"], out[f"{m}.w3"] = t[:, :f], t[:, f:]
        elif n.endswith("experts.down_proj"):
            out[n.replace("down_proj", "w2")] = t
        elif n.endswith("mlp.gate.weight"):
            out[n.replace("mlp.gate.weight", "mlp.router.gate.weight")] = t
        elif n.endswith("mlp.gate.e_score_correction_bias"):  # DeepSeek-V3's router bias (a buffer)
            out[n.replace("mlp.gate.", "mlp.router.")] = t
        elif ".mlp.shared_expert." in n or ".mlp.shared_expert_gate." in n:  # Qwen2-MoE's: AutoEPMoELayer's names
            out[n.replace(".mlp.shared_expert", ".mlp.shared_experts")] = t
        else:
            out[n] = t
    return out


def _comparable(d: dict) -> dict:
    """A written file without what a fresh model's files hold otherwise (weights aside: shapes and
    dtypes stay): steps, the moments' keys order, the Adam settings' key order, ``clip_grad``."""
    for k in (*FRESH, "/global_steps", "/skipped_steps"):
        d.pop(k[1:], None)
    if "optimizer_state_dict" in d:
        o = d["optimizer_state_dict"]["base_optimizer_state"]
        o["state"] = {k: sorted(v) for k, v in o["state"].items()}
        o["param_groups"] = [sorted(g) for g in o["param_groups"]]
        d["optimizer_state_dict"]["clip_grad"] = None  # an HF folder records none: 0.0, said in a note
    return d


@pytest.mark.parametrize("preset", tiered(PRESETS))
def test_deepspeeds_autoep_files_convert_as_ds_to_universal_does(preset, tmp_path):
    """Reading DeepSpeed's own AutoEP job of the model type: reshard's universal checkpoint is
    DeepSpeed's ``ds_to_universal``'s, the same files, model states byte for byte, every tensor equal."""
    pytest.importorskip("deepspeed")
    from tests.support.dsconv import ds_to_universal_folder

    theirs = ds_to_universal_folder(_native(preset).parent, tmp_path / "ds")
    ours = convert(_native(preset).parent, tmp_path / "ours").out_dir
    their_files = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.pt")) == their_files
    for rel in their_files:
        if "model_states" in rel:
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
        else:
            same(load(ours / rel), load(theirs / rel), rel)


def _universal(kind: str, tmp_path: Path, preset: str = "deepseek_v3") -> Path:
    """The universal checkpoint of DeepSpeed's AutoEP job of the preset: ``ds_to_universal``'s or reshard's."""
    if kind == "ds_to_universal":
        from tests.support.dsconv import ds_to_universal_folder

        return ds_to_universal_folder(_native(preset).parent, tmp_path / "ucp").parent
    return convert(_native(preset).parent, tmp_path / "ucp").out_dir.parent


@pytest.mark.parametrize("kind", ["ds_to_universal", "reshard"])
@pytest.mark.parametrize("preset", ["deepseek_v3", "minimax_m3"])
def test_ep_from_a_universal_with_buffers_writes_deepspeeds_own_files(preset, kind, tmp_path):
    """``--ep 2 --dp 2`` from the universal checkpoint of DeepSpeed's DeepSeek-V3 or MiniMax-M3 AutoEP
    job (its router's ``e_score_correction_bias`` a module buffer: ``Reader.buffers``, placed where
    the module holds it, in no optimizer group; MiniMax-M3's router alias holds the buffer too):
    DeepSpeed's own files, every file and no other, each key in
    the same order and every value equal (weights, masters, moments, steps, partition layout,
    ``buffer_names``) but what a fresh job's files record otherwise (``ds_config``,
    ``global_samples``, ``universal_checkpoint_info``)."""
    if kind == "ds_to_universal":
        pytest.importorskip("deepspeed")
    ours = reshard(_universal(kind, tmp_path, preset), tmp_path / "ours", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    theirs = _native(preset)
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        mine, native = load(ours / p.name), load(p)
        out: list[str] = []
        _differences(mine, native, "", out)
        assert all(x in FRESH or x.startswith(tuple(f"{f}/" for f in FRESH)) for x in out), (p.name, sorted(out))
        assert _key_order(_comparable(mine)) == _key_order(_comparable(native)), p.name
    model = load(ours / "mp_rank_00_model_states.pt")
    assert model["buffer_names"] == ["model.layers.1.mlp.router.e_score_correction_bias"]
    assert not any(n in g for g in model["param_shapes"] for n in model["buffer_names"])


def test_ep_at_zero3_from_a_universal_with_buffers_is_refused(tmp_path):
    """AutoEP at ZeRO-3 from DeepSeek-V3's universal checkpoint: refused naming the buffer, before
    anything exists (no DeepSpeed AutoEP ZeRO-3 checkpoint with buffers shows where they go)."""
    with pytest.raises(ReshardError, match=r"ZeRO stage 3 .*router\.e_score_correction_bias: buffer_names"):
        reshard(_universal("reshard", tmp_path), tmp_path / "out", to="deepspeed", tp=1, dp=2, ep=2, zero_stage=3)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset", PRESETS)
def test_hf_folder_to_autoep_is_laid_out_as_deepspeeds_own(preset, tmp_path):
    """``--ep 2 --dp 2`` from ``save_pretrained``'s folder (the Hub's per-expert layout) of the model
    DeepSpeed trained: every file DeepSpeed saved, and no other, each with the same keys in the
    same order, the same dtypes and shapes and every other value equal (param_slice_mappings,
    paddings, partition counts, ``ds_autoep_layers``, ``param_shapes``, ``buffer_names``), but the
    weights, moments, steps and optimizer settings a fresh model holds."""
    ours = reshard(_pretrained(preset), tmp_path / "ours", tp=1, dp=2, ep=2).out_dir
    theirs = _native(preset)
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in sorted(theirs.glob("*.pt")):
        mine, native = _comparable(load(ours / p.name)), _comparable(load(p))
        assert _shaped(mine) == _shaped(native), p.name
        assert _key_order(mine) == _key_order(native), p.name


@pytest.mark.parametrize("preset", PRESETS)
def test_hf_folder_to_autoep_holds_what_transformers_loads(preset, tmp_path):
    """Every module and expert value is the model ``from_pretrained`` builds (transformers' own
    loader fuses the Hub's per-expert tensors) under AutoEP's names, bit for bit; the router's
    alias (where AutoEP keeps one) its router; the moments zeros (the folder holds none)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(_pretrained(preset)).state_dict()
    ours = reshard(_pretrained(preset), tmp_path / "ours", tp=1, dp=2, ep=2).out_dir
    got = _read_back(ours, tmp_path / "back")
    want = _autoep_names(model)
    for n in [k for k in got if k.endswith(".mlp.gate.gate.weight")]:  # AutoEP's router alias
        assert torch.equal(got.pop(n), model[n[len("weight."):].replace("gate.gate", "gate")])
    for n in [k for k in got if k.startswith("weight.") and k.endswith(".mlp.gate.e_score_correction_bias")]:
        assert torch.equal(got.pop(n), model[n[len("weight."):]])  # the alias of the router's bias (MiniMax-M3)
    assert {k.split(".", 1)[1] for k in got if k.startswith("weight.")} == set(want)
    for n, t in want.items():
        assert torch.equal(got[f"weight.{n}"], t), n
    assert all(not got[f"{m}.{n}"].any() for m in MOMENTS for n in want if f"{m}.{n}" in got)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_dcp_of_the_hf_folder_to_autoep_writes_the_same_files(preset, tmp_path):
    """A DCP checkpoint of the same model (reshard's, its experts held apart as the folder holds
    them): ``--ep 2`` from it writes the HF folder's files exactly. Qwen3.5-MoE's and MiniMax-M3's are
    refused, before anything exists: without a config.json the model's order is the preset's
    architecture's at the source's layer count, and which layers are linear attention or dense
    (``layer_types``, ``mlp_layer_types``) no preset says."""
    dcp = convert(_pretrained(preset), tmp_path / "dcp", fmt="dcp").out_dir
    if preset in NO_ORDER_WITHOUT_CONFIG:
        with pytest.raises(ReshardError, match=r"does not record the model's parameter order"):
            reshard(dcp, tmp_path / "a", to="deepspeed", tp=1, dp=2, ep=2)
        assert not (tmp_path / "a").exists()
        return
    a = reshard(dcp, tmp_path / "a", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    b = reshard(_pretrained(preset), tmp_path / "b", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    assert sorted(p.name for p in a.glob("*.pt")) == sorted(p.name for p in b.glob("*.pt"))
    for p in sorted(b.glob("*.pt")):
        out: list[str] = []
        _differences(load(a / p.name), load(p), "", out)
        assert out == [], (p.name, out)


@pytest.mark.e2e
@pytest.mark.slow  # make test-all; make test keeps the file-for-file checks of the same route above
@pytest.mark.parametrize("preset", PRESETS)
def test_deepspeed_loads_autoep_written_from_the_hf_folder_and_trains(preset, tmp_path):
    """One real job at world 2, EP 2, the preset's own recipe (the DeepSpeed fixture's): DeepSpeed
    0.19.8 builds the model, wraps it in AutoEP, loads reshard's files natively, saves them straight
    back (the same tensors and values: only what a fresh job records otherwise differs) and trains
    two steps with finite losses."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    spec = model_spec_from_fixture(_native(preset).parent)
    ours = reshard(_pretrained(preset), tmp_path / "ours", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    native = tmp_path / "native"
    reports = resume_many([resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=2, universal=False,
                                       save_dir=native)], world_size=2, workdir=tmp_path / "job")
    mine = reports["reshard"]
    assert mine["global_steps_after_load"] == 0 and mine["ranks_agree"]
    experts = next(n for n in mine["layouts"] if n.endswith(".mlp.experts.w1"))
    assert mine["layouts"][experts] == "autoep"
    assert len(mine["losses"]) == 2 and all(math.isfinite(x) for x in mine["losses"])
    for p in sorted(ours.glob("*.pt")):
        out: list[str] = []
        _differences(load(p), load(native / ours.name / p.name), "", out)
        assert all(x in FRESH or x.startswith(tuple(f"{f}/" for f in FRESH)) for x in out), (p.name, sorted(out))


@pytest.mark.e2e
@pytest.mark.slow  # make test-all; make test keeps the file-for-file check of the same route above
def test_deepspeed_loads_autoep_written_from_deepseek_v3s_universal_and_trains(tmp_path):
    """DeepSpeed 0.19.8 loads the ``--ep 2`` files written from ``ds_to_universal``'s checkpoint of
    its own DeepSeek-V3 job natively, saves them straight back (only what a fresh job records
    otherwise differs) and trains two steps with finite losses."""
    pytest.importorskip("deepspeed")
    from tests.e2e.launch import model_spec_from_fixture, resume_load, resume_many

    spec = model_spec_from_fixture(_native("deepseek_v3").parent)
    ours = reshard(_universal("ds_to_universal", tmp_path), tmp_path / "ours", to="deepspeed", tp=1, dp=2,
                   ep=2).out_dir
    native = tmp_path / "native"
    reports = resume_many([resume_load("reshard", ours.parent, model_spec=spec, tp=1, dp=2, universal=False,
                                       save_dir=native)], world_size=2, workdir=tmp_path / "job")
    mine = reports["reshard"]
    assert mine["ranks_agree"] and len(mine["losses"]) == 2 and all(math.isfinite(x) for x in mine["losses"])
    for p in sorted(ours.glob("*.pt")):
        out: list[str] = []
        _differences(load(p), load(native / ours.name / p.name), "", out)
        assert all(x in FRESH or x.startswith(tuple(f"{f}/" for f in FRESH)) for x in out), (p.name, sorted(out))


def test_a_model_type_without_a_preset_entry_is_refused_naming_it(tmp_path):
    """A model type no preset entry lists: Qwen3.5-MoE's composite (vision + text) ``qwen3_5_moe``,
    which DeepSpeed's AutoEP refuses too (its preset takes the text backbone, ``qwen3_5_moe_text``):
    refused by its config's model_type, before anything exists."""
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(_pretrained("qwen3_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5_moe"}))
    with pytest.raises(ReshardError, match=r"model_type 'qwen3_5_moe': DeepSpeed AutoEP is written for mixtral, "
                                           r"qwen3_moe, qwen2_moe, qwen3_5_moe_text, deepseek_v2, deepseek_v3, "
                                           r"minimax_m3_vl_text \(autoep.json"):
        reshard(src, tmp_path / "out", to="deepspeed", tp=1, dp=2, ep=2)
    assert not (tmp_path / "out").exists()


def _hf_names(ucp: Path, qwen2: bool = False) -> dict[str, torch.Tensor]:
    """A universal checkpoint's fp32 masters (``zero/<name>/fp32.pt``) in transformers' in-memory
    names, written out here independently of ``autoep.json``: ``gate_up_proj`` = [w1; w3] along
    dim 1, ``down_proj`` = w2, the router ``gate.weight`` (buffers: ``fp32.pt`` alone, as they are)."""
    out = {}
    for d in sorted(p for p in (ucp / "zero").iterdir() if p.is_dir()):
        t = load(d / "fp32.pt")
        t = t["param"] if isinstance(t, dict) else t
        out[d.name] = t
    for n in [n for n in out if n.endswith(".experts.w1")]:
        m = n.rpartition(".w1")[0]
        out[f"{m}.gate_up_proj"] = torch.cat([out.pop(f"{m}.w1"), out.pop(f"{m}.w3")], dim=1)
        out[f"{m}.down_proj"] = out.pop(f"{m}.w2")
    out = {n: t for n, t in out.items() if not n.endswith(".mlp.gate.gate.weight")  # AutoEP's router aliases
           and not (n.endswith(".mlp.gate.e_score_correction_bias") and n.replace(".gate.", ".router.") in out)}
    if qwen2:  # Qwen2-MoE's shared expert and gate (AutoEPMoELayer's shared_experts/shared_experts_gate)
        out = {n.replace(".mlp.shared_experts", ".mlp.shared_expert"): t for n, t in out.items()}
    return {n.replace(".router.gate.weight", ".gate.weight").replace(".router.", ".gate."): t for n, t in out.items()}


@pytest.mark.parametrize("preset", tiered(["mixtral", *PRESETS], heavy=("minimax_m3",)))
def test_deepspeeds_autoep_files_export_to_a_folder_from_pretrained_loads(preset, tmp_path):
    """The HF export of DeepSpeed's own AutoEP job (``--hf-config`` the same model type's folder):
    ``from_pretrained`` loads it with no missing, unexpected or mismatched key, and every weight of
    the model it builds is DeepSpeed's own consolidation (``ds_to_universal``'s fp32 masters) in
    transformers' names, bit for bit; the router alias is written once (as the router)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    from tests.support.dsconv import ds_to_universal_folder

    ucp = ds_to_universal_folder(_native(preset).parent, tmp_path / "ds")
    r = convert(_native(preset).parent, tmp_path / "hf", fmt="hf", hf_config=_pretrained(preset))
    assert any("AutoEP's router alias" in n for n in r.notes) == (preset not in NO_ALIAS)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(r.out_dir, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    got, want = model.state_dict(), _hf_names(ucp, qwen2=preset in SHARED_GATE)
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    # reshard's own universal checkpoint exports alike (its alias a tied entry, not a parameter)
    again = convert(convert(_native(preset).parent, tmp_path / "ucp").out_dir, tmp_path / "hf2", fmt="hf",
                    hf_config=_pretrained(preset)).out_dir
    assert (again / "model.safetensors").read_bytes() == (r.out_dir / "model.safetensors").read_bytes()


def test_autoep_names_without_a_preset_for_the_model_type_are_refused(tmp_path):
    """An AutoEP checkpoint exported with another model type's config: refused, naming a tensor
    and the model type, before anything exists (its names would load as nothing)."""
    with pytest.raises(ReshardError, match=r"experts\.w1: DeepSpeed AutoEP's names, which a Hugging Face model_type "
                                           r"'llama' folder cannot hold"):
        convert(_native("qwen3_moe").parent, tmp_path / "hf", fmt="hf", hf_config=HF / "pretrained_llama")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("fixture", ["torch_dist_deepseek_v3_tp2_ep2", "torch_dist_moe_ep2_shared_softmax"])
def test_a_megatron_moe_with_shared_experts_to_autoep_holds_its_hf_names_values(fixture, tmp_path):
    """Megatron-Core's DeepSeek-V3 (MLA, shared expert, router expert bias; TP 2 x EP 2) and its
    Qwen2-MoE (shared expert and gate), read in HF names, at ``--ep 2 --dp 2``: every weight and Adam
    moment of the AutoEP files is reshard's HF-named conversion of the same source under AutoEP's
    names (this test's own mapping; the router alias its router), DeepSeek-V3's expert bias a module
    buffer (``buffer_names``, in no optimizer group)."""
    from safetensors.torch import load_file

    from tests.support.paths import MEGATRON

    src = MEGATRON / fixture
    ours = reshard(src, tmp_path / "ours", to="deepspeed", tp=1, dp=2, ep=2).out_dir
    got = _read_back(ours, tmp_path / "back")
    for n in [k for k in got if k.endswith(".mlp.gate.gate.weight")]:  # AutoEP's router alias
        assert torch.equal(got.pop(n), got[n.replace("gate.gate", "router.gate")])
    folder = convert(src, tmp_path / "hf", fmt="safetensors", with_optimizer=True, names="hf").out_dir
    want = {f"weight.{n}": t for n, t in _autoep_names(load_file(folder / "model.safetensors")).items()}
    for d in (p for p in (folder / "zero").iterdir() if p.is_dir()):
        for m in MOMENTS:
            if (d / f"{m}.pt").is_file():
                want.update({f"{m}.{n}": t for n, t in _autoep_names({d.name: load(d / f"{m}.pt")["param"]}).items()})
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items()), [k for k, v in want.items() if not torch.equal(got[k], v)]
    model = load(ours / "mp_rank_00_model_states.pt")
    bias = list(model["buffer_names"])
    assert all(n.endswith(".mlp.router.e_score_correction_bias") for n in bias) and bool(bias) == ("deepseek" in fixture)
    assert not any(n in g for g in model["param_shapes"] for n in bias)


def test_a_source_buffer_the_preset_does_not_write_as_one_is_refused():
    """The HF folder reports DeepSeek-V3's router bias as a module buffer (``Reader.buffers``: a
    persistent buffer of the model its config.json describes); a preset entry without ``buffer``
    would write it as a trained parameter, so the view refuses it, naming it."""
    import json

    from reshard.formats.deepspeed.autoep_view import AUTOEP_DOC, AutoEPView
    from reshard.formats.registry import open_reader

    reader = open_reader(_pretrained("deepseek_v3"))
    assert reader.buffers() == ("model.layers.1.mlp.gate.e_score_correction_bias",)
    doc = json.loads(AUTOEP_DOC.read_text())
    for p in doc["presets"]:
        for spec in p["sources"]:
            for e in spec["params"]:
                e.pop("buffer", None)
    with pytest.raises(ReshardError, match=r"router\.e_score_correction_bias: a module buffer of the source, which "
                                           r"DeepSpeed AutoEP's deepseek_v3 preset"):
        AutoEPView(reader, reader.expert_layers(), 2, doc)
