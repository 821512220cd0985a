"""Every source entry accounted for, on every route (issue 35, ``jobs.accounted``): a tensor planted
in a copy of each reader's committed fixture is written (carried), reported as not carried, or
refused naming it before any output folder exists; ``drop=`` (``--drop``) turns the refusal into a
"dropped" entry of the report and the manifest. A route with nothing to report writes no new
manifest key.

Planted: a buffer-like tensor (a DeepSpeed module buffer, an ``expert_bias``-like Megatron tensor,
a DCP entry outside the model, a safetensors file the index does not list) and a run's state (a
client-state entry, an ``_extra_state`` object)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from reshard.errors import CheckpointError, ReshardError, UnplacedError
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.support.paths import DCP, DEEPSPEED, HF, MEGATRON

BUFFER = "planted_buffer"  # in a key: what the refusals must name
PLANTED = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _copy(src: Path, tmp: Path) -> Path:
    dst = tmp / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("oracle", "reference"))
    return dst


# -- planting, each as its framework would hold it ------------------------------------------------------


def _plant_deepspeed(ckpt: Path) -> str:
    """A module buffer (``buffer_names``) and a client-state entry in every model-state file."""
    tag = ckpt / (ckpt / "latest").read_text().strip()
    for f in sorted(tag.glob("*model_states.pt")):
        if f.name.startswith("layer_"):
            continue
        state = load(f, mmap=False)
        if state.get("module") is not None:
            state["module"][f"mlp.{BUFFER}"] = PLANTED.clone()
            state["buffer_names"] = [*state["buffer_names"], f"mlp.{BUFFER}"]
        state["planted_client_state"] = {"epoch": 3}
        torch.save(state, f)
    return f"mlp.{BUFFER}"


def _plant_dcp(folder: Path, tmp: Path, tensors: dict, objects: dict) -> None:
    """``tensors`` and ``objects`` saved by ``dcp.save`` and merged into ``folder``'s checkpoint:
    their records appended to its first file, their entries to its ``.metadata``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    extra = tmp / f"{folder.name}.planted"
    with warnings.catch_warnings():  # one process, no process group: what the warning says it assumes
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**tensors, **objects}, checkpoint_id=str(extra))
    md, new = FileSystemReader(str(folder)).read_metadata(), FileSystemReader(str(extra)).read_metadata()
    first = sorted(folder.glob("*.distcp"))[0]
    base = {}
    with open(first, "ab") as out:
        for f in sorted(extra.glob("*.distcp")):
            base[f.name] = first.stat().st_size
            out.write(f.read_bytes())
            out.flush()
    for idx, info in new.storage_data.items():
        md.storage_data[idx] = dataclasses.replace(info, relative_path=first.name,
                                                   offset=base[info.relative_path] + info.offset)
    md.state_dict_metadata.update(new.state_dict_metadata)
    with open(folder / ".metadata", "wb") as out:
        pickle.dump(md, out)


def _plant_megatron_legacy(save: Path) -> str:
    from reshard.formats.megatron import safe

    for f in sorted(save.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        sd = safe.load_file(f)
        sd = {k: v for k, v in sd.items()}
        sd["model"] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd["model"].items()}
        sd["model"][f"decoder.layers.0.mlp.router.{BUFFER}"] = PLANTED.clone()
        f.write_bytes(safe.dumps(sd))
    return f"decoder.layers.0.mlp.router.{BUFFER}"


def _planted(name: str, tmp: Path) -> tuple[Path, str]:
    """A copy of source ``name`` with a planted buffer-like tensor, and the key refusals name."""
    kind, path = SOURCES[name]
    if kind == "deepspeed":
        src = _copy(path, tmp)
        return src, _plant_deepspeed(src)
    if kind == "universal":  # reshard's universal of a DeepSpeed job: the model states copied beside zero/
        out = convert(DEEPSPEED / "llama_zero1_dp2", tmp / "ucp", fmt="universal").out_dir
        return out, _plant_deepspeed_universal(out)
    if kind == "dcp":
        src = _copy(path, tmp)
        folder = src / "pytorch_model_fsdp_0" if (src / "pytorch_model_fsdp_0").is_dir() else src
        _plant_dcp(folder, tmp, {f"ema.{BUFFER}": PLANTED.clone()}, {"planted._extra_state": "fp8 meta"})
        return src, f"ema.{BUFFER}"
    if kind == "safetensors":
        from safetensors.torch import save_file

        src = _copy(path, tmp)
        save_file({BUFFER: PLANTED.clone()}, src / f"{BUFFER}.safetensors")
        return src, f"{BUFFER}.safetensors"
    src = _copy(path, tmp)  # megatron
    if kind == "megatron-legacy":
        return src, _plant_megatron_legacy(src)
    key = f"decoder.layers.mlp.router.{BUFFER}"
    _plant_dcp(next(src.glob("iter_*")), tmp, {key: PLANTED.clone()}, {})
    return src, key


