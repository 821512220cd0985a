"""The seed's "N-d grouped" segment table (§8.2) as assertions, with both layouts derived from
DeepSpeed 0.19.8's own partition functions and every plan checked bit-exact."""

from __future__ import annotations

import pytest
import torch

from reshard import apply_plan, derive, plan

oracles = pytest.importorskip("tests.support.oracles")


def _fused(kind: str, shape, tp: int, **meta):
    m = oracles.meta(**meta)
    return derive(lambda f, r: oracles.fused_qkv(kind, f, tp, r, m).contiguous(), shape, tp)


def _yuan(shape, tp: int, value: bool, heads: int = 8):
    def fn(f, r):
        out = oracles.shared_qk(f, None, tp, r, value, heads)
        return (out[0].data if isinstance(out, tuple) else out).contiguous()

    return derive(fn, shape, tp)


CASES = [
    # layout, maker, (src tp, tgt tp), seed bound
    *[("bigcode", lambda tp: _fused("bigcode", (96, 8), tp, n_embd=64), pair, bound)
      for pair, bound in [((2, 4), 7), ((4, 2), 6), ((2, 8), 15), ((8, 2), 10), ((4, 8), 15), ((8, 4), 12)]],
    *[("codegen", lambda tp: _fused("codegen", (96, 8), tp, num_kv_heads=32), pair, bound)
      for pair, bound in [((2, 4), 20), ((4, 2), 20), ((2, 8), 8), ((8, 2), 8), ((4, 8), 40), ((8, 4), 40)]],
    *[("yuan value", lambda tp: _yuan((64, 8), tp, True), pair, 4) for pair in [(2, 4), (4, 2)]],
    *[("yuan o_proj", lambda tp: _yuan((8, 64), tp, False), pair, 4) for pair in [(2, 4), (4, 2)]],
]


@pytest.mark.parametrize("layout,make,pair,bound", CASES, ids=[f"{c[0]} {c[2][0]}->{c[2][1]}" for c in CASES])
def test_segment_count_within_seed_table(layout, make, pair, bound):
    src, tgt = make(pair[0]), make(pair[1])
    p = plan(src, tgt)
    assert len(p.segments) <= bound, [(s.src_rank, s.dst_rank, s.shape) for s in p.segments]
    full = torch.randn(src.logical_shape)
    out = apply_plan(p, {r: src.extract(full, r) for r in src.ranks})
    for r in tgt.ranks:
        assert torch.equal(out[r], tgt.extract(full, r))


def test_codegen_count_does_not_grow_with_hidden():
    counts = {}
    for hidden in (32, 64, 128, 256, 512):
        src = _fused("codegen", (3 * hidden, 8), 4, num_kv_heads=32)
        tgt = _fused("codegen", (3 * hidden, 8), 8, num_kv_heads=32)
        counts[hidden] = len(plan(src, tgt).segments)
    assert max(counts.values()) <= 40, counts
    # at hidden 32 each of the 32 kv heads is one row and blocks coalesce; past that it is flat
    assert len({counts[h] for h in (64, 128, 256, 512)}) == 1, counts
