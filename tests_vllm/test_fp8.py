"""FP8 block scales kept at vLLM's TP (issue 33 item 5), against vLLM 0.32's own code: from the committed
FP8 Qwen2 folder (transformers' ``Fp8Quantize``, 16 x 32 blocks), ``reshard convert --format vllm --tp 2
--quantize fp8`` writes, on each rank, byte for byte what vLLM's ``Fp8LinearMethod`` layers hold once its
weight_loaders have loaded the HF folder (FP8 payloads, float32 ``weight_scale_inv`` rows, the
``Fp8KVCacheMethod`` scalars), and vLLM's ``ShardedStateLoader`` loads the files (every key, no other)
into the same state. vLLM's CPU build runs no FP8 linear (its kernels need AMX), so the layers are
built without a kernel (``loader_run.py --no-fp8-kernel``); loading never uses one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import HERE, ROOT, run


def _same(ours: dict[str, torch.Tensor], engine: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(ours) == sorted(engine), what
    for k, t in engine.items():
        assert ours[k].dtype == t.dtype and ours[k].shape == t.shape, (what, k)
        assert torch.equal(ours[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (what, k)


@pytest.mark.parametrize(("name", "tp", "quantize"), [("fp8_qwen2", 2, "fp8"), ("fp8_qwen2_ue8m0", 1, "fp8-ue8m0")])
def test_fp8_ranks_are_what_vllm_loads(tmp_path: Path, name: str, tp: int, quantize: str) -> None:
    """Float32 scales at TP 2; E8M0 scales (32 x 32 blocks, which TP 2 would cut) at TP 1, where vLLM's
    loader converts them into its float32 parameter as reshard does."""
    src = tmp_path / "fp8"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / name, src)
    config = json.loads((src / "config.json").read_text())  # config.save_pretrained leaves the class out
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    run([HERE / "loader_run.py", src, tmp_path / "vllm", "--tp", tp, "--no-fp8-kernel"], 600, tmp_path / "loader.log")
    run(["-m", "reshard", "convert", src, tmp_path / "reshard", "--format", "vllm", "--tp", tp, "--quantize", quantize,
         "--max-file-gb", 0.00002], 300, tmp_path / "convert.log")  # ~21 kB parts: payloads and scales apart
    run([HERE / "loader_run.py", tmp_path / "reshard", tmp_path / "back", "--tp", tp, "--no-fp8-kernel",
         "--load-format", "sharded_state"], 600, tmp_path / "back.log")
    for r in range(tp):
        engine = load_file(tmp_path / "vllm" / f"rank-{r}.safetensors")
        assert engine["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
        ours: dict[str, torch.Tensor] = {}
        for f in sorted((tmp_path / "reshard").glob(f"model-rank-{r}-part-*.safetensors")):
            ours.update(load_file(f))
        _same(ours, engine, f"rank {r}")
        _same(load_file(tmp_path / "back" / f"rank-{r}.safetensors"), engine, f"rank {r} loaded by vLLM")
