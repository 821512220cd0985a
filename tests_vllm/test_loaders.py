"""vLLM's own loaders (each parameter's ``weight_loader``, run by ``loader_run.py`` in TP processes
without an engine) on a marker model: every element of every HF tensor unique. What they load on
each rank, before post-processing, is

* byte for byte what ``reshard convert --format vllm --tp T`` writes for that rank (every tensor,
  the fused linears and the scalars included), and
* read back as maps (``reshard.layouts.learned``), equal to reshard's vLLM layouts
  (``layouts.arch.LLAMA_VLLM``): engine tensor, offset and canonical map of every HF tensor.

TP 2, and TP 4 where each of the 2 key/value heads is replicated on 2 ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.ir.canonical import canonicalize
from reshard.layouts.arch import LLAMA_VLLM, inference_targets
from reshard.layouts.learned import learn_placed, markers

from .conftest import HERE, reshard_convert, run


def same_state(ours: dict, engine: dict, rank: int) -> None:
    """reshard's file for ``rank`` holds exactly the engine's tensors, bit for bit (float32)."""
    assert sorted(ours) == sorted(engine), f"rank {rank}"
    for name, t in engine.items():
        assert ours[name].dtype == t.dtype == torch.float32 and ours[name].shape == t.shape, (rank, name)
        assert torch.equal(ours[name].reshape(-1).view(torch.int32), t.reshape(-1).view(torch.int32)), (rank, name)


@pytest.fixture(scope="module")
def marked(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("marked") / "hf"
    out.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(qwen2 / f, out / f)
    with safe_open(qwen2 / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    save_file(markers(shapes), out / "model.safetensors", metadata={"format": "pt"})
    return out, shapes


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_loaders_place_what_reshard_writes(marked, tmp_path: Path, tp: int):
    folder, shapes = marked
    run([HERE / "loader_run.py", folder, tmp_path / "vllm", "--tp", tp, "--dtype", "float32"], 600,
        tmp_path / "loader.log")
    reshard_convert(folder, tmp_path / "reshard", tp, "fp32", tmp_path / "convert.log")
    engine = {r: load_file(tmp_path / "vllm" / f"rank-{r}.safetensors") for r in range(tp)}
    for r in range(tp):
        same_state(load_file(tmp_path / "reshard" / f"model-rank-{r}-part-0.safetensors"), engine[r], r)

    config = json.loads((folder / "config.json").read_text())
    learned = learn_placed(shapes, engine)
    layouts = inference_targets(LLAMA_VLLM, shapes, tp=tp, num_heads=config["num_attention_heads"],
                                num_kv_heads=config["num_key_value_heads"])
    for name, p in layouts.items():
        q = learned[name]
        assert (q.into, dict(q.offsets)) == (p.into, dict(p.offsets)), name
        assert {r: tuple(s) for r, s in q.shapes.items()} == {r: tuple(s) for r, s in p.shapes.items()}, name
        assert canonicalize(q.map) == canonicalize(p.map), name


@pytest.mark.parametrize("fixture,arch", [("qwen2_tp2", "Qwen2ForCausalLM"),
                                          ("llama_zero3_tp2_dp2", "LlamaForCausalLM")])
def test_deepspeed_source(tmp_path: Path, fixture: str, arch: str):
    """Committed DeepSpeed fixtures (a TP=2 ZeRO-1 Qwen2, a TP=2 x DP=2 ZeRO-3 Llama; head_dim 8,
    which vLLM's CPU attention does not serve, but its loaders load): ``--format vllm --tp 2`` from
    the DeepSpeed files is byte for byte what vLLM's loaders make of the same weights exported as an
    HF folder."""
    from transformers import AutoConfig

    fixture = HERE.parent / "tests" / "fixtures" / "deepspeed" / fixture
    meta = json.loads((fixture / "fixture.json").read_text())
    AutoConfig.for_model(meta["model_type"], **meta["model_config"], architectures=[arch],
                         dtype="float32").save_pretrained(tmp_path / "config")
    for fmt, out in (("hf", "hf"), ("vllm", "reshard")):
        run(["-m", "reshard", "convert", fixture, tmp_path / out, "--format", fmt, "--hf-config", tmp_path / "config",
             *(["--tp", 2] if fmt == "vllm" else [])], 300, tmp_path / f"{out}.log")
    run([HERE / "loader_run.py", tmp_path / "hf", tmp_path / "vllm", "--tp", 2, "--dtype", "float32"], 600,
        tmp_path / "loader.log")
    for r in range(2):
        engine = load_file(tmp_path / "vllm" / f"rank-{r}.safetensors")
        ours = load_file(tmp_path / "reshard" / f"model-rank-{r}-part-0.safetensors")
        assert engine["model.embed_tokens.weight"].shape == (64, 32)  # 96 rows -> 128, 64 a rank
        same_state(ours, engine, r)