def _plant_deepspeed_universal(out: Path) -> str:
    for f in sorted(out.glob("*model_states.pt")):
        state = load(f, mmap=False)
        state["module"] = {**(state.get("module") or {}), f"mlp.{BUFFER}": PLANTED.clone()}
        state["buffer_names"] = [*(state.get("buffer_names") or []), f"mlp.{BUFFER}"]
        torch.save(state, f)
    return f"mlp.{BUFFER}"


# the sources of tests/formats/test_routes.py, and the formats' others
SOURCES = {
    "deepspeed-autotp-zero1": ("deepspeed", DEEPSPEED / "llama_tp2_dp2"),
    "deepspeed-zero3": ("deepspeed", DEEPSPEED / "llama_zero3_dp2"),
    "deepspeed-autoep": ("deepspeed", DEEPSPEED / "mixtral_autoep_ep2"),
    "universal": ("universal", None),
    "dcp-fsdp2": ("dcp", DCP / "llama_fsdp2_ws2"),
    "accelerate": ("dcp", HF / "accelerate_fsdp_llama" / "checkpoint-3"),
    "hf-sharded": ("safetensors", HF / "pretrained_llama_sharded"),
    "megatron-torch-dist": ("megatron", MEGATRON / "torch_dist_tp2_pp2"),
    "megatron-legacy": ("megatron-legacy", MEGATRON / "legacy_tp2_pp2"),
    # MoE and MLA (issue 35): Qwen3-MoE shaped (TP2 x EP2 x expert TP1), DeepSeek-V3 shaped (MLA + MoE with shared
    # experts and an expert bias), and legacy files with EP (mp_rank_TT_EEE)
    "megatron-moe": ("megatron", MEGATRON / "torch_dist_moe_tp2_ep2_qk_layernorm"),
    "megatron-mla-moe": ("megatron", MEGATRON / "torch_dist_mla_moe_tp2_ep2"),
    "megatron-legacy-moe": ("megatron-legacy", MEGATRON / "legacy_moe_tp2_ep2_shared"),
    # DeepSeek-V3 MoE (MLA, TP2 x EP2, a dense first layer, a shared expert without gate, the expert bias): HF names
    "megatron-deepseek-v3": ("megatron", MEGATRON / "torch_dist_deepseek_v3_tp2_ep2"),
}
TARGETS = ("ucp", "safetensors", "dcp", "deepspeed")  # as tests/formats/test_routes.py: DeepSpeed to DeepSpeed aside
# safetensors takes HF names, which a shared-expert gate has none of in deepseek_v3.json (DeepseekV3 has no such
# gate), nor an expert bias beside one in llama.json (Qwen2-MoE has no expert bias): the route is refused naming
# that key of the source's own, before the planted one is looked at
UNNAMED = {"megatron-mla-moe": "decoder.layers.1.mlp.shared_experts.gate_weight",
           "megatron-legacy-moe": "decoder.layers.1.mlp.router.expert_bias"}
# the contract suite's other targets (tests/formats/test_routes.py), for the source that has HF names for every
# tensor: an HF folder and a Megatron checkpoint take the route; vLLM's writer refuses the architecture by name
MORE_TARGETS = {"megatron-deepseek-v3": ("hf", "megatron", "vllm"),
                # legacy sources to legacy files (--ckpt-format torch, the source's format: the default)
                "megatron-legacy": ("megatron",), "megatron-legacy-moe": ("megatron",)}
ARCH_REFUSED = {("megatron-deepseek-v3", "vllm"): r"architecture \['DeepseekV3ForCausalLM'\] -- --format vllm writes"}
# where the target copies the source's own files, the planted buffer is written, not refused
CARRIED = {("deepspeed-autotp-zero1", "ucp"), ("deepspeed-zero3", "ucp"), *(("deepspeed-autoep", t) for t in TARGETS)}
# AutoEP reads every module entry its optimizer does not own as a module weight (a router alias):
# the buffer is a parameter there, written by every target
# one route per source also runs with drop= (each target in turn): the rest are refused only
DROPPED = {"deepspeed-autotp-zero1": "safetensors", "deepspeed-zero3": "dcp", "deepspeed-autoep": None,
           "universal": "deepspeed", "dcp-fsdp2": "ucp", "accelerate": "safetensors", "hf-sharded": "dcp",
           "megatron-torch-dist": "deepspeed", "megatron-legacy": "ucp", "megatron-moe": "dcp",
           "megatron-mla-moe": "ucp", "megatron-legacy-moe": "deepspeed",
           "megatron-deepseek-v3": ("safetensors", "hf", "megatron")}


