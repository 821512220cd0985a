"""Fused and irregular TP layouts against DeepSpeed 0.19.8's real partition functions:
``prepare_tp_fused_qkvw`` for every fused-QKV arrangement, ``GateUpPack_LinearLayer``,
``shard_value_with_share_qk`` (Yuan), plus the seed's piece-count tables."""

from __future__ import annotations

import itertools

import pytest
import torch

from reshard import ParamMap
from reshard.errors import MapError
from reshard.ir import canonicalize
from reshard.layouts import (
    bigcode_mqa,
    codegen_qkv,
    fused_qkv,
    gate_up,
    shared_qk_head_ids,
    shared_qk_o_proj,
    shared_qk_o_proj_bias,
    shared_qk_value,
)
from tests.support import oracles

TPS = [1, 2, 3, 4, 5, 6, 7, 8, 16]


def _check_fused(kind, shape, tp, *, seed=0, bias=False, deepspeed=False, **kw):
    m_ds = oracles.meta(kw.get("num_kv_heads"), kw.get("num_attention_heads"), kw.get("n_embd"), kw.get("grain", 1))
    full = oracles.random_full(shape, seed)
    want = {r: oracles.fused_qkv(kind, full, tp, r, m_ds).contiguous() for r in range(tp)}
    m = fused_qkv(kind, shape, tp, **kw)
    oracles.verify(m, full, want, deepspeed=deepspeed)
    if kind not in ("bigcode", "codegen") and not bias:
        # fused_LinearLayer's own path for these layouts must agree with prepare_tp_fused_qkvw
        for r in range(tp):
            assert torch.equal(oracles.fused_qkv_subparam_split(kind, full, tp, r, m_ds), want[r])
    return m


@pytest.mark.parametrize("tp", TPS)
def test_bloom(tp):
    for rows, kv, grain in itertools.product([24, 30, 96, 7], [None, 4, 6], [1, 8]):
        _check_fused("bloom", (rows, 5), tp, seed=rows, num_kv_heads=kv, grain=grain, deepspeed=tp == 2)
        _check_fused("bloom", (rows,), tp, seed=rows, bias=True, num_kv_heads=kv, grain=grain)


@pytest.mark.parametrize("kind", ["glm", "qwen"])
@pytest.mark.parametrize("tp", TPS)
def test_glm_qwen_two_kv_heads(kind, tp):
    # ChatGLM2/3 and Qwen with 2 kv heads: q is n_embd rows, k and v (rows - n_embd) / 2 each
    for n_embd, head_dim, grain in itertools.product([16, 32, 48], [2, 4], [1, 4]):
        rows = n_embd + 2 * 2 * head_dim
        m = _check_fused(kind, (rows, 6), tp, seed=rows + tp, num_kv_heads=2, n_embd=n_embd, grain=grain,
                         deepspeed=tp in (2, 4) and grain == 1)
        _check_fused(kind, (rows,), tp, seed=rows, bias=True, num_kv_heads=2, n_embd=n_embd, grain=grain)
        if tp == 2:
            assert all(len(s.pieces) == 3 for s in m.shards.values())


@pytest.mark.parametrize("kind", ["glm", "qwen"])
@pytest.mark.parametrize("tp", TPS)
def test_glm_qwen_thirds(kind, tp):
    for third, kv, grain in itertools.product([8, 12, 32, 5], [None, 4, 8], [1, 4]):
        _check_fused(kind, (3 * third, 4), tp, seed=third, num_kv_heads=kv, grain=grain, deepspeed=tp == 4)
        _check_fused(kind, (3 * third,), tp, seed=third, bias=True, num_kv_heads=kv, grain=grain)


@pytest.mark.parametrize("tp", TPS)
def test_phi3_and_gqa(tp):
    # q rows then k and v of num_kv_heads * head_dim each, widths head-aware per sub-parameter
    for heads, kv_heads, head_dim in [(8, 8, 4), (8, 2, 4), (16, 4, 2), (12, 3, 4), (32, 8, 2)]:
        hidden = heads * head_dim
        rows = hidden + 2 * kv_heads * head_dim
        _check_fused("phi3", (rows, hidden), tp, seed=heads + tp, num_kv_heads=kv_heads,
                     num_attention_heads=heads, deepspeed=tp == 2)


