"""``--quantize fp8`` / ``fp8-ue8m0`` on the hf and safetensors targets: every payload and scale
equals transformers' own ``Fp8Quantize`` of the same bf16 weights, bit for bit, on the tensors its
FP8 quantizer picks (decoder linears; embeddings, norms, biases and ``lm_head`` left as they are); the
folder loads with ``FineGrainedFP8Config(dequantize=True)``; transformers' FP8 fixture decoded to bf16
and quantized again gives its bytes back; a source already in the asked encoding is copied, never
decoded (at any file split); partial blocks and runs of block rows; refusals before any output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reshard import convert
from reshard.errors import QuantizedError, ReshardError
from reshard.formats.safetensors import quantized as quantized_module
from reshard.formats.safetensors import writer as writer_module
from reshard.ir.codec import fp8_block_encode
from tests.support.paths import HF

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, FineGrainedFP8Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Quantize  # noqa: E402

# transformers' FP8 fixtures: (folder, --quantize, their block, FineGrainedFP8Config's scale_fmt)
CASES = [("fp8_qwen2", "fp8", (16, 32), "float"), ("fp8_qwen2_ue8m0", "fp8-ue8m0", (32, 32), "ue8m0")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.rglob("*.safetensors")):  # the safetensors target writes into OUT/<tag>/
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each FP8 fixture decoded to an ordinary bf16 folder (transformers' dequantized load, bit for bit:
    test_quantized_decode)."""
    root = tmp_path_factory.mktemp("bf16")
    for name, *_ in CASES:
        convert(HF / name, root / name, fmt="hf", dtype=torch.bfloat16)
    return {name: root / name for name, *_ in CASES}


