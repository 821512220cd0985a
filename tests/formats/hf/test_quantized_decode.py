"""A quantized Hugging Face folder read as the weights it encodes: every decoded tensor equals, bit
for bit, what transformers' own dequantizing load gives (``FineGrainedFP8Config(dequantize=True)``,
``Mxfp4Config(dequantize=True)``) on the fixtures transformers' ``Fp8Quantize`` wrote (and the
hand-packed gpt-oss MXFP4 one; ``scripts/make_quantized_fixtures.py``); ``--format hf`` gives a
folder plain ``from_pretrained`` loads with the same logits; partial last blocks decode as
DeepSeek's reference formula (per element, ``w[i, j] = q[i, j] * s[i // bm, j // bn]``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reshard import convert, reshard
from reshard.errors import CheckpointError
from reshard.formats.safetensors.reader import SafetensorsReader
from tests.support.paths import HF

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

FP8 = ["fp8_qwen2", "fp8_qwen2_ue8m0"]
ALL = [*FP8, "mxfp4_gpt_oss"]
PROBE = torch.tensor([[5, 17, 3, 99, 42, 7, 64, 1, 12, 100, 31, 8]])


def _dequantized(name: str) -> torch.nn.Module:
    q = Mxfp4Config(dequantize=True) if name.startswith("mxfp4") else FineGrainedFP8Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(HF / name, quantization_config=q, attn_implementation="eager").eval()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


def _fp32_products(name: str) -> dict[str, torch.Tensor]:
    """The quantized tensors decoded in float32 by transformers' own dequantizing ops."""
    raw, out = load_file(HF / name / "model.safetensors"), {}
    for k, v in raw.items():
        if k.endswith("weight_scale_inv"):
            w = k[:-len("_scale_inv")]
            out[w] = Fp8Dequantize(None)._dequantize_one(raw[w], v, output_dtype=torch.float32)
        elif k.endswith("_blocks"):
            out[k[:-len("_blocks")]] = convert_moe_packed_tensors(v, raw[k[:-len("_blocks")] + "_scales"],
                                                                  dtype=torch.float32)
    return out


@pytest.mark.parametrize("name", ALL)
def test_hf_export_equals_transformers_dequantized_load(tmp_path: Path, name: str) -> None:
    model = _dequantized(name)
    report = convert(HF / name, tmp_path / "out", fmt="hf", dtype=model.dtype)
    assert "decoded" in report.source_description
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    _same(load_file(tmp_path / "out" / "model.safetensors"), dict(model.state_dict()))
    # an ordinary model: plain from_pretrained, the dequantized load's logits
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert plain.config.quantization_config is None if hasattr(plain.config, "quantization_config") else True
    with torch.no_grad():
        assert torch.equal(plain(PROBE).logits, model(PROBE).logits)


@pytest.mark.parametrize("name", ALL)
def test_safetensors_fp32_equals_the_fp32_products(tmp_path: Path, name: str) -> None:
    convert(HF / name, tmp_path / "out", fmt="safetensors")
    got = {k.removeprefix("model.safetensors/"): v for k, v in load_file(
        next((tmp_path / "out").rglob("*.safetensors"))).items()}
    want = _fp32_products(name)
    assert want and all(got[k].dtype == torch.float32 for k in want)
    _same({k: got[k] for k in want}, want)
    raw = load_file(HF / name / "model.safetensors")
    plain = {k: v for k, v in raw.items() if k in got and k not in want}
    assert plain and all(torch.equal(_bits(got[k]), _bits(v)) for k, v in plain.items())  # copied as they are
    assert sorted(got) == sorted(plain.keys() | want.keys())  # scales consumed, not listed


def test_deepspeed_target_gets_the_decoded_weights(tmp_path: Path) -> None:
    """A fresh DeepSpeed ZeRO-1 job from an FP8 folder: fp32 masters the decoded float32 products,
    bf16 module weights their rounding (DeepSpeed's own loading of such files: test_hf_to_deepspeed)."""
    pytest.importorskip("deepspeed")
    src = HF / "fp8_qwen2"
    reshard(src, tmp_path / "out", to="deepspeed", tp=1, dp=1)
    model = torch.load(tmp_path / "out" / "fp8_qwen2" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    optim = torch.load(tmp_path / "out" / "fp8_qwen2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                       weights_only=False)["optimizer_state_dict"]
    flat, where = optim["single_partition_of_fp32_groups"][0], optim["param_slice_mappings"][0]
    reader = SafetensorsReader(src)
    assert sorted(model) == sorted(reader.names) and len(reader.coded) == 14
    for k in reader.names:
        want = reader.fragment(k, "weight", 0).float()
        assert torch.equal(_bits(flat.narrow(0, where[k].start, where[k].numel)), _bits(want)), k
        assert torch.equal(_bits(model[k].reshape(-1)), _bits(want.to(torch.bfloat16))), k


def test_universal_target_gets_the_decoded_weights(tmp_path: Path) -> None:
    src = HF / "fp8_qwen2"
    convert(src, tmp_path / "out", fmt="ucp")
    convert(tmp_path / "out", tmp_path / "back", fmt="safetensors", dtype=torch.float32)
    back = load_file(next((tmp_path / "back").rglob("*.safetensors")))
    reader = SafetensorsReader(src)
    assert sorted(back) == sorted(reader.names)
    for k in reader.names:
        want = reader.fragment(k, "weight", 0).float().view(reader.shape(k))
        assert torch.equal(_bits(back[k]), _bits(want)), k


def _partial_folder(folder: Path, scales: torch.Tensor, payload: torch.Tensor, block: list[int]) -> Path:
    folder.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": payload, "model.layers.0.mlp.down_proj.weight_scale_inv": scales,
               "model.norm.weight": torch.ones(8)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}}))
    return folder