@pytest.mark.parametrize("tp", TPS)
def test_glm_gate_up(tp):
    for rows, cols, grain in itertools.product([16, 64, 22, 6], [3, 8], [1, 4]):
        m_ds = oracles.meta(8, grain=grain)
        full = oracles.random_full((rows, cols), rows + tp)
        want = {r: oracles.gate_up(full, tp, r, m_ds).contiguous() for r in range(tp)}
        m = gate_up((rows, cols), tp, num_kv_heads=8, grain=grain)
        oracles.verify(m, full, want, deepspeed=tp == 2)


@pytest.mark.parametrize("tp", TPS)
def test_bigcode_mqa(tp):
    for n_embd, head_dim, cols, kv, grain in itertools.product([32, 48, 64], [4, 8], [5], [None, 4], [1, 8]):
        rows = n_embd + 2 * head_dim
        for shape in [(rows, cols), (rows,)]:
            m = _check_fused("bigcode", shape, tp, seed=rows, n_embd=n_embd, num_kv_heads=kv, grain=grain,
                             deepspeed=tp == 4 and len(shape) == 2)
            everyone = frozenset(range(tp))
            for s in m.shards.values():
                kvp = [p for p in s.pieces if p.source.offset >= n_embd * (cols if len(shape) == 2 else 1)]
                if tp > 1:
                    assert len(kvp) == 1 and kvp[0].locations == everyone


def test_seed_table_bigcode():
    m = bigcode_mqa((48, 8), 4, n_embd=32)
    assert {r: len(s.pieces) for r, s in m.shards.items()} == {0: 2, 1: 2, 2: 2, 3: 2}
    assert m.num_pieces == 8
    for s in m.shards.values():
        kv = [p for p in s.pieces if p.locations == frozenset(range(4))]
        assert len(kv) == 1 and kv[0].source.offset == 32 * 8 and kv[0].numel == 16 * 8
    # the last rank's q slice ends where kv begins: adjacent, but different holders, so 2 pieces
    q3 = [p for p in m.shard(3).pieces if p.locations == {3}][0]
    assert q3.source.offset + q3.numel == 256


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_codegen_permuted_blocks(tp):
    combos = itertools.product([4 * tp, 8 * tp], [4 * tp, 8 * tp, 12 * tp], [1, 2])
    if tp == 16:  # DeepSpeed's own partition is slow at this degree; one case is enough
        combos = [(64, 64, 1)]
    for kv, hidden, grain in combos:
        rows = 3 * hidden
        try:
            m = codegen_qkv((rows, hidden), tp, num_kv_heads=kv, grain=grain)
        except MapError:
            continue
        full = oracles.random_full((rows, hidden), hidden + tp)
        want = {r: oracles.fused_qkv("codegen", full, tp, r, oracles.meta(kv, grain=grain)).contiguous()
                for r in range(tp)}
        oracles.verify(m, full, want, deepspeed=tp == 2)
        if tp >= 2:
            # DeepSpeed's own description of the permutation, lowered and canonicalized
            from deepspeed.checkpoint.affine import block_gather_map
            from deepspeed.module_inject.fusedqkv_utils import codegen_block_layout

            size, ids = codegen_block_layout(rows, tp, kv)
            theirs = canonicalize(ParamMap.from_dict(block_gather_map((rows, hidden), ids, size, 0).to_dict()))
            assert theirs == m


def test_seed_table_codegen():
    counts = {}
    for hidden in (8, 16, 32, 64, 128, 256):
        m = codegen_qkv((3 * hidden, hidden), 2, num_kv_heads=8)
        full = oracles.random_full(m.logical_shape, hidden)
        want = {r: oracles.fused_qkv("codegen", full, 2, r, oracles.meta(8)).contiguous() for r in range(2)}
        oracles.verify(m, full, want)
        per_rank = {len(s.pieces) for s in m.shards.values()}
        assert len(per_rank) == 1
        counts[hidden] = per_rank.pop()
    assert all(n <= 11 for n in counts.values())
    # The seed's 11 per rank from hidden 16 up, flat in the hidden size. At hidden 8 every block
    # is a single row, and the canonical *fold* stacks those rows into strided pieces: 6.
    assert {h: n for h, n in counts.items() if h >= 16} == {16: 11, 32: 11, 64: 11, 128: 11, 256: 11}
    assert counts[8] == 6


def test_codegen_refusals():
    with pytest.raises(MapError, match="divisible by tp"):
        codegen_qkv((96, 32), 2, num_kv_heads=4)
    with pytest.raises(MapError, match="whole blocks"):
        codegen_qkv((36, 12), 2, num_kv_heads=8)
    # a grain making rank slices uneven: DeepSpeed slices rank r at r * its own length
    with pytest.raises(MapError, match="differ"):
        codegen_qkv((216, 72), 2, num_kv_heads=16, grain=5)


