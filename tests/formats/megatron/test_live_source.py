"""``formats.megatron.live.megatron_sources``: a live Megatron-Core GPTModel's TP x PP ranks as a
weight-sync source under HF names. The module parameters here are laid out by hand as Megatron's
local spec holds them (q/k/v interleaved per query group and split by rows, SwiGLU's fc1 as
``[gate_t; up_t]``, o/down split by columns, the vocabulary padded and split by rows, norms
replicated); the real GPTModel against a real vLLM is ``tests_vllm/test_live.py``'s Megatron case."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reshard.errors import MapError
from reshard.formats.megatron.live import megatron_sources

H, HEADS, GROUPS, HD, FFN, VOCAB, PADDED, LAYERS = 32, 8, 4, 4, 16, 30, 32, 2


def config(tp: int, pp: int, **kw) -> SimpleNamespace:
    base = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HD,
                ffn_hidden_size=FFN, gated_linear_unit=True, add_qkv_bias=True, add_bias_linear=False,
                qk_layernorm=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return SimpleNamespace(**{**base, **kw})


def hf_model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    out = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": r(H), "lm_head.weight": r(VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
                p + "self_attn.q_proj.weight": r(HEADS * HD, H), p + "self_attn.k_proj.weight": r(GROUPS * HD, H),
                p + "self_attn.v_proj.weight": r(GROUPS * HD, H), p + "self_attn.q_proj.bias": r(HEADS * HD),
                p + "self_attn.k_proj.bias": r(GROUPS * HD), p + "self_attn.v_proj.bias": r(GROUPS * HD),
                p + "self_attn.o_proj.weight": r(H, HEADS * HD), p + "mlp.gate_proj.weight": r(FFN, H),
                p + "mlp.up_proj.weight": r(FFN, H), p + "mlp.down_proj.weight": r(H, FFN)}
    return out


def megatron_rank(hf: dict, tp: int, pp: int, t: int, s: int) -> dict[str, torch.Tensor]:
    """TP rank ``t`` of pipeline stage ``s``'s module parameters, as Megatron's local spec names them."""
    per = HEADS // GROUPS
    out = {}

    def rows(x, n):
        return x.chunk(tp)[t].clone() if n is None else x.chunk(tp)[t].clone()

    def padded(x):
        return torch.cat([x, torch.full((PADDED - VOCAB, H), 7.0)])

    if s == 0:
        out["embedding.word_embeddings.weight"] = rows(padded(hf["model.embed_tokens.weight"]), None)
    stage = LAYERS // pp
    for local, i in enumerate(range(s * stage, (s + 1) * stage)):
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        for kind in ("weight", "bias"):
            q = hf[p + f"self_attn.q_proj.{kind}"].unflatten(0, (GROUPS, per * HD))
            k = hf[p + f"self_attn.k_proj.{kind}"].unflatten(0, (GROUPS, HD))
            v = hf[p + f"self_attn.v_proj.{kind}"].unflatten(0, (GROUPS, HD))
            out[m + f"self_attention.linear_qkv.{kind}"] = rows(torch.cat([q, k, v], 1).flatten(0, 1), None)
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(tp, 1)[t].clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"].chunk(tp)[t],
                                                      hf[p + "mlp.up_proj.weight"].chunk(tp)[t]])
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, 1)[t].clone()
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
    if s == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        out["output_layer.weight"] = rows(padded(hf["lm_head.weight"]), None)
    return {"module." + n: torch.nn.Parameter(x) for n, x in out.items()}  # a DDP-style wrapper prefix


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2), (1, 2), (4, 1)])
def test_each_rank_offers_views_that_rebuild_every_hf_tensor(tp: int, pp: int):
    hf = hf_model()
    ranks = {(t, s): megatron_rank(hf, tp, pp, t, s) for t in range(tp) for s in range(pp)}
    got = {}
    for (t, s), params in ranks.items():
        got[(t, s)] = megatron_sources(params, config(tp, pp), vocab_size=VOCAB, padded_vocab=PADDED, tied=False,
                                       tp_rank=t, pp_rank=s)
    maps = got[(0, 0)][0]
    assert sorted(maps) == sorted(hf)
    for (t, s), (m, shards) in got.items():
        assert {n: x.to_dict() for n, x in m.items()} == {n: x.to_dict() for n, x in maps.items()}  # same on every rank
        owned = {p.untyped_storage().data_ptr() for p in ranks[(t, s)].values()}
        for n, x in shards.items():
            assert x.untyped_storage().data_ptr() in owned, n  # a view of a module parameter: no copy
            assert tuple(x.shape) == m[n].shard(t + tp * s).shape
    for name, m in maps.items():
        m.check()
        shards = {t + tp * s: got[(t, s)][1][name] for (t, s) in ranks if name in got[(t, s)][1]}
        assert sorted(shards) == sorted(m.ranks)
        rebuilt = m.rebuild({r: x.contiguous() for r, x in shards.items()})
        assert torch.equal(rebuilt[tuple(slice(0, n) for n in hf[name].shape)], hf[name]), name
    # 2 query groups per TP rank at TP 2: q rows are 2 evenly spaced runs, a strided [2, rows] view
    if tp == 2:
        assert maps["model.layers.0.self_attn.q_proj.weight"].shard(0).shape == (2, 2 * HD * H)


def test_views_follow_the_optimizer():
    hf = hf_model()
    params = megatron_rank(hf, 2, 1, 1, 0)
    _, shards = megatron_sources(params, config(2, 1), vocab_size=VOCAB, padded_vocab=PADDED, tied=False,
                                 tp_rank=1, pp_rank=0)
    before = shards["model.layers.1.self_attn.k_proj.weight"].clone()
    with torch.no_grad():
        params["module.decoder.layers.1.self_attention.linear_qkv.weight"].mul_(2)
    assert torch.equal(shards["model.layers.1.self_attn.k_proj.weight"], 2 * before)


def test_other_data_parallel_ranks_hold_nothing():
    hf = hf_model()
    maps, shards = megatron_sources(megatron_rank(hf, 2, 1, 0, 0), config(2, 1), vocab_size=VOCAB,
                                    padded_vocab=PADDED, tied=False, tp_rank=0, pp_rank=0, dp_rank=1, dp=2)
    assert shards == {}
    assert {r for m in maps.values() for r in m.ranks} == {0, 1}  # data-parallel rank 0's TP ranks


def test_what_it_cannot_place_is_refused():
    hf = hf_model()
    params = megatron_rank(hf, 2, 1, 0, 0)
    extra = {**params, "module.decoder.layers.0.self_attention.linear_proj.bias": torch.nn.Parameter(torch.zeros(H))}
    with pytest.raises(MapError, match="linear_proj.bias"):
        megatron_sources(extra, config(2, 1), vocab_size=VOCAB, padded_vocab=PADDED, tied=False, tp_rank=0, pp_rank=0)
    lacking = {n: p for n, p in params.items() if "linear_fc2" not in n or "layers.1." not in n}
    with pytest.raises(MapError, match="lacks 'decoder.layers.1.mlp.linear_fc2.weight'"):
        megatron_sources(lacking, config(2, 1), vocab_size=VOCAB, padded_vocab=PADDED, tied=False, tp_rank=0,
                         pp_rank=0)
    with pytest.raises(MapError, match="num_moe_experts"):
        megatron_sources(params, config(2, 1, num_moe_experts=4), vocab_size=VOCAB, padded_vocab=PADDED, tied=False,
                         tp_rank=0, pp_rank=0)
    with pytest.raises(MapError, match="linear_fc1.weight"):
        bad = {**params, "module.decoder.layers.0.mlp.linear_fc1.weight": torch.nn.Parameter(torch.zeros(4, H))}
        megatron_sources(bad, config(2, 1), vocab_size=VOCAB, padded_vocab=PADDED, tied=False, tp_rank=0, pp_rank=0)
