"""The FP8 folder ``benchmarks/bench_fp8_export.py`` generates one tensor at a time (hand-written
safetensors headers) is a valid sharded HF folder: safetensors reads every shard, the index names
every tensor's file, each decoder linear is an E4M3 payload with a float32 ``weight_scale_inv`` of
its block grid and decodes (``fp8_block_decode``) to finite weights of the generated size (the
benchmark's own runs compare reshard's decoded output with transformers' dequantizing load, bit
for bit)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.bench_fp8_export import BLOCK, QUANT, write_fp8_folder
from reshard.ir.codec import fp8_block_decode, scale_grid

TOY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
       "num_key_value_heads": 1, "vocab_size": 64}


def test_generated_fp8_folder_is_a_sharded_block_scale_checkpoint(tmp_path: Path) -> None:
    made = write_fp8_folder(tmp_path, TOY, max_shard=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(tmp_path.glob("*.safetensors"))
    assert made["files"] == len(files) >= 2
    tensors = {}
    for f in files:
        got = load_file(f)
        assert all(index["weight_map"][n] == f.name for n in got)
        tensors.update(got)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == made["bytes"] == sum(f.stat().st_size for f in files) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == QUANT
    payloads = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert len(payloads) == 7  # the decoder layer's linears
    for n in payloads:
        s = tensors[n + "_scale_inv"]
        assert s.dtype == torch.float32 and tuple(s.shape) == scale_grid(tuple(tensors[n].shape), BLOCK)
        w = fp8_block_decode(tensors[n], s, BLOCK)
        assert torch.isfinite(w).all() and 0.04 < w.float().abs().max() < 0.2  # std 0.02 weights
    assert {t.dtype for n, t in tensors.items() if n not in payloads and not n.endswith("_scale_inv")} == {torch.bfloat16}
