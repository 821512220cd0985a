"""Encoding at the vLLM target (issue 33 item 4 at a TP layout): ``--format vllm --tp T --quantize
fp8`` from a bf16 folder quantizes each rank's shard where it is written. Every file equals, byte for
byte, ``--format hf --quantize fp8`` and then ``--format vllm --tp T`` (the FP8 folder's bytes moved
as stored), and -- the bf16 folder being transformers' FP8 fixture decoded, which quantizes back to
the fixture's bytes (test_quantize_encode) -- the fixture moved to TP T as stored: the TP slices of
transformers' ``Fp8Quantize`` of the full weights. Partial blocks at the weights' edges; a TP that
cuts a block refused as vLLM refuses it. No vLLM needed (its CPU backend runs no FP8 linear)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard import convert
from reshard.errors import QuantizedError
from tests.support.paths import HF


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _named(src: Path, dst: Path) -> Path:
    """A copy of folder ``src`` whose config names its architecture (vLLM needs it)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    return dst


def _files(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(f) for f in sorted(folder.glob("model-rank-*.safetensors"))}


def _same_files(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert fa and sorted(fa) == sorted(fb)
    for f, tensors in fa.items():
        assert sorted(tensors) == sorted(fb[f]), f
        for k, v in tensors.items():
            assert v.dtype == fb[f][k].dtype and v.shape == fb[f][k].shape and torch.equal(_bits(v), _bits(fb[f][k])), \
                (f, k)
    assert json.loads((a / "config.json").read_text())["quantization_config"] == \
        json.loads((b / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each FP8 fixture decoded to a bf16 folder (transformers' dequantized load, bit for bit)."""
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for name in ("fp8_qwen2", "fp8_qwen2_ue8m0"):
        convert(HF / name, root / f"{name}_plain", fmt="hf", dtype=torch.bfloat16)
        out[name] = _named(root / f"{name}_plain", root / name)
    return out


@pytest.mark.parametrize(("name", "tp", "quantize", "block"), [
    ("fp8_qwen2", 2, "fp8", (16, 32)),  # whole blocks on every rank
    ("fp8_qwen2", 1, "fp8", (16, 48)),  # a partial last block in every weight's columns
    ("fp8_qwen2_ue8m0", 1, "fp8-ue8m0", (32, 32)),
])
def test_equals_hf_quantize_then_vllm(tmp_path: Path, bf16: dict[str, Path], name: str, tp: int, quantize: str,
                                      block: tuple[int, int]) -> None:
    convert(bf16[name], tmp_path / "direct", fmt="vllm", tp=tp, quantize=quantize, block=block)
    convert(bf16[name], tmp_path / "fp8", fmt="hf", quantize=quantize, block=block)
    convert(_named(tmp_path / "fp8", tmp_path / "fp8_named"), tmp_path / "two_steps", fmt="vllm", tp=tp,
            quantize=quantize)
    _same_files(tmp_path / "direct", tmp_path / "two_steps")


@pytest.mark.parametrize(("name", "tp", "quantize"), [("fp8_qwen2", 2, "fp8"), ("fp8_qwen2_ue8m0", 1, "fp8-ue8m0")])
def test_equals_the_tp_slices_of_transformers_quantizer(tmp_path: Path, bf16: dict[str, Path], name: str, tp: int,
                                                        quantize: str) -> None:
    """Encoded at TP T from bf16 = transformers' FP8 fixture moved to TP T as stored (its payload and
    scale rows cut per rank: test_vllm_fp8)."""
    convert(_named(HF / name, tmp_path / "src"), tmp_path / "moved", fmt="vllm", tp=tp, quantize=quantize)
    q = json.loads((tmp_path / "moved" / "config.json").read_text())["quantization_config"]["weight_block_size"]
    convert(bf16[name], tmp_path / "at_block", fmt="vllm", tp=tp, quantize=quantize, block=tuple(q))
    _same_files(tmp_path / "at_block", tmp_path / "moved")


def test_tp_that_cuts_a_block_refused_before_any_output(tmp_path: Path, bf16: dict[str, Path]) -> None:
    with pytest.raises(QuantizedError, match=r"'model.layers.0.self_attn.o_proj.weight' \[64, 64\] at --format vllm "
                                             r"--tp 4: rank 0 holds 16 of its columns.*block_k = 32"):
        convert(bf16["fp8_qwen2"], tmp_path / "out", fmt="vllm", tp=4, quantize="fp8", block=(16, 32))
    assert not (tmp_path / "out").exists()


def test_nan_weight_refused_naming_it_leaving_nothing(tmp_path: Path, bf16: dict[str, Path]) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(bf16["fp8_qwen2"], src)
    t = load_file(src / "model.safetensors")
    t["model.layers.1.mlp.down_proj.weight"][3, 70] = float("nan")
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizedError, match=r"'model.layers.1.mlp.down_proj.weight' \(rank 1's shard\).*block "
                                             r"\[0, 0\] holds a NaN"):
        convert(src, tmp_path / "out", fmt="vllm", tp=2, quantize="fp8", block=(16, 32))
    assert not (tmp_path / "out").exists()
