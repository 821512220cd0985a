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

pytest.importorskip("vllm")


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
        ours = load_file(tmp_path / "reshard" / f"model-rank-{r}-part-0.safetensors")
        assert sorted(ours) == sorted(engine[r]), f"rank {r}"
        for name, t in engine[r].items():
            assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, (r, name)
            assert torch.equal(ours[name].reshape(-1).view(torch.int32), t.reshape(-1).view(torch.int32)), (r, name)

    config = json.loads((folder / "config.json").read_text())
    learned = learn_placed(shapes, engine)
    layouts = inference_targets(LLAMA_VLLM, shapes, tp=tp, num_heads=config["num_attention_heads"],
                                num_kv_heads=config["num_key_value_heads"])
    for name, p in layouts.items():
        q = learned[name]
        assert (q.into, dict(q.offsets)) == (p.into, dict(p.offsets)), name
        assert {r: tuple(s) for r, s in q.shapes.items()} == {r: tuple(s) for r, s in p.shapes.items()}, name
        assert canonicalize(q.map) == canonicalize(p.map), name
