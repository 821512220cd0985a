"""Inference-engine layouts (``reshard.layouts.inference``) and architecture mappings
(``reshard.layouts.arch``) against plain-torch slicing of the full tensors, the way vLLM cuts them
(``tests/support/vllm_ref.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import MapError
from reshard.layouts.arch import LLAMA_VLLM, QWEN3_MOE_VLLM, inference_targets
from reshard.layouts.inference import (
    check_placed,
    engine_shapes,
    moe_experts,
    placed,
    qkv_parts,
    vocab_padded_rows,
    vocab_parallel_padded,
)
from reshard.layouts.tp import split
from tests.support.vllm_ref import engine_slices


def _assemble(targets, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Each engine tensor of ``rank`` built from the maps alone: every part extracted from its
    source's F and laid at its offset."""
    out = {n: torch.full(s, float("nan")) for n, s in engine_shapes(targets, rank).items()}
    for name, t in targets.items():
        if rank in t.shapes:
            part = t.map.extract(full[name], rank).reshape(-1)
            out[t.into].view(-1)[t.offsets[rank]:t.offsets[rank] + part.numel()] = part
    return out


def _llama(hq: int, kv: int, d: int, hidden: int, inter: int, vocab: int, layers: int = 1):
    cfg = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=kv, head_dim=d, hidden_size=hidden,
                          num_hidden_layers=layers, vocab_size=vocab)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hq * d, hidden), p + "self_attn.k_proj.weight": (kv * d, hidden),
                       p + "self_attn.v_proj.weight": (kv * d, hidden), p + "self_attn.o_proj.weight": (hidden, hq * d),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    return cfg, shapes


@st.composite
def llama_sizes(draw):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if tp % k == 0 or k % tp == 0]))
    hq = kv * draw(st.sampled_from([1, 2, 4])) * max(1, tp // kv)
    return dict(tp=tp, hq=hq, kv=kv, d=draw(st.sampled_from([2, 3, 4])), hidden=draw(st.integers(1, 4)) * tp,
                inter=draw(st.integers(1, 5)) * tp, vocab=draw(st.integers(1, 200)))


@settings(max_examples=40, deadline=None)
@given(llama_sizes(), st.integers(0, 2**16))
def test_llama_targets_equal_vllm_slicing(sizes, seed):
    tp = sizes.pop("tp")
    cfg, shapes = _llama(**sizes)
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    tg = inference_targets(LLAMA_VLLM, shapes, tp=tp, num_heads=cfg.num_attention_heads,
                           num_kv_heads=cfg.num_key_value_heads, ranks=[10 + r for r in range(tp)])
    for r in range(tp):
        got, want = _assemble(tg, full, 10 + r), engine_slices(full, cfg, tp, r)
        assert set(got) == set(want)
        for n in want:
            assert torch.equal(got[n], want[n]), (n, r)


def test_replicated_kv_heads_name_every_rank_that_holds_them():
    """TP 8 over 2 key/value heads: each head on 4 consecutive ranks, one piece naming all 4."""
    q, k, v = qkv_parts((64, 16), (16, 16), 8, num_heads=8, num_kv_heads=2)
    (piece,) = k.map.shard(5).pieces
    assert piece.locations == frozenset({4, 5, 6, 7}) and piece.source.offset == 8 * 16
    assert k.offsets[5] == 8 * 16 and v.offsets[5] == 16 * 16 and k.shapes[5] == (8 + 8 + 8, 16)


def test_qkv_biases_are_fused_like_weights():
    """Qwen2's q/k/v biases: ``[q_r; k_r; v_r]`` of 1-d tensors."""
    q, k, v = (torch.arange(n, dtype=torch.float32) + base for n, base in ((32, 0), (16, 100), (16, 200)))
    parts = qkv_parts((32,), (16,), 2, num_heads=4, num_kv_heads=2)
    tg = {"q": parts[0].named("qkv"), "k": parts[1].named("qkv"), "v": parts[2].named("qkv")}
    check_placed(tg)
    for r in range(2):
        want = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])
        assert torch.equal(_assemble(tg, {"q": q, "k": k, "v": v}, r)["qkv"], want)


@pytest.mark.parametrize("vocab,tp,rows,per_rank_rows", [(101, 2, 128, 128), (128256, 8, 128256, 128512),
                                                          (64, 1, 64, 64), (200, 4, 256, 256)])
def test_vocab_padding_rules(vocab, tp, rows, per_rank_rows):
    assert vocab_padded_rows(vocab, tp) == rows  # vLLM: a multiple of 64, then split over TP
    assert vocab_padded_rows(vocab, tp, per_rank=True) == per_rank_rows  # a multiple of 64 x TP
    m = vocab_parallel_padded((vocab, 3), tp)
    assert m.logical_shape == (rows, 3) and m.valid_shape == (vocab, 3)
    full = torch.randn(vocab, 3)
    padded = torch.cat([full, torch.zeros(rows - vocab, 3)])
    for r in range(tp):
        assert torch.equal(m.extract(full, r), padded.chunk(tp)[r])