@pytest.mark.parametrize("scale_kind", ["float32", "e8m0", "uint8"])
@pytest.mark.parametrize("shape", [(130, 200), (576, 256), (3, 5)])
def test_partial_last_blocks_decode_as_deepseek_reference(tmp_path: Path, shape: tuple[int, int],
                                                          scale_kind: str) -> None:
    """Rows and columns not a multiple of 128 (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows):
    ``ceil`` scale rows/cols, the last block partial; per element ``q * s[i // 128, j // 128]``."""
    g = torch.Generator().manual_seed(sum(shape))
    rows, cols = shape
    payload = (torch.randn(shape, generator=g) * 200).to(torch.float8_e4m3fn)
    grid = (-(-rows // 128), -(-cols // 128))
    if scale_kind == "float32":
        scales = torch.rand(grid, generator=g) * 1e-3 + 1e-6
        s32 = scales
    else:
        raw = torch.randint(100, 140, grid, generator=g, dtype=torch.uint8)
        scales = raw if scale_kind == "uint8" else raw.view(torch.float8_e8m0fnu)
        s32 = torch.ldexp(torch.ones(grid), raw.to(torch.int32) - 127)
    src = _partial_folder(tmp_path / "src", scales, payload, [128, 128])
    # DeepSeek's weight_dequant: each element times its block's scale, in float32
    full = s32.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    want = payload.to(torch.float32) * full
    convert(src, tmp_path / "fp32", fmt="safetensors")
    got = load_file(next((tmp_path / "fp32").rglob("*.safetensors")))["model.layers.0.mlp.down_proj.weight"]
    assert got.dtype == torch.float32 and torch.equal(_bits(got), _bits(want))
    # two tensors, not a whole model: an hf export is refused (from_pretrained would leave the rest at
    # their initial values); the same decode, cast to bf16, through the safetensors writer
    with pytest.raises(CheckpointError, match=r"holds no lm_head.weight, .*from_pretrained would leave them"):
        convert(src, tmp_path / "hf", fmt="hf", dtype=torch.bfloat16)
    assert not (tmp_path / "hf").exists()
    convert(src, tmp_path / "bf16", fmt="safetensors", dtype=torch.bfloat16)
    got = load_file(next((tmp_path / "bf16").rglob("*.safetensors")))["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(_bits(got), _bits(want.to(torch.bfloat16)))


def test_reader_decodes_one_tensor_and_reports_it() -> None:
    r = SafetensorsReader(HF / "mxfp4_gpt_oss")
    assert "MXFP4" in r.description and "decoded" in r.description
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert name in r.names and not [n for n in r.names if n.endswith(("_blocks", "_scales"))]
    assert r.shape(name) == (4, 64, 128) and r.dtype(name, "weight") == torch.float32
    first = r.fragment(name, "weight", 0)
    assert r.fragment(name, "weight", 0) is first  # a second segment of it: not decoded again
    r.fragment("model.layers.0.mlp.experts.down_proj", "weight", 0)
    assert r._decoded is not None and r._decoded[0] == "model.layers.0.mlp.experts.down_proj"  # one held at a time


def test_sharded_fp8_folder_decodes_as_the_single_file(tmp_path: Path) -> None:
    """``model.safetensors.index.json`` with a payload and its scales in different shards."""
    raw = load_file(HF / "fp8_qwen2" / "model.safetensors")
    names = sorted(raw)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    src = tmp_path / "src"
    src.mkdir()
    for f, part in shards.items():
        save_file({n: raw[n] for n in part}, src / f, metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    assert weight_map["model.layers.0.mlp.down_proj.weight"] != weight_map["model.layers.0.mlp.down_proj.weight_scale_inv"]
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_bytes((HF / "fp8_qwen2" / "config.json").read_bytes())
    convert(src, tmp_path / "sharded", fmt="hf")
    convert(HF / "fp8_qwen2", tmp_path / "single", fmt="hf")
    _same(load_file(tmp_path / "sharded" / "model.safetensors"), load_file(tmp_path / "single" / "model.safetensors"))


def test_dcp_at_two_files_cuts_each_decoded_tensor(tmp_path: Path) -> None:
    """``reshard --files 2``: every weight in two dim-0 chunks, each read from the one decoded tensor."""
    src = HF / "mxfp4_gpt_oss"
    reshard(src, tmp_path / "dcp", to="dcp", files=2)
    assert sorted(p.name for p in (tmp_path / "dcp" / "mxfp4_gpt_oss").glob("*.distcp")) == ["__0_0.distcp",
                                                                                             "__1_0.distcp"]
    convert(tmp_path / "dcp" / "mxfp4_gpt_oss", tmp_path / "back", fmt="safetensors")
    back = load_file(next((tmp_path / "back").rglob("*.safetensors")))
    reader = SafetensorsReader(src)
    for k in reader.names:
        want = reader.fragment(k, "weight", 0).view(reader.shape(k)).float()  # DCP holds fp32 weights
        assert torch.equal(_bits(back[k]), _bits(want)), k


def test_a_sharded_fp8_folder_decodes_as_the_single_file_one(tmp_path):
    """``fp8_qwen2_sharded`` (two files and an index; one weight's scales in the file after its
    payload's) is ``fp8_qwen2``'s tensors: every decoded weight is the same, bit for bit."""
    from reshard import cli

    outs = {}
    for name in ("fp8_qwen2", "fp8_qwen2_sharded"):
        assert cli.main(["convert", str(HF / name), str(tmp_path / name), "--format", "safetensors"]) == 0
        outs[name] = load_file(next((tmp_path / name).rglob("model.safetensors")))
    a, b = outs.values()
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