@pytest.mark.parametrize(("name", "quantize", "block", "scale_fmt"), CASES)
def test_equals_transformers_fp8_quantize(tmp_path: Path, bf16: dict[str, Path], name: str, quantize: str,
                                          block: tuple[int, int], scale_fmt: str) -> None:
    out = tmp_path / "q"
    report = convert(bf16[name], out, fmt="hf", quantize=quantize, block=block)
    assert any("FP8 E4M3" in n for n in report.notes)
    config = json.loads((out / "config.json").read_text())
    qconfig = FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt)
    assert config["quantization_config"] == json.loads(json.dumps(qconfig.to_dict())) and config["dtype"] == "bfloat16"
    op = Fp8Quantize(SimpleNamespace(quantization_config=qconfig))
    src, got = load_file(bf16[name] / "model.safetensors"), _tensors(out)
    picked = json.loads((HF / name / "fixture.json").read_text())["recipe"]["quantized"]
    assert sorted(k for k, v in got.items() if v.dtype == torch.float8_e4m3fn) == sorted(picked)
    for k, v in src.items():
        want = op.convert({k: v}) if k in picked else {k: v}
        assert sorted(want) == sorted(n for n in got if n == k or n == k.removesuffix(".weight") + ".weight_scale_inv")
        assert all(_same(got[n], w) for n, w in want.items()), k
    # transformers' FP8 fixture -> bf16 -> --quantize: its bytes back, tensor for tensor
    fixture = load_file(HF / name / "model.safetensors")
    assert sorted(fixture) == sorted(got) and all(_same(got[k], v) for k, v in fixture.items())
    # and transformers loads it, as it loads its own
    q = FineGrainedFP8Config(dequantize=True)
    ours = AutoModelForCausalLM.from_pretrained(out, quantization_config=q).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(HF / name, quantization_config=q).state_dict()
    assert sorted(ours) == sorted(theirs) and all(_same(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize(("quantize", "fmt"), [("fp8", "float32"), ("fp8-ue8m0", "ue8m0")])
def test_partial_blocks_in_runs_of_block_rows(tmp_path: Path, quantize: str, fmt: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama whose dims (72, 32) are no multiple of the block: the zero-pad-then-crop convention,
    encoded a few block rows at a time (``RUN`` made small) as the whole tensor is; payloads and
    their scales share a file at any split."""
    monkeypatch.setattr(writer_module, "RUN", 2 * 16 * 32)
    src = HF / "pretrained_llama_bf16"
    convert(src, tmp_path / "q", fmt="safetensors", quantize=quantize, block=(16, 32), max_file_bytes=6000)
    index = json.loads(next((tmp_path / "q").rglob("model.safetensors.index.json")).read_text())["weight_map"]
    got, plain = _tensors(tmp_path / "q"), load_file(src / "model.safetensors")
    encoded = [k for k in plain if k.endswith("proj.weight")]
    assert sorted(k for k, v in got.items() if v.dtype == torch.float8_e4m3fn) == sorted(encoded)
    for k, v in plain.items():
        if k in encoded:
            q, s = fp8_block_encode(v, (16, 32), fmt)
            scale = k.removesuffix(".weight") + ".weight_scale_inv"
            assert _same(got[k], q) and _same(got[scale], s) and index[k] == index[scale], k
        else:
            assert _same(got[k], v), k


@pytest.mark.parametrize(("name", "quantize", "block", "_fmt"), CASES)
@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_source_encoding_copied_as_stored(tmp_path: Path, name: str, quantize: str, block: tuple[int, int], _fmt: str,
                                          fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--quantize naming the source's own encoding (its block by default): payloads and scales are
    the source's bytes, at any file split, and nothing is decoded (the decoder made to fail)."""
    def refuse(*_: object) -> None:
        raise AssertionError("decoded")

    monkeypatch.setattr(quantized_module, "fp8_block_decode", refuse)
    report = convert(HF / name, tmp_path / "q", fmt=fmt, quantize=quantize, max_file_bytes=20000)
    assert any("14 copied as the source stores them" in n for n in report.notes)
    src, got = load_file(HF / name / "model.safetensors"), _tensors(tmp_path / "q")
    assert sorted(src) == sorted(got) and all(_same(got[k], v) for k, v in src.items())
    assert len(list((tmp_path / "q").rglob("*.safetensors"))) > 1


def test_another_block_is_encoded_again(tmp_path: Path) -> None:
    """A block other than the source's: decoded (float32) and encoded again, equal to encoding the
    decoded values."""
    convert(HF / "fp8_qwen2", tmp_path / "fp32", fmt="safetensors")
    convert(HF / "fp8_qwen2", tmp_path / "q", fmt="safetensors", quantize="fp8", block=(32, 32))
    decoded, got = _tensors(tmp_path / "fp32"), _tensors(tmp_path / "q")
    k = "model.layers.1.mlp.down_proj.weight"
    q, s = fp8_block_encode(decoded[k], (32, 32))
    assert _same(got[k], q) and _same(got[k.removesuffix("weight") + "weight_scale_inv"], s)


def test_nan_weight_refused_leaving_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in (HF / "pretrained_llama_bf16").iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    t = load_file(src / "model.safetensors")
    t["model.layers.1.self_attn.o_proj.weight"][20, 7] = float("inf")
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizedError, match=r"parameter 'model.layers.1.self_attn.o_proj.weight'.*block \[1, 0\] "
                                             "holds a NaN or infinite value"):
        convert(src, tmp_path / "out", fmt="hf", quantize="fp8", block=(16, 32))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"fmt": "ucp", "quantize": "fp8"}, "--quantize goes with"),
    ({"fmt": "dcp", "quantize": "fp8"}, "a DCP target keeps a quantized source's weights as it stores them"),
    # gate_up_proj's up part starts at row 72 (intermediate 72), inside a 128-row block: vLLM's rule
    ({"fmt": "vllm", "quantize": "fp8"}, "'model.layers.0.mlp.gate_up_proj.weight' on rank 0: a part starts at row 72"),
    ({"fmt": "hf", "block": (128, 128)}, "--block goes with --quantize"),
    ({"fmt": "hf", "quantize": "fp8", "block": (0, 128)}, "two positive integers"),
    ({"fmt": "hf", "quantize": "fp8", "block": (128,)}, "two positive integers"),
    ({"fmt": "safetensors", "quantize": "int4"}, "reshard writes fp8 or fp8-ue8m0, or keep"),
])
def test_refused(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ReshardError, match=match):
        convert(HF / "pretrained_llama_bf16", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_cli_block_flag(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "reshard", "convert", str(HF / "pretrained_llama_bf16"), str(tmp_path / "out"),
           "--format", "hf", "--quantize", "fp8"]
    bad = subprocess.run([*run, "--block", "12x0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--block: must be ROWSxCOLS" in bad.stderr and not (tmp_path / "out").exists()
    good = subprocess.run([*run, "--block", "16x32"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 32]


def test_deepspeed_source_quantized_from_its_bf16_export(tmp_path: Path) -> None:
    """A DeepSpeed ZeRO-2 Trainer checkpoint (fp32 masters): --quantize encodes the weights the hf
    export would write (the config's bf16), equal to transformers' Fp8Quantize of that export."""
    src = HF / "trainer_llama_zero2_bf16" / "checkpoint-3"
    convert(src, tmp_path / "plain", fmt="hf")
    convert(src, tmp_path / "q", fmt="hf", quantize="fp8", block=(4, 8))  # every dim a multiple: transformers quantizes
    plain, got = load_file(tmp_path / "plain" / "model.safetensors"), _tensors(tmp_path / "q")
    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(4, 8))))
    encoded = [k for k in plain if k.endswith("proj.weight")]
    assert plain[encoded[0]].dtype == torch.bfloat16 and len(encoded) == 14
    for k, v in plain.items():
        want = op.convert({k: v}) if k in encoded else {k: v}
        assert (want[k].dtype == torch.float8_e4m3fn) == (k in encoded)
        assert all(_same(got[n], w) for n, w in want.items()), k


@pytest.mark.parametrize("name", ["fp8_qwen2", "mxfp4_gpt_oss"])
def test_the_weights_transformers_would_convert(tmp_path: Path, name: str) -> None:
    """The FP8 tensors are those of the modules transformers' own ``replace_with_fp8_linear`` makes
    ``FP8Linear`` (``nn.Linear``s less ``get_keys_to_not_convert``): gpt-oss's router (not an
    ``nn.Linear``) and 3-D experts stay bf16, as do embeddings, norms and ``lm_head``."""
    from transformers.integrations.finegrained_fp8 import FP8Linear, replace_with_fp8_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    convert(HF / name, tmp_path / "q", fmt="hf", quantize="fp8", block=(16, 16))
    got = _tensors(tmp_path / "q")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "q")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # the fixtures' configs name no architectures
    # 3-D experts (FP8Experts) are not --quantize's (2-D weights only; transformers' refuses gpt-oss's biased ones)
    skip = [*get_keys_to_not_convert(model), "experts"]
    replace_with_fp8_linear(model, skip, FineGrainedFP8Config(weight_block_size=(16, 16)))
    want = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert want and sorted(k for k, v in got.items() if v.dtype == torch.float8_e4m3fn) == sorted(want)
    assert all(k.removesuffix("weight") + "weight_scale_inv" in got for k in want)


