"""The Megatron reader against Megatron's own TP=1 reload of every fixture, bit for bit: weights,
Adam moments and fp32 main parameters in Megatron's names, and the weights in HF names."""

from __future__ import annotations

import re

import pytest
import torch

from reshard.errors import ReshardError
from reshard.formats.megatron.reader import MegatronReader
from reshard.formats.registry import open_reader, source_format

from .support import ALL, FIXTURES, full, oracle


@pytest.mark.parametrize("fixture", ALL)
def test_megatron_names_equal_the_oracle(fixture):
    from .support import compare_megatron

    reader = MegatronReader.open(FIXTURES / fixture)
    reader.check()
    n = compare_megatron(reader, fixture)
    _, optim, _, info = oracle(fixture)
    assert n == len(info["names"]) + sum(1 for k in optim if k.split(".", 1)[0] in ("exp_avg", "exp_avg_sq", "param"))


def _hf_of(model: dict, name: str, reader: MegatronReader) -> torch.Tensor:
    """The HF tensor ``name`` cut from the oracle's TP=1 weights by hand (the documented rules)."""
    a = reader.arch
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m is None:
        src = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "model.norm.weight":
               "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"}[name]
        t = model[src]
        return t[:a.vocab] if name != "model.norm.weight" else t
    i, rest = m.groups()
    p = f"decoder.layers.{i}."
    mla = {"q_a_proj": "linear_q_down_proj", "q_b_proj": "linear_q_up_proj", "q_a_layernorm": "q_layernorm",
           "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_b_proj": "linear_kv_up_proj",
           "kv_a_layernorm": "kv_layernorm", "q_proj": "linear_q_proj"}
    if a.mla and rest.startswith("self_attn.") and rest.split(".")[1] in mla:  # one for one (deepseek_v3.json)
        return model[f"{p}self_attention.{mla[rest.split('.')[1]]}.weight"]
    qkv = model.get(p + "self_attention.linear_qkv.weight")
    qkv = qkv.view(a.groups, a.per_group + 2, a.head_dim, a.hidden) if qkv is not None else None
    fc1 = model.get(p + "mlp.linear_fc1.weight")
    experts = range(a.experts)
    return {
        "input_layernorm.weight": lambda: model[p + "input_layernorm.weight"],
        "post_attention_layernorm.weight": lambda: model[p + "pre_mlp_layernorm.weight"],
        "self_attn.q_proj.weight": lambda: qkv[:, :a.per_group].reshape(-1, a.hidden),
        "self_attn.k_proj.weight": lambda: qkv[:, a.per_group].reshape(-1, a.hidden),
        "self_attn.v_proj.weight": lambda: qkv[:, a.per_group + 1].reshape(-1, a.hidden),
        "self_attn.o_proj.weight": lambda: model[p + "self_attention.linear_proj.weight"],
        "self_attn.q_norm.weight": lambda: model[p + "self_attention.q_layernorm.weight"],
        "self_attn.k_norm.weight": lambda: model[p + "self_attention.k_layernorm.weight"],
        "mlp.gate_proj.weight": lambda: fc1[:a.ffn],
        "mlp.up_proj.weight": lambda: fc1[a.ffn:],
        "mlp.down_proj.weight": lambda: model[p + "mlp.linear_fc2.weight"],
        "mlp.gate.weight": lambda: model[p + "mlp.router.weight"],
        "mlp.experts.gate_up_proj": lambda: torch.stack(
            [model[f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts]),
        "mlp.experts.down_proj": lambda: torch.stack(
            [model[f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts]),
    }[rest]()


@pytest.mark.parametrize("fixture", ALL)
def test_hf_names_are_the_weights_de_interleaved(fixture):
    model, optim, _, _ = oracle(fixture)
    if MegatronReader.open(FIXTURES / fixture).arch.shared_ffn:  # Qwen2-MoE / DeepSeek-V3 names: not mapped
        with pytest.raises(ReshardError, match="shared experts .* not mapped by reshard yet"):
            open_reader(FIXTURES / fixture, route="safetensors")
        return
    reader = open_reader(FIXTURES / fixture, route="safetensors")
    assert reader.naming == "hf"
    for name in reader.names:
        got = full(reader, name, "weight")
        want = _hf_of(model, name, reader)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert reader.shape(name) == tuple(want.shape)
    # the moments move with their parameters under HF names too
    name = "model.layers.1.self_attn.k_proj.weight"
    if "exp_avg.decoder.layers.1.self_attention.linear_qkv.weight" in optim:
        a = reader.arch
        qkv = optim["exp_avg.decoder.layers.1.self_attention.linear_qkv.weight"].view(
            a.groups, a.per_group + 2, a.head_dim, a.hidden)
        assert torch.equal(full(reader, name, "exp_avg"), qkv[:, a.per_group].reshape(-1, a.hidden))


def test_fragments_are_views_of_the_mapped_files():
    reader = MegatronReader.open(FIXTURES / "torch_dist_tp2_pp2", names="hf")
    name = "model.layers.2.self_attn.q_proj.weight"
    m = reader.map(name, "weight")
    assert len(m.ranks) == 2  # one q block of each TP chunk (one query group per TP rank)
    for r in m.ranks:
        t = reader.fragment(name, "weight", r)
        assert t.is_contiguous() and t.untyped_storage().nbytes() > t.numel() * t.element_size()


def test_detection_and_formats():
    assert source_format(FIXTURES / "torch_dist_tp2_pp2") == "megatron"
    assert source_format(FIXTURES / "torch_dist_tp2_pp2" / "iter_0000003") == "megatron"
    assert source_format(FIXTURES / "legacy_tp2_pp2") == "megatron"
    r = open_reader(FIXTURES / "legacy_tp2_pp2" / "iter_0000003")
    assert r.topology == {"tp": 2, "pp": 2, "dp": 1} and r.step(r.names[1]) == 3


def test_hf_config():
    cfg = MegatronReader.open(FIXTURES / "torch_dist_tp2_pp2", names="hf").hf_config()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (24, 4, 2, 10)
    assert (cfg["vocab_size"], cfg["intermediate_size"], cfg["tie_word_embeddings"]) == (120, 36, False)
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == 1e-5
