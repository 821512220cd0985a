"""A quantized Hugging Face folder reshard cannot decode exactly is refused on every route, naming
the file and tensor, and nothing is written: its payload is never copied as if it were a weight.
Decoded folders (FP8 block scales, MXFP4): test_quantized_decode.py. Refused: a payload or scales
without a config saying how to decode them, a quant_method reshard does not decode (bitsandbytes,
GPTQ, ...), FP8 without block scales, and damaged input (a scale of the wrong shape, a missing one,
NaN / inf / non-positive scales, a payload dtype the config does not name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard import convert, reshard
from reshard.errors import QuantizedError

GPT_OSS_MXFP4 = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                 "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
FP8 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
       "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}


def _mxfp4(folder: Path, *, config: bool) -> Path:
    """gpt-oss's layout: ``*_blocks`` (two E2M1 values per byte, 32 per block) and ``*_scales`` (E8M0)."""
    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.experts.down_proj_blocks": torch.randint(0, 256, (2, 8, 2, 16), generator=g,
                                                                             dtype=torch.uint8),
               "model.layers.0.mlp.experts.down_proj_scales": torch.randint(120, 130, (2, 8, 2), generator=g,
                                                                             dtype=torch.uint8),
               "model.norm.weight": torch.ones(8)}, folder / "model.safetensors")
    if config:
        (folder / "config.json").write_text(json.dumps(GPT_OSS_MXFP4))
    return folder


def _fp8(folder: Path, *, config: bool, scales: bool = True) -> Path:
    w = torch.randn(130, 64).to(torch.float8_e4m3fn)
    tensors = {"model.layers.0.mlp.down_proj.weight": w, "model.norm.weight": torch.ones(64)}
    if scales:
        tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 1)
    save_file(tensors, folder / "model.safetensors")
    if config:
        (folder / "config.json").write_text(json.dumps(FP8))
    return folder


def _fp8_scaled_bf16(folder: Path) -> Path:
    """A config that says fp8 over tensors of an ordinary dtype: config and weights disagree."""
    save_file({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(FP8))
    return folder


def _config(folder: Path, quantization_config: dict) -> Path:
    save_file({"model.layers.0.mlp.down_proj.weight": torch.ones(8, 8, dtype=torch.bfloat16)},
              folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**FP8, "quantization_config": quantization_config}))
    return folder


SOURCES = {
    "mxfp4-no-config": (lambda d: _mxfp4(d, config=False), "down_proj_blocks"),
    "fp8-as-bf16": (lambda d: _fp8_scaled_bf16(d), "quant_method = 'fp8'"),
    "fp8-no-config": (lambda d: _fp8(d, config=False), "F8_E4M3"),
    "bitsandbytes": (lambda d: _config(d, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
                     "quant_method = 'bitsandbytes'"),
    "gptq": (lambda d: _config(d, {"quant_method": "gptq", "bits": 4}), "quant_method = 'gptq'"),
}
ROUTES = {
    "ucp": lambda src, out: convert(src, out, fmt="ucp"),
    "safetensors": lambda src, out: convert(src, out, fmt="safetensors"),
    "hf-bf16": lambda src, out: convert(src, out, fmt="hf", dtype=torch.bfloat16),
    "dcp": lambda src, out: convert(src, out, fmt="dcp"),
    "deepspeed": lambda src, out: reshard(src, out, to="deepspeed", tp=1, dp=1),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_quantized_source_is_refused_on_every_route(tmp_path: Path, kind: str, route: str) -> None:
    make, named = SOURCES[kind]
    (tmp_path / "src").mkdir()
    src = make(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(QuantizedError, match=named) as e:
        ROUTES[route](src, out)
    assert str(src) in str(e.value)
    assert "\n" not in str(e.value)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_scale_tensor_alone_is_refused(tmp_path: Path) -> None:
    """An FP8 weight saved as bf16 beside its ``weight_scale_inv`` is still half of a quantized pair."""
    save_file({"w.weight": torch.ones(4, 4, dtype=torch.bfloat16), "w.weight_scale_inv": torch.ones(1, 1)},
              tmp_path / "model.safetensors")
    with pytest.raises(QuantizedError, match="w.weight_scale_inv"):
        convert(tmp_path, tmp_path.parent / "out-scale", fmt="safetensors")


def _fp8_defect(folder: Path, *, payload: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                drop_scales: bool = False, **q: object) -> Path:
    """The 130 x 200 FP8 weight of 128 x 128 blocks (2 x 2 scales) with one thing wrong."""
    w = payload if payload is not None else torch.randn(130, 200).to(torch.float8_e4m3fn)
    tensors = {"model.layers.0.mlp.down_proj.weight": w, "model.norm.weight": torch.ones(64)}
    if not drop_scales:
        tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = scales if scales is not None else torch.ones(2, 2)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**FP8, "quantization_config": {**FP8["quantization_config"], **q}}))
    return folder