@pytest.mark.parametrize(("name", "shape", "want"), [
    ("model.layers.0.mlp.down_proj.weight", (8, 8), True), ("module.layers.3.attention.wqkv.weight", (8, 8), True),
    ("lm_head.weight", (8, 8), False), ("output.weight", (8, 8), False), ("embed_out.weight", (8, 8), False),
    ("model.embed_tokens.weight", (8, 8), False), ("model.layers.0.input_layernorm.weight", (8, 8), False),
    ("model.layers.0.self_attn.q_proj.bias", (8, 8), False), ("model.layers.0.mlp.experts.down_proj", (2, 8, 8), False),
    ("model.layers.0.mlp.w.weight", (8,), False), ("model.layers.0.mlp.gate.weight", (4, 8), False),
    ("model.layers.0.mlp.router.gate.weight", (4, 8), False), ("model.layers.0.mlp.gate_proj.weight", (8, 8), True),
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", (8, 8), True),
])
def test_chosen_by_name_without_a_model(name: str, shape: tuple[int, ...], want: bool) -> None:
    """Where transformers cannot build the model (no config.json): 2-D ``X.weight`` not an embedding,
    a norm, an MoE router or an output head."""
    assert writer_module.quantizable(name, shape) is want


def test_sharded_fp8_source_copied_as_stored(tmp_path: Path) -> None:
    """An FP8 folder in shards (its index), as reshard's hf target writes it past --max-file-gb, read
    back and written again in its own encoding: every tensor the first folder's bytes."""
    convert(HF / "fp8_qwen2", tmp_path / "sharded", fmt="hf", quantize="fp8", max_file_bytes=30000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    report = convert(tmp_path / "sharded", tmp_path / "again", fmt="hf", quantize="fp8")
    assert any("14 copied" in n for n in report.notes)
    first, again = _tensors(tmp_path / "sharded"), _tensors(tmp_path / "again")
    assert sorted(first) == sorted(again) and all(_same(again[k], v) for k, v in first.items())
    assert sorted(first) == sorted(load_file(HF / "fp8_qwen2" / "model.safetensors"))
