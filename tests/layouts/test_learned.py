"""``learn_placed``: maps learned back from an engine's loaded markers (the engine here lays the
markers out by reshard's own vLLM maps; tests_vllm/ runs vLLM's loaders on them)."""

from __future__ import annotations

import pytest
import torch

from reshard.errors import MapError
from reshard.ir.canonical import canonicalize
from reshard.layouts.arch import LLAMA_VLLM, inference_targets
from reshard.layouts.learned import learn_placed, markers

# a tiny Qwen2 (q/k/v biases): 4 query heads, 2 key/value heads of size 4, vocabulary 70 (padded to 128)
H, V, INTER, D = 16, 70, 24, 4
SHAPES = {"model.embed_tokens.weight": (V, H), "model.layers.0.input_layernorm.weight": (H,)}
SHAPES.update({f"model.layers.0.self_attn.{p}_proj.{k}": ((4 if p == "q" else 2) * D,) + ((H,) if k == "weight" else ())
               for p in "qkv" for k in ("weight", "bias")})
SHAPES.update({"model.layers.0.self_attn.o_proj.weight": (H, 4 * D), "model.layers.0.mlp.gate_proj.weight": (INTER, H),
               "model.layers.0.mlp.up_proj.weight": (INTER, H), "model.layers.0.mlp.down_proj.weight": (H, INTER),
               "model.norm.weight": (H,), "lm_head.weight": (V, H)})


def engine_of(targets, full):
    """Each rank's engine tensors, laid out as ``targets`` say (what an engine's loader would do)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, p in targets.items():
        for r in p.map.ranks:
            t = out.setdefault(r, {}).setdefault(p.into, torch.zeros(p.shapes[r]))
            part = p.map.extract(full[name], r).reshape(-1)
            t.view(-1)[p.offsets[r]:p.offsets[r] + part.numel()] = part
    for r in out:
        out[r]["model.layers.0.self_attn.attn._k_scale"] = torch.tensor(1.0)  # a scalar: not read
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_learned_maps_are_the_layouts_that_placed_them(tp):
    ours = inference_targets(LLAMA_VLLM, SHAPES, tp=tp, num_heads=4, num_kv_heads=2)
    learned = learn_placed(SHAPES, engine_of(ours, markers(SHAPES)))
    for name, p in ours.items():
        q = learned[name]
        assert (q.into, dict(q.offsets), dict(q.shapes)) == (p.into, dict(p.offsets), dict(p.shapes)), name
        assert canonicalize(q.map) == canonicalize(p.map), name
    if tp == 4:  # each key/value head on two ranks: derive names both holders
        k = learned["model.layers.0.self_attn.k_proj.weight"].map
        assert {tuple(sorted(p.locations)) for _, _, p in k.pieces()} == {(0, 1), (2, 3)}


def test_a_swapped_element_is_another_map():
    ours = inference_targets(LLAMA_VLLM, SHAPES, tp=2, num_heads=4, num_kv_heads=2)
    engine = engine_of(ours, markers(SHAPES))
    t = engine[1]["model.layers.0.self_attn.o_proj.weight"]
    t[0, 0], t[0, 1] = t[0, 1].clone(), t[0, 0].clone()
    learned = learn_placed(SHAPES, engine)
    name = "model.layers.0.self_attn.o_proj.weight"
    assert canonicalize(learned[name].map) != canonicalize(ours[name].map)


def test_refused():
    ours = inference_targets(LLAMA_VLLM, SHAPES, tp=2, num_heads=4, num_kv_heads=2)
    engine = engine_of(ours, markers(SHAPES))
    split = {r: {n: t.clone() for n, t in ts.items()} for r, ts in engine.items()}
    qkv = split[0]["model.layers.0.self_attn.qkv_proj.weight"]
    qkv[[0, 9]] = qkv[[9, 0]].clone()  # a row of q among k's: neither is one run any more
    with pytest.raises(MapError, match="not one contiguous run"):
        learn_placed(SHAPES, split)
    bf16 = {r: dict(ts) for r, ts in engine.items()}
    bf16[1]["model.norm.weight"] = bf16[1]["model.norm.weight"].bfloat16()
    with pytest.raises(MapError, match="model.norm.weight.*rank 1.*float32"):
        learn_placed(SHAPES, bf16)
    lost = {r: {n: t for n, t in ts.items() if n != "model.norm.weight"} for r, ts in engine.items()}
    with pytest.raises(MapError, match="'model.norm.weight': the engine loaded none of it"):
        learn_placed(SHAPES, lost)