# -- Yuan shared-QK ------------------------------------------------------------------------------


def _yuan_cases():
    for heads in (4, 6, 8, 12, 16, 20, 24, 32):
        for tp in range(1, heads // 2 + 1):
            if heads % tp == 0 and tp <= 16:
                yield heads, tp


def test_shared_qk_head_ids_match_deepspeed():
    for heads, tp in _yuan_cases():
        for r in range(tp):
            assert shared_qk_head_ids(heads, tp, r) == oracles.ds_fused.shared_qk_value_head_ids(heads, tp, r)


@pytest.mark.parametrize("heads,tp", list(_yuan_cases()))
def test_yuan_value_and_o_proj(heads, tp):
    head_dim, other = 3, 5
    # value: heads on rows, with a bias
    full = oracles.random_full((heads * head_dim, other), heads + tp)
    bias = oracles.random_full((heads * head_dim,), heads)
    got = [oracles.shared_qk(full, bias, tp, r, True, heads) for r in range(tp)]
    m = shared_qk_value(full.shape, tp, num_heads=heads)
    oracles.verify(m, full, {r: w.data.contiguous() for r, (w, _) in enumerate(got)}, deepspeed=tp == 2)
    mb = shared_qk_value(bias.shape, tp, num_heads=heads)
    oracles.verify(mb, bias, {r: b.data.contiguous() for r, (_, b) in enumerate(got)})
    # o_proj: heads on columns (no bias: DeepSpeed's bias path raises, see below)
    full = oracles.random_full((other, heads * head_dim), heads * tp)
    got = [oracles.shared_qk(full, None, tp, r, False, heads)[0].data.contiguous() for r in range(tp)]
    mo = shared_qk_o_proj(full.shape, tp, num_heads=heads)
    oracles.verify(mo, full, dict(enumerate(got)), deepspeed=tp == 2)
    per = heads // tp
    if per % 2:
        # odd heads per rank: neighbouring ranks share a head, named by both (partial replication)
        shared = [p for _, _, p in mo.pieces() if len(p.locations) == 2]
        assert shared and all(len(p.locations) <= 2 for _, _, p in mo.pieces())


def test_seed_tables_yuan():
    for heads in (4, 8):
        v = shared_qk_value((32, 8), 2, num_heads=heads)
        assert {r: len(s.pieces) for r, s in v.shards.items()} == {0: 2, 1: 2}
    o = shared_qk_o_proj((8, 32), 2, num_heads=8)
    assert {r: len(s.pieces) for r, s in o.shards.items()} == {0: 2, 1: 2}
    assert all(p.source.strides == (32, 1) for _, _, p in o.pieces())


def test_yuan_odd_heads_per_rank_is_partial_replication():
    # 12 heads over 4 ranks: 3 query heads per rank; value heads [0,1,6,7], [1,2,7,8], ...
    m = shared_qk_value((12 * 2, 3), 4, num_heads=12)
    holders = {}
    for _, _, p in m.pieces():
        head = p.source.offset // (2 * 3)
        holders.setdefault(head, p.locations)
    assert holders[1] == {0, 1} and holders[7] == {0, 1} and holders[4] == {2, 3} and holders[0] == {0}
    # DeepSpeed produces these shards but declines to describe them for checkpoint conversion
    from deepspeed.module_inject.layers import _shared_qk_affine_map

    layer = oracles._fake_layer(tp_meta=oracles.meta(12), tp_world_size=4)
    assert _shared_qk_affine_map(layer, (24, 3), 0) is None


def test_yuan_o_proj_bias():
    bias = oracles.random_full((6,), 1)
    # DeepSpeed 0.19.8 computes bias / world_size and then fails to return it
    with pytest.raises(AttributeError):
        oracles.shared_qk(oracles.random_full((6, 8), 2), torch.nn.Parameter(bias), 2, 0, False, 8)
    m = shared_qk_o_proj_bias((6,), 2)
    oracles.verify(m, bias, {r: bias / 2.0 for r in range(2)}, deepspeed=True)
    assert all(p.scale == 0.5 for _, _, p in m.pieces())


def test_yuan_refusals():
    with pytest.raises(MapError):
        shared_qk_value((24, 3), 5, num_heads=12)  # tp does not divide heads
    with pytest.raises(MapError):
        shared_qk_value((24, 3), 12, num_heads=12)  # more ranks than half the heads
    with pytest.raises(MapError):
        shared_qk_value((25, 3), 2, num_heads=12)  # rows not whole heads
