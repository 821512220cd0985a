"""``reshard convert HF --format vllm --tp 2``, and the same from a DCP checkpoint PyTorch wrote of
the same weights, loaded by a real vLLM (CPU) with ``load_format="sharded_state"`` at TP 2, against
vLLM loading the HF folder itself at TP 2: the same greedy tokens and top-20 logprobs, and every
tensor the engine keeps as loaded equal byte for byte (vLLM's CPU backend repacks the linears after
loading, so those count through the logits; vLLM's loaders compare them before that, tensor by
tensor). Three engine starts in all (the HF load is shared: ``conftest.hf_engine``), two more for
a Megatron-Core checkpoint (a model of its own), and two more for its TP 2 x PP 2 sibling."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from .conftest import HERE, reshard_convert, run, sharded_engine


@pytest.fixture(scope="module")
def engines(qwen2: Path, hf_engine: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("engines")
    out = work / "vllm-tp2"
    reshard_convert(qwen2, out, 2, "bf16", work / "convert.log")
    return {"hf": hf_engine, "sharded": sharded_engine(out, work), "out": out}


def test_files_are_vllms_sharded_state(engines):
    out = engines["out"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    with safe_open(out / "model-rank-1-part-0.safetensors", "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [160, 256]  # 300 -> 320 rows, 160 a rank
        assert f.get_slice("model.layers.0.self_attn.qkv_proj.weight").get_shape() == [256, 256]  # [q 128; k 64; v 64]
        assert f.get_tensor("model.layers.1.self_attn.attn._k_scale").item() == 1.0


def same_outputs(sharded: dict, hf: dict) -> None:
    """Greedy tokens and top-20 logprobs exactly equal."""
    assert [o["tokens"] for o in sharded["outputs"]] == [o["tokens"] for o in hf["outputs"]]
    assert all(len(step) >= 20 for o in hf["outputs"] for step in o["logprobs"])
    assert [o["logprobs"] for o in sharded["outputs"]] == [o["logprobs"] for o in hf["outputs"]]  # every top-20 token


def same_kept(sharded: dict, hf: dict, last: int = 1) -> None:
    """Every parameter the engine keeps as loaded, byte for byte (digests), on both ranks
    (``last``: the model's last layer)."""
    assert len(hf["kept"]) == len(sharded["kept"]) == 2
    for rank in range(2):
        assert sharded["kept"][rank] == hf["kept"][rank], f"rank {rank}"
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.input_layernorm.weight", f"model.layers.{last}.self_attn.qkv_proj.bias"):
            assert name in hf["kept"][rank], name


def test_same_tokens_and_top20_logprobs(engines):
    same_outputs(engines["sharded"], engines["hf"])


def test_kept_parameters_equal_byte_for_byte(engines):
    same_kept(engines["sharded"], engines["hf"])


@pytest.fixture(scope="module")
def dcp(qwen2: Path, hf_engine: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A DCP checkpoint PyTorch wrote of ``qwen2``'s weights (FSDP2 over 2 gloo ranks, model and
    AdamW state: ``make_dcp.py``) converted with ``--format vllm --tp 2`` (config.json from the
    model folder, ``--hf-config``) in fp32 and bf16; vLLM's own loaders on the HF folder at TP 2
    (fp32, no engine: ``loader_run.py``); the bf16 output served by an engine."""
    work = tmp_path_factory.mktemp("dcp")
    run([HERE / "make_dcp.py", qwen2, work / "dcp"], 300, work / "dcp.log")
    for dtype in ("fp32", "bf16"):
        run(["-m", "reshard", "convert", work / "dcp", work / dtype, "--format", "vllm", "--tp", 2, "--dtype", dtype,
             "--hf-config", qwen2], 300, work / f"convert-{dtype}.log")
    run([HERE / "loader_run.py", qwen2, work / "loader", "--tp", 2, "--dtype", "float32"], 600, work / "loader.log")
    return {"work": work, "hf": hf_engine, "sharded": sharded_engine(work / "bf16", work)}


def test_dcp_source_is_what_vllms_loaders_load(dcp):
    """Every tensor of every rank, the fused linears included, bit for bit (fp32)."""
    from safetensors.torch import load_file

    from .test_loaders import same_state

    work = dcp["work"]
    assert (work / "dcp" / ".metadata").is_file() and len(list((work / "dcp").glob("*.distcp"))) == 2
    for r in range(2):
        same_state(load_file(work / "fp32" / f"model-rank-{r}-part-0.safetensors"),
                   load_file(work / "loader" / f"rank-{r}.safetensors"), r)


def test_dcp_source_serves_as_vllms_hf_load(dcp):
    same_outputs(dcp["sharded"], dcp["hf"])
    same_kept(dcp["sharded"], dcp["hf"])


def test_megatron_source_is_what_vllms_loaders_load(megatron):
    """Every tensor of every rank, the fused q/k/v (Megatron's per-group interleaving undone, then
    vLLM's per-rank [q; k; v]) and its bias included, bit for bit (fp32)."""
    from safetensors.torch import load_file

    from .test_loaders import same_state

    work = megatron["work"]
    for r in range(2):
        ours = load_file(work / "vllm-fp32" / f"model-rank-{r}-part-0.safetensors")
        assert ours["model.embed_tokens.weight"].shape == (64, 256)  # 120 rows -> 128, 64 a rank
        assert ours["model.layers.0.self_attn.qkv_proj.bias"].shape == (256,)  # [q 128; k 64; v 64]
        same_state(ours, load_file(work / "loader" / f"rank-{r}.safetensors"), r)


def test_megatron_source_serves_as_vllms_hf_load(megatron):
    same_outputs(megatron["sharded"], megatron["hf"])
    same_kept(megatron["sharded"], megatron["hf"], last=0)


def test_megatron_pipeline_source_is_what_vllms_loaders_load(megatron_pp):
    """A TP 2 x PP 2 checkpoint (layer 0 in stage 0's files, layer 1 in stage 1's): every tensor of
    every rank bit for bit what vLLM's loaders make of its fp32 HF export."""
    from safetensors.torch import load_file

    from .test_loaders import same_state

    work = megatron_pp["work"]
    for r in range(2):
        ours = load_file(work / "vllm-fp32" / f"model-rank-{r}-part-0.safetensors")
        assert ours["model.embed_tokens.weight"].shape == (64, 128)  # 120 rows -> 128, 64 a rank
        for layer in range(2):  # one query group a rank: [q 64; k 64; v 64]
            assert ours[f"model.layers.{layer}.self_attn.qkv_proj.bias"].shape == (192,)
        same_state(ours, load_file(work / "loader" / f"rank-{r}.safetensors"), r)


def test_megatron_pipeline_source_serves_as_vllms_hf_load(megatron_pp):
    same_outputs(megatron_pp["sharded"], megatron_pp["hf"])
    same_kept(megatron_pp["sharded"], megatron_pp["hf"], last=1)