def _bad_scale(value: float) -> torch.Tensor:
    s = torch.ones(2, 2)
    s[1, 0] = value
    return s


def _mxfp4_defect(folder: Path, *, blocks: tuple[int, ...] = (2, 8, 2, 16), scales: tuple[int, ...] = (2, 8, 2),
                  scale_value: int = 127, drop_scales: bool = False, also_plain: bool = False) -> Path:
    tensors = {"model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(blocks, dtype=torch.uint8),
               "model.norm.weight": torch.ones(8)}
    if also_plain:
        tensors["model.layers.0.mlp.experts.down_proj"] = torch.ones(2, 64, 8)
    if not drop_scales:
        tensors["model.layers.0.mlp.experts.down_proj_scales"] = torch.full(scales, scale_value, dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(GPT_OSS_MXFP4))
    return folder


PAYLOAD, SCALES = "'model.layers.0.mlp.down_proj.weight'", "'model.layers.0.mlp.down_proj.weight_scale_inv'"
MX_BLOCKS, MX_SCALES = "'model.layers.0.mlp.experts.down_proj_blocks'", "'model.layers.0.mlp.experts.down_proj_scales'"
DEFECTS = {
    "scale-shape": (lambda d: _fp8_defect(d, scales=torch.ones(1, 2)), f"{SCALES}: shape \\[1, 2\\]"),
    "scale-shape-block": (lambda d: _fp8_defect(d, weight_block_size=[64, 128]), f"{SCALES}: shape \\[2, 2\\]"),
    "missing-scale": (lambda d: _fp8_defect(d, drop_scales=True), f"{PAYLOAD} is an FP8 payload without"),
    "nan-scale": (lambda d: _fp8_defect(d, scales=_bad_scale(float("nan"))), f"{SCALES}: the scale of block \\[1, 0\\]"),
    "inf-scale": (lambda d: _fp8_defect(d, scales=_bad_scale(float("inf"))), f"{SCALES}: .* is inf"),
    "zero-scale": (lambda d: _fp8_defect(d, scales=_bad_scale(0.0)), f"{SCALES}: .* is 0.0"),
    "negative-scale": (lambda d: _fp8_defect(d, scales=_bad_scale(-1.0)), f"{SCALES}: .* is -1.0"),
    "e8m0-nan": (lambda d: _fp8_defect(d, scales=torch.full((2, 2), 255, dtype=torch.uint8)), f"{SCALES}: .*NaN"),
    "e5m2-under-e4m3": (lambda d: _fp8_defect(d, payload=torch.randn(130, 200).to(torch.float8_e5m2)),
                        f"{PAYLOAD}: dtype 'F8_E5M2', but .*fmt is 'e4m3'"),
    "no-block-size": (lambda d: _fp8_defect(d, weight_block_size=None), "weight_block_size = None"),
    "static-activations": (lambda d: _fp8_defect(d, activation_scheme="static"), "activation_scheme = 'static'"),
    "fp4-experts": (lambda d: _fp8_defect(d, expert_dtype="fp4"), "expert_dtype = 'fp4'"),
    "mxfp4-scale-shape": (lambda d: _mxfp4_defect(d, scales=(2, 8, 3)), f"{MX_SCALES}: shape \\[2, 8, 3\\]"),
    "mxfp4-block-bytes": (lambda d: _mxfp4_defect(d, blocks=(2, 8, 2, 8), scales=(2, 8, 2)), f"{MX_BLOCKS}: shape"),
    "mxfp4-missing-scales": (lambda d: _mxfp4_defect(d, drop_scales=True), f"{MX_BLOCKS} is an MXFP4 payload without"),
    "mxfp4-nan-scale": (lambda d: _mxfp4_defect(d, scale_value=255), f"{MX_SCALES}: .*NaN"),
    "mxfp4-and-plain": (lambda d: _mxfp4_defect(d, also_plain=True), "'model.layers.0.mlp.experts.down_proj' is also"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_damaged_quantized_source_is_refused_naming_the_tensor(tmp_path: Path, defect: str) -> None:
    make, named = DEFECTS[defect]
    (tmp_path / "src").mkdir()
    src = make(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(QuantizedError, match=named) as e:
        convert(src, out, fmt="hf", dtype=torch.bfloat16)
    assert str(src) in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
