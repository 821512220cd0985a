"""``--format vllm --tp T`` on the committed HF fixtures (no vLLM here: ``tests_vllm/`` loads the
output in a real vLLM): each rank's engine tensors are exactly the HF tensors cut and fused as
vLLM's loaders do, and what cannot be served is refused before any output exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import ReshardError
from reshard.jobs.convert import convert

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
ATTN = "model.layers.{i}.self_attn."


def ranks(out: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(out / f"model-rank-{r}-part-0.safetensors") for r in range(tp)]


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_shards_are_the_hf_tensors_cut_and_fused(tmp_path, tp):
    src = FIXTURES / "pretrained_llama"
    convert(src, tmp_path / "out", fmt="vllm", tp=tp)
    hf = load_file(src / "model.safetensors")
    shards = ranks(tmp_path / "out", tp)
    d, kv_heads = 6, 2  # head_dim 6: 4 query heads, 2 key/value heads
    for r, s in enumerate(shards):
        q = hf[ATTN.format(i=1) + "q_proj.weight"].chunk(tp)[r]
        kv = [r // (tp // kv_heads)] if tp >= kv_heads else list(range(r * kv_heads // tp, (r + 1) * kv_heads // tp))
        k = torch.cat([hf[ATTN.format(i=1) + "k_proj.weight"][h * d:(h + 1) * d] for h in kv])
        v = torch.cat([hf[ATTN.format(i=1) + "v_proj.weight"][h * d:(h + 1) * d] for h in kv])
        assert torch.equal(s[ATTN.format(i=1) + "qkv_proj.weight"], torch.cat([q, k, v]))
        assert torch.equal(s[ATTN.format(i=0) + "o_proj.weight"], hf[ATTN.format(i=0) + "o_proj.weight"].chunk(tp, 1)[r])
        gate, up = (hf[f"model.layers.0.mlp.{p}_proj.weight"].chunk(tp)[r] for p in ("gate", "up"))
        assert torch.equal(s["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate, up]))
        rows = 128 // tp  # 128 tokens: already a multiple of 64
        assert torch.equal(s["lm_head.weight"], hf["lm_head.weight"][r * rows:(r + 1) * rows])
        assert torch.equal(s["model.norm.weight"], hf["model.norm.weight"])
        assert s[ATTN.format(i=1) + "attn._prob_scale"].dtype == torch.float32
        assert s[ATTN.format(i=1) + "attn._prob_scale"].shape == () and s[ATTN.format(i=1) + "attn._q_scale"] == 1.0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_tied_qwen2_keeps_one_table_as_lm_head(tmp_path):
    src = FIXTURES / "pretrained_qwen2_tied"  # tied: no lm_head.weight in the folder
    convert(src, tmp_path / "out", fmt="vllm", tp=2, dtype=torch.bfloat16)
    embed = load_file(src / "model.safetensors")["model.embed_tokens.weight"].bfloat16()
    for r, s in enumerate(ranks(tmp_path / "out", 2)):
        assert "model.embed_tokens.weight" not in s  # vLLM's state dict names the shared table lm_head.weight
        assert torch.equal(s["lm_head.weight"], embed[r * 64:(r + 1) * 64])
        assert s["model.layers.0.self_attn.qkv_proj.bias"].dtype == torch.bfloat16


def test_refused_before_any_output(tmp_path):
    src = FIXTURES / "pretrained_llama"
    with pytest.raises(ReshardError, match="pretrained_llama: --format vllm --tp 3: .*does not split evenly over tp 3"):
        convert(src, tmp_path / "a", fmt="vllm", tp=3)
    other = tmp_path / "mixtral"
    shutil.copytree(src, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, architectures=["MixtralForCausalLM"])))
    with pytest.raises(ReshardError, match=r"architecture \['MixtralForCausalLM'\] -- --format vllm writes"):
        convert(other, tmp_path / "b", fmt="vllm", tp=2)
    (other / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=3)))
    # the HF keys check (what from_pretrained would leave at its initial value) comes first
    with pytest.raises(ReshardError, match=r"holds no model.layers.2.input_layernorm.weight, .* and 6 more: 9 of "
                                           r"the 30 weights of the LlamaForCausalLM model"):
        convert(other, tmp_path / "b", fmt="vllm", tp=2)
    (other / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    with pytest.raises(ReshardError, match=r"\['model.layers.1.input_layernorm.weight', .*past the config's 1 layers"):
        convert(other, tmp_path / "b", fmt="vllm", tp=2)
    with pytest.raises(ReshardError, match="--tp goes with .*--format vllm"):
        convert(src, tmp_path / "c", fmt="hf", tp=2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_reshard_to_vllm_is_convert_format_vllm(tmp_path):
    """The one row of the format table serves both commands: ``reshard --to vllm --tp 2`` writes
    the files ``convert --format vllm --tp 2`` writes."""
    from reshard.jobs.convert import reshard

    src = FIXTURES / "pretrained_llama"
    a = convert(src, tmp_path / "a", fmt="vllm", tp=2).out_dir
    b = reshard(src, tmp_path / "b", to="vllm", tp=2).out_dir
    for r in range(2):
        name = f"model-rank-{r}-part-0.safetensors"
        assert (a / name).read_bytes() == (b / name).read_bytes()
