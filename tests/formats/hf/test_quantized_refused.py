"""A quantized Hugging Face folder (FP8 block scales, MXFP4) is refused on every route, naming the
file and tensor, and nothing is written: its payload is never copied as if it were a weight."""

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
    """A config that says fp8 over tensors of an ordinary dtype: the config alone is enough to refuse."""
    save_file({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(FP8))
    return folder


SOURCES = {
    "mxfp4": (lambda d: _mxfp4(d, config=True), "quant_method = 'mxfp4'"),
    "mxfp4-no-config": (lambda d: _mxfp4(d, config=False), "down_proj_blocks"),
    "fp8": (lambda d: _fp8(d, config=True), "F8_E4M3"),  # the header is read before config.json
    "fp8-as-bf16": (lambda d: _fp8_scaled_bf16(d), "quant_method = 'fp8'"),
    "fp8-no-config": (lambda d: _fp8(d, config=False), "F8_E4M3"),
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
