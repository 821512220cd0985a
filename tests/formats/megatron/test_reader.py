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
    bias = model.get(p + "self_attention.linear_qkv.bias")
    bias = bias.view(a.groups, a.per_group + 2, a.head_dim) if bias is not None else None
    shared = model.get(p + "mlp.shared_experts.linear_fc1.weight")
    experts = range(a.experts)
    return {
        "input_layernorm.weight": lambda: model[p + "input_layernorm.weight"],
        "post_attention_layernorm.weight": lambda: model[p + "pre_mlp_layernorm.weight"],
        "self_attn.q_proj.weight": lambda: qkv[:, :a.per_group].reshape(-1, a.hidden),
        "self_attn.k_proj.weight": lambda: qkv[:, a.per_group].reshape(-1, a.hidden),
        "self_attn.v_proj.weight": lambda: qkv[:, a.per_group + 1].reshape(-1, a.hidden),
        "self_attn.q_proj.bias": lambda: bias[:, :a.per_group].reshape(-1),
        "self_attn.k_proj.bias": lambda: bias[:, a.per_group].reshape(-1),
        "self_attn.v_proj.bias": lambda: bias[:, a.per_group + 1].reshape(-1),
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
        "mlp.shared_expert.gate_proj.weight": lambda: shared[:a.shared_ffn],
        "mlp.shared_expert.up_proj.weight": lambda: shared[a.shared_ffn:],
        "mlp.shared_expert.down_proj.weight": lambda: model[p + "mlp.shared_experts.linear_fc2.weight"],
        "mlp.shared_expert_gate.weight": lambda: model[p + "mlp.shared_experts.gate_weight"],
        # DeepseekV3 (deepseek_v3.json): the router's bias buffer, the shared experts under another name
        "mlp.gate.e_score_correction_bias": lambda: model[p + "mlp.router.expert_bias"],
        "mlp.shared_experts.gate_proj.weight": lambda: shared[:a.shared_ffn],
        "mlp.shared_experts.up_proj.weight": lambda: shared[a.shared_ffn:],
        "mlp.shared_experts.down_proj.weight": lambda: model[p + "mlp.shared_experts.linear_fc2.weight"],
    }[rest]()


@pytest.mark.parametrize("fixture", ALL)
def test_hf_names_are_the_weights_de_interleaved(fixture):
    model, optim, _, _ = oracle(fixture)
    arch = MegatronReader.open(FIXTURES / fixture).arch
    if arch.expert_bias and (not arch.mla or arch.shared_gate):
        # an expert bias has no place in llama.json's models, a shared-expert gate none in DeepseekV3: refused by name
        with pytest.raises(ReshardError, match=r"no entry for Megatron key .*(router\.|shared_experts\.gate_weight)"):
            open_reader(FIXTURES / fixture, route="safetensors")
        return
    reader = open_reader(FIXTURES / fixture, route="safetensors")
    assert reader.naming == "hf"
    if arch.mtp:  # no HF model holds MTP layers (the documents' "unplaced"): weights with no place, never names
        mtp = [s.key for s in arch.keys() if s.key.startswith("mtp.")]
        held = {h.key: h for h in reader.unlowered() if h.what == "weights"}
        assert set(held) == set(mtp) and all("multi-token prediction" in h.reason for h in held.values())
        assert not any(n.startswith("mtp.") for n in reader.names)
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


def test_grouped_gemm_under_the_local_spec_is_sequential_mlp():
    """Megatron 0.19.2 builds SequentialMLP for --moe-grouped-gemm under --transformer-impl local: the
    same keys, shapes and bucket entries as the SequentialMLP fixture, read equal to Megatron's reload
    (test_megatron_names_equal_the_oracle)."""
    grouped = MegatronReader.open(FIXTURES / "torch_dist_moe_ep2_grouped_gemm_local")
    plain = MegatronReader.open(FIXTURES / "torch_dist_moe_ep2_distopt")
    assert grouped.args.moe_grouped_gemm and grouped.args.transformer_impl == "local"
    assert not plain.args.moe_grouped_gemm
    shapes = {k: tuple(e.shape) for k, e in grouped.src.ck.tensors.items()}
    assert shapes == {k: tuple(e.shape) for k, e in plain.src.ck.tensors.items()}
    assert sorted(grouped.src.ck.objects) == sorted(plain.src.ck.objects)


def test_te_grouped_gemm_with_plain_adam_is_read(tmp_path):
    """TEGroupedMLP's torch_dist keys are SequentialMLP's (Megatron's code: grouped.py), so a Transformer
    Engine --moe-grouped-gemm checkpoint with plain Adam (model-space states) is read; the files here are
    Megatron's SequentialMLP ones with the args a TE run records."""
    import argparse
    import shutil

    from .test_bad_input import _common, _plant

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "torch_dist_moe_ep2", src, ignore=shutil.ignore_patterns("oracle"))
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    args.moe_grouped_gemm, args.transformer_impl = True, "transformer_engine"
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    reader = MegatronReader.open(src)
    reader.check()
    from .support import compare_megatron

    assert compare_megatron(reader, "torch_dist_moe_ep2") > 0
