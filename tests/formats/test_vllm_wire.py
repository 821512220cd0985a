"""The "reshard" weight-transfer backend's wire (``reshard.formats.vllm.wire``), without vLLM or
processes: a toy Qwen2 whose trainer ranks 0, 1 hold FSDP2 dim-0 shards and whose engine ranks
2, 3 hold vLLM's TP 2 layout (fused ``qkv_proj`` and ``gate_up_proj``, a padded vocabulary).
Each rank cuts its links from its own ``plan_for_rank``; both ends of a link agree on the
message, packing on the trainers and unpacking on the workers gives exactly what the in-memory
executor gives (each engine tensor bit for bit, padding zero), each worker receives each of its
elements once, and every message round-trips. Runs in well under a second."""

from __future__ import annotations

import pytest
import torch

from reshard.errors import MapError
from reshard.execute.sources import dtensor_map
from reshard.formats.vllm import wire
from reshard.ir.apply import extract
from reshard.layouts.arch import LLAMA_VLLM, inference_targets
from reshard.layouts.inference import engine_shapes
from reshard.plan.planner import plan_for_rank

TRAINERS, WORKERS = (0, 1), (2, 3)
SHAPES = {"model.embed_tokens.weight": (100, 16), "lm_head.weight": (100, 16),
          "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
          "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.q_proj.bias": (16,),
          "model.layers.0.self_attn.k_proj.bias": (8,), "model.layers.0.self_attn.v_proj.bias": (8,),
          "model.layers.0.self_attn.o_proj.weight": (16, 16), "model.layers.0.mlp.gate_proj.weight": (24, 16),
          "model.layers.0.mlp.up_proj.weight": (24, 16), "model.layers.0.mlp.down_proj.weight": (16, 24),
          "model.layers.0.input_layernorm.weight": (16,), "model.norm.weight": (16,)}


class _Shard:
    """FSDP2's ``Shard(0)`` placement, as ``dtensor_map`` reads it."""

    dim = 0


_Shard.__name__ = "Shard"


@pytest.fixture(scope="module")
def toy():
    sources = {n: dtensor_map(s, list(TRAINERS), [_Shard()], name=n) for n, s in SHAPES.items()}
    targets = inference_targets(LLAMA_VLLM, SHAPES, tp=2, num_heads=4, num_kv_heads=2, ranks=list(WORKERS))
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    maps = {n: t.map for n, t in targets.items()}
    links = {r: wire.link_program(plan_for_rank(sources, maps, r), r) for r in TRAINERS + WORKERS}
    return sources, targets, full, links


def test_links_agree_and_carry_each_element_once(toy):
    sources, targets, _, links = toy
    for t in TRAINERS:
        sends, recvs = links[t]
        assert recvs == {} and set(sends) == set(WORKERS)
        for w in WORKERS:
            mine, theirs = sends[w], links[w][1][t]  # the same segments, in the same order, at both ends
            assert (mine.peer, theirs.peer) == (w, t) and (mine.segments, mine.numel) == (theirs.segments, theirs.numel)
    for w in WORKERS:
        assert links[w][0] == {}
        placed = sum(p.map.shards[w].numel for p in targets.values())
        padding = 2 * 28 * 16  # embed and lm_head: 100 rows -> 128, 64 a rank; rank 3 holds rows 64..99 and 28 padding
        got = sum(link.numel for link in links[w][1].values())
        assert got == placed - (padding if w == 3 else 0)


def test_pack_unpack_is_the_in_memory_result(toy):
    sources, targets, full, links = toy
    shards = {t: {n: extract(m, full[n], t) for n, m in sources.items()} for t in TRAINERS}
    for w in WORKERS:
        staging = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in engine_shapes(targets, w).items()}
        flat = {n: s.reshape(-1) for n, s in staging.items()}
        for t in TRAINERS:
            link = links[t][0][w]
            msg = wire.pack(link, shards[t], torch.empty(link.numel, dtype=torch.bfloat16))
            wire.unpack(links[w][1][t], msg, targets, flat, w)
        for n, p in targets.items():
            want = extract(p.map, full[n], w).to(torch.bfloat16).reshape(-1)
            got = flat[p.into][p.offsets[w]:p.offsets[w] + want.numel()]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, w)


def test_messages_round_trip(toy):
    sources, targets, full, _ = toy
    setup = wire.Setup.decode(wire.Setup(dict(SHAPES), sources, "bfloat16").encode())
    assert setup.shapes == SHAPES and setup.dtype == "bfloat16"
    assert all(setup.sources[n].to_dict() == m.to_dict() for n, m in sources.items())
    back = wire.decode_targets(wire.encode_targets(targets))
    for n, p in targets.items():
        q = back[n]
        assert (q.into, dict(q.offsets), dict(q.shapes), q.map.to_dict()) == (
            p.into, dict(p.offsets), {r: tuple(s) for r, s in p.shapes.items()}, p.map.to_dict())
    tensors = wire.decode_tensors(wire.encode_tensors(full))
    assert all(torch.equal(tensors[n], full[n]) for n in full)
    got = wire.decode_marker_reply(wire.encode_marker_reply(full), 1)
    assert all(torch.equal(got[n], full[n]) for n in full)
    with pytest.raises(MapError, match="vLLM worker 1 could not load the markers: KeyError: 'x'"):
        wire.decode_marker_reply(wire.encode_marker_reply(None, "KeyError: 'x'"), 1)
    with pytest.raises(MapError, match="learning the engine's maps failed on trainer rank 0: no marker"):
        wire.decode_targets(wire.encode_targets(None, "no marker"))



def test_with_cause_keeps_the_errors_class_and_fields():
    """The trainer names vLLM's failed RPC after its own error (``_Rpc.why``, tests_vllm): a
    ``MapError`` stays one, with its fields, whichever side's failure arrived first."""
    from reshard.errors import ReplicaMismatchError, with_cause

    e = with_cause(MapError("could not load the markers", path="layers.0.mlp.extra_proj"), "the engine reported: boom")
    assert type(e) is MapError and str(e) == "layers.0.mlp.extra_proj: could not load the markers; the engine reported: boom"
    r = with_cause(ReplicaMismatchError("differ", ranks=(0, 2), max_abs_diff=1.0), "x")
    assert type(r) is ReplicaMismatchError and r.ranks == (0, 2) and str(r) == "differ; x"
