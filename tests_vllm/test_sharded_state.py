"""``reshard convert HF --format vllm --tp 2``, loaded by a real vLLM (CPU) with
``load_format="sharded_state"`` at TP 2, against vLLM loading the HF folder itself at TP 2: the same
greedy tokens and top-20 logprobs, and every tensor the engine keeps as loaded equal byte for byte
(vLLM's CPU backend repacks the linears after loading, so those count through the logits; the
loader tests compare them before that, tensor by tensor). Two engine starts in all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from .conftest import HERE, reshard_convert, run

pytest.importorskip("vllm")

ENGINE_S = 600  # one engine start, a few prompts and its teardown (about a minute here)


@pytest.fixture(scope="module")
def engines(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("engines")
    out = work / "vllm-tp2"
    reshard_convert(qwen2, out, 2, "bf16", work / "convert.log")
    runs = {}
    for kind, folder, extra in (("hf", qwen2, []), ("sharded", out, ["--sharded"])):
        run([HERE / "engine_run.py", folder, work / f"{kind}.json", *extra], ENGINE_S, work / f"{kind}.log")
        runs[kind] = json.loads((work / f"{kind}.json").read_text())
    runs["out"] = out
    return runs


def test_files_are_vllms_sharded_state(engines):
    out = engines["out"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    with safe_open(out / "model-rank-1-part-0.safetensors", "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [160, 256]  # 300 -> 320 rows, 160 a rank
        assert f.get_slice("model.layers.0.self_attn.qkv_proj.weight").get_shape() == [256, 256]  # [q 128; k 64; v 64]
        assert f.get_tensor("model.layers.1.self_attn.attn._k_scale").item() == 1.0


def test_same_tokens_and_top20_logprobs(engines):
    hf, sharded = engines["hf"]["outputs"], engines["sharded"]["outputs"]
    assert [o["tokens"] for o in sharded] == [o["tokens"] for o in hf]
    assert all(len(step) >= 20 for o in hf for step in o["logprobs"])
    assert [o["logprobs"] for o in sharded] == [o["logprobs"] for o in hf]  # exactly, every token of the top 20


def test_kept_parameters_equal_byte_for_byte(engines):
    hf, sharded = engines["hf"]["kept"], engines["sharded"]["kept"]
    assert len(hf) == len(sharded) == 2
    for rank in range(2):
        assert sharded[rank] == hf[rank], f"rank {rank}"
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.qkv_proj.bias"):
            assert name in hf[rank], name