def _run(src: Path, target: str, out: Path, **kw):
    if target == "deepspeed":
        return reshard(src, out, to="deepspeed", tp=1, dp=2, **kw)
    if target == "megatron":
        return reshard(src, out, to="megatron", tp=1, ep=1, **kw)
    return convert(src, out, fmt=target, **kw)


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_planted_tensor_is_written_reported_or_refused_never_lost(source, tmp_path_factory):
    src, key = _planted(source, tmp_path_factory.mktemp(source))
    for target in TARGETS[:3] if SOURCES[source][0] == "deepspeed" else TARGETS + MORE_TARGETS.get(source, ()):
        out = tmp_path_factory.mktemp(f"{source}-{target}") / "out"
        if (source, target) in ARCH_REFUSED:
            with pytest.raises(ReshardError, match=ARCH_REFUSED[source, target]):
                _run(src, target, out)
            assert not out.exists()
            continue
        if source in UNNAMED and target == "safetensors":
            with pytest.raises(CheckpointError, match=rf"no entry for Megatron key '{UNNAMED[source]}'"):
                _run(src, target, out)
            assert not out.exists()
            continue
        if (source, target) in CARRIED:
            report = _run(src, target, out)
            assert key not in report.dropped and key not in report.not_carried
            if target == "safetensors":  # written as a parameter, as the source holds it
                from safetensors.torch import load_file

                got = {k: v for f in report.out_dir.glob("*.safetensors") for k, v in load_file(f).items()}
                assert torch.equal(got[key], PLANTED)
            continue
        with pytest.raises(UnplacedError) as e:
            _run(src, target, out)
        assert key in str(e.value) and key in e.value.entries, (target, str(e.value))
        assert "--drop" in str(e.value)
        assert not out.exists(), f"{target}: an output folder exists after the refusal"
        dropped = DROPPED[source]
        if target == dropped or isinstance(dropped, tuple) and target in dropped:
            report = _run(src, target, out, drop=[BUFFER])
            assert key in report.dropped
            assert any(key in n and n.startswith("dropped by --drop") for n in report.notes), report.notes
            manifest = json.loads((report.out_dir / "reshard-manifest.json").read_text())
            assert key in [d["key"] for d in manifest["dropped"]]


@pytest.mark.parametrize("source,topology", [("deepspeed-autotp-zero1", {"tp": 2, "dp": 1}),
                                             ("deepspeed-zero3", {"tp": 1, "dp": 1, "zero_stage": 1})])
def test_a_carried_buffer_is_in_the_target_as_the_source_holds_it(source, topology, tmp_path):
    src, key = _planted(source, tmp_path)
    report = reshard(src, tmp_path / "out", to="deepspeed", **topology)
    assert not report.not_carried and not report.dropped
    for f in sorted(report.out_dir.glob("mp_rank_*_model_states.pt")):
        state = load(f, mmap=False)
        assert torch.equal(state["module"][key], PLANTED) and key in state["buffer_names"]
        assert state["planted_client_state"] == {"epoch": 3}


def test_a_runs_state_is_reported_not_carried_with_its_reason(tmp_path):
    report = convert(MEGATRON / "torch_dist_tp2_pp2", tmp_path / "out", fmt="safetensors")
    manifest = json.loads((report.out_dir / "reshard-manifest.json").read_text())
    extra = [h for h in manifest["not_carried"] if "_extra_state" in h["key"]]
    assert extra and all("_extra_state" in h["reason"] and h["what"] == "state" for h in extra)
    assert any(h["key"].startswith("rng_state/") and "RNG" in h["reason"] for h in manifest["not_carried"])
    assert any(n.startswith("not carried (a module's _extra_state") for n in report.notes)
    assert "dropped" not in manifest


