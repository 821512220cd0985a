"""``reshard convert CKPT OUT --format hf``: a folder ``from_pretrained`` loads as it stands, from the
checkpoints HF Trainer + DeepSpeed (ZeRO-2/3, fp32/bf16, a tied Qwen2) and Accelerate's FSDP save
functions wrote (``tests/fixtures/hf``, made by ``scripts/make_hf_fixtures.py``).

Every weight equals the live model's at save time (``reference/``, taken from the job), or its
bf16 rounding with ``--dtype bf16``; the loaded model's logits on the recorded probe equal, bit for
bit, those of the fixture's architecture rebuilt here with the reference weights (and the recorded
ones to rounding: another CPU's kernels); nothing is copied by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reshard.cli import main
from reshard.errors import CheckpointError, ReshardError, UnplacedError
from reshard.jobs.convert import convert
from tests.support.paths import HF, MEGATRON

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

TRAINER = ["trainer_llama_zero3", "trainer_llama_zero2", "trainer_llama_zero3_bf16", "trainer_llama_zero2_bf16",
           "trainer_qwen2_tied_zero2", "trainer_qwen2_tied_zero3"]


def _reference(name: str) -> dict[str, Path]:
    fx = json.loads((HF / name / "fixture.json").read_text())
    files = fx["checkpoints"]["checkpoint-3"]["reference_files"] if "checkpoints" in fx else fx["reference_files"]
    return {k: HF / name / v for k, v in files.items()}


def _load(out: Path):
    # the live model ran eager attention (the recipe's): the same kernels, the same bits
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    return model.eval(), tokenizer


def _recipe_model(name: str, weights: dict[str, torch.Tensor], dtype: torch.dtype):
    """The fixture's own architecture (its recipe's model type and config, built by transformers
    here, not from the exported folder) holding the reference weights: the live model, rebuilt."""
    recipe = json.loads((HF / name / "fixture.json").read_text())["recipe"]
    config = transformers.AutoConfig.for_model(recipe["model_type"], **recipe["model_config"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: the embedding
    return model.eval()


def _check(model, name: str, dtype: torch.dtype | None = None) -> None:
    ref = _reference(name)
    want = load_file(ref["model"])
    got = model.state_dict()
    for key, w in want.items():
        w = w if dtype is None else load_file(ref.get("fp32", ref["model"])).get(key, w).to(dtype)
        assert got[key].dtype == w.dtype and torch.equal(got[key], w), key
    if dtype is None:  # logits on the probe recorded at save time
        probe = load_file(ref["logits"])
        with torch.no_grad():
            logits = model(probe["input_ids"]).logits
            live = _recipe_model(name, want, logits.dtype)(probe["input_ids"]).logits
        # bit for bit against the live model rebuilt in this run (the same CPU kernels); the
        # recorded logits came from the generating machine's CPU, whose kernels may round otherwise
        assert torch.equal(logits, live)
        torch.testing.assert_close(logits, probe["logits"].to(logits.dtype))


@pytest.mark.parametrize("name", TRAINER)
def test_trainer_checkpoints_export_as_folders_from_pretrained_loads(name, tmp_path):
    out = tmp_path / "exported"
    report = convert(HF / name / "checkpoint-3", out, fmt="hf")
    assert report.out_dir == out
    model, tokenizer = _load(out)
    _check(model, name)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= files
    tied = "qwen2_tied" in name
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is not tied  # written once, as save_pretrained
    assert any("HF export" in n for n in report.notes)


def test_dtype_casts_the_fp32_masters(tmp_path):
    out = tmp_path / "bf16"
    convert(HF / "trainer_llama_zero3" / "checkpoint-3", out, fmt="hf", dtype=torch.bfloat16)
    model, _ = _load(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    want = load_file(_reference("trainer_llama_zero3").get("fp32", _reference("trainer_llama_zero3")["model"]))
    for name, t in model.state_dict().items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[name].to(torch.bfloat16)), name


def test_accelerate_fsdp_export_takes_the_config_it_is_given(tmp_path):
    src = HF / "accelerate_fsdp_llama" / "checkpoint-3" / "pytorch_model_fsdp_0"
    with pytest.raises(ReshardError, match="--hf-config"):
        convert(src, tmp_path / "no", fmt="hf")
    assert not (tmp_path / "no").exists()
    out = tmp_path / "fsdp"
    convert(src, out, fmt="hf", hf_config=HF / "accelerate_fsdp_llama" / "hf_files")
    model, _ = _load(out)
    _check(model, "accelerate_fsdp_llama")


def test_the_command_exports_in_one_line(tmp_path, capsys):
    assert main(["convert", HF / "trainer_llama_zero2" / "checkpoint-3", tmp_path / "x", "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert "HF export: 21 tensors" in out and "config.json from" in out


def test_a_source_in_other_names_is_refused_not_exported_as_random_weights(tmp_path):
    """A DCP in Megatron-Core's names with a Llama config: every Llama weight would be missing and
    ``from_pretrained`` would leave them at their initial values -- refused before any output."""
    dcp = tmp_path / "dcp"
    convert(MEGATRON / "torch_dist_tp2_pp2", dcp, fmt="dcp")
    with pytest.raises(CheckpointError, match=r"holds no lm_head.weight, model.embed_tokens.weight, .*21 of the 21 "
                                              r"weights of the LlamaForCausalLM model .*'embedding.word_embeddings"):
        convert(next(dcp.iterdir()), tmp_path / "hf", fmt="hf", hf_config=HF / "pretrained_llama")
    assert not (tmp_path / "hf").exists()


def test_a_tensor_the_model_has_no_key_for_is_refused_or_dropped(tmp_path):
    """A tensor the config's model has no key for (``from_pretrained`` would ignore it): refused
    naming it and why, unless ``--drop`` names it (recorded)."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    for f in (HF / "pretrained_llama").iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(HF / "pretrained_llama" / "model.safetensors")
    save_file({**tensors, "model.extra.weight": torch.ones(3)}, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnplacedError, match=r"model.extra.weight \(no key of the LlamaForCausalLM model .*"
                                            r"from_pretrained would ignore it\).*--drop"):
        convert(src, tmp_path / "no", fmt="hf")
    assert not (tmp_path / "no").exists()
    convert(src, tmp_path / "out", fmt="hf", drop=[r"^model\.extra\."])
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(tensors)
    manifest = json.loads((tmp_path / "out" / "reshard-manifest.json").read_text())
    assert "model.extra.weight" in json.dumps(manifest.get("dropped"))