def test_mapping_document_pads_per_rank_on_request():
    _, shapes = _llama(4, 2, 2, 4, 4, 101)
    vllm = inference_targets(LLAMA_VLLM, shapes, tp=4, num_heads=4, num_kv_heads=2)
    tg = inference_targets(LLAMA_VLLM, shapes, tp=4, num_heads=4, num_kv_heads=2, pad_per_rank=True)
    assert vllm["lm_head.weight"].map.logical_shape == (128, 4) and vllm["lm_head.weight"].shapes[0] == (32, 4)
    assert tg["lm_head.weight"].map.logical_shape == (256, 4) and tg["lm_head.weight"].shapes[0] == (64, 4)


def test_vocab_that_tp_cannot_split_is_refused():
    with pytest.raises(MapError, match="does not split evenly over tp 3"):
        vocab_padded_rows(100, 3)


@settings(max_examples=20, deadline=None)
@given(e_per=st.integers(1, 3), ep=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2]),
       placement=st.sampled_from(["linear", "round_robin"]))
def test_moe_experts_equal_plain_slicing(e_per, ep, tp, placement):
    num, inter, hidden = e_per * ep, 2 * tp, 3
    gate_up, down = torch.randn(num, 2 * inter, hidden), torch.randn(num, hidden, inter)
    w13 = moe_experts(gate_up.shape, "w13", ep=ep, tp=tp, placement=placement)
    w2 = moe_experts(down.shape, "w2", ep=ep, tp=tp, placement=placement)
    for e in range(ep):
        experts = list(range(e * e_per, (e + 1) * e_per)) if placement == "linear" else list(range(e, num, ep))
        for t in range(tp):
            gate, up = gate_up[experts, :inter], gate_up[experts, inter:]
            want13 = torch.cat([gate.chunk(tp, dim=1)[t], up.chunk(tp, dim=1)[t]], dim=1)
            assert torch.equal(w13.extract(gate_up, e * tp + t), want13)
            assert torch.equal(w2.extract(down, e * tp + t), down[experts].chunk(tp, dim=2)[t])


def test_moe_mapping_document_and_engine_replicas():
    """Qwen3-MoE/Mixtral names of transformers 5 over two engine replicas of TP=2 with EP=2."""
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": (4, 8, 3), "model.layers.0.mlp.experts.down_proj": (4, 3, 4),
              "model.layers.0.mlp.gate.weight": (4, 3)}
    tg = inference_targets(QWEN3_MOE_VLLM, shapes, tp=2, ep=2, ranks=[[0, 1], [2, 3]])
    full = {n: torch.randn(s) for n, s in shapes.items()}
    w13 = tg["model.layers.0.mlp.experts.gate_up_proj"]
    assert w13.into == "model.layers.0.mlp.experts.w13_weight" and sorted(w13.map.ranks) == [0, 1, 2, 3]
    for replica in ([0, 1], [2, 3]):
        for e, r in enumerate(replica):  # EP 2 x TP 1 inside each replica: rank e holds experts 2e, 2e+1
            got = _assemble(tg, full, r)
            assert torch.equal(got["model.layers.0.mlp.experts.w13_weight"],
                               full["model.layers.0.mlp.experts.gate_up_proj"][2 * e:2 * e + 2])
            assert torch.equal(got["model.layers.0.mlp.experts.w2_weight"],
                               full["model.layers.0.mlp.experts.down_proj"][2 * e:2 * e + 2])
    (piece,) = w13.map.shard(1).pieces
    assert piece.locations == frozenset({1, 3})  # replicas hold identical data


def test_mapping_document_refuses_what_it_cannot_place():
    _, shapes = _llama(4, 2, 2, 4, 4, 10)
    with pytest.raises(MapError, match="no rule of the mapping document matches"):
        inference_targets(LLAMA_VLLM, {**shapes, "model.extra.weight": (3,)}, tp=2, num_heads=4, num_kv_heads=2)
    del shapes["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(MapError, match=r"lacks its part\(s\) \['v'\]"):
        inference_targets(LLAMA_VLLM, shapes, tp=2, num_heads=4, num_kv_heads=2)
    _, shapes = _llama(6, 2, 2, 6, 6, 10)
    attention = {n: s for n, s in shapes.items() if "_proj" in n and "self_attn" in n}
    with pytest.raises(MapError, match="parameter 'model.layers.0.self_attn.q_proj.weight'.*tp 3 is not a multiple "
                                       "of the 2 key/value heads"):
        inference_targets(LLAMA_VLLM, attention, tp=3, num_heads=6, num_kv_heads=2)
    with pytest.raises(MapError, match="vocabulary of 10 padded to 64 rows does not split evenly over tp 3"):
        inference_targets(LLAMA_VLLM, shapes, tp=3, num_heads=6, num_kv_heads=2)
    with pytest.raises(MapError, match="version"):
        inference_targets({"params": []}, shapes, tp=1)


def test_check_placed_finds_overlaps_and_holes():
    a = split((4, 2), 0, [4])
    tg = {"a": placed(a, "x"), "b": placed(a, "x")}
    with pytest.raises(MapError, match="overlaps"):
        check_placed(tg)
    q, k, _ = qkv_parts((8, 2), (4, 2), 2, num_heads=4, num_kv_heads=2)
    with pytest.raises(MapError, match="written by no parameter"):
        check_placed({"q": q.named("qkv"), "k": k.named("qkv")})