def test_a_planted_dcp_object_is_not_carried_and_a_route_with_nothing_to_report_adds_no_key(tmp_path):
    src = _copy(DCP / "llama_fsdp2_ws2", tmp_path)
    _plant_dcp(src, tmp_path, {}, {"planted._extra_state": "fp8 meta"})
    report = convert(src, tmp_path / "out", fmt="safetensors")
    assert report.not_carried == ["planted._extra_state"]
    manifest = json.loads((report.out_dir / "reshard-manifest.json").read_text())
    assert manifest["not_carried"] == [{"key": "planted._extra_state", "file": str(src / ".metadata"),
                                        "what": "state", "reason": "a non-tensor entry"}]
    clean = convert(DCP / "llama_fsdp2_ws2", tmp_path / "clean", fmt="safetensors")
    manifest = json.loads((clean.out_dir / "reshard-manifest.json").read_text())
    assert "not_carried" not in manifest and "dropped" not in manifest and not clean.not_carried


def test_a_layer_file_tensor_of_a_pipeline_is_refused_by_name(tmp_path):
    """DeepSpeed's pipeline layer files hold parameters only: another tensor there is refused by
    the reader (UnplacedError), whatever the route."""
    src = _copy(DEEPSPEED / "tp_pipe_tp2_pp2", tmp_path)
    tag = src / (src / "latest").read_text().strip()
    f = sorted(tag.glob("layer_01-model_00-model_states.pt"))[0]
    state = load(f, mmap=False)
    state[BUFFER] = PLANTED.clone()
    torch.save(state, f)
    with pytest.raises(UnplacedError, match=BUFFER):
        convert(src, tmp_path / "out", fmt="safetensors")
    assert not (tmp_path / "out").exists()


def test_drop_patterns_are_checked_first(tmp_path):

    with pytest.raises(ReshardError, match=r"drop \(--drop\): '\(' is not a regular expression"):
        convert(DCP / "llama_fsdp2_ws2", tmp_path / "out", fmt="safetensors", drop=["("])
    assert not (tmp_path / "out").exists()


def test_the_command_line_takes_drop(tmp_path, capsys):
    from reshard.cli import main

    src, key = _planted("hf-sharded", tmp_path)
    assert main(["convert", str(src), str(tmp_path / "out"), "--format", "dcp"]) == 2
    assert key in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "out"), "--format", "dcp", "--drop", BUFFER,
                 "--drop", "no_such_entry"]) == 0
    printed = capsys.readouterr().out
    assert f"dropped by --drop (a safetensors file the folder's index does not list): {key}" in printed
    assert "--drop 'no_such_entry' matched no entry of the source" in printed


