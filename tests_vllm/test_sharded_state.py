"""``reshard convert HF --format vllm --tp 2``, and the same from a DCP checkpoint PyTorch wrote of
the same weights, loaded by a real vLLM (CPU) with ``load_format="sharded_state"`` at TP 2, against
vLLM loading the HF folder itself at TP 2: the same greedy tokens and top-20 logprobs, and every
tensor the engine keeps as loaded equal byte for byte (vLLM's CPU backend repacks the linears after
loading, so those count through the logits; vLLM's loaders compare them before that, tensor by
tensor). Three engine starts in all (the HF load is shared: ``conftest.hf_engine``), and two more for
a Megatron-Core checkpoint (a model of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from .conftest import ENGINE_S, HERE, reshard_convert, run

pytest.importorskip("vllm")

def sharded_engine(folder: Path, work: Path, sharded: bool = True) -> dict:
    """``engine_run.py --sharded``: vLLM loading ``folder`` with ``load_format="sharded_state"``
    (``sharded=False``: vLLM's own load of the HF folder ``folder``)."""
    name = "sharded" if sharded else "hf"
    run([HERE / "engine_run.py", folder, work / f"{name}.json", *(["--sharded"] if sharded else [])], ENGINE_S,
        work / f"{name}.log")
    return json.loads((work / f"{name}.json").read_text())


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


MEGATRON = HERE.parent / "tests" / "fixtures" / "megatron" / "torch_dist_tp2_qwen2_vllm"


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The committed Megatron-Core fixture ``torch_dist_tp2_qwen2_vllm`` (a Qwen2-shaped GPTModel
    Megatron-LM trained and saved at TP 2, bf16: head_dim 64, 4 query heads in 2 groups, q/k/v
    biases, a 120-token vocabulary padded to 128 by Megatron) converted with ``--format vllm --tp
    2`` and ``--format hf``, each in bf16 (as stored) and fp32; vLLM's own loaders on the fp32 HF
    folder at TP 2 (``loader_run.py``); an engine on the bf16 sharded state and one on the bf16 HF
    folder (the reference: a model of its own, so not ``hf_engine``)."""
    work = tmp_path_factory.mktemp("megatron")
    for fmt, dtype in (("vllm", "bf16"), ("vllm", "fp32"), ("hf", "bf16"), ("hf", "fp32")):
        run(["-m", "reshard", "convert", MEGATRON, work / f"{fmt}-{dtype}", "--format", fmt, "--dtype", dtype,
             *(["--tp", 2] if fmt == "vllm" else [])], 300, work / f"convert-{fmt}-{dtype}.log")
    run([HERE / "loader_run.py", work / "hf-fp32", work / "loader", "--tp", 2, "--dtype", "float32"], 600,
        work / "loader.log")
    (work / "e-hf").mkdir()
    (work / "e-sharded").mkdir()
    return {"work": work, "hf": sharded_engine(work / "hf-bf16", work / "e-hf", sharded=False),
            "sharded": sharded_engine(work / "vllm-bf16", work / "e-sharded")}


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