def _hf_with(tmp: Path, extra: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import load_file, save_file

    src = _copy(HF / "pretrained_llama", tmp)
    save_file({**load_file(src / "model.safetensors"), **extra}, src / "model.safetensors", metadata={"format": "pt"})
    return src


def test_drop_leaves_out_a_tensor_a_target_architecture_has_no_place_for(tmp_path):
    """An expert bias in an HF folder whose Megatron mapping has no key for it: refused naming it,
    and with --drop written without it (the report and manifest say so)."""

    bias = "model.layers.0.mlp.gate.e_score_correction_bias"
    src = _hf_with(tmp_path, {bias: torch.zeros(4)})
    with pytest.raises(ReshardError, match=rf"'{bias}'.*--drop"):
        reshard(src, tmp_path / "out", to="megatron", tp=1)
    assert not (tmp_path / "out").exists()
    report = reshard(src, tmp_path / "out", to="megatron", tp=1, drop=["e_score_correction_bias$"])
    assert report.dropped == [bias]
    manifest = json.loads(next(report.out_dir.rglob("reshard-manifest.json")).read_text())
    assert manifest["dropped"] == [{"key": bias, "file": str(src), "what": "weights",
                                    "reason": "a parameter --drop names"}]


def test_a_dropped_parameter_is_absent_from_a_target_that_reads_back(tmp_path):
    """From a DeepSpeed source whose files a target would copy as they are, a dropped parameter
    makes the target write the source as any other format's: the output reads back without it."""
    from reshard.formats.registry import open_reader

    gone = "model.layers.1.mlp.up_proj.weight"
    for fmt in ("ucp", "deepspeed"):
        out = tmp_path / fmt
        if fmt == "deepspeed":
            report = reshard(DEEPSPEED / "llama_tp2_dp2", out, to="deepspeed", tp=1, dp=2, drop=[r"layers\.1\.mlp\.up"])
        else:
            report = convert(DEEPSPEED / "llama_tp2_dp2", out, fmt=fmt, drop=[r"layers\.1\.mlp\.up"])
        assert report.dropped == [gone]
        back = open_reader(report.out_dir)
        back.check()
        assert gone not in back.names and len(back.names) == 20


def test_drop_names_a_buffer_a_target_would_carry(tmp_path):
    """A universal target copies a DeepSpeed source's model states, buffers included; dropping the
    buffer makes it write them afresh, without it."""
    src, key = _planted("deepspeed-autotp-zero1", tmp_path)
    report = convert(src, tmp_path / "out", fmt="ucp", drop=[BUFFER])
    assert report.dropped == [key] and report.not_carried == ["planted_client_state"]
    for f in sorted(report.out_dir.glob("*model_states.pt")):
        assert key not in (load(f, mmap=False).get("module") or {})


def test_a_tied_lm_head_is_written_as_its_table_and_a_recomputed_buffer_reported(tmp_path):
    """A tied model's folder holding lm_head.weight beside its table: the HF and vLLM targets write
    the table once (the alias is carried by it); an older checkpoint's rotary inv_freq is no
    parameter: reported as not carried, on every route."""
    from safetensors.torch import load_file, save_file

    src = _copy(HF / "pretrained_qwen2_tied", tmp_path)
    sd = load_file(src / "model.safetensors")
    inv = "model.layers.0.self_attn.rotary_emb.inv_freq"
    extra = {"lm_head.weight": sd["model.embed_tokens.weight"].clone(), inv: torch.ones(4)}
    save_file({**sd, **extra}, src / "model.safetensors", metadata={"format": "pt"})
    for fmt in ("hf", "vllm", "safetensors"):
        report = convert(src, tmp_path / fmt, fmt=fmt)
        assert report.not_carried == [inv] and not report.dropped, fmt
        if fmt == "hf":
            assert "lm_head.weight" not in load_file(report.out_dir / "model.safetensors")
        if fmt == "safetensors":
            assert "lm_head.weight" in load_file(report.out_dir / "model.safetensors")


def test_a_stray_file_in_a_deepspeed_tag_folder_is_reported(tmp_path):
    """A file no DeepSpeed pattern names is read by no target: reported, not copied, on the route
    that copies the model-state files as they are."""
    src = _copy(DEEPSPEED / "llama_tp2_dp2", tmp_path)
    tag = src / (src / "latest").read_text().strip()
    (tag / "notes.txt").write_text("lr sweep 3")
    report = convert(src, tmp_path / "out", fmt="ucp")
    assert report.not_carried == ["notes.txt"] and not (report.out_dir / "notes.txt").exists()


def test_megatron_to_megatron_drops_a_tensor_and_refuses_to_drop_what_it_copies(tmp_path):
    """An expert-bias-like tensor no parameter takes is refused, then dropped, Megatron to Megatron
    (the target still written from the source's own files); the RNG records that target copies at
    the same topology cannot be dropped: refused naming them."""

    src, key = _planted("megatron-torch-dist", tmp_path)
    with pytest.raises(UnplacedError, match=BUFFER):
        reshard(src, tmp_path / "a", to="megatron", tp=1)
    report = reshard(src, tmp_path / "a", to="megatron", tp=1, drop=[BUFFER])
    assert report.dropped == [key] and not any("rng_state" in k for k in report.dropped)
    with pytest.raises(ReshardError, match=r"--drop names 'rng_state/.*cannot be left out"):
        reshard(src, tmp_path / "b", to="megatron", drop=[BUFFER, "^rng_state"])
    assert not (tmp_path / "b").exists()


def test_a_source_without_dropped_tensors_answers_every_contract_question_as_the_source():
    """``--drop`` wraps the source (``accounted.Without``): a contract method it did not forward
    would fall back to the contract's default there, e.g. ``stored`` -> None, so ``--quantize keep``
    with ``--drop`` decoded the weights it was asked to keep."""
    from reshard.formats.contract import Reader, ReaderView
    from reshard.jobs.accounted import Without

    asked = {n for n, v in vars(Reader).items() if callable(v) and not n.startswith("_")}
    # answered by Without itself, or by ReaderView from the source (native: none, on purpose)
    assert sorted(asked - set(vars(Without)) - set(vars(ReaderView))) == []
    import reshard

    assert Without(reshard.open(HF / "pretrained_llama"), ()).native("safetensors") is None


def test_drop_keeps_quantized_weights_as_stored(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "out"
    convert(HF / "fp8_qwen2", out, fmt="hf", quantize="keep", drop=["lm_head.weight"])
    with safe_open(str(out / "model.safetensors"), "pt") as f, \
            safe_open(str(HF / "fp8_qwen2" / "model.safetensors"), "pt") as g:
        kept = [k for k in f.keys() if f.get_tensor(k).dtype == torch.float8_e4m3fn]
        assert kept and all(torch.equal(f.get_tensor(k).view(torch.uint8), g.get_tensor(k).view(torch.uint8))
                            for k in kept)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
